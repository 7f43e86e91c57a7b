"""DeepSeek-V4.1's low-ratio fields of a plan (``metadata.LowRatioMetadata``; docs/design.md
§8), from the rows' positions and page table: torch ops, on every planner path.

A row at position ``p`` writes its token's entry into the c1 cache at its full-cache slot, and
on an odd ``p`` the pair ``(p - 1, p)``'s entry into the c2 cache at ``full slot // 2`` (the
full page table addresses both: a page of 256 tokens holds 256 c1 and 128 c2 entries). It sees
``(p + 1) // r`` entries of ratio ``r``.
"""

from __future__ import annotations

import dataclasses

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.planning.metadata import AttentionMetadata, LowRatioMetadata


def row_full_slots(config: DSV4AttentionConfig, metadata: AttentionMetadata) -> torch.Tensor:
    """``[T]`` int64 full-cache slot of each row's token, from ``page_table`` and the row's
    position (the slot the planner checked against ``req_to_token``)."""
    positions = metadata.positions_causal.long()
    column = (positions // config.page_size)[:, None]
    pages = metadata.page_table.long().gather(1, column).squeeze(1)
    return pages * config.page_size + positions % config.page_size


def low_ratio_fields(
    config: DSV4AttentionConfig, metadata: AttentionMetadata, ratio: int
) -> LowRatioMetadata:
    """The fields of low ``ratio`` for ``metadata``'s rows (module docstring)."""
    positions = metadata.positions_causal.long()
    full = row_full_slots(config, metadata)
    out_loc = full if ratio == 1 else torch.where(positions % 2 == 1, full // 2, -1)
    visible = ((positions + 1) // ratio).int()
    rows = positions.shape[0]
    v41 = config.v41
    candidates = None
    source = -1 if v41 is None else v41.candidate_source_layer
    if v41 is not None and source >= 0 and config.compress_ratios[source] == ratio:
        candidates = torch.full(
            (rows, v41.candidate_topk_blocks), -1, dtype=torch.int32, device=positions.device
        )
    return LowRatioMetadata(
        ratio=ratio,
        out_loc=out_loc,
        topk_lengths_raw=visible,
        sparse_topk_lengths=visible.clamp(max=config.index_topk).clamp(min=1),
        page_indices=torch.full(
            (rows, config.index_topk), -1, dtype=torch.int32, device=positions.device
        ),
        candidate_blocks=candidates,
    )


def with_low_ratio_fields(
    config: DSV4AttentionConfig, metadata: AttentionMetadata
) -> AttentionMetadata:
    """``metadata`` with the fields of every low ratio ``config`` uses (itself for V4)."""
    present = config.low_ratios_present
    if not present:
        return metadata
    fields = {r: low_ratio_fields(config, metadata, r) for r in present}
    return dataclasses.replace(metadata, c1=fields.get(1), c2=fields.get(2))
