"""FlashMLA's sparse FP8 decode as a variant of the ``sparse_attention`` op.

:func:`sparse_attention_flashmla` takes the arguments of
``table.sparse_attention_with_sink`` and computes the same attention with the
``flash_mla`` package sglang 0.5.23 pins (:data:`DISTRIBUTION`), called as sglang's built-in
DeepSeek-V4 backend calls it (``srt/layers/attention/deepseek_v4_backend.py``,
``DeepseekV4AttnBackend._forward_attention``, the ``flash_mla_with_kvcache`` branch).
:func:`flashmla_unsupported_reason` says where it runs (``table.py`` declares it).

How the op's tensors become FlashMLA's arguments (:func:`flashmla_arguments`):

* queries ``[T, H, D]`` -> ``q`` ``[T, 1, Hk, D]`` bf16: one query token per batch entry (as
  sglang's decode, verify and small extends pass them), heads zero-padded to ``Hk`` = 64 when
  ``H <= 64`` (FlashMLA takes 64 or 128 heads; sglang's ``DeepseekV4Attention`` pads a TP rank's
  heads to 64 the same way, ``_kernel_num_heads`` / ``_local_attn_sink``); fp32 queries are
  rounded to bf16, which the Triton kernel's dot operands on a GPU are too;
* each fp8 cache -> ``[pages, page_tokens, 1, 584]`` uint8 over its first ``page_tokens * 584``
  bytes a page, page stride the layout's ``page_bytes``: FlashMLA detects sglang's V4 layout
  (:mod:`dsv4_backend.cache.fp8_format`) from that last dim, as sglang views its pool;
  the window cache is FlashMLA's main cache, the c4 / c128 cache its extra cache;
* slots -> ``indices`` ``[T, 1, W]`` int32 unchanged (both number a slot ``page * page_tokens +
  offset``), ``-1`` padded to a multiple of 64 columns (sglang's ``_pad_last_dim``; FlashMLA
  needs ``topk % 64 == 0``); lengths -> ``topk_length`` ``[T]`` int32, clamped to ``[0, W]``
  (the op ignores columns past the width; FlashMLA reads ``topk_length`` columns);
* ``sink`` -> ``attn_sink`` ``[Hk]`` fp32 (zero-padded); ``softmax_scale`` as given;
  ``is_fp8_kvcache=True``, ``use_legacy=True`` (the V4 layout is not token-interleaved:
  sglang's ``use_legacy=not swa_interleaved``); a ``FlashMLASchedMeta`` from
  ``flash_mla.get_mla_metadata()`` that the first call fills (:func:`flashmla_schedule`).

FlashMLA returns ``[T, 1, Hk, D]`` bf16; the variant returns its first ``H`` heads, ``[T, H, D]``
bf16 (``common.output_dtype`` for bf16 queries on a GPU, how the backend calls the op;
for fp32 queries the op's other paths give fp32 and the caller casts). ``num_splits`` is
accepted (and checked) so the variant is called like the other kernels; FlashMLA's scheduler
picks its own splits, which do not change the result.

Prefill: sglang runs a non-speculative extend of more than 11673 query rows (or any with
``SGLANG_OPT_FLASHMLA_SPARSE_PREFILL``) through ``flash_mla_sparse_fwd`` instead
(``_forward_prefill_sparse``): it first dequantises each request's window and compressed
entries into a bf16 workspace (``dequantize_k_cache_paged_dsv4``) and rebases every row's
indices into it. This variant does not cover that path: it runs every row, extend rows
included, through the decode kernel, as sglang does below that threshold. Adding the prefill
call needs that gather workspace (an extra kernel and ``T``-sized bf16 scratch), so it is left
out.

Not run here: ``flash_mla`` needs CUDA; the tests check the arguments against its documented
signature with a stand-in module and compare the result with ``sparse_attention_torch``.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.attention.common import ExtraSpan, check_inputs, checked_num_splits

#: The module it calls and the distribution (as sglang 0.5.23 pins it) that provides it.
PACKAGE = "flash_mla"
DISTRIBUTION = "sgl-flash-mla==1.0.0"
#: Query heads FlashMLA's sparse decode takes; fewer than the first are padded to it.
KERNEL_HEADS = (64, 128)
#: Head dim and rope channels of the V4 layout FlashMLA reads (448 e4m3 + 64 bf16 rope, 584 B).
HEAD_DIM = 512
ROPE_DIM = 64
#: FlashMLA's indices are read in blocks of this many columns (``topk % 64 == 0``).
INDEX_ALIGN = 64


def flashmla_unsupported_reason(
    device: torch.device,
    window: TokenCache,
    extra: TokenCache | None,
    heads: int,
    dim: int,
    *,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why :func:`sparse_attention_flashmla` cannot run on these inputs (None when it can).

    ``heads`` / ``dim``: the queries' ``H`` and ``D``. ``capability``: the device's compute
    capability; None reads it from ``device`` (tests pass one). Checked in order: a CUDA
    device; fp8 caches of FlashMLA's geometry (head dim 512 with 64 rope channels, contiguous
    16-byte aligned pages); 64 heads or fewer, or 128; ``flash_mla`` importable, with its
    legacy kernels (the V4 layout's); Hopper (sm_90) or Blackwell (sm_100 family), the legacy
    sparse decode's targets (``is_sm90a || is_sm100f``; sglang takes sm_120 elsewhere).
    """
    if device.type != "cuda":
        return f"FlashMLA runs on CUDA devices only; the tensors are on {device}"
    for name, cache in (("window", window), ("extra", extra)):
        if cache is None:
            continue
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
    if dim != HEAD_DIM:
        return f"head_dim {dim}; FlashMLA's sparse decode takes {HEAD_DIM}"
    if not (0 < heads <= KERNEL_HEADS[0] or heads == KERNEL_HEADS[1]):
        return (
            f"{heads} query heads; FlashMLA takes {KERNEL_HEADS[0]} or {KERNEL_HEADS[1]} "
            f"(1 ... {KERNEL_HEADS[0]} are padded to {KERNEL_HEADS[0]})"
        )
    try:
        flash_mla = importlib.import_module(PACKAGE)
    except ImportError as error:  # the wheel, or its CUDA extension against this torch
        return f"{PACKAGE} does not import ({error}); install {DISTRIBUTION}"
    has_legacy = getattr(flash_mla, "has_legacy", None)
    if has_legacy is None or not has_legacy():
        return (
            f"{PACKAGE} {getattr(flash_mla, '__version__', '?')} has no legacy kernels, which "
            f"read the V4 layout ({DISTRIBUTION} ships them)"
        )
    major, minor = capability or torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0) and major != 10:
        return (
            f"compute capability {major}.{minor}; FlashMLA's legacy sparse decode runs on "
            "sm_90 and the sm_100 family"
        )
    return None


