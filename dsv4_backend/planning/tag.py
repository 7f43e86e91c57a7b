"""``BatchTag``: which batch a plan was made for, checked without reading any tensor.

A plan is only valid for the batch it was made from. Shapes alone cannot tell (the next step,
or the same requests in another order, have the same shapes), and comparing values would sync
the device. The tag therefore records the batch's objects by identity (weak references, so it
keeps nothing alive) and each tensor's in-place version counter (``Tensor._version``; inference
tensors have none and are compared by identity only), plus a serial number for messages. A
tensor rebound, replaced or written in place since planning makes the tag disagree.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

_serials = itertools.count(1)


def _reference(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # e.g. SimpleNamespace: hold it (small host objects)
        return lambda: obj


def _version(obj: Any) -> int | None:
    if not isinstance(obj, torch.Tensor) or obj.is_inference():
        return None
    return obj._version


class BatchTag:
    """The identity of a batch's objects at planning time.

    Parameters
    ----------
    **objects : the objects (a ``ForwardBatch``, its tensors) by the name messages use.
    """

    def __init__(self, **objects: Any) -> None:
        self.serial = next(_serials)
        held = {name: obj for name, obj in objects.items() if obj is not None}
        self._entries = {name: (_reference(obj), _version(obj)) for name, obj in held.items()}

    def mismatch(self, **objects: Any) -> str | None:
        """What differs between ``objects`` and the tagged ones (None: the same batch).

        Only the names given are compared; a name the tag does not hold is ignored.
        """
        for name, obj in objects.items():
            if name not in self._entries:
                continue
            ref, version = self._entries[name]
            if ref() is not obj:
                return f"{name} is not the object the plan was made from"
            if version is not None and _version(obj) != version:
                return (
                    f"{name} was written in place since planning (version {version} -> "
                    f"{_version(obj)})"
                )
        return None

    def __repr__(self) -> str:
        return f"BatchTag(#{self.serial}, {sorted(self._entries)})"
