"""The torch implementation of the sparse-attention op (``torch`` path): gather the keys, then
one masked softmax with the sink, in fp32, in row chunks."""

from __future__ import annotations

import torch

from dsv4_backend.kernels.attention.common import AttentionCall, output_dtype

#: Rows per chunk of the torch path, so its gathered ``[rows, Ws + Ke, D]`` keys stay bounded.
_TORCH_CHUNK_ELEMENTS = 1 << 26


def sparse_attention_torch(call: AttentionCall) -> torch.Tensor:
    """The torch variant of ``sparse_attention_with_sink``: gather, then one masked softmax
    (each row on its own: ``rows_per_group``, the op's argument, is not used)."""
    q, window, swa_indices, swa_lengths, extra_span, sink, softmax_scale = call.parts()
    spans = [(window, swa_indices, swa_lengths)]
    if extra_span is not None:
        spans.append(extra_span)
    rows, heads, dim = q.shape
    out = torch.empty((rows, heads, dim), dtype=torch.float32, device=q.device)
    width = sum(idx.shape[1] for _, idx, _ in spans)
    step = max(1, _TORCH_CHUNK_ELEMENTS // (width * max(dim, heads)))
    for r0 in range(0, rows, step):
        keys, valid = [], []
        for cache, idx, lengths in spans:
            idx = idx[r0 : r0 + step].long()
            cols = torch.arange(idx.shape[1], device=idx.device)
            ok = (cols[None, :] < lengths[r0 : r0 + step, None]) & (idx >= 0)
            keys.append(cache.gather(torch.where(ok, idx, -1)))  # [t, width, D] fp32
            valid.append(ok)
        k = torch.cat(keys, dim=1)
        logits = torch.einsum("thd,tnd->thn", q[r0 : r0 + step].float(), k) * softmax_scale
        logits = logits.masked_fill(~torch.cat(valid, dim=1)[:, None, :], float("-inf"))
        m = torch.maximum(logits.amax(dim=-1), sink[None, :])  # [t, H]
        m = m.masked_fill(m == float("-inf"), 0.0)
        p = torch.exp(logits - m[..., None])
        denom = p.sum(dim=-1) + torch.exp(sink[None, :] - m)
        denom = denom.masked_fill(denom == 0, 1.0)  # -inf sink and no key: output 0
        out[r0 : r0 + step] = torch.einsum("thn,tnd->thd", p, k) / denom[..., None]
    return out.to(output_dtype(q))
