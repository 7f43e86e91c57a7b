"""What the two FlashMLA variants of the sparse-attention op share: the library's contract.

``flashmla`` (``flashmla.py``, FlashMLA's sparse FP8 decode over the cache bytes) and
``flashmla_prefill`` (``flashmla_prefill.py``, its sparse prefill over gathered bf16 keys) call
the ``flash_mla`` package sglang 0.5.23 pins (:data:`DISTRIBUTION`) with ``use_legacy=True``,
the kernels that read sglang's V4 layout. Both take 64 or 128 query heads of dim 512
(:data:`KERNEL_HEADS`, :data:`HEAD_DIM`; fewer heads are zero-padded to 64, as sglang's
``DeepseekV4Attention`` pads a TP rank's heads, ``_kernel_num_heads`` / ``_local_attn_sink``)
and read indices in blocks of :data:`INDEX_ALIGN` columns (the prefill in pairs of them,
:data:`PREFILL_INDEX_ALIGN`). Neither variant imports the other
(``tests/tool/test_import_graph.py``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.kernels.attention.common import AttentionCall

#: The module both variants call and the distribution (as sglang 0.5.23 pins it) that has it.
PACKAGE = "flash_mla"
DISTRIBUTION = "sgl-flash-mla==1.0.0"
#: Query heads FlashMLA's sparse kernels take; fewer than the first are padded to it.
KERNEL_HEADS = (64, 128)
#: Head dim (``d_qk`` = ``d_v``) of DeepSeek-V4's keys; the V4 fp8 layout keeps the last
#: :data:`ROPE_DIM` of them in bf16 (448 e4m3 + 64 bf16 rope, 584 B a token).
HEAD_DIM = 512
ROPE_DIM = 64
#: FlashMLA's sparse decode reads indices in blocks of this many columns (``topk % 64 == 0``).
INDEX_ALIGN = 64
#: Its sparse prefill reads two such blocks a step: Hopper's kernel asserts ``params.topk %
#: (2 * B_TOPK) == 0`` (``B_TOPK`` 64), as does sm_100's 128-head kernel past 1280 columns;
#: sglang pads the same call to 128 (``sparse_prefill_kernels.SPARSE_PREFILL_TOPK_ALIGNMENT``).
PREFILL_INDEX_ALIGN = 128


def library_unsupported_reason(
    device: torch.device,
    heads: int,
    dim: int,
    capability: tuple[int, int] | None,
    functions: tuple[str, ...],
) -> str | None:
    """Why FlashMLA's legacy sparse kernels cannot take ``heads`` query heads of ``dim`` on
    ``device`` (None when they can). ``capability``: the device's compute capability; None
    reads it from ``device`` (tests pass one); ``functions``: what the variant calls of
    ``flash_mla``. Checked in order: a CUDA device; head dim :data:`HEAD_DIM`; 64 heads or
    fewer, or 128; ``flash_mla`` importable, with ``functions`` and its legacy kernels; Hopper
    (sm_90) or the Blackwell sm_100 family (``is_sm90a || is_sm100f``; sglang takes sm_120
    elsewhere)."""
    if device.type != "cuda":
        return f"FlashMLA runs on CUDA devices only; the tensors are on {device}"
    if dim != HEAD_DIM:
        return f"head_dim {dim}; FlashMLA's sparse kernels take {HEAD_DIM}"
    if not (0 < heads <= KERNEL_HEADS[0] or heads == KERNEL_HEADS[1]):
        return (
            f"{heads} query heads; FlashMLA takes {KERNEL_HEADS[0]} or {KERNEL_HEADS[1]} "
            f"(1 ... {KERNEL_HEADS[0]} are padded to {KERNEL_HEADS[0]})"
        )
    try:
        flash_mla = importlib.import_module(PACKAGE)
    except ImportError as error:  # the wheel, or its CUDA extension against this torch
        return f"{PACKAGE} does not import ({error}); install {DISTRIBUTION}"
    missing = [name for name in functions if not hasattr(flash_mla, name)]
    if missing:
        return (
            f"{PACKAGE} {getattr(flash_mla, '__version__', '?')} has no {', '.join(missing)}; "
            f"install {DISTRIBUTION}"
        )
    has_legacy = getattr(flash_mla, "has_legacy", None)
    if has_legacy is None or not has_legacy():
        return (
            f"{PACKAGE} {getattr(flash_mla, '__version__', '?')} has no legacy kernels, which "
            f"read the V4 layout ({DISTRIBUTION} ships them)"
        )
    major, minor = capability or torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0) and major != 10:
        return (
            f"compute capability {major}.{minor}; FlashMLA's legacy sparse kernels run on "
            "sm_90 and the sm_100 family"
        )
    return None


def fp8_cache_unsupported_reason(name: str, cache: TokenCache) -> str | None:
    """Why FlashMLA cannot read ``cache``'s bytes (None when it can): an fp8 cache of the V4
    geometry (:data:`HEAD_DIM` with :data:`ROPE_DIM` rope channels) in one contiguous 16-byte
    aligned buffer, which FlashMLA addresses from its base. ``name`` names it in the reason."""
    if cache.fmt != "fp8":
        return (
            f"the {name} cache is {cache.fmt}; FlashMLA's sparse decode reads fp8 caches "
            "(sglang's 584-byte V4 layout)"
        )
    if cache.dim != HEAD_DIM or cache.rope_dim != ROPE_DIM:
        return (
            f"the {name} cache holds head_dim {cache.dim} with rope_dim {cache.rope_dim}; "
            f"FlashMLA's V4 layout is head_dim {HEAD_DIM} with rope_dim {ROPE_DIM}"
        )
    if not cache.storage.is_contiguous() or cache.storage.data_ptr() % 16:
        return (
            f"the {name} cache's pages are not one contiguous 16-byte aligned buffer; "
            "FlashMLA addresses every page from its base"
        )
    return None


def kernel_queries(q: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, Hk, D] bf16 contiguous, sink [Hk] fp32 contiguous)``: the op's ``[T, H, D]``
    queries and ``[H]`` sink with ``H <= 64`` zero-padded to ``Hk = 64`` heads (zero heads add
    nothing and are sliced off the output); fp32 queries are rounded to bf16, which the Triton
    kernel's dot operands on a GPU are too."""
    heads = q.shape[1]
    kernel_heads = KERNEL_HEADS[0] if heads <= KERNEL_HEADS[0] else heads
    q = q.to(torch.bfloat16)
    if kernel_heads != heads:
        q = F.pad(q, (0, 0, 0, kernel_heads - heads))
        sink = F.pad(sink, (0, kernel_heads - heads))
    return q.contiguous(), sink.contiguous()


