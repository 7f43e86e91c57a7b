"""Sparse attention on the kernel ``dispatch.attention_kernel`` names, from one table.

:data:`ATTENTION_VARIANTS` declares each kernel of the Triton paths: its entry point, why it
cannot take given inputs, and whether it has passed ``scripts/gpu_check.sh``. ``triton`` (the
default): ``sparse_attention.sparse_attention_with_sink``. ``pipelined``
(``kernels/sparse_attention_pipelined.py``), ``ws`` (``kernels/sparse_attention_ws.py``,
Gluon, compiled GPUs only) and ``flashmla`` (``kernels/attention_flashmla.py``, FlashMLA's
sparse FP8 decode) are chosen explicitly (``DSV4_ATTENTION_KERNEL``); none has run on a GPU, so
none is the default. An explicit choice that cannot run with a backend's caches is refused when
the backend is built (:func:`explicit_choice_reason`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention_flashmla import (
    flashmla_unsupported_reason,
    sparse_attention_flashmla,
)
from dsv4_backend.kernels.sparse_attention import (
    output_dtype,
    sparse_attention_triton,
    sparse_attention_with_sink,
)
from dsv4_backend.kernels.sparse_attention_pipelined import (
    pipelined_unsupported_reason,
    sparse_attention_pipelined,
)
from dsv4_backend.kernels.sparse_attention_ws import sparse_attention_ws, ws_unsupported_reason

#: ``(device, window, extra, heads, dim) -> reason or None``: why a kernel cannot take these
#: caches and ``[T, heads, dim]`` queries on ``device``.
UnsupportedReason = Callable[
    [torch.device, TokenCache, "TokenCache | None", int, int], "str | None"
]


@dataclass(frozen=True)
class AttentionVariant:
    """One sparse-attention kernel of the Triton paths.

    ``run`` takes ``sparse_attention_with_sink``'s arguments and ``num_splits`` (and
    ``rows_per_group`` where ``groups_rows``); ``unsupported`` says why it cannot take given
    inputs; ``gpu_verified``: the ``scripts/gpu_check.sh`` run it passed (None: never run on a
    GPU); ``takes``: what it takes, as ``info`` prints it.
    """

    name: str
    run: Callable[..., torch.Tensor]
    unsupported: UnsupportedReason
    groups_rows: bool
    gpu_verified: str | None
    takes: str


def _any_inputs(*_: object) -> str | None:
    return None


ATTENTION_VARIANTS: dict[str, AttentionVariant] = {
    v.name: v
    for v in (
        AttentionVariant(
            "triton", sparse_attention_triton, _any_inputs, True,
            "2026-11-30, before the kernel's rewrite (issue 9)", "every cache and shape",
        ),
        AttentionVariant(
            "pipelined", sparse_attention_pipelined,
            lambda device, window, extra, heads, dim: pipelined_unsupported_reason(
                window, extra, dim
            ),
            True, None, "fp8 caches, head dim 128 / 256 / 512 with 64 rope channels",
        ),
        AttentionVariant(
            "ws", sparse_attention_ws, ws_unsupported_reason, False, None,
            "Gluon, CUDA only (9.x / 10.x), fp8 or dense bf16 caches, <= 64 heads of dim 512",
        ),
        AttentionVariant(
            "flashmla", sparse_attention_flashmla, flashmla_unsupported_reason, False, None,
            "FlashMLA's sparse FP8 decode (sgl-flash-mla), fp8 caches, heads of dim 512",
        ),
    )
}  # fmt: skip
DEFAULT_VARIANT = ATTENTION_VARIANTS[dispatch.ATTENTION_KERNELS[0]]


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
    and the kernel takes the inputs (a backend refuses an explicit choice that cannot when it is
    built; the opt-in kernels write bf16)."""
    args = (q, window, swa_indices, swa_lengths, extra, extra_indices, extra_lengths, sink)
    if not dispatch.use_triton(q.device):
        return sparse_attention_with_sink(*args, softmax_scale)
    variant = ATTENTION_VARIANTS[dispatch.attention_kernel()[0]]
    if variant.unsupported(q.device, window, extra, q.shape[1], q.shape[2]) is not None:
        variant = DEFAULT_VARIANT
    grouping = {"rows_per_group": rows_per_group} if variant.groups_rows else {}
    return variant.run(*args, softmax_scale, **grouping).to(output_dtype(q))


def explicit_choice_reason(
    device: torch.device, window: TokenCache, extra: TokenCache | None, heads: int, dim: int
) -> str | None:
    """Why the kernel chosen explicitly (``DSV4_ATTENTION_KERNEL`` or
    ``dispatch.force_attention_kernel``) cannot run with these caches and ``heads`` queries of
    ``dim`` on ``device``; None for the default or a kernel that runs. ``ConfigError`` for an
    unknown name."""
    kernel, why = dispatch.attention_kernel()
    if kernel == DEFAULT_VARIANT.name:
        return None
    if not dispatch.use_triton(device):
        path = dispatch.select_path(device)
        return f"{why}: tensors on {device} take the {path} path, which has no {kernel} kernel"
    reason = ATTENTION_VARIANTS[kernel].unsupported(device, window, extra, heads, dim)
    return None if reason is None else f"{why}: the {kernel} kernel cannot run here: {reason}"
