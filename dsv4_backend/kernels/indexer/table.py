"""Lightning indexer: score a row's visible c4 entries and keep the top-k as c4 cache slots.

docs/design.md §2. For query row ``t`` (position ``p``) and c4 entry ``s``::

    score[t, s] = sum_h w[t, h] * relu(q_idx[t, h] . K[s])      for s < num_candidates[t]

``num_candidates = c4.topk_lengths_raw = (p + 1) // 4``; ``K[s]`` is the indexer key cache row
at the c4 slot of entry ``s``: ``page_table[t, s * 4 // 256] * 64 + s % 64``. The selection keeps
every candidate when there are at most ``topk``, else the ``topk`` best scores; equal scores at
the boundary go to the smaller entry index, so every path selects the same set. Selected
entries are written in ascending entry order, as c4 slots, ``-1`` padded
(``c4.page_indices``).

Shapes: ``T`` rows, ``HI`` indexer heads, ``DI`` indexer head dim, ``Pw`` page-table width,
``N`` score columns (``max_candidates``), ``K`` ``topk``. Every output shape depends only on
``(T, N, K)`` and nothing reads a tensor value on the host, so the indexer can be captured in
a CUDA graph (warm it up first: the first call compiles).

The entry points here (:func:`index_scores`, :func:`select_topk`, :func:`run_indexer`) run
the variant :data:`INDEXER` chooses (``kernels/variants.py``); every one selects the same set
(ties go to the smaller index). Under ``indexer_selection="fp4"`` the keys are fp4 pages
(``cache.fp4_format.Fp4IndexKeyCache``, ``kernels/indexer/fp4.py``): every variant scores them.

* ``deep_gemm`` (``deep_gemm.py``): DeepGEMM's paged MQA logits (the field's GPU-proven
  kernels, as sglang's built-in scores: ``fp8_paged_mqa_logits`` over fp8 keys,
  ``fp8_fp4_paged_mqa_logits`` over fp4 keys on sm_100 / sm_120), then the same selection;
  for ``indexer_selection="fp8"`` / ``"fp4"`` only (it is exact for them). A CUDA default once
  it passes the start-up self-check on the device (``self_check/``).
* ``bounded`` (``bounded.py``; the interpreter's default): three launches whose work follows
  each row's own candidate count.
* ``full_width`` (``triton.py``; the CUDA baseline): Triton scores over the page table's whole
  width, then the top-k of the whole matrix and the slots (``slots.py``, ``topk.py``).
* ``torch`` (``torch.py``): the plain implementation (the torch path, every path's twin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.indexer.bounded import (
    index_scores_bounded,
    run_indexer_bounded,
    select_topk_bounded,
)
from dsv4_backend.kernels.indexer.common import (
    C4_ENTRIES_PER_PAGE,
    IndexCall,
    IndexerKernels,
    SelectCall,
)
from dsv4_backend.kernels.indexer.deep_gemm import (
    FUNCTIONS as DEEP_GEMM_FUNCTIONS,
)
from dsv4_backend.kernels.indexer.deep_gemm import (
    deep_gemm_unsupported_reason,
    index_scores_deep_gemm,
)
from dsv4_backend.kernels.indexer.fp4 import fp4_query_view
from dsv4_backend.kernels.indexer.fp8 import quantised_view
from dsv4_backend.kernels.indexer.slots import select_padded_slots, select_slots
from dsv4_backend.kernels.indexer.torch import indexer_scores_torch, select_topk_torch
from dsv4_backend.kernels.indexer.triton import indexer_scores_triton
from dsv4_backend.kernels.variants import (
    TRITON_PATHS,
    OpTable,
    Variant,
    on_cuda,
    on_paths,
    resolve,
    with_library,
)

if TYPE_CHECKING:
    from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache
    from dsv4_backend.cache.indexer_cache import IndexerKeyCache


#: The variants; each entry is an :class:`~dsv4_backend.kernels.indexer.common.IndexerKernels`,
#: ``deep_gemm``'s ``rejects(device, keys, heads, dim, indexer_selection)`` says why it cannot
#: take a layer's key cache and ``[T, heads, dim]`` queries.
INDEXER: OpTable[IndexerKernels] = OpTable(
    "indexer",
    "the lightning indexer: scores of each row's c4 candidates and their top-k as slots",
    (
        Variant(
            "deep_gemm",
            IndexerKernels(index_scores_deep_gemm, select_slots, select_padded_slots),
            (
                on_paths(dispatch.TRITON),
                on_cuda(9, 10, 12),
                with_library("deep_gemm", *DEEP_GEMM_FUNCTIONS),
            ),
            "DeepGEMM's paged MQA logits, heads of dim 128: fp8 keys (fp8_paged_mqa_logits; "
            "32 / 64 heads) with indexer_selection='fp8', fp4 keys (fp8_fp4_paged_mqa_logits; "
            "CUDA 10.x: 8 / 16 / 32 / 64 heads, 12.x: 64) with indexer_selection='fp4'",
            rejects=deep_gemm_unsupported_reason,
            setting="DSV4_BACKEND_INDEXER_SELECTION=fp8, or sglang's "
            "--enable-deepseek-v4-fp4-indexer (fp4)",
        ),
        Variant(
            "bounded",
            IndexerKernels(
                index_scores_bounded, select_topk_bounded, select_topk_bounded, run_indexer_bounded
            ),
            (TRITON_PATHS,),
            "dense, fp8 or fp4 keys; work follows each row's candidate count",
        ),
        Variant(
            "full_width",
            IndexerKernels(indexer_scores_triton, select_slots, select_padded_slots),
            (TRITON_PATHS,),
            "dense, fp8 or fp4 keys; work follows the page table's width",
            baseline=True,
        ),
        Variant(
            "torch",
            IndexerKernels(indexer_scores_torch, select_topk_torch, select_topk_torch),
            (),
            "dense, fp8 or fp4 keys",
            baseline=True,
        ),
    ),
)


def _kernels(device: torch.device) -> IndexerKernels:
    return resolve(INDEXER, device).variant.entry


def selection_queries(selection: str, q_idx: torch.Tensor) -> torch.Tensor:
    """The queries ``[T, HI, DI]`` the op scores under ``indexer_selection`` ``selection``:
    ``q_idx`` (``"exact"``), or sglang's rotated e4m3 (``"fp8"``) / fp4 (``"fp4"``) values."""
    if selection == "fp8":
        return quantised_view(q_idx)
    if selection == "fp4":
        return fp4_query_view(q_idx)
    return q_idx