def flashmla_schedule() -> Any:
    """An empty ``FlashMLASchedMeta`` (``flash_mla.get_mla_metadata()[0]``) that the first
    call fills. Calls may share one only with the same shapes and the same lengths (FlashMLA
    does not check the lengths): sglang shares one per compress ratio across a forward's
    layers (``DSV4AttnMetadata.get_flashmla_metadata``)."""
    return importlib.import_module(PACKAGE).get_mla_metadata()[0]


def flashmla_cache(cache: TokenCache) -> torch.Tensor:
    """``cache``'s pages as FlashMLA reads them: ``[pages, page_tokens, 1, 584]`` uint8, a
    view of each page's first ``page_tokens * 584`` bytes (page stride ``page_bytes``), as
    sglang views ``get_swa_key_buffer_radix`` / ``get_extra_key_buffer``."""
    layout = cache.layout
    assert layout is not None  # flashmla_unsupported_reason refused dense caches
    per_token = layout.bytes_per_token
    # Strides spelled out: view() would give a one-page cache another (unused) page stride,
    # and FlashMLA checks it.
    return cache.storage.as_strided(
        (cache.storage.shape[0], cache.page_tokens, 1, per_token),
        (layout.page_bytes, per_token, per_token, 1),
    )


def _indices_and_lengths(
    indices: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([T, 1, W'] int32, [T] int32)``: ``indices`` ``[T, W]`` -1 padded to ``W'``, a
    multiple of :data:`INDEX_ALIGN`, and ``lengths`` clamped to ``[0, W]``."""
    pad = -indices.shape[1] % INDEX_ALIGN
    padded = F.pad(indices, (0, pad), value=-1) if pad else indices.contiguous()
    return padded[:, None, :], lengths.clamp(0, indices.shape[1]).contiguous()


def flashmla_arguments(
    q: torch.Tensor,
    window: TokenCache,
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra_span: ExtraSpan | None,
    sink: torch.Tensor,
    softmax_scale: float,
    schedule: Any,
) -> dict[str, Any]:
    """Keyword arguments of ``flash_mla.flash_mla_with_kvcache`` for the op's inputs (already
    checked by ``check_inputs``, which returned ``extra_span``; the caches accepted by
    :func:`flashmla_unsupported_reason`); the module docstring maps them. Pure torch: runs on
    any device."""
    _, heads, dim = q.shape
    kernel_heads = KERNEL_HEADS[0] if heads <= KERNEL_HEADS[0] else heads
    q = q.to(torch.bfloat16)
    if kernel_heads != heads:  # zero heads: they add nothing and are sliced off
        q = F.pad(q, (0, 0, 0, kernel_heads - heads))
        sink = F.pad(sink, (0, kernel_heads - heads))
    indices, topk_length = _indices_and_lengths(swa_indices, swa_lengths)
    extra: dict[str, torch.Tensor | None] = dict.fromkeys(
        ("extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length")
    )
    if extra_span is not None:
        ext_cache, ext_indices, ext_lengths = extra_span
        ext_idx, ext_len = _indices_and_lengths(ext_indices, ext_lengths)
        extra = dict(
            extra_k_cache=flashmla_cache(ext_cache),
            extra_indices_in_kvcache=ext_idx,
            extra_topk_length=ext_len,
        )
    return dict(
        q=q.contiguous()[:, None],
        k_cache=flashmla_cache(window),
        block_table=None,
        cache_seqlens=None,
        head_dim_v=dim,
        tile_scheduler_metadata=schedule,
        softmax_scale=softmax_scale,
        is_fp8_kvcache=True,
        indices=indices,
        topk_length=topk_length,
        attn_sink=sink.contiguous(),
        use_legacy=True,
        **extra,
    )


def sparse_attention_flashmla(
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
    num_splits: int | None = None,
    schedule: Any = None,
    rows_per_group: int = 1,
) -> torch.Tensor:
    """``sparse_attention_with_sink`` on FlashMLA's sparse FP8 decode: the same arguments
    (``[T, H, D]`` queries, window and extra caches with their ``[T, W]`` int32 slots and
    ``[T]`` int32 lengths, ``[H]`` fp32 sink) and result, ``[T, H, D]`` bf16; rows without a
    valid key are 0.

    ``num_splits``: checked, else unused (FlashMLA schedules its own splits);
    ``rows_per_group``, the op's argument, is not used (one row a query). ``schedule``: a
    :func:`flashmla_schedule` shared with calls of the same shapes and lengths; None makes a
    fresh one. Raises ``BatchError`` / ``ContractError`` for bad inputs (the op's checks) and
    ``BatchError`` naming :func:`flashmla_unsupported_reason`'s reason.
    """
    extra_span = check_inputs(
        q, window, swa_indices, swa_lengths, extra, extra_indices, extra_lengths, sink,
        softmax_scale,
    )  # fmt: skip
    if num_splits is not None:
        checked_num_splits(num_splits)
    rows, heads, dim = q.shape
    reason = flashmla_unsupported_reason(q.device, window, extra, heads, dim)
    if reason is not None:
        raise BatchError(reason)
    if rows == 0:  # FlashMLA needs a batch
        return torch.empty((0, heads, dim), dtype=torch.bfloat16, device=q.device)
    flash_mla = importlib.import_module(PACKAGE)
    kwargs = flashmla_arguments(
        q, window, swa_indices, swa_lengths, extra_span, sink, softmax_scale,
        flashmla_schedule() if schedule is None else schedule,
    )  # fmt: skip
    out = flash_mla.flash_mla_with_kvcache(**kwargs)[0]  # [T, 1, Hk, D] bf16
    return out[:, 0, :heads].contiguous()
