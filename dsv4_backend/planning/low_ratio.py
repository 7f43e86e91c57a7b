"""DeepSeek-V4.1's low-ratio fields of a plan (``metadata.LowRatioMetadata``; docs/design.md
§8): the torch planner's, and the torch twin of the fused planner kernel's
(``planning/kernels/plan_fields.py`` ``_low_ratio_fields``).

A row at position ``p`` writes its token's entry into the c1 cache at its full-cache slot, and
on an odd ``p`` the pair ``(p - 1, p)``'s entry into the c2 cache at ``full slot // 2`` (the
full page table addresses both: a page of 256 tokens holds 256 c1 and 128 c2 entries). It sees
``(p + 1) // r`` entries of ratio ``r``. A row that writes nothing (write slot -1: a request
that failed a deferred batch check; a graph bucket's rows past the batch, whose sentinels
``GraphMetadataBuffers`` writes) sees nothing. sglang's padding requests write its padding
slot 0.
"""

from __future__ import annotations

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.planning.metadata import LowRatioMetadata


def low_ratio_fields(
    config: DSV4AttentionConfig, positions: torch.Tensor, write_slots: torch.Tensor, ratio: int
) -> LowRatioMetadata:
    """The fields of low ``ratio`` (1 or 2) for rows at ``positions`` ``[T]`` int64 writing
    full-cache slots ``write_slots`` ``[T]`` int64 (-1: no write); the selections
    (``page_indices``, the candidate source ratio's ``candidate_blocks``) filled with -1 for
    the index sources to write (module docstring)."""
    positions, full = positions.long(), write_slots.long()
    writes = full >= 0
    out_loc = full if ratio == 1 else torch.where((positions % 2 == 1) & writes, full // 2, -1)
    visible = torch.where(writes, (positions + 1) // ratio, 0).int()
    rows, device = positions.shape[0], positions.device
    v41 = config.v41
    return LowRatioMetadata(
        ratio=ratio,
        out_loc=torch.where(writes, out_loc, -1),
        topk_lengths_raw=visible,
        sparse_topk_lengths=visible.clamp(max=config.index_topk).clamp(min=1),
        page_indices=torch.full((rows, config.index_topk), -1, dtype=torch.int32, device=device),
        candidate_blocks=torch.full(
            (rows, v41.candidate_topk_blocks), -1, dtype=torch.int32, device=device
        )
        if v41 is not None and config.candidate_ratio == ratio
        else None,
    )