def index_scores(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    keys: IndexerKeyCache | Fp4IndexKeyCache,
    page_table: torch.Tensor,
    num_candidates: torch.Tensor,
    max_candidates: int,
) -> torch.Tensor:
    """Indexer scores of every row's candidate c4 entries.

    Parameters
    ----------
    q_idx : ``[T, HI, DI]`` fp32 / bf16 indexer queries, already roped.
    weights : ``[T, HI]`` float head weights, already scaled by ``DI^-0.5 * HI^-0.5``.
    keys : the layer's indexer key cache (dense, fp8, or fp4 pages under
        ``indexer_selection="fp4"``: ``kernels.indexer.fp4``), addressed by c4 slot.
    page_table : ``[T, Pw]`` int32 full-cache pages of each row's request.
    num_candidates : ``[T]`` int32 visible entries, ``c4.topk_lengths_raw`` (``(p+1)//4``);
        values above ``max_candidates`` are clamped to it.
    max_candidates : ``N``, the score columns; static under CUDA graphs.

    Returns ``[T, N]`` fp32 scores, ``-inf`` at columns ``>= num_candidates``.
    """
    call = IndexCall.of(q_idx, weights, keys, page_table, num_candidates, max_candidates)
    return _kernels(q_idx.device).scores(call)


def select_topk(
    scores: torch.Tensor,
    num_candidates: torch.Tensor,
    page_table: torch.Tensor,
    topk: int,
    out: torch.Tensor,
) -> None:
    """Write the c4 slots of each row's selected entries into ``out``.

    Parameters
    ----------
    scores : ``[T, N]`` float (``index_scores``).
    num_candidates : ``[T]`` int32 candidates per row.
    page_table : ``[T, Pw]`` int32 full-cache pages of each row's request.
    topk : ``K``, entries kept per row (``index_topk``).
    out : ``[T, K]`` int32, e.g. ``c4.page_indices``; receives the slots of the selected
        entries in ascending entry order, then ``-1`` (rows with 0 candidates are all ``-1``).
    """
    call = SelectCall(scores, num_candidates, page_table, topk, out)
    _kernels(scores.device).select(call)


def run_indexer(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    keys: IndexerKeyCache | Fp4IndexKeyCache,
    page_table: torch.Tensor,
    num_candidates: torch.Tensor,
    topk: int,
    out: torch.Tensor,
    max_candidates: int | None = None,
) -> None:
    """Score and select: fill ``out`` (``[T, topk]`` int32, ``c4.page_indices``) with slots.

    ``max_candidates`` defaults to every entry the page table can address (``Pw * 64``); pass
    a smaller static bound for long prefills (the score matrix is ``[T, max_candidates]``).
    Other arguments as in ``index_scores`` and ``select_topk``.
    """
    if max_candidates is None:
        max_candidates = page_table.shape[-1] * C4_ENTRIES_PER_PAGE
    call = IndexCall.of(q_idx, weights, keys, page_table, num_candidates, max_candidates)
    kernels = _kernels(q_idx.device)
    if kernels.run is not None:
        kernels.run(call, topk, out)
        return
    scores = kernels.scores(call)
    kernels.select_padded(SelectCall(scores, num_candidates, page_table, topk, out))
