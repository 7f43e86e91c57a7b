"""Fixed CUDA-graph buffers for ``AttentionMetadata``: allocated once, refilled by ``copy_``.

The graph path runs the same planner as eager mode (``planner.plan`` with fixed widths), then
``GraphMetadataBuffers.load`` copies the plan into buffers whose storage never changes, so a
captured graph always reads the current batch. Rows past the plan (a graph bucket larger than
the batch) and columns past an eager plan's widths hold sentinels that every kernel skips:

==========================================  ========  ==============================================
fields                                      sentinel  why
==========================================  ========  ==============================================
``positions_causal``                        0         the position of a length-1 row (sglang's graph
                                                      fill ``seq_len_fill_value``)
``row_batch_ids``                           0         an in-bounds request; no plan record uses it
``swa_topk_lengths``,                       1         sparse kernels need >= 1; every index is -1
``*.sparse_topk_lengths``
``*.topk_lengths_raw``                      0         no visible compressed entry
``c1/c2.candidate_blocks``                  -1        no candidate block
``*_out_loc``, ``*.out_loc``                -1        no cache write (stores skip negative slots)
``page_table``, ``*_page_indices``          -1        no slot
``*.compress_plan``, ``*.write_plan``       -1        invalid record (valid records stay first)
==========================================  ========  ==============================================
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dsv4_backend.config import COMPRESSED_RATIOS, DSV4AttentionConfig
from dsv4_backend.errors import ContractError
from dsv4_backend.planning import planner
from dsv4_backend.planning.batch import BatchView, ForwardKind
from dsv4_backend.planning.metadata import (
    PLAN_COLUMNS,
    AttentionMetadata,
    CompressedMetadata,
    LowRatioMetadata,
)
from dsv4_backend.planning.metadata import sentinel as _sentinel
from dsv4_backend.planning.planner import PlanWidths

_INT32, _INT64 = torch.int32, torch.int64
#: ``field -> (shape after the row dimension, dtype)``
_Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _compressed_layout(config: DSV4AttentionConfig, ratio: int, widths: PlanWidths) -> _Layout:
    plan = ((len(PLAN_COLUMNS),), _INT32)
    index_width = config.index_topk if ratio == 4 else widths.c128
    return {
        "out_loc": ((), _INT64),
        "topk_lengths_raw": ((), _INT32),
        "sparse_topk_lengths": ((), _INT32),
        "page_indices": ((index_width,), _INT32),
        "compress_plan": plan,
        "write_plan": plan,
    }


def _low_ratio_layout(config: DSV4AttentionConfig, ratio: int) -> _Layout:
    layout: _Layout = {
        "out_loc": ((), _INT64),
        "topk_lengths_raw": ((), _INT32),
        "sparse_topk_lengths": ((), _INT32),
        "page_indices": ((config.index_topk,), _INT32),
    }
    if config.v41 is not None and config.candidate_ratio == ratio:
        layout["candidate_blocks"] = ((config.v41.candidate_topk_blocks,), _INT32)
    return layout


def _layout(config: DSV4AttentionConfig, widths: PlanWidths, swa_width: int) -> _Layout:
    return {
        "row_batch_ids": ((), _INT32),
        "page_table": ((widths.page_table,), _INT32),
        "swa_out_loc": ((), _INT64),
        "positions_causal": ((), _INT64),
        "swa_page_indices": ((swa_width,), _INT32),
        "swa_topk_lengths": ((), _INT32),
    }


def _load_field(buf: torch.Tensor, src: torch.Tensor, num_rows: int, sentinel: int) -> None:
    """Copy ``src`` into ``buf``'s top-left corner; pad its other columns and rows."""
    rows = src.shape[0]
    if buf.dim() == 1:
        buf[:rows].copy_(src)
    else:
        cols = src.shape[1]
        buf[:rows, :cols].copy_(src)
        buf[:rows, cols:].fill_(sentinel)
    buf[rows:num_rows].fill_(sentinel)


