"""Sparse attention on the kernel ``dispatch.attention_kernel`` names.

``triton`` (the default): ``sparse_attention.sparse_attention_with_sink``. ``pipelined``
(``kernels/sparse_attention_pipelined.py``) and ``ws`` (``kernels/sparse_attention_ws.py``,
Gluon, compiled GPUs only) run where they take the inputs; elsewhere the default runs. Neither
has run on a GPU, so neither is the default.
"""

from __future__ import annotations

import torch

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.sparse_attention import output_dtype, sparse_attention_with_sink
from dsv4_backend.kernels.sparse_attention_pipelined import (
    pipelined_unsupported_reason,
    sparse_attention_pipelined,
)
from dsv4_backend.kernels.sparse_attention_ws import sparse_attention_ws, ws_unsupported_reason


def sparse_attention_with_kernel_choice(
    q: torch.Tensor,
    window: TokenCache,
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra: TokenCache | None,
    extra_indices: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    sink: torch.Tensor,
    softmax_scale: float,
    *,
    rows_per_group: int = 1,
) -> torch.Tensor:
    """``sparse_attention_with_sink`` (same arguments and ``[T, H, D]`` result in
    ``sparse_attention.output_dtype(q)``) on the selected kernel where the path is a Triton one
    and the kernel takes the inputs (both opt-in kernels write bf16)."""
    args = (q, window, swa_indices, swa_lengths, extra, extra_indices, extra_lengths, sink)
    kernel = dispatch.attention_kernel()[0] if dispatch.use_triton(q.device) else "triton"
    dim = q.shape[2]
    if kernel == "ws" and ws_unsupported_reason(q.device, window, extra, q.shape[1], dim) is None:
        return sparse_attention_ws(*args, softmax_scale).to(output_dtype(q))
    if kernel == "pipelined" and pipelined_unsupported_reason(window, extra, dim) is None:
        out = sparse_attention_pipelined(*args, softmax_scale, rows_per_group=rows_per_group)
        return out.to(output_dtype(q))
    return sparse_attention_with_sink(*args, softmax_scale, rows_per_group=rows_per_group)
