"""Attention reference: one query token at a time over its window plus its compressed set."""

from __future__ import annotations

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ContractError


def visible_entries(ratio: int, position: int) -> int:
    """Entries ``w < (position + 1) // ratio`` a query at ``position`` may see (0 for ratio 0)."""
    return (position + 1) // ratio if ratio else 0


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query row: ``q [H, D]``, keys = values ``[n, D]``, ``sink [H]`` -> ``[H, D]`` fp32.

    ``o_h = sum exp(l) k / (sum exp(l) + exp(sink_h))`` with ``l = scale * q_h . k``;
    ``n = 0`` gives zeros.
    """
    if keys.shape[0] == 0:
        return torch.zeros_like(q, dtype=torch.float32)
    logits = scale * (q.float() @ keys.float().T)  # [H, n]
    m = torch.maximum(logits.max(dim=-1).values, sink.float())  # [H], stabilises exp
    p = torch.exp(logits - m[:, None])
    denom = p.sum(dim=-1) + torch.exp(sink.float() - m)
    return (p @ keys.float()) / denom[:, None]


def reference_attention(
    config: DSV4AttentionConfig,
    ratio: int,
    q: torch.Tensor,
    kv: torch.Tensor,
    compressed: torch.Tensor | None,
    selected: torch.Tensor | None,
    sink: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of one request whose tokens sit at positions ``0 ... S-1``.

    Parameters
    ----------
    q : ``[S, H, D]`` float32, already normed and roped.
    kv : ``[S, D]`` float32 window keys = values, normed and roped.
    compressed : ``[n_entries, D]`` float32 entries of this layer, or None (ratio 0).
    selected : ratio 4 only: ``[S, K]`` int entry indices per query (-1 = none), as from
        ``indexer_select``; None means every visible entry.
    sink : ``[H]`` float32 per-head sink logit.

    Query ``t`` sees window keys ``max(0, t-W+1) ... t`` plus ``E_t``: for ratio 4 the
    selected entries among ``w < (t+1)//4``, for ratio 128 all ``w < (t+1)//128``. Returns
    ``[S, H, D]`` float32.
    """
    s = q.shape[0]
    if kv.shape[0] != s or (ratio and compressed is None):
        raise ContractError(
            f"reference_attention got q {tuple(q.shape)}, kv {tuple(kv.shape)}, compressed "
            f"{None if compressed is None else tuple(compressed.shape)} for ratio {ratio}; "
            "expected S rows in both and entries for a compressed layer"
        )
    out = torch.empty(q.shape, dtype=torch.float32)
    for t in range(s):
        keys = [kv[max(0, t - config.window_size + 1) : t + 1].float()]
        n_vis = visible_entries(ratio, t)
        if n_vis:
            ids = torch.arange(n_vis)
            if selected is not None:
                row = selected[t].long()
                ids = row[(row >= 0) & (row < n_vis)]
            keys.append(compressed[ids].float())
        out[t] = sink_attention(q[t], torch.cat(keys), sink, config.softmax_scale)
    return out