def _load_part(bufs: dict[str, torch.Tensor], part: Any, num_rows: int) -> dict[str, torch.Tensor]:
    """Copy the tensor fields of a plan's per-ratio ``part`` into ``bufs``; their views."""
    for name, buf in bufs.items():
        _load_field(buf, getattr(part, name), num_rows, _sentinel(name))
    return {name: buf[:num_rows] for name, buf in bufs.items()}


class GraphMetadataBuffers:
    """Every ``AttentionMetadata`` tensor of a CUDA graph, allocated once at its largest shape.

    Parameters
    ----------
    config : attention configuration (which ratios get fields, index widths).
    max_batch_size : largest batch a graph serves.
    max_rows : largest row count (``T``) a graph serves.
    widths : the ``PlanWidths`` every graph plan is made with (e.g.
        ``PlanWidths.for_max_len(max_context_len)``); eager plans may be narrower.
    device : where the buffers live.
    swa_width : columns of ``swa_page_indices`` (default ``config.swa_index_width``; a DSpark
        draft block's are wider, ``planning.dspark_swa_width``).
    """

    def __init__(
        self,
        config: DSV4AttentionConfig,
        *,
        max_batch_size: int,
        max_rows: int,
        widths: PlanWidths,
        device: torch.device | str,
        swa_width: int | None = None,
    ) -> None:
        if max_batch_size < 0 or max_rows < 0:
            raise ContractError(
                f"max_batch_size={max_batch_size}, max_rows={max_rows}; expected >= 0"
            )
        self.config = config
        self.max_batch_size = max_batch_size
        self.max_rows = max_rows
        self.widths = widths

        def alloc(layout: _Layout) -> dict[str, torch.Tensor]:
            return {
                name: torch.full((max_rows, *shape), _sentinel(name), dtype=dtype, device=device)
                for name, (shape, dtype) in layout.items()
            }

        self.common = alloc(_layout(config, widths, swa_width or config.swa_index_width))
        self.compressed = {
            r: alloc(_compressed_layout(config, r, widths)) for r in sorted(config.ratios_present)
        }
        self.low_ratio = {
            r: alloc(_low_ratio_layout(config, r)) for r in sorted(config.low_ratios_present)
        }
        self.device = self.common["row_batch_ids"].device

    def load(self, plan: AttentionMetadata, *, num_rows: int | None = None) -> AttentionMetadata:
        """Copy ``plan`` into the buffers and return views of their first ``num_rows`` rows.

        ``num_rows`` (default ``plan.num_rows``) is the graph's row count; rows past the plan
        get the sentinels of the module table; ``batch_size`` and ``kind`` are the plan's.
        Allocates nothing and never syncs; the returned tensors are views of the buffers (the
        same storage on every call).

        Raises ``ContractError`` when the plan does not fit the buffers.
        """
        num_rows = plan.num_rows if num_rows is None else num_rows
        self._check(
            batch_size=plan.batch_size,
            plan_rows=plan.num_rows,
            num_rows=num_rows,
            widths=plan_widths(plan),
            device=plan.row_batch_ids.device,
            ratios=[r for r in COMPRESSED_RATIOS if plan.compressed(r) is not None],
        )
        swa_columns = self.common["swa_page_indices"].shape[1]
        if plan.swa_page_indices.shape[1] > swa_columns:
            raise ContractError(
                f"plan has {plan.swa_page_indices.shape[1]} swa_page_indices columns, the "
                f"buffers {swa_columns}; build the buffers with swa_width covering the plan's "
                "(a DSpark block: planning.dspark_swa_width)"
            )
        for name, buf in self.common.items():
            _load_field(buf, getattr(plan, name), num_rows, _sentinel(name))
        # A window-only plan (DRAFT_EXTEND) has no per-ratio parts.
        comp = {
            ratio: CompressedMetadata(ratio=ratio, **_load_part(bufs, part, num_rows))
            for ratio, bufs in self.compressed.items()
            if (part := plan.compressed(ratio)) is not None
        }
        low = {
            ratio: LowRatioMetadata(ratio=ratio, **_load_part(bufs, low_part, num_rows))
            for ratio, bufs in self.low_ratio.items()
            if (low_part := plan.low_ratio(ratio)) is not None
        }
        return AttentionMetadata(
            kind=plan.kind,
            batch_size=plan.batch_size,
            num_rows=num_rows,
            max_request_rows=plan.max_request_rows,
            **{name: buf[:num_rows] for name, buf in self.common.items()},
            c4=comp.get(4),
            c128=comp.get(128),
            c1=low.get(1),
            c2=low.get(2),
            tag=plan.tag,
            pending_checks=plan.pending_checks,
        )

    def plan(self, batch: BatchView, *, num_rows: int | None = None) -> AttentionMetadata:
        """``load(plan(config, batch, widths=self.widths), num_rows=num_rows)``, in one launch
        where the fused planner runs (``planner.fuses``): it writes straight into the buffers,
        padded rows included."""
        if not planner.fuses(batch):
            metadata = planner.plan(self.config, batch, widths=self.widths)
            return self.load(metadata, num_rows=num_rows)
        num_rows = batch.num_rows if num_rows is None else num_rows
        compressed = batch.kind is not ForwardKind.DRAFT_EXTEND
        ratios = sorted(self.compressed) if compressed else []
        self._check(
            batch_size=batch.batch_size,
            plan_rows=batch.num_rows,
            num_rows=num_rows,
            widths=self.widths,
            device=batch.req_to_token.device,
            ratios=ratios,
        )
        low = {r: self._low_ratio_views(r, num_rows) for r in self.low_ratio} if compressed else {}
        out = AttentionMetadata(
            kind=batch.kind,
            batch_size=batch.batch_size,
            num_rows=num_rows,
            max_request_rows=planner.max_request_rows(batch),
            **{name: buf[:num_rows] for name, buf in self.common.items()},
            c4=self._ratio_views(4, num_rows) if 4 in ratios else None,
            c128=self._ratio_views(128, num_rows) if 128 in ratios else None,
            c1=low.get(1),
            c2=low.get(2),
            tag=None,  # plan_into's result carries the batch's
            pending_checks=None,
        )
        return planner.plan_into(self.config, batch, self.widths, out)

    def _ratio_views(self, ratio: int, num_rows: int) -> CompressedMetadata:
        """The first ``num_rows`` rows of compress ratio ``ratio``'s buffers."""
        views = {name: buf[:num_rows] for name, buf in self.compressed[ratio].items()}
        return CompressedMetadata(ratio=ratio, **views)

    def _low_ratio_views(self, ratio: int, num_rows: int) -> LowRatioMetadata:
        """The first ``num_rows`` rows of low ratio ``ratio``'s buffers."""
        views = {name: buf[:num_rows] for name, buf in self.low_ratio[ratio].items()}
        return LowRatioMetadata(ratio=ratio, **views)

    def _check(
        self,
        *,
        batch_size: int,
        plan_rows: int,
        num_rows: int,
        widths: PlanWidths,
        device: torch.device,
        ratios: list[int],
    ) -> None:
        fix = (
            "build GraphMetadataBuffers with max_batch_size / max_rows / widths covering the "
            "largest graph batch, and plan graph batches with widths=buffers.widths"
        )
        if not plan_rows <= num_rows <= self.max_rows or batch_size > self.max_batch_size:
            raise ContractError(
                f"cannot load a plan of batch_size={batch_size}, num_rows={plan_rows} "
                f"as {num_rows} rows into buffers of max_batch_size={self.max_batch_size}, "
                f"max_rows={self.max_rows} (need plan rows <= num_rows <= max_rows); {fix}"
            )
        if not self.widths.covers(widths):
            raise ContractError(f"plan widths {widths} exceed the buffers' {self.widths}; {fix}")
        if device != self.device:
            raise ContractError(
                f"plan tensors are on {device}, the buffers on {self.device}; "
                "plan on the buffers' device"
            )
        for ratio in ratios:
            if ratio not in self.compressed:
                raise ContractError(
                    f"plan has c{ratio} fields but the buffers' config has no ratio-{ratio} layers"
                )


