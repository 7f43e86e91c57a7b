"""Immutable attention metadata: one row per query token (docs/design.md §4).

Shapes use ``B`` requests, ``T`` query rows, ``Pw`` page-table width (pages), ``Ws`` window
index width (``config.swa_index_width``), ``K`` ``index_topk`` and ``N128`` c128 index width.
Index tensors use ``-1`` for "no slot". The dataclasses are frozen (fields are never rebound,
which CUDA graphs rely on); ``c4.page_indices`` is the one tensor written after planning, by the
indexer's top-k (DeepSeek-V4.1: also ``c1`` / ``c2``'s ``page_indices`` and
``candidate_blocks``).

Plan records (``compress_plan`` / ``write_plan``, ``[T, 4]`` int32) are rows
``(ragged_id, batch_id, position, window_len)``: the valid records first, in row order, then
``-1`` rows, so their shape is fixed by ``T`` alone.

* the *compress plan* of ratio ``r`` lists rows with ``(position + 1) % r == 0`` (the row that
  completes a compressed entry);
* the *write plan* lists rows whose compressor state must stay in the state ring after this
  forward: ``position >= (keep_len // r) * r``, one block earlier (``- r``) for ratio 4, whose
  entries overlap the previous block. ``keep_len`` is the shortest length the request can have
  after this forward: its length for every kind but TARGET_VERIFY, where drafts may be
  rejected, so it is ``seq_lens + 1`` (the speculative rings are long enough to hold the extra
  rows);
* ``window_len`` = ``min(span, position - first_new_position + 1)``: how many of the tokens that
  feed the entry ending at this row are inputs of this forward (``span`` = 8 for ratio 4, 128 for
  ratio 128); the others come from the state ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from dsv4_backend.errors import ContractError
from dsv4_backend.planning.batch import ForwardKind, seq_len_fill_value
from dsv4_backend.planning.checks import PendingChecks
from dsv4_backend.planning.tag import BatchTag

PLAN_COLUMNS = ("ragged_id", "batch_id", "position", "window_len")

#: The value of a row that writes nothing and attends to nothing (a graph bucket's padded row,
#: a ragged verify's padding row), by field name;
#: every field not listed: -1 (no slot / no write / invalid record).
_SENTINELS = {
    "positions_causal": seq_len_fill_value - 1,
    "row_batch_ids": 0,
    "swa_topk_lengths": 1,
    "topk_lengths_raw": 0,
    "sparse_topk_lengths": 1,
}
#: Fields that are record lists, not one entry a row (padding rows simply leave no record).
RECORD_FIELDS = frozenset({"compress_plan", "write_plan"})


def sentinel(name: str) -> int:
    """The padding value of field ``name`` (a ``CompressedMetadata`` field by its own name)."""
    return _SENTINELS.get(name, -1)


@dataclass(frozen=True, kw_only=True)
class CompressedMetadata:
    """Per-row fields of one compress ratio (4 or 128).

    Attributes
    ----------
    ratio : 4 or 128.
    out_loc : ``[T]`` int64 — cache slot of the entry this row completes (the row's full-cache
        slot ``// ratio``), ``-1`` where ``(position + 1) % ratio != 0``.
    topk_lengths_raw : ``[T]`` int32 — visible entries, ``seq_len // ratio``.
    sparse_topk_lengths : ``[T]`` int32 — the same clamped to >= 1 (sparse kernels need >= 1;
        padded indices are -1), and for ratio 4 to at most ``K``.
    page_indices : ratio 4: ``[T, K]`` int32 of -1, filled by the indexer's top-k with c4 cache
        slots; ratio 128: ``[T, N128]`` int32, slots of all visible entries then -1.
    compress_plan, write_plan : ``[T, 4]`` int32 plan records (module docstring).
    """

    ratio: int
    out_loc: torch.Tensor
    topk_lengths_raw: torch.Tensor
    sparse_topk_lengths: torch.Tensor
    page_indices: torch.Tensor
    compress_plan: torch.Tensor
    write_plan: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class LowRatioMetadata:
    """Per-row fields of one DeepSeek-V4.1 low ratio (1 or 2; docs/design.md §8).

    Attributes
    ----------
    ratio : 1 or 2.
    out_loc : ``[T]`` int64 — slot (in the kv source's c1 / c2 cache and index keys) of the
        entry this row completes: c1 the row's full-cache slot, c2 ``full slot // 2`` on odd
        positions (a pair's second token), ``-1`` on even ones.
    topk_lengths_raw : ``[T]`` int32 — visible entries, ``(position + 1) // ratio``.
    sparse_topk_lengths : ``[T]`` int32 — ``min(visible, K)`` clamped to >= 1.
    page_indices : ``[T, K]`` int32 of -1, written by each index source of the ratio with the
        slots of its selected entries (the later layers of the ratio attend with the last).
    candidate_blocks : ``[T, NB]`` int32 of -1 (``NB = candidate_topk_blocks``), written by the
        candidate source with its candidate block ids; None for a ratio without one.
    """

    ratio: int
    out_loc: torch.Tensor
    topk_lengths_raw: torch.Tensor
    sparse_topk_lengths: torch.Tensor
    page_indices: torch.Tensor
    candidate_blocks: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    """Everything a DeepSeek-V4 attention forward reads about its batch.

    Attributes
    ----------
    kind : the planned ``ForwardKind``.
    batch_size, num_rows : ``B`` and ``T`` this metadata was planned for.
    row_batch_ids : ``[T]`` int32 — request of each row.
    page_table : ``[T, Pw]`` int32 — full-cache page of each of the row's request pages.
    swa_out_loc : ``[T]`` int64 — window-cache slot the row's key is written to
        (``full_to_swa`` of the full-cache slot it writes: its draft step's slice for a draft
        step).
    positions_causal : ``[T]`` int64 (the causal length of the row is ``position + 1``).
    swa_page_indices : ``[T, Ws]`` int32 — window-cache slots of positions p, p-1, ..., p-127;
        -1 where negative or beyond the window.
    swa_topk_lengths : ``[T]`` int32 — ``min(seq_len, window)``.
    c4, c128 : per-ratio fields, or None when no layer uses the ratio or for DRAFT_EXTEND
        (the MTP layer is window only).
    c1, c2 : DeepSeek-V4.1's low-ratio fields, likewise.
    max_request_rows : the most rows one request has, where the host knows it without a
        sync: a uniform kind's count a request (a decode, a draft step, a verify), a ragged
        verify's verify width (its requests' counts are device values); None for extends.
        The compressor skips deferring its ring writes only below a bound of it.
    tag : the batch tensors it was planned from (``check_batch``); None for plans made
        by hand.
    pending_checks : the planning checks still on their way to the host (CUDA without strict
        mode, ``planning/checks.py``); the host calls ``raise_if_failed`` at a safe point.
    """

    kind: ForwardKind
    batch_size: int
    num_rows: int
    row_batch_ids: torch.Tensor
    page_table: torch.Tensor
    swa_out_loc: torch.Tensor
    positions_causal: torch.Tensor
    swa_page_indices: torch.Tensor
    swa_topk_lengths: torch.Tensor
    c4: CompressedMetadata | None = None
    c128: CompressedMetadata | None = None
    c1: LowRatioMetadata | None = None
    c2: LowRatioMetadata | None = None
    max_request_rows: int | None = None
    tag: BatchTag | None = field(default=None, compare=False)
    pending_checks: PendingChecks | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        rows = self.num_rows
        parts = (("", self), ("c4.", self.c4), ("c128.", self.c128))
        for prefix, part in (*parts, ("c1.", self.c1), ("c2.", self.c2)):
            if part is None:
                continue
            for f in fields(part):
                value = getattr(part, f.name)
                if isinstance(value, torch.Tensor) and value.shape[0] != rows:
                    raise ContractError(
                        f"metadata field {prefix}{f.name} has {value.shape[0]} rows, expected "
                        f"num_rows={rows}"
                    )

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """``name -> tensor`` of every planned field (``c4.out_loc`` style for the per-ratio
        ones; not ``tag`` or ``pending_checks``, which describe the batch, not the plan)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.compare}
        out = {name: value for name, value in out.items() if isinstance(value, torch.Tensor)}
        for comp in (self.c4, self.c128, self.c1, self.c2):
            if comp is not None:
                for f in fields(comp):
                    value = getattr(comp, f.name)
                    if isinstance(value, torch.Tensor):
                        out[f"c{comp.ratio}.{f.name}"] = value
        return out

    def compressed(self, ratio: int) -> CompressedMetadata | None:
        """The fields of ``ratio`` (0 gives None: window-only layers)."""
        parts = {0: None, 4: self.c4, 128: self.c128}
        if ratio not in parts:
            raise ContractError(f"ratio={ratio}; expected a layer's compress ratio 0, 4 or 128")
        return parts[ratio]

    def low_ratio(self, ratio: int) -> LowRatioMetadata | None:
        """DeepSeek-V4.1's fields of low ``ratio`` (1 or 2)."""
        parts = {1: self.c1, 2: self.c2}
        if ratio not in parts:
            raise ContractError(f"ratio={ratio}; expected a DeepSeek-V4.1 low ratio, 1 or 2")
        return parts[ratio]

    def check_matches(self, *, batch_size: int, num_rows: int, where: str = "forward") -> None:
        """Raise ``ContractError`` unless this plan was made for a batch of these shapes.

        A mismatch means the metadata was planned before the batch reached its final (padded)
        shape, e.g. before data-parallel padding of a verify batch.
        """
        if batch_size != self.batch_size or num_rows != self.num_rows:
            raise ContractError(
                f"{where}: attention metadata was planned for batch_size={self.batch_size}, "
                f"num_rows={self.num_rows} but the {where} got batch_size={batch_size}, "
                f"num_rows={num_rows}. The metadata was planned before the batch reached its "
                "final (padded) shape; plan after padding (skip_attn_backend_init must equal "
                "can_run_cuda_graph)."
            )

    def check_batch(self, where: str = "forward", **tensors: torch.Tensor) -> None:
        """Raise ``ContractError`` unless ``tensors`` (by ``BatchView`` field name, e.g.
        ``req_pool_indices=``) are the objects this plan was made from, unchanged since.

        Catches a plan reused for another batch of the same shapes (the next step, the same
        requests in another order) without reading any tensor. A plan without a tag passes.
        """
        if self.tag is None:
            return
        mismatch = self.tag.mismatch(**tensors)
        if mismatch is not None:
            raise ContractError(
                f"{where}: the attention metadata (plan #{self.tag.serial}, {self.kind.name}) was "
                f"made for another batch: {mismatch}. Plan every batch before its forward."
            )
