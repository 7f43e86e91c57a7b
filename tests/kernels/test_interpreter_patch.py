"""``testing/interpreter.py``: a device call inside a launch skips Triton's language re-patch,
the launch's own patch is still made and undone, and results do not change."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from marks import needs_interpreter
from triton.runtime import interpreter

from dsv4_backend.testing import interpreter as fast

pytestmark = needs_interpreter


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _loop_kernel(x_ptr, out_ptr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.load(x_ptr + offs)
    for _ in range(STEPS):
        acc = _twice(acc) - acc  # a device call a step
    tl.store(out_ptr + offs, acc + tl.program_id(0))


def test_one_patch_a_launch_and_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    def counted(fn):
        calls.append(fn)
        return original(fn)

    original = fast._original_patch_lang
    monkeypatch.setattr(fast, "_original_patch_lang", counted)
    monkeypatch.setattr(interpreter, "_patch_lang", fast._patch_lang)
    load = tl.load
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty(8)
    _loop_kernel[(3,)](x, out, STEPS=5, BLOCK=8)
    assert torch.equal(out, x + 2)  # the last program's id
    assert len(calls) == 1, f"{len(calls)} language patches for one launch, expected 1"
    assert tl.load is load and not fast._patched  # the launch's patch was undone

    monkeypatch.setattr(interpreter, "_patch_lang", original)  # Triton's own: a patch a call
    plain = torch.empty(8)
    _loop_kernel[(3,)](x, plain, STEPS=5, BLOCK=8)
    assert torch.equal(plain, out)


SCALARS = [
    tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
    tl.float16, tl.bfloat16, tl.float32, tl.float64,
    tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15,
]  # fmt: skip


def test_numpy_dtypes_are_the_originals() -> None:
    """The table answers as Triton's own function for scalar, pointer and block types (asked
    twice: filled, then read), and it is the one the suite's interpreter asks."""
    kinds = [
        *SCALARS,
        *(tl.pointer_type(t) for t in SCALARS),
        *(tl.block_type(t, [4, 2]) for t in SCALARS),
        tl.block_type(tl.pointer_type(tl.bfloat16), [8]),
    ]
    for _ in range(2):
        for kind in kinds:
            assert fast._get_np_dtype(kind) == fast._original_np_dtype(kind), kind
    assert interpreter._get_np_dtype is fast._get_np_dtype  # installed by tests/conftest.py
