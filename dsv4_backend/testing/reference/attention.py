"""Attention reference: each query token over its window plus its compressed set."""

from __future__ import annotations

from typing import Any

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ContractError


def visible_entries(ratio: int, position: Any) -> Any:
    """Entries ``w < (position + 1) // ratio`` a query at ``position`` (an int or an int tensor
    of positions) may see; 0 for ratio 0."""
    return (position + 1) // ratio if ratio else position * 0


#: Query rows a step of :func:`reference_attention` (its logits are ``[rows, H, rows + W - 1 +
#: entries]``).
QUERY_CHUNK = 256


def sink_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Query rows ``q [..., H, D]`` over keys = values ``[n, D]`` with ``sink [H]``: ``[..., H,
    D]`` fp32. ``visible [..., n]`` bool: the keys each row sees (None: all).

    ``o_h = sum exp(l) k / (sum exp(l) + exp(sink_h))`` over the visible keys, with ``l = scale *
    q_h . k``; a row that sees no key gives zeros.
    """
    if keys.shape[0] == 0:
        return torch.zeros_like(q, dtype=torch.float32)
    logits = scale * torch.einsum("...hd,nd->...hn", q.float(), keys.float())
    if visible is not None:
        logits = logits.masked_fill(~visible[..., None, :], float("-inf"))
    m = torch.maximum(logits.amax(dim=-1), sink.float())  # [..., H], stabilises exp
    m = m.masked_fill(m == float("-inf"), 0.0)  # no visible key and a -inf sink
    p = torch.exp(logits - m[..., None])
    denom = p.sum(dim=-1) + torch.exp(sink.float() - m)
    out = torch.einsum("...hn,nd->...hd", p, keys.float())
    return out / denom.masked_fill(denom == 0, 1.0)[..., None]


def reference_attention(
    config: DSV4AttentionConfig,
    ratio: int,
    q: torch.Tensor,
    kv: torch.Tensor,
    compressed: torch.Tensor | None,
    selected: torch.Tensor | None,
    sink: torch.Tensor,
    window_floor: torch.Tensor | None = None,
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
    window_floor : optional ``[S]`` int: query ``t`` sees no window key before
        ``window_floor[t]`` (DeepSeek-V4.1's late-layer tail, ``planning/tail.py``).

    Query ``t`` sees window keys ``max(0, t-W+1) ... t`` plus ``E_t``: for ratio 4 the
    selected entries among ``w < (t+1)//4``, for ratio 128 all ``w < (t+1)//128``. Returns
    ``[S, H, D]`` float32. Rows go :data:`QUERY_CHUNK` at a time over the window keys any of
    them sees and every entry, each row masked to its own.
    """
    s = q.shape[0]
    if kv.shape[0] != s or (ratio and compressed is None):
        raise ContractError(
            f"reference_attention got q {tuple(q.shape)}, kv {tuple(kv.shape)}, compressed "
            f"{None if compressed is None else tuple(compressed.shape)} for ratio {ratio}; "
            "expected S rows in both and entries for a compressed layer"
        )
    out = torch.empty(q.shape, dtype=torch.float32)
    entries = compressed if ratio and compressed is not None else kv[:0]
    width = config.window_size
    w = torch.arange(entries.shape[0])
    for t0 in range(0, s, QUERY_CHUNK):
        t1 = min(s, t0 + QUERY_CHUNK)
        t = torch.arange(t0, t1)
        k0 = max(0, t0 - width + 1)  # the chunk's window keys: positions k0 ... t1 - 1
        key_pos = torch.arange(k0, t1)
        in_window = (key_pos[None, :] <= t[:, None]) & (key_pos[None, :] > t[:, None] - width)
        if window_floor is not None:
            in_window &= key_pos[None, :] >= window_floor[t0:t1, None]
        seen = w[None, :] < visible_entries(ratio, t)[:, None]
        if selected is not None:  # the selected entries (-1: none), one extra column for none
            rows = selected[t0:t1].long()
            picked = torch.where((rows >= 0) & (rows < len(w)), rows, len(w))
            chosen = torch.zeros(t1 - t0, len(w) + 1, dtype=torch.bool).scatter_(1, picked, True)
            seen &= chosen[:, :-1]
        visible = torch.cat([in_window, seen], dim=1)
        keys = torch.cat([kv[k0:t1], entries])
        out[t0:t1] = sink_attention(q[t0:t1], keys, sink, config.softmax_scale, visible)
    return out
