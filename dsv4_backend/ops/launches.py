"""Hooks that let a launch counter (``tools.op_counter.LaunchCounter``) see the launches the
torch dispatcher cannot: kernels called through TVM or flashinfer declare themselves with
``launch(name)``, and CPU-only host checks run ``uncounted()``. Without a counter active both
are free (a list check and an integer increment)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Protocol


class LaunchSink(Protocol):
    """A counter that receives declared launches (``kernels[name] += 1``)."""

    kernels: Counter[str]


#: Active counters, innermost last (``LaunchCounter`` pushes itself on entry).
active: list[LaunchSink] = []
_quiet_depth = 0


def quiet() -> bool:
    """Whether the code running now is inside ``uncounted()`` (or a declared launch)."""
    return _quiet_depth > 0


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Ops inside are not counted: host-side checks that run only on CPU tensors (a GPU run
    never executes them), and the torch plumbing of a launch counted as one (``launch``)."""
    global _quiet_depth
    _quiet_depth += 1
    try:
        yield
    finally:
        _quiet_depth -= 1


@contextlib.contextmanager
def launch(name: str) -> Iterator[None]:
    """Count one device launch ``name`` (a TVM or flashinfer kernel, a host-to-device copy)
    and none of the torch ops its Python wrapper runs inside the block."""
    if active and not _quiet_depth:
        active[-1].kernels[name] += 1
    with uncounted():
        yield
