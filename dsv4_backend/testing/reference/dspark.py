"""Reference of a DSpark draft block: one window-only draft stage over one request's block."""

from __future__ import annotations

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ContractError
from dsv4_backend.testing.reference.attention import sink_attention


def reference_dspark_block(
    config: DSV4AttentionConfig,
    q: torch.Tensor,
    context_kv: torch.Tensor,
    block_kv: torch.Tensor,
    sink: torch.Tensor,
    *,
    valid_from: int = 0,
) -> torch.Tensor:
    """Attention of one request's DSpark draft block at positions ``L ... L + g - 1``.

    Parameters
    ----------
    q : ``[g, H, D]`` float32 block queries (normed, roped).
    context_kv : ``[L, D]`` float32 draft keys of the committed positions ``0 ... L - 1``
        (injected from the target's hidden states).
    block_kv : ``[g, D]`` float32 keys of the block's own rows.
    sink : ``[H]`` float32.
    valid_from : first committed position whose key the request wrote (sglang's
        ``swa_valid_from``).

    Every row sees the same keys: the committed positions
    ``max(L - W, valid_from, 0) ... L - 1`` and all ``g`` block keys (no causal mask inside
    the block). Returns ``[g, H, D]`` float32.
    """
    g, length = q.shape[0], context_kv.shape[0]
    if block_kv.shape[0] != g:
        raise ContractError(
            f"reference_dspark_block got q {tuple(q.shape)} and block_kv "
            f"{tuple(block_kv.shape)}; expected one key per block row"
        )
    first = max(length - config.window_size, valid_from, 0)
    keys = torch.cat([context_kv[first:length].float(), block_kv.float()])
    return torch.stack([sink_attention(q[i], keys, sink, config.softmax_scale) for i in range(g)])
