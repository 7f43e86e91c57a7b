"""The lightning indexer's shared host code: the c4 page geometry, the scoring and selection
calls every variant takes, checked when made (:class:`IndexCall`, :class:`SelectCall`), the c4
slots of entry indices, the selection's definition (``select_entries``, the torch variant's
selection) and the record of a variant's entry points (:class:`IndexerKernels`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from dsv4_backend.cache.indexer_cache import IndexerKeyCache
from dsv4_backend.errors import ContractError
from dsv4_backend.kernels.indexer.topk import best_columns

if TYPE_CHECKING:
    from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache

#: c4 entries per full-cache page (page size 256 / ratio 4).
C4_ENTRIES_PER_PAGE = 64
#: Candidate columns per Triton program (per loop step of the length-bounded kernel).
BLOCK_N = 64


@dataclass(frozen=True)
class IndexCall:
    """One scoring call of the lightning indexer, checked when made (:meth:`of`); every
    variant's ``scores`` and ``run`` take one (``table.py``). DeepSeek-V4.1's index scores
    run the same scores over fp4 index keys with their ratio's entries a page
    (``kernels/low_ratio/``).

    Attributes
    ----------
    q_idx : ``[T, HI, DI]`` fp32 / bf16 indexer queries, already roped.
    weights : ``[T, HI]`` float head weights, already scaled by ``DI^-0.5 * HI^-0.5``.
    keys : the layer's indexer key cache (dense, fp8, or fp4 under
        ``indexer_selection="fp4"``), addressed by c4 slot; V4.1: a kv source's fp4 index keys.
    page_table : ``[T, Pw]`` int32 full-cache pages of each row's request.
    num_candidates : ``[T]`` int32 visible entries (``(p+1)//4`` for c4); values above
        ``max_candidates`` are clamped to it.
    max_candidates : ``N``, the score columns; static under CUDA graphs.
    entries_per_page : entries a page of ``page_table`` holds (c4: 64).
    """

    q_idx: torch.Tensor
    weights: torch.Tensor
    keys: IndexerKeyCache | Fp4IndexKeyCache
    page_table: torch.Tensor
    num_candidates: torch.Tensor
    max_candidates: int
    entries_per_page: int = C4_ENTRIES_PER_PAGE

    @classmethod
    def of(
        cls,
        q_idx: torch.Tensor,
        weights: torch.Tensor,
        keys: IndexerKeyCache | Fp4IndexKeyCache,
        page_table: torch.Tensor,
        num_candidates: torch.Tensor,
        max_candidates: int,
    ) -> IndexCall:
        """The c4 indexer's arguments as one checked call (``ContractError`` naming the first
        that does not fit)."""
        if q_idx.dim() != 3 or not q_idx.is_floating_point():
            raise ContractError(
                f"q_idx has shape {tuple(q_idx.shape)} and dtype {q_idx.dtype}; expected a float "
                "tensor [T, HI, DI]"
            )
        rows, heads, dim = q_idx.shape
        # name -> (tensor, expected shape (None: any size), expected dtype (None: any float))
        expected = {
            "weights": (weights, (rows, heads), None),
            "page_table": (page_table, (rows, None), torch.int32),
            "num_candidates": (num_candidates, (rows,), torch.int32),
        }
        for name, (tensor, shape, dtype) in expected.items():
            shape_ok = tensor.dim() == len(shape) and all(
                want is None or got == want for got, want in zip(tensor.shape, shape, strict=True)
            )
            dtype_ok = tensor.is_floating_point() if dtype is None else tensor.dtype == dtype
            if not (shape_ok and dtype_ok):
                want = "[" + ", ".join("Pw" if n is None else str(n) for n in shape) + "]"
                raise ContractError(
                    f"{name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; expected "
                    f"{want} {dtype or 'float'} (q_idx is [T={rows}, HI={heads}, DI={dim}])"
                )
        for name, device in (
            ("weights", weights.device),
            ("page_table", page_table.device),
            ("num_candidates", num_candidates.device),
            ("the indexer key cache", keys.device),
        ):
            if device != q_idx.device:
                raise ContractError(f"{name} is on {device}; q_idx is on {q_idx.device}")
        if keys.dim != dim:
            raise ContractError(f"the indexer key cache has dim {keys.dim}; q_idx has DI={dim}")
        if keys.fmt == "dense" and keys.storage.stride(1) != 1:
            raise ContractError(
                f"the dense indexer key cache has channel stride {keys.storage.stride(1)}; "
                "expected contiguous rows (stride(1) == 1)"
            )
        if max_candidates < 0:
            raise ContractError(f"max_candidates={max_candidates}; expected >= 0")
        return cls(q_idx, weights, keys, page_table, num_candidates, max_candidates)


def entry_slots(
    page_table: torch.Tensor, entries: torch.Tensor, per_page: int = C4_ENTRIES_PER_PAGE
) -> torch.Tensor:
    """Cache slots of per-row entry indices (c4 by default; DeepSeek-V4.1's c1 / c2 with
    ``per_page`` 256 / 128).

    Parameters
    ----------
    page_table : ``[T, Pw]`` int32 full-cache pages of each row's request.
    entries : ``[T, n]`` integer entry indices; negative means none.
    per_page : entries a full-cache page holds.

    Returns ``[T, n]`` int64: ``page_table[t, e // E] * E + e % E`` (``E = per_page``), -1
    where ``e < 0``.
    """
    valid = entries >= 0
    entries = torch.where(valid, entries, 0).long()
    pages = page_table.gather(1, entries // per_page).long()
    return torch.where(valid, pages * per_page + entries % per_page, -1)


def select_entries(scores: torch.Tensor, num_candidates: torch.Tensor, topk: int) -> torch.Tensor:
    """Selected entry indices per row: ``[T, topk]`` int64, ascending, ``-1`` padded.

    Every candidate when ``num_candidates[t] <= topk``, else the ``topk`` best scores (ties to
    the smaller index). ``scores`` is ``[T, N]`` float (``index_scores``' output); candidates
    beyond ``N`` are ignored.
    """
    rows, cols = scores.shape
    num = num_candidates.clamp(0, cols).long()[:, None]
    column = torch.arange(cols, device=scores.device)
    if cols > topk:
        # Valid scores are finite, so they outrank the -inf padding of short rows.
        masked = scores.float().masked_fill(column >= num, float("-inf"))
        picked = best_columns(masked, topk)
    else:
        picked = column.expand(rows, cols)
    picked = torch.where(picked < num, picked, cols).sort(dim=1).values
    picked = torch.where(picked < cols, picked, -1)
    return torch.nn.functional.pad(picked, (0, topk - picked.shape[1]), value=-1)


@dataclass(frozen=True)
class SelectCall:
    """One selection call of the lightning indexer (``table.select_topk``'s arguments, which
    its docstring describes), checked when made (``ContractError`` naming the first that does
    not fit); every variant's ``select`` and ``select_padded`` take one.

    Attributes
    ----------
    scores : ``[T, N]`` float scores.
    num_candidates : ``[T]`` int32 candidates per row.
    page_table : ``[T, Pw]`` int32 full-cache pages of each row's request.
    topk : ``K``, entries kept per row.
    out : ``[T, K]`` int32, receives the c4 slots of the selected entries.
    """

    scores: torch.Tensor
    num_candidates: torch.Tensor
    page_table: torch.Tensor
    topk: int
    out: torch.Tensor

    def __post_init__(self) -> None:
        scores, num_candidates, out = self.scores, self.num_candidates, self.out
        if scores.dim() != 2 or num_candidates.shape != scores.shape[:1]:
            raise ContractError(
                f"scores {tuple(scores.shape)} and num_candidates "
                f"{tuple(num_candidates.shape)}; expected [T, N] and [T]"
            )
        rows, topk = scores.shape[0], self.topk
        if tuple(out.shape) != (rows, topk) or out.dtype != torch.int32:
            raise ContractError(
                f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected [{rows}, "
                f"{topk}] int32 (topk={topk})"
            )
        if self.page_table.dim() != 2 or self.page_table.shape[0] != rows:
            raise ContractError(
                f"page_table has shape {tuple(self.page_table.shape)}; expected [{rows}, Pw]"
            )


def mask_past_count(scores: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:
    """``[T, N]`` fp32 ``scores`` with ``-inf`` at each row's columns ``>= num_candidates``."""
    column = torch.arange(scores.shape[1], device=scores.device)
    return scores.float().masked_fill(column >= num_candidates[:, None], float("-inf"))


class IndexerKernels(NamedTuple):
    """One indexer variant's entry points (arguments as ``table.py``'s functions).

    ``scores``: ``index_scores`` (``[T, N]`` fp32, ``-inf`` past each row's count);
    ``select``: ``select_topk`` from any scores; ``select_padded``: the selection of scores
    already ``-inf`` past each row's count; ``run``: ``run_indexer`` in one (``None``:
    ``scores``, then ``select_padded``).
    """

    scores: Callable[[IndexCall], torch.Tensor]
    select: Callable[[SelectCall], None]
    select_padded: Callable[[SelectCall], None]
    run: Callable[[IndexCall, int, torch.Tensor], None] | None = None
