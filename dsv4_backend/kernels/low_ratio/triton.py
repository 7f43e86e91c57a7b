"""DeepSeek-V4.1's index scores, Triton variant: the lightning indexer's scores kernel
(``kernels/indexer/triton.py``) over a kv source's fp4 index-key pages, one program per 64
entries of a row."""

from __future__ import annotations

import torch

from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache
from dsv4_backend.config import entries_per_page
from dsv4_backend.kernels.indexer.triton import _index_scores_triton


def index_scores_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: Fp4IndexKeyCache,
    page_table: torch.Tensor,
    visible: torch.Tensor,
    ratio: int,
    width: int,
) -> torch.Tensor:
    """``table.low_ratio_scores`` by the lightning indexer's scores kernel."""
    return _index_scores_triton(
        q, weights, keys, page_table, visible.int(), width, entries_per_page(ratio)
    )