def aligned_columns(indices: torch.Tensor) -> torch.Tensor:
    """``indices`` ``[T, W]`` int32, -1 padded to ``W'`` columns, a multiple of
    :data:`INDEX_ALIGN` (sglang's ``_pad_last_dim``), contiguous."""
    pad = -indices.shape[1] % INDEX_ALIGN
    return F.pad(indices, (0, pad), value=-1) if pad else indices.contiguous()


def library() -> ModuleType:
    """The ``flash_mla`` module (imported where :func:`library_unsupported_reason` found it)."""
    return importlib.import_module(PACKAGE)


#: What the sparse prefill calls of ``flash_mla``.
PREFILL_FUNCTIONS = ("flash_mla_sparse_fwd",)


def prefill_arguments(call: AttentionCall) -> dict[str, Any]:
    """Keyword arguments of ``flash_mla.flash_mla_sparse_fwd`` for the op's checked call;
    ``flashmla_prefill.py``'s docstring maps them. Pure torch: runs on any device (one host
    synchronisation, ``torch.unique``)."""
    q, window, swa_indices, swa_lengths, extra_span, sink, softmax_scale = call.parts()
    rows, _, dim = q.shape
    spans = [(window, swa_indices, swa_lengths)]
    if extra_span is not None:
        spans.append(extra_span)
    width = sum(idx.shape[1] for _, idx, _ in spans)
    width += -width % PREFILL_INDEX_ALIGN
    # One spare column takes every invalid key's scatter, then is cut off.
    indices = torch.full((rows, width + 1), -1, dtype=torch.int32, device=q.device)
    packed = torch.zeros(rows, dtype=torch.int64, device=q.device)  # keys placed per row
    keys = []
    first_row = 0  # workspace row of the span's first distinct slot
    for cache, idx, lengths in spans:
        columns = torch.arange(idx.shape[1], device=idx.device)
        valid = (columns[None, :] < lengths[:, None]) & (idx >= 0)
        slots, rank = torch.unique(idx[valid], return_inverse=True)
        keys.append(cache.gather(slots))
        workspace_rows = torch.full_like(idx, -1)
        workspace_rows[valid] = rank.to(torch.int32) + first_row
        target = torch.where(valid, packed[:, None] + valid.cumsum(1) - 1, width)
        indices.scatter_(1, target, workspace_rows)
        packed += valid.sum(1)
        first_row += slots.numel()
    kv = torch.cat(keys) if first_row else torch.zeros((1, dim), device=q.device)
    q, sink = kernel_queries(q, sink)
    return dict(
        q=q,
        kv=kv.to(torch.bfloat16)[:, None, :],
        indices=indices[:, :width].contiguous()[:, None, :],
        sm_scale=softmax_scale,
        d_v=dim,
        attn_sink=sink,
        topk_length=packed.to(torch.int32),
        use_legacy=True,
        return_log2_lse=False,
    )


def sparse_prefill(arguments: dict[str, Any], heads: int) -> torch.Tensor:
    """FlashMLA's sparse prefill called with ``arguments`` (:func:`prefill_arguments` of the
    op's checked inputs; the library's ``PREFILL_FUNCTIONS`` found): ``[T, heads, D]`` bf16,
    rows without a valid key 0."""
    rows, dim = arguments["q"].shape[0], arguments["d_v"]
    if rows == 0:  # FlashMLA needs a query
        return torch.empty((0, heads, dim), dtype=torch.bfloat16, device=arguments["q"].device)
    out = library().flash_mla_sparse_fwd(**arguments)[0][:, :heads]  # [T, H, D] bf16
    return out.masked_fill((arguments["topk_length"] == 0)[:, None, None], 0).contiguous()