def plan_widths(plan: AttentionMetadata) -> PlanWidths:
    """The widths ``plan`` was made with (at least one column each, like ``PlanWidths``)."""
    return PlanWidths(
        page_table=max(plan.page_table.shape[1], 1),
        c128=max(plan.c128.page_indices.shape[1], 1) if plan.c128 is not None else 1,
    )


def pad_plan(
    config: DSV4AttentionConfig, plan: AttentionMetadata, *, batch_size: int, num_rows: int
) -> AttentionMetadata:
    """``plan`` grown to ``batch_size`` requests and ``num_rows`` rows of padding.

    For a host that pads a batch after planning it on purpose (sglang plans a draft-extend
    batch, then pads it for data-parallel sync): the appended rows get the sentinels of the
    module table, so they write nothing and attend to nothing (their output is 0). Allocates new
    tensors (eager use only). Raises ``ContractError`` when the batch shrank.
    """
    if batch_size < plan.batch_size or num_rows < plan.num_rows:
        raise ContractError(
            f"cannot pad a plan of batch_size={plan.batch_size}, num_rows={plan.num_rows} to "
            f"batch_size={batch_size}, num_rows={num_rows}: padding only appends"
        )
    buffers = GraphMetadataBuffers(
        config,
        max_batch_size=batch_size,
        max_rows=num_rows,
        widths=plan_widths(plan),
        device=plan.row_batch_ids.device,
    )
    return dataclasses.replace(buffers.load(plan, num_rows=num_rows), batch_size=batch_size)


