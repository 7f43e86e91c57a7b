"""The top-k columns of an indexer score matrix, ties to the smaller column: flashinfer's radix
top-k on CUDA where it is installed, a stable torch sort elsewhere (:data:`INDEXER_TOPK`). Used
by the selection's definition (``common.select_entries``) and by ``slots.py``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4_backend.kernels.variants import OpTable, Variant, on_cuda, resolve, with_library
from dsv4_backend.ops.launches import launch


def flashinfer_best_columns(masked: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`best_columns` on flashinfer's radix top-k (plus an int64 cast of the ids)."""
    import flashinfer

    with launch("flashinfer.top_k"):
        return flashinfer.top_k(
            masked, k, tie_break=flashinfer.TopKTieBreak.SMALL, dsa_graph_safe=True
        )[1]


def sorted_best_columns(masked: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`best_columns` by a stable descending sort, which keeps equal scores in column
    order (torch.topk does not promise which of equal scores it keeps, and relu makes exact
    ties common)."""
    return torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :k]


#: A variant's entry: ``[T, k]`` int64 columns of the ``k`` largest of ``[T, N]`` fp32 scores.
TopkEntry = Callable[[torch.Tensor, int], torch.Tensor]

FLASHINFER: Variant[TopkEntry] = Variant(
    "flashinfer",
    flashinfer_best_columns,
    (on_cuda(), with_library("flashinfer", "top_k", "TopKTieBreak")),
    "any [T, N] fp32 scores; graph-safe, its first call compiles (warm_up_topk)",
    baseline=True,
)
INDEXER_TOPK: OpTable[TopkEntry] = OpTable(
    "indexer_topk",
    "the top-k columns of the indexer's score matrix, ties to the smaller column",
    (FLASHINFER, Variant("sort", sorted_best_columns, (), "any scores", baseline=True)),
)


def best_columns(masked: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, k]`` int64 columns of the ``k`` largest values per row of ``[T, N]`` ``masked``
    (``N > k``), ties to the smaller column."""
    return resolve(INDEXER_TOPK, masked.device).variant.entry(masked, k)


def warm_up_topk(device: torch.device | str, topk: int) -> None:
    """Build flashinfer's top-k kernels and its workspace on ``device`` where it is the
    variant (a no-op elsewhere).

    Its first call JIT-compiles and allocates, which must not happen inside a CUDA-graph
    capture: call this before capturing.
    """
    if resolve(INDEXER_TOPK, device).variant is FLASHINFER:
        best_columns(torch.zeros(1, topk + 1, device=device), topk)
