"""Lightning indexer reference: score visible c4 entries and keep the top-k per query."""

from __future__ import annotations

import torch

from dsv4_backend.errors import ContractError


def indexer_scores(
    q_idx: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor
) -> torch.Tensor:
    """``score[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s])``, -inf where ``s >= (t+1)//4``.

    Parameters
    ----------
    q_idx : ``[S, HI, DI]`` float32 indexer queries (roped), tokens at positions ``0 ... S-1``.
    weights : ``[S, HI]`` float32 head weights.
    index_keys : ``[n, DI]`` float32 indexer keys (indexer compressor entries).

    Returns ``[S, n]`` float32.
    """
    s, n = q_idx.shape[0], index_keys.shape[0]
    if weights.shape != q_idx.shape[:2] or index_keys.shape[-1] != q_idx.shape[-1]:
        raise ContractError(
            f"indexer got q_idx {tuple(q_idx.shape)}, weights {tuple(weights.shape)}, keys "
            f"{tuple(index_keys.shape)}; expected [S, HI, DI], [S, HI], [n, DI]"
        )
    dots = torch.einsum("thd,sd->ths", q_idx.float(), index_keys.float())
    scores = torch.einsum("th,ths->ts", weights.float(), dots.relu())
    visible = torch.arange(n)[None, :] < ((torch.arange(s) + 1) // 4)[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def indexer_select(
    q_idx: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, topk: int
) -> torch.Tensor:
    """Selected entries per query: ``[S, topk]`` int64, ascending, padded with -1.

    All visible entries when there are at most ``topk`` of them, else the ``topk`` best scores
    (``indexer_scores``); equal scores at the boundary go to the smaller entry index.
    """
    scores = indexer_scores(q_idx, weights, index_keys)
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int64)
    for t in range(scores.shape[0]):
        n_vis = min((t + 1) // 4, scores.shape[1])
        ids = torch.arange(n_vis)
        if n_vis > topk:
            ids = torch.sort(scores[t, :n_vis], descending=True, stable=True).indices[:topk]
        ids = ids.sort().values
        out[t, : ids.numel()] = ids
    return out
