"""The compressor's per-entry math outside the kernels: softmax pooling of an entry's slots and
the finish (RMSNorm, then RoPE at the entry's first position) (docs/design.md §2)."""

from __future__ import annotations

import torch

from dsv4_backend.ops.norm import rms_norm
from dsv4_backend.ops.rope import CosSin, apply_rope


def pool_slots(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Per-channel softmax of ``score`` over the slot dim weighting ``kv``.

    ``kv``, ``score``: ``[..., n, D]``; returns ``[..., D]`` fp32. A slot of score -inf weighs 0;
    every pooled span has a finite slot.
    """
    weights = torch.softmax(score.float(), dim=-2)
    return (weights * kv.float()).sum(dim=-2)


def finish_entries(
    pooled: torch.Tensor,
    entry_ids: torch.Tensor,
    norm_weight: torch.Tensor,
    ratio: int,
    rope: CosSin,
    eps: float = 1e-6,
) -> torch.Tensor:
    """RMSNorm (epsilon ``eps``: the compressor module's ``variance_epsilon``), then RoPE at
    position ``entry_id * ratio``.

    ``pooled`` ``[n, D]`` float, ``entry_ids`` ``[n]`` int -> ``[n, D]`` fp32. An all-zero
    pooled row stays exactly zero.
    """
    cos, sin = rope.cos_sin(entry_ids.long() * ratio)
    return apply_rope(rms_norm(pooled, norm_weight, eps), cos, sin)
