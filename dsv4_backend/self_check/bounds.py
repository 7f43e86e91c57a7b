"""The bounds a kernel path is judged by against the torch path on the same inputs
(docs/gpu-check.md derives them): the start-up self-check (``self_check/check.py``) and the GPU
check's verdict (``tools/gpu_verdict.py``) both apply them through ``judge.py``.

Tie-aware selection: with fp32 scores ``s`` and a bound ``b`` on each score's error, a set ``K``
is the top-k of some scores within ``b`` of ``s`` exactly when it holds ``min(topk, candidates)``
distinct candidates and ``min_{a in K} (s_a + b_a) >= max_{c not in K} (s_c - b_c)``: an entry
may give way only to one whose fp32 score is within the bounds of its own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

#: Entries of the compressors on two paths: the same fp32 arithmetic in another order (a few
#: ulp of values of order 1, summed over at most 2 * 128 pooled rows); a wrong entry errs O(1).
COMPRESSOR_ATOL = 1e-4
#: One e4m3 step relative to the largest value of a row (3 mantissa bits): where two paths'
#: entries straddle a rounding boundary, their fp8 bytes differ by one step.
FP8_STEP = 2.0**-3
#: The widest e2m1 step (4 to 6, two units of a block scale ``2^e`` whose block's amax is at
#: least ``3 * 2^e``) relative to that amax: where two paths' fp4 index keys straddle a
#: rounding boundary (or a block's amax a power of two), their values differ by this much.
FP4_STEP = 2.0 / 3.0
#: Rounding of a bf16 output (8 significant bits).
BF16_OUTPUT_RTOL = 2.0**-8


@dataclass(frozen=True)
class Finding:
    """One comparison. ``excess``: the worst error as a fraction of its bound (passes at
    ``<= 1``; 0 for equal, ``inf`` for an exact comparison that differs)."""

    mode: str
    layer: int
    step: str
    excess: float
    passed: bool
    detail: str = ""

    def as_json(self) -> dict[str, object]:
        out = asdict(self)
        out["excess"] = self.excess if math.isfinite(self.excess) else None
        return out


def score_bound(
    q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, operand_dtype: torch.dtype
) -> torch.Tensor:
    """Bound on the error of ``sum_h w_h relu(q_h . k)`` computed with operands rounded to
    ``operand_dtype`` and fp32 accumulation, against the fp32 score.

    ``q_idx`` ``[T, HI, DI]``, ``weights`` ``[T, HI]``, ``keys`` ``[T, N, DI]`` (each row's
    candidates), all float. Rounding q, k and w once each to a roundoff ``u`` moves a product by
    at most ``(3u + 3u^2) |w| |q| |k|``; relu is 1-Lipschitz; both paths' fp32 sums over
    ``DI`` and ``HI`` add at most ``(DI + HI) * 2^-24`` each of the same magnitude. Returns
    ``[T, N]`` float32 (plus a floor of ``2^-40`` so that an exact 0 is never out of bounds).
    """
    u = torch.finfo(operand_dtype).eps / 2 if operand_dtype != torch.float32 else 0.0
    accumulation = 2 * (q_idx.shape[-1] + q_idx.shape[1]) * torch.finfo(torch.float32).eps / 2
    magnitude = torch.einsum(
        "th,thn->tn",
        weights.float().abs(),
        torch.einsum("thd,tnd->thn", q_idx.float().abs(), keys.float().abs()),
    )
    return (3 * u + 3 * u * u + accumulation) * magnitude + 2.0**-40


def check_selection(
    selected: torch.Tensor,
    candidates: torch.Tensor,
    scores: torch.Tensor,
    bound: torch.Tensor,
    topk: int,
) -> tuple[float, str]:
    """The tie-aware check of a top-k selection (module docstring).

    Parameters
    ----------
    selected : ``[T, K]`` int slots the path under test selected, ``-1`` padded.
    candidates : ``[T, N]`` int slot of each row's candidate entry, ``-1`` past its count.
    scores : ``[T, N]`` fp32 scores of the candidates (ignored where ``candidates`` is -1).
    bound : ``[T, N]`` bound on each score's error (:func:`score_bound`).
    topk : ``K``.

    Returns ``(excess, detail)``: 0 and ``""`` for a valid selection; else ``inf`` when a row
    holds the wrong number of entries, a duplicate or a non-candidate, or the largest
    ``(s_c - b_c) - (s_a + b_a)`` over the batch (a kept entry ``a`` beaten by a dropped
    ``c``) as a fraction of the bounds, and the first offending row.
    """
    valid = candidates >= 0
    chosen = selected >= 0
    expected = valid.sum(1).clamp(max=topk)
    count = chosen.sum(1)
    unused = torch.iinfo(selected.dtype).max
    ordered = torch.where(chosen, selected, unused).sort(1).values
    duplicate = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != unused)).any(1)
    member = (candidates[:, :, None] == selected[:, None, :]).any(-1) & valid
    found = member.sum(1)
    for name, bad in (
        ("holds the wrong number of entries", count != expected),
        ("selects an entry twice", duplicate),
        ("selects a slot that is not a candidate", found != count),
    ):
        if bad.any():
            row = int(bad.nonzero()[0])
            return math.inf, (
                f"row {row} {name}: {int(count[row])} selected, {int(found[row])} of them "
                f"candidates, {int(expected[row])} expected"
            )
    kept = torch.where(member, scores + bound, math.inf).amin(1)
    dropped = torch.where(valid & ~member, scores - bound, -math.inf).amax(1)
    slack = torch.where(member, bound, 0).amax(1) + torch.where(valid & ~member, bound, 0).amax(1)
    overlap = (dropped - kept) / slack.clamp(min=2.0**-40)
    has_both = torch.isfinite(kept) & torch.isfinite(dropped)
    overlap = torch.where(has_both, overlap, -math.inf)
    worst = float(overlap.max()) if overlap.numel() else -math.inf
    if worst <= 0:
        return 0.0, ""
    row = int(overlap.argmax())
    return 1.0 + worst, (
        f"row {row}: a dropped entry scores {float(dropped[row]):.6g} (minus its bound), a kept "
        f"one {float(kept[row]):.6g} (plus its bound)"
    )


def differing_bytes(got: torch.Tensor, want: torch.Tensor) -> int:
    """Bytes at which two tensors of one shape and dtype differ."""
    return int((_as_bytes(got) != _as_bytes(want)).sum())


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


def excess(error: torch.Tensor, bound: torch.Tensor | float) -> float:
    if error.numel() == 0:
        return 0.0
    return float((error / bound).max())
