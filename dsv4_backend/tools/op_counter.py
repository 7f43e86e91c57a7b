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

import torch
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


def _counting_run(original: Callable[..., Any], counter: LaunchCounter) -> Callable[..., Any]:
    @functools.wraps(original)
    def run(self: Any, *args: Any, warmup: bool = False, **kwargs: Any) -> Any:
        if warmup:
            return original(self, *args, warmup=warmup, **kwargs)
        name = f"triton:{getattr(self, '__name__', type(self).__name__)}"
        with launches.launch(name):
            counter._kernel.append(name)
            try:
                return original(self, *args, warmup=warmup, **kwargs)
            finally:
                counter._kernel.pop()

    return run


def _element_bytes(dtype: Any) -> int:
    return max(1, dtype.primitive_bitwidth // 8)


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

    The work of interpreted Triton kernels is measured too (the interpreter runs every
    program on the host): ``bytes_loaded`` maps a kernel to the bytes its unmasked load
    lanes read, ``working_programs`` to the programs that stored anything; torch ops add the
    bytes of their tensor inputs to ``bytes_loaded["torch:<op>"]``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.torch_ops: Counter[str] = Counter()
        self.bytes_loaded: Counter[str] = Counter()
        self.working_programs: Counter[str] = Counter()
        self._kernel: list[str] = []
        self._stored: set[tuple[str, int, tuple[int, ...]]] = set()
        self._patched: list[tuple[type, str, Callable[..., Any]]] = []

    def _patch(self, cls: type, name: str, replacement: Callable[..., Any]) -> None:
        self._patched.append((cls, name, getattr(cls, name)))
        setattr(cls, name, replacement)

    def __enter__(self) -> LaunchCounter:
        from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder
        from triton.runtime.jit import JITFunction

        for cls in (JITFunction, InterpretedFunction):
            self._patch(cls, "run", _counting_run(cls.run, self))
        load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
        counter = self

        def masked_load(builder: Any, ptrs: Any, mask: Any, *args: Any) -> Any:
            if counter._kernel:
                lanes = int(mask.data.sum())
                width = _element_bytes(ptrs.get_element_ty())
                counter.bytes_loaded[counter._kernel[-1]] += lanes * width
            return load(builder, ptrs, mask, *args)

        def masked_store(builder: Any, ptrs: Any, value: Any, mask: Any, *args: Any) -> Any:
            if counter._kernel and mask.data.any():
                name = counter._kernel[-1]
                program = (name, sum(self.kernels.values()), tuple(builder.grid_idx))
                if program not in counter._stored:
                    counter._stored.add(program)
                    counter.working_programs[name] += 1
            return store(builder, ptrs, value, mask, *args)

        self._patch(InterpreterBuilder, "create_masked_load", masked_load)
        self._patch(InterpreterBuilder, "create_masked_store", masked_store)
        launches.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        launches.active.remove(self)
        for cls, name, original in reversed(self._patched):
            setattr(cls, name, original)
        self._patched.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if launches.quiet():
            return func(*args, **(kwargs or {}))
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        if not (func.is_view or name in NO_KERNEL_OPS or name in SYNC_OPS):
            self.torch_ops[name] += 1
            inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            self.bytes_loaded[f"torch:{name}"] += sum(a.numel() * a.element_size() for a in inputs)
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
