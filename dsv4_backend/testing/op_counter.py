"""Count the aten ops a block of code runs, and the ones that force a host sync.

A host sync (``.item()``, ``int(tensor)``, a data-dependent output shape) cannot be captured in
a CUDA graph and stalls the CPU on every step. On CPU tensors these ops are free, so they would
go unnoticed in CPU tests; recording the ops under a ``TorchDispatchMode`` catches them anywhere.
(``.tolist()`` / ``.cpu()`` of a CPU tensor never reach the dispatcher: plan on ``meta`` tensors
to catch those.)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops that read device data on the host or size their output from it.
SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",  # .item(), int(t), bool(t)
        "aten.item",
        "aten.nonzero",
        "aten.nonzero_static",
        "aten.masked_select",
        "aten.unique",
        "aten._unique2",
        "aten.unique_consecutive",
        "aten.equal",
        "aten.is_nonzero",
    }
)


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: ...`` then read ``ops.counts`` (op packet name -> calls).

    ``repeat_interleave`` with a tensor of repeats is a sync unless ``output_size`` is given;
    it is counted under ``syncs`` only in that case.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        self.counts[name] += 1
        if name in SYNC_OPS or (
            name == "aten.repeat_interleave" and kwargs.get("output_size") is None
        ):
            self.syncs[name] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