#: The fields through which a plan writes (caches, compressor rings): sentinels in a read plan.
_WRITE_FIELDS = frozenset({"swa_out_loc", "out_loc", "compress_plan", "write_plan"})


def _read_rows(part: Any, rows: torch.Tensor) -> dict[str, Any]:
    """``part``'s tensor fields at ``rows``; the write fields filled with their sentinel."""
    out = {}
    for f in dataclasses.fields(part):
        value = getattr(part, f.name)
        if isinstance(value, torch.Tensor):
            kept = value.index_select(0, rows)
            out[f.name] = kept.fill_(_sentinel(f.name)) if f.name in _WRITE_FIELDS else kept
    return out


def read_plan(
    config: DSV4AttentionConfig, plan: AttentionMetadata, rows: torch.Tensor, *, num_rows: int
) -> AttentionMetadata:
    """The plan of some of ``plan``'s rows that only reads: rows ``rows`` (``[n]`` int64 row
    indices of ``plan``, in the order given), then sentinel rows up to ``num_rows`` (they
    attend to nothing; output 0).

    For a prefill context-parallel rank, whose queries are its own rows of the batch while its
    cache and compressor writes are the whole batch's: the rank reads (indexer, attention)
    through this plan and writes through ``plan``. Every write field is a sentinel here (no
    cache write, no plan record), so this plan cannot write; ``c4.page_indices`` (and
    DeepSeek-V4.1's ``c1`` / ``c2`` selections and candidate blocks) are its own tensors, which
    the rank's index sources fill. Allocates new tensors (eager use only).
    ``ContractError`` for a row index outside ``plan`` or more rows than ``num_rows``.
    """
    if rows.dim() != 1 or (
        rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < plan.num_rows
    ):
        raise ContractError(
            f"read_plan rows {rows.tolist()[:8]}... of shape {tuple(rows.shape)}: expected [n] "
            f"row indices of the plan's {plan.num_rows} rows"
        )
    rows = rows.to(device=plan.row_batch_ids.device, dtype=torch.int64)
    c4, c128 = (
        None if part is None else dataclasses.replace(part, **_read_rows(part, rows))
        for part in (plan.c4, plan.c128)
    )
    c1, c2 = (
        None if low is None else dataclasses.replace(low, **_read_rows(low, rows))
        for low in (plan.c1, plan.c2)
    )
    subset = dataclasses.replace(
        plan,
        num_rows=rows.numel(),
        c4=c4,
        c128=c128,
        c1=c1,
        c2=c2,
        pending_checks=None,
        **_read_rows(plan, rows),
    )
    return pad_plan(config, subset, batch_size=plan.batch_size, num_rows=num_rows)
