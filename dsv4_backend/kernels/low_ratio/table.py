"""The variants of DeepSeek-V4.1's index scores (:data:`LOW_RATIO_SCORES`,
``kernels/variants.py``): ``score[t, e] = sum_h w[t, h] relu(q[t, h] . K[e])`` of a row's
visible entries ``e`` of its kv source's fp4 index keys (-inf past them); the selection that
follows is ``selection.py``'s. Both variants are the lightning indexer's (``kernels/indexer/``)
with the ratio's entries a page.

* ``triton`` (``triton.py``): the lightning indexer's scores kernel
  (``kernels/indexer/triton.py``) reading the fp4 index-key pages (``kernels/device/fp4.py``)
  with the ratio's entries per page; the interpreter's default, opt-in on CUDA until it passes
  ``scripts/gpu_check.sh``;
* ``torch`` (``torch.py``): the indexer's torch scores, the CUDA baseline.
"""

from __future__ import annotations

import torch

from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache
from dsv4_backend.kernels.low_ratio.torch import index_scores_torch
from dsv4_backend.kernels.low_ratio.triton import index_scores_triton
from dsv4_backend.kernels.variants import TRITON_PATHS, OpTable, Variant, resolve

LOW_RATIO_SCORES = OpTable(
    "low_ratio_scores",
    "DeepSeek-V4.1's index scores of each row's visible entries (fp4 index keys)",
    (
        Variant("triton", index_scores_triton, (TRITON_PATHS,),
                "fp4 and dense index keys; one program per 64 entries of a row"),
        Variant("torch", index_scores_torch, (), "every cache format", baseline=True),
    ),
)  # fmt: skip


def low_ratio_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: Fp4IndexKeyCache,
    page_table: torch.Tensor,
    visible: torch.Tensor,
    ratio: int,
    width: int,
) -> torch.Tensor:
    """``[T, width]`` float32 scores: ``q`` ``[T, HI, DI]`` (fp4 queries), ``weights`` ``[T,
    HI]``, the kv source's ``keys``, ``page_table`` ``[T, Pw]``, ``visible`` ``[T]`` int, of
    ``ratio``'s entries (``width`` columns); the variant :data:`LOW_RATIO_SCORES` chooses."""
    entry = resolve(LOW_RATIO_SCORES, q.device).variant.entry
    return entry(q, weights, keys, page_table, visible, ratio, width)
