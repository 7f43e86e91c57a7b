"""A faster Triton interpreter for the CPU runs (tests, ``ab``), with the same results.

Two of Triton 3.8's interpreter costs are skipped by :func:`patch_language_once`:

* Its ``_get_np_dtype`` (the numpy dtype of a Triton type, asked by nearly every operation)
  builds its table of 19 types on every call: about a tenth of the interpreter's time in a
  sampled profile of ``tests/kernels/test_compressor.py``. The patch answers from a table
  filled once per type by the original function.
* It re-patches ``triton.language`` on every call of a ``@triton.jit`` device function made
  from a running kernel (``InterpretedFunction.__call__`` calls ``_patch_lang``: an
  ``inspect.getmembers`` walk over the language modules, about half a millisecond), although
  the kernel's launch (``GridExecutor.__call__``) patched the same modules already. The
  kernels call helpers inside their key loops, so the walk ran some 100,000 times a suite and
  took about a quarter of the interpreter's time. The patch skips a device call's walk while
  the launch's patch is in effect over the same modules; the launch still patches and
  restores as before, so results are unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
from triton import language as tl
from triton.runtime import interpreter

_original_patch_lang: Callable[[Any], Any] = interpreter._patch_lang
_original_np_dtype: Callable[[Any], np.dtype] = interpreter._get_np_dtype
#: ``_get_np_dtype``'s answers by scalar Triton type (pointer and block types are unhashable).
_np_dtypes: dict[Any, np.dtype] = {}
_POINTER_NP_DTYPE = np.dtype(np.uint64)


def _get_np_dtype(tt_dtype: Any) -> np.dtype:
    """``interpreter._get_np_dtype``: a block's element type's, a pointer's uint64, a scalar
    type's from the table (filled by the original on first use)."""
    if isinstance(tt_dtype, tl.block_type):
        tt_dtype = tt_dtype.element_ty
    if isinstance(tt_dtype, tl.pointer_type):
        return _POINTER_NP_DTYPE
    found = _np_dtypes.get(tt_dtype)
    if found is None:
        found = _np_dtypes[tt_dtype] = _original_np_dtype(tt_dtype)
    return found


class _NoChanges:
    """The scope of a device call that changed nothing: nothing to restore."""

    def restore(self) -> None:
        pass


#: ``id``s of the language modules a running launch has patched (empty between launches).
_patched: set[int] = set()
#: The language modules each function's globals hold, by function (looked up once).
_languages_of: dict[Callable[..., Any], frozenset[int]] = {}


def _languages(fn: Callable[..., Any]) -> frozenset[int]:
    """The language modules ``_patch_lang`` would patch for ``fn`` (as ``id``s)."""
    if fn not in _languages_of:
        _languages_of[fn] = frozenset(
            id(value)
            for value in fn.__globals__.values()
            if inspect.ismodule(value) and value in (tl, tl.core)
        )
    return _languages_of[fn]


def _patch_lang(fn: Callable[..., Any]) -> Any:
    languages = _languages(fn)
    if _patched and languages <= _patched:
        return _NoChanges()  # a device call inside a launch that patched these modules
    scope = _original_patch_lang(fn)
    if _patched:
        _patched.update(languages)  # a device call that reached another module: kept patched
        return scope
    _patched.update(languages)
    restore = scope.restore

    def restore_and_forget() -> None:
        _patched.clear()
        restore()

    scope.restore = restore_and_forget
    return scope


def patch_language_once() -> None:
    """Install both skips (idempotent). Call before any kernel runs in the interpreter."""
    interpreter._patch_lang = _patch_lang
    interpreter._get_np_dtype = _get_np_dtype
