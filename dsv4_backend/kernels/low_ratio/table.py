"""The variants of DeepSeek-V4.1's low-ratio ops (``kernels/variants.py``).

:data:`LOW_RATIO_PAIRS`, a ratio-2 kv source's pair pooling (``torch.pair_pool``'s contract):
``triton`` (two launches, ``triton.py``; the interpreter's default, opt-in on CUDA) and
``torch`` (the CUDA baseline).

:data:`LOW_RATIO_ROWS`, the rows of a kv source's compressor and of an index source's queries:
``bf16(x)``, an optional RMSNorm rounded to bf16, RoPE at the row's position rounded to bf16,
fp4 with e4m3 scales a 16 values (compressed entries) or ue8m0 scales a 32 (index keys,
queries), and for index keys the store into the kv source's fp4 pages.

* ``triton`` (``triton.py``): one launch, the fp4 pages packed in the kernel; the
  interpreter's default, opt-in on CUDA until it passes ``scripts/gpu_check.sh``;
* ``torch`` (``torch.py``): the CUDA baseline.

:data:`LOW_RATIO_SCORES`, the index scores: ``score[t, e] = sum_h w[t, h] relu(q[t, h] .
K[e])`` of a row's visible entries ``e`` of its kv source's fp4 index keys (-inf past them); the
selection that follows is ``selection.py``'s. Both variants are the lightning indexer's
(``kernels/indexer/``) with the ratio's entries a page.

* ``triton``: the lightning indexer's scores kernel (``kernels/indexer/triton.py``) reading
  the fp4 index-key pages (``kernels/device/fp4.py``) with the ratio's entries per page; the
  interpreter's default, opt-in on CUDA until it passes ``scripts/gpu_check.sh``;
* ``torch``: the indexer's torch scores (``kernels/indexer/torch.py``), the CUDA baseline.

Each variant takes its op's call, checked when made: :class:`~.common.PairCall`,
:class:`~.common.RowsCall`, and for the scores the indexer's ``IndexCall``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache, Fp4Scale
from dsv4_backend.cache.state import CompressorState
from dsv4_backend.config import entries_per_page
from dsv4_backend.kernels.indexer.common import IndexCall
from dsv4_backend.kernels.indexer.torch import indexer_scores_torch
from dsv4_backend.kernels.indexer.triton import indexer_scores_triton
from dsv4_backend.kernels.low_ratio.common import PairCall, RowsCall
from dsv4_backend.kernels.low_ratio.torch import fp4_rows_torch, pair_pool
from dsv4_backend.kernels.low_ratio.triton import fp4_rows_triton, pair_pool_triton
from dsv4_backend.kernels.variants import TRITON_PATHS, OpTable, Variant, resolve

LOW_RATIO_PAIRS: OpTable[Callable[[PairCall], torch.Tensor]] = OpTable(
    "low_ratio_pairs",
    "a DeepSeek-V4.1 ratio-2 kv source's pair pooling over its pair ring",
    (
        Variant(
            "triton",
            pair_pool_triton,
            (TRITON_PATHS,),
            "every batch; a program per row and 128 channels, then the ring write",
        ),
        Variant("torch", pair_pool, (), "every batch", baseline=True),
    ),
)

LOW_RATIO_ROWS: OpTable[Callable[[RowsCall], tuple[torch.Tensor, torch.Tensor | None]]] = OpTable(
    "low_ratio_rows",
    "DeepSeek-V4.1's entry, index-key and index-query rows: norm, RoPE, fp4 (and the fp4 store)",
    (
        Variant(
            "triton",
            fp4_rows_triton,
            (TRITON_PATHS,),
            "a power-of-two number of scale blocks a row; one program a row (a head)",
        ),
        Variant("torch", fp4_rows_torch, (), "every shape and cache format", baseline=True),
    ),
)

LOW_RATIO_SCORES: OpTable[Callable[[IndexCall], torch.Tensor]] = OpTable(
    "low_ratio_scores",
    "DeepSeek-V4.1's index scores of each row's visible entries (fp4 index keys)",
    (
        Variant(
            "triton",
            indexer_scores_triton,
            (TRITON_PATHS,),
            "fp4 and dense index keys; one program per 64 entries of a row",
        ),
        Variant("torch", indexer_scores_torch, (), "every cache format", baseline=True),
    ),
)


def low_ratio_pairs(
    rings: CompressorState,
    kv: torch.Tensor,
    score: torch.Tensor,
    req_rows: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
    """``[T, D]`` float32: each row pooled with the token before it, updating the pair ring
    (``torch.pair_pool`` documents the arguments); the variant :data:`LOW_RATIO_PAIRS`
    chooses."""
    call = PairCall(rings, kv, score, req_rows, positions, valid)
    return resolve(LOW_RATIO_PAIRS, kv.device).variant.entry(call)


def low_ratio_rows(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: Fp4Scale,
    norm: tuple[torch.Tensor, float] | None = None,
    store: tuple[Fp4IndexKeyCache, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rows, normed)``: ``x`` ``[N, D]`` or ``[N, H, D]`` float (bf16 values), ``cos`` /
    ``sin`` ``[N, R/2]`` of each row's position (every head of a row at it), rounded to fp4
    with ``scale``'s block scales, float32 like ``x``; ``normed`` the RMSNorm's bf16 output
    (``norm`` = ``(weight [D], eps)``; None without). ``store`` = ``(cache, slots [N])``
    writes the rows at ``slots`` (-1: the padding slot 0). The variant :data:`LOW_RATIO_ROWS`
    chooses."""
    call = RowsCall(x, cos, sin, scale, norm, store)
    return resolve(LOW_RATIO_ROWS, x.device).variant.entry(call)


def low_ratio_scores(call: IndexCall) -> torch.Tensor:
    """``[T, N]`` float32 scores of the lightning indexer's ``call`` over a kv source's fp4
    index keys (``q_idx`` ``[T, HI, DI]`` fp4 queries, ``N = max_candidates`` columns, the
    ratio's ``entries_per_page``, :func:`low_ratio_call`); the variant
    :data:`LOW_RATIO_SCORES` chooses."""
    return resolve(LOW_RATIO_SCORES, call.q_idx.device).variant.entry(call)


def low_ratio_call(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: Fp4IndexKeyCache,
    page_table: torch.Tensor,
    visible: torch.Tensor,
    ratio: int,
) -> IndexCall:
    """The index scores' call: ``q`` ``[T, HI, DI]`` (fp4 queries), ``weights`` ``[T, HI]``,
    the kv source's ``keys``, ``page_table`` ``[T, Pw]``, ``visible`` ``[T]`` int entries
    of each row, of ``ratio``'s entries: every entry the page table addresses a column."""
    per_page = entries_per_page(ratio)
    width = max(1, page_table.shape[1] * per_page)
    return IndexCall(q, weights, keys, page_table, visible.int(), width, per_page)
