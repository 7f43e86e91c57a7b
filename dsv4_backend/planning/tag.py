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
from dataclasses import dataclass
from typing import Any

import torch

from dsv4_backend.planning.batch import seq_len_fill_value
from dsv4_backend.planning.checks import Check

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

    def rewritten(self) -> str | None:
        """Which tagged tensor still alive was written in place since tagging (None: none)."""
        alive = {name: ref() for name, (ref, _) in self._entries.items()}
        return self.mismatch(**{name: obj for name, obj in alive.items() if obj is not None})

    def __repr__(self) -> str:
        return f"BatchTag(#{self.serial}, {sorted(self._entries)})"


@dataclass(frozen=True)
class PlanInputs:
    """The batch values a plan was made from, to match a batch handed to its consumers.

    A host may hand the consumers a *copy* of the planned batch rather than the planned object:
    sglang's eager runner copies every batch into its static buffers after planning, a
    multi-step draft step rebinds ``out_cache_loc`` to its own slots, and data-parallel padding
    grows a planned batch by padding requests. So a batch object other than the planned one is
    matched by value: its first ``B`` requests and ``T`` rows must equal these, and anything past
    them must be padding (pool row 0, length ``seq_len_fill_value``, slot 0).

    Attributes
    ----------
    req_pool_indices, seq_lens : ``[B]`` int, as planned.
    out_cache_loc : ``[T]`` int, each row's write slot as the consumers' batch holds it (a
        draft step's own slots; a graph replay's padded to the bucket).
    seq_lens_cpu : the host lengths planned with, when known (compared without a device read).
    sources : the tensors those were read from, with their in-place versions at planning
        (``BatchTag``): once one is written in place, the values above no longer hold.
    """

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_cpu: list[int] | None
    sources: BatchTag

    def stale(self) -> str | None:
        """Why the planned values no longer hold (a source written in place), or None."""
        return self.sources.rewritten()

    def host_mismatch(self, seq_lens_cpu: list[int] | None) -> str | None:
        """How the host lengths ``seq_lens_cpu`` of a batch differ from the planned ones."""
        planned = self.seq_lens_cpu
        if planned is None or seq_lens_cpu is None:
            return None
        n = len(planned)
        if seq_lens_cpu[:n] == planned and all(v == seq_len_fill_value for v in seq_lens_cpu[n:]):
            return None
        return (
            f"it was planned with seq_lens_cpu={planned} and the batch has {seq_lens_cpu}; only "
            f"padding requests (seq_lens_cpu {seq_len_fill_value}) may be appended after planning"
        )

    def checks(
        self,
        *,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor | None,
    ) -> list[Check]:
        """The value checks of a batch's tensors against the planned ones (module ``checks``):
        equal over the planned requests and rows, padding past them (``out_cache_loc`` None:
        the requests only)."""
        found: list[Check] = []
        given = [
            ("req_pool_indices", self.req_pool_indices, req_pool_indices, 0),
            ("seq_lens", self.seq_lens, seq_lens, seq_len_fill_value),
        ]
        if out_cache_loc is not None:
            given.append(("out_cache_loc", self.out_cache_loc, out_cache_loc, 0))
        for name, planned, got, pad in given:
            n = planned.numel()
            head = got.reshape(-1)[:n]
            found.append(
                Check(
                    message=f"{name}[{{index}}]={{value}} but the plan was made with "
                    f"{name}[{{index}}]={{expected}}",
                    bad=head != planned,
                    values=head,
                    expected=planned,
                )
            )
            tail = got.reshape(-1)[n:]
            if tail.numel():
                found.append(
                    Check(
                        message=f"{name}[{{index}}]={{value}} is past the planned {name} ({n}), "
                        f"where only padding ({name} {pad}) may be appended after planning",
                        bad=tail != pad,
                        values=tail,
                        indices=torch.arange(n, n + tail.numel(), device=tail.device),
                    )
                )
        return found
