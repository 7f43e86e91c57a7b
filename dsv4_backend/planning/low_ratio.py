"""DeepSeek-V4.1's low-ratio fields of a plan (``metadata.LowRatioMetadata``; docs/design.md
§8), from the rows' positions and page table: torch ops without a host sync, on every planner
path, eager or into the CUDA-graph buffers.

A row at position ``p`` writes its token's entry into the c1 cache at its full-cache slot, and
on an odd ``p`` the pair ``(p - 1, p)``'s entry into the c2 cache at ``full slot // 2`` (the
full page table addresses both: a page of 256 tokens holds 256 c1 and 128 c2 entries). It sees
``(p + 1) // r`` entries of ratio ``r``. A graph replay's padding request (pool row 0) writes
sglang's padding slot 0; a row without a page (``page_table`` all -1: a bucket's rows past the
batch's requests) writes nothing and sees nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.planning.batch import BatchView
from dsv4_backend.planning.metadata import AttentionMetadata, LowRatioMetadata


def row_write_slots(batch: BatchView, metadata: AttentionMetadata) -> torch.Tensor:
    """``[T]`` int64 full-cache slot each row writes: its slot of ``batch.out_cache_loc``, which
    the planner checked to be ``req_to_token``'s for the row; sglang's padding slot 0 for the
    rows past it (a graph replay's padding requests, whose view carries the live rows' slots
    only), -1 for a row without a page (a bucket's rows past the batch's requests)."""
    rows = metadata.num_rows
    loc = batch.out_cache_loc.reshape(-1)[:rows].long()
    slots = torch.zeros(rows, dtype=torch.int64, device=loc.device)
    slots[: loc.shape[0]] = loc
    return torch.where(metadata.page_table[:, 0] >= 0, slots, -1)


def low_ratio_fields(
    config: DSV4AttentionConfig,
    metadata: AttentionMetadata,
    write_slots: torch.Tensor,
    ratio: int,
    out: LowRatioMetadata | None = None,
) -> LowRatioMetadata:
    """The fields of low ``ratio`` for ``metadata``'s rows writing ``write_slots``
    (``row_write_slots``; module docstring); written into ``out``'s tensors (``[T]`` views of
    the graph buffers) when given, else new tensors."""
    positions = metadata.positions_causal.long()
    full = write_slots
    has_page = full >= 0
    out_loc = full if ratio == 1 else torch.where((positions % 2 == 1) & has_page, full // 2, -1)
    visible = torch.where(has_page, (positions + 1) // ratio, 0).int()
    sparse = visible.clamp(max=config.index_topk).clamp(min=1)
    v41 = config.v41
    if out is not None:
        out.out_loc.copy_(out_loc)
        out.topk_lengths_raw.copy_(visible)
        out.sparse_topk_lengths.copy_(sparse)
        out.page_indices.fill_(-1)
        if out.candidate_blocks is not None:
            out.candidate_blocks.fill_(-1)
        return out
    rows, device = positions.shape[0], positions.device
    return LowRatioMetadata(
        ratio=ratio,
        out_loc=out_loc,
        topk_lengths_raw=visible,
        sparse_topk_lengths=sparse,
        page_indices=torch.full((rows, config.index_topk), -1, dtype=torch.int32, device=device),
        candidate_blocks=torch.full(
            (rows, v41.candidate_topk_blocks), -1, dtype=torch.int32, device=device
        )
        if v41 is not None and config.candidate_ratio == ratio
        else None,
    )


def with_low_ratio_fields(
    config: DSV4AttentionConfig,
    batch: BatchView,
    metadata: AttentionMetadata,
    out: Mapping[int, LowRatioMetadata] | None = None,
) -> AttentionMetadata:
    """``metadata`` (the plan of ``batch``) with the fields of every low ratio ``config`` uses
    (itself for V4); ``out`` (ratio -> buffers of ``metadata.num_rows`` rows): written there."""
    present = config.low_ratios_present
    if not present:
        return metadata
    slots = row_write_slots(batch, metadata)
    fields = {
        r: low_ratio_fields(config, metadata, slots, r, None if out is None else out[r])
        for r in present
    }
    return dataclasses.replace(metadata, c1=fields.get(1), c2=fields.get(2))
