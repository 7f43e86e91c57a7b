"""The sparse-attention op: its variants (:data:`ATTENTION`, ``kernels/variants.py``) and its
entry point :func:`sparse_attention_with_sink`.

In order of preference:

* ``flashmla`` (``flashmla.py``): FlashMLA as sglang's built-in DeepSeek-V4 backend runs it,
  the field's GPU-proven kernel: its sparse FP8 decode for fp8 caches, and its sparse prefill
  for a call of more than ``flashmla.PREFILL_ROWS`` rows outside a CUDA-graph capture. It is
  a CUDA default once it passes the start-up self-check on the device (``self_check/``);
* ``triton`` (``triton.py``): the project's kernel, every cache and shape; the CUDA baseline
  and the interpreter's default;
* ``pipelined`` (``pipelined.py``), ``ws`` (``ws.py``, Gluon, compiled GPUs only) and
  ``flashmla_prefill`` (``flashmla_prefill.py``: every call through FlashMLA's prefill
  kernel, over a bf16 gather of the keys, any cache format);
* ``torch`` (``torch.py``): the torch path and every other path's twin.

A named variant (``DSV4_ATTENTION_KERNEL``) that cannot take a backend's caches is refused
when the backend is built (``variants.named_rejection``); at a forward the variant's own
checks raise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention.common import (
    AttentionCall,
    output_dtype,
    pipelined_unsupported_reason,
)
from dsv4_backend.kernels.attention.flashmla import (
    DECODE_FUNCTIONS,
    PREFILL_ROWS,
    flashmla_unsupported_reason,
    sparse_attention_flashmla,
)
from dsv4_backend.kernels.attention.flashmla_library import PREFILL_FUNCTIONS
from dsv4_backend.kernels.attention.flashmla_prefill import (
    flashmla_prefill_unsupported_reason,
    sparse_attention_flashmla_prefill,
)
from dsv4_backend.kernels.attention.pipelined import sparse_attention_pipelined
from dsv4_backend.kernels.attention.torch import sparse_attention_torch
from dsv4_backend.kernels.attention.triton import sparse_attention_triton
from dsv4_backend.kernels.attention.ws import sparse_attention_ws, ws_unsupported_reason
from dsv4_backend.kernels.variants import (
    TRITON_PATHS,
    OpTable,
    Target,
    Variant,
    on_cuda,
    on_paths,
    resolve,
    with_library,
)


def _pipelined_rejects(
    device: torch.device, window: TokenCache, extra: TokenCache | None, heads: int, dim: int
) -> str | None:
    return pipelined_unsupported_reason(window, extra, dim)


#: The variants: each entry takes one checked ``common.AttentionCall``; ``rejects(device,
#: window, extra, heads, dim)`` says why it cannot take these caches and ``[T, heads, dim]``
#: queries on ``device``.
ATTENTION: OpTable[Callable[[AttentionCall], torch.Tensor]] = OpTable(
    "attention",
    "sparse attention with sink over window keys plus compressed keys",
    (
        Variant(
            "flashmla",
            sparse_attention_flashmla,
            (
                on_paths(dispatch.TRITON),
                on_cuda(9, 10),
                with_library("flash_mla", *DECODE_FUNCTIONS, *PREFILL_FUNCTIONS),
            ),
            "FlashMLA as sglang runs it (sgl-flash-mla): its sparse FP8 decode, its sparse "
            f"prefill above {PREFILL_ROWS} rows; fp8 caches, heads of dim 512",
            rejects=flashmla_unsupported_reason,
        ),
        Variant(
            "triton",
            sparse_attention_triton,
            (TRITON_PATHS,),
            "every cache format and shape; rows of a request grouped below 64 heads",
            baseline=True,
        ),
        Variant(
            "pipelined",
            sparse_attention_pipelined,
            (TRITON_PATHS,),
            "fp8 caches, head dim 128 / 256 / 512 with 64 rope channels",
            rejects=_pipelined_rejects,
        ),
        Variant(
            "ws",
            sparse_attention_ws,
            (on_paths(dispatch.TRITON), on_cuda(9, 10)),
            "Gluon (Triton 3.8, or a precompiled cubin), fp8 or dense bf16 caches, <= 64 heads "
            "of dim 512",
            rejects=ws_unsupported_reason,
        ),
        Variant(
            "flashmla_prefill",
            sparse_attention_flashmla_prefill,
            (
                on_paths(dispatch.TRITON),
                on_cuda(9, 10),
                with_library("flash_mla", *PREFILL_FUNCTIONS),
            ),
            "FlashMLA's sparse prefill (sgl-flash-mla) for every call, over a bf16 gather of "
            "the keys: any cache format, heads of dim 512",
            rejects=flashmla_prefill_unsupported_reason,
        ),
        Variant("torch", sparse_attention_torch, (), "every cache format and shape", baseline=True),
    ),
)


def sparse_attention_with_sink(call: AttentionCall) -> torch.Tensor:
    """Attention of each query row over its window keys plus its compressed keys, with sink:
    ``call`` (``common.AttentionCall``, checked when made) on the variant :data:`ATTENTION`
    chooses for its device.

    Returns ``[T, H, D]`` in ``common.output_dtype`` (bf16 for bf16 queries on a GPU, else
    float32; the caller casts). Rows without a valid key are 0.
    """
    out = resolve(ATTENTION, call.q.device).variant.entry(call)
    return out.to(output_dtype(call.q))  # opt-in variants write bf16


def variant_reason(
    variant: Variant[Callable[[AttentionCall], torch.Tensor]],
    device: torch.device,
    window: TokenCache,
    extra: TokenCache | None,
    heads: int,
    dim: int,
) -> str | None:
    """Why ``variant`` cannot run on ``device`` (its needs) or take these caches and ``heads``
    queries of ``dim`` (its ``rejects``); None when it can."""
    reason = variant.unmet(Target.of(device))
    if reason is None and variant.rejects is not None:
        reason = variant.rejects(device, window, extra, heads, dim)
    return reason
