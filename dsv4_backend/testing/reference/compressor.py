"""Compressor reference: softmax-gated pooling of a request's tokens into compressed entries.

Ratio ``r`` and overlap ``c`` (``c = 2`` for ``r = 4``, ``1`` for ``r = 128``). Per token ``j``
the projections are ``kv_j`` and ``s_j + ape[j mod r]``, both ``c * D`` wide.

* ``r = 128``: entry ``w`` pools tokens ``128w ... 128w + 127``.
* ``r = 4`` (overlap): entry ``w`` pools 8 slots. Slots 0-3 are the previous block's tokens
  ``4(w-1) ... 4w-1`` using projection dims ``[:D]`` (the "first half"), slots 4-7 are the
  current block's tokens ``4w ... 4w+3`` using dims ``[D:]``. For ``w = 0`` the previous block
  does not exist: those slots hold kv 0 and score -inf (they get zero weight).

Pooling is a per-channel softmax over the slots of the scores, weighting kv; then RMSNorm with
``norm_weight`` and RoPE at position ``w * r`` (the block's first token).
"""

from __future__ import annotations

import torch

from dsv4_backend.errors import ContractError
from dsv4_backend.testing.reference.norm import rms_norm
from dsv4_backend.testing.reference.rope import RopeParams, apply_rope


def overlap(ratio: int) -> int:
    """``c``: how many ``D``-wide halves each token's projection has (2 for ratio 4)."""
    return 2 if ratio == 4 else 1


def pool_slots(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Per-channel softmax pooling: ``[..., n, D]`` kv and scores -> ``[..., D]`` fp32.

    Slots with score -inf get zero weight; every pooled span has at least one finite slot.
    """
    return (torch.softmax(score.float(), dim=-2) * kv.float()).sum(dim=-2)


def entry_slots(
    kv_proj: torch.Tensor, score_proj: torch.Tensor, ratio: int, w: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(kv, score)`` slots ``[span, D]`` of entry ``w`` (scores already include ape).

    ``span`` is 8 for ratio 4 (previous block's first halves, current block's second halves)
    and 128 for ratio 128.
    """
    d, r = head_dim, ratio
    cur = slice(r * w, r * w + r)
    if r == 128:
        return kv_proj[cur], score_proj[cur]
    if w == 0:
        prev_kv = kv_proj.new_zeros(r, d)
        prev_score = score_proj.new_full((r, d), float("-inf"))
    else:
        prev = slice(r * (w - 1), r * w)
        prev_kv, prev_score = kv_proj[prev, :d], score_proj[prev, :d]
    kv = torch.cat([prev_kv, kv_proj[cur, d:]])
    score = torch.cat([prev_score, score_proj[cur, d:]])
    return kv, score


def finish_entries(
    pooled: torch.Tensor,
    entry_ids: torch.Tensor,
    norm_weight: torch.Tensor,
    ratio: int,
    rope: RopeParams,
    eps: float = 1e-6,
) -> torch.Tensor:
    """RMSNorm (epsilon ``eps``) then RoPE at ``w * ratio``: pooled ``[n, D]``, entry ids ``[n]``
    -> ``[n, D]``."""
    cos, sin = rope.cos_sin(entry_ids.to(torch.int64) * ratio)
    return apply_rope(rms_norm(pooled, norm_weight, eps), cos, sin)


def compress_entries(
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    ratio: int,
    rope: RopeParams,
    head_dim: int,
    eps: float = 1e-6,
) -> torch.Tensor:
    """All complete entries of one request whose tokens are positions ``0 ... S-1``.

    Parameters
    ----------
    kv_proj, score_proj : ``[S, c*D]`` float32 — per-token projections (scores without ape).
    ape : ``[r, c*D]`` float32 — added to token ``j``'s score as ``ape[j mod r]``.
    norm_weight : ``[D]`` float32.
    ratio : 4 or 128.
    rope : the compressed layer's RoPE (``rope_for_ratio(config, ratio)``).
    head_dim : ``D`` (``config.head_dim`` for the layer, ``index_head_dim`` for the indexer).
    eps : the RMSNorm epsilon (``config.rms_norm_eps``).

    Returns ``[S // r, D]`` float32.
    """
    c, d = overlap(ratio), head_dim
    s = kv_proj.shape[0]
    want = {"kv_proj": (s, c * d), "score_proj": (s, c * d), "ape": (ratio, c * d)}
    for name, tensor in (("kv_proj", kv_proj), ("score_proj", score_proj), ("ape", ape)):
        if tuple(tensor.shape) != want[name]:
            raise ContractError(f"{name} has shape {tuple(tensor.shape)}, expected {want[name]}")
    kv_proj = kv_proj.float()
    score_proj = score_proj.float() + ape.float()[torch.arange(s) % ratio]
    n = s // ratio
    pooled = [pool_slots(*entry_slots(kv_proj, score_proj, ratio, w, d)) for w in range(n)]
    if n == 0:
        return kv_proj.new_zeros(0, d)
    return finish_entries(torch.stack(pooled), torch.arange(n), norm_weight, ratio, rope, eps)
