"""Count the aten ops a block of code runs, the ones that force a host sync, and launches.

A host sync (``.item()``, ``int(tensor)``, a data-dependent output shape) cannot be captured in
a CUDA graph and stalls the CPU on every step. On CPU tensors these ops are free, so they would
go unnoticed in CPU tests; recording the ops under a ``TorchDispatchMode`` catches them anywhere.
(``.tolist()`` / ``.cpu()`` of a CPU tensor never reach the dispatcher: plan on ``meta`` tensors
to catch those.)

``LaunchCounter`` counts device launches (torch kernels, Triton, TVM, flashinfer) on the CPU:
the benchmarks print them and the launch-budget tests bound them.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from dsv4_backend.ops import launches

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


#: aten ops that allocate or re-describe memory without running a kernel on the device.
NO_KERNEL_OPS = frozenset(
    {
        "aten.empty",
        "aten.empty_strided",
        "aten.empty_like",
        "aten.new_empty",
        "aten.new_empty_strided",
        "aten.detach",
        "aten.alias",
        "aten.lift_fresh",
        "aten.resize_",
        "aten.set_",
        "aten.scalar_tensor",  # a CPU scalar operand (torch.where(mask, x, 0))
    }
)


def _counting_run(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def run(self: Any, *args: Any, warmup: bool = False, **kwargs: Any) -> Any:
        if warmup:
            return original(self, *args, warmup=warmup, **kwargs)
        with launches.launch(f"triton:{getattr(self, '__name__', type(self).__name__)}"):
            return original(self, *args, warmup=warmup, **kwargs)

    return run


class LaunchCounter(OpCounter):
    """Device launches of a block of code, counted on any device (launches do not depend on
    the machine): ``with LaunchCounter() as launches: ...`` then ``launches.total``.

    * torch: every aten op that runs a kernel (views, ``empty`` and host reads excluded);
    * Triton: every kernel launch, compiled or in the interpreter (whose own torch plumbing is
      not counted);
    * others (TVM, flashinfer, host-to-device copies): the launches their wrappers declare with
      ``ops.launches.launch(name)``.

    ``kernels`` maps ``"triton:<kernel>"`` / wrapper names to launches, ``torch_ops`` aten op
    names to launches; ``counts`` / ``syncs`` are ``OpCounter``'s (every op, host syncs).
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.torch_ops: Counter[str] = Counter()
        self._patched: list[tuple[type, Callable[..., Any]]] = []

    def __enter__(self) -> LaunchCounter:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        for cls in (JITFunction, InterpretedFunction):
            self._patched.append((cls, cls.run))
            cls.run = _counting_run(cls.run)  # type: ignore[method-assign]
        launches.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        launches.active.remove(self)
        for cls, run in reversed(self._patched):
            cls.run = run  # type: ignore[method-assign]
        self._patched.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if launches.quiet():
            return func(*args, **(kwargs or {}))
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        if not (func.is_view or name in NO_KERNEL_OPS or name in SYNC_OPS):
            self.torch_ops[name] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    @property
    def total(self) -> int:
        return sum(self.torch_ops.values()) + sum(self.kernels.values())

    def summary(self) -> str:
        """``"N (torch a, triton b, other c)"`` for benchmark tables."""
        triton = sum(n for k, n in self.kernels.items() if k.startswith("triton:"))
        other = sum(self.kernels.values()) - triton
        torch_ops = sum(self.torch_ops.values())
        return f"{self.total} (torch {torch_ops}, triton {triton}, other {other})"
