"""FlashMLA's sparse FP8 decode as a variant of the ``sparse_attention`` op.

:func:`sparse_attention_flashmla` takes the arguments of
``table.sparse_attention_with_sink`` and computes the same attention with the
``flash_mla`` package sglang 0.5.23 pins (``flashmla_library.py``), called as sglang's built-in
DeepSeek-V4 backend calls it (``srt/layers/attention/deepseek_v4_backend.py``,
``DeepseekV4AttnBackend._forward_attention``, the ``flash_mla_with_kvcache`` branch).
:func:`flashmla_unsupported_reason` says where it runs (``table.py`` declares it).

How the op's tensors become FlashMLA's arguments (:func:`flashmla_arguments`):

* queries ``[T, H, D]`` -> ``q`` ``[T, 1, Hk, D]`` bf16: one query token per batch entry (as
  sglang's decode, verify and small extends pass them), heads zero-padded to ``Hk`` = 64 when
  ``H <= 64`` (``flashmla_library.kernel_queries``);
* each fp8 cache -> ``[pages, page_tokens, 1, 584]`` uint8 over its first ``page_tokens * 584``
  bytes a page, page stride the layout's ``page_bytes``: FlashMLA detects sglang's V4 layout
  (:mod:`dsv4_backend.cache.fp8_format`) from that last dim, as sglang views its pool;
  the window cache is FlashMLA's main cache, the c4 / c128 cache its extra cache;
* slots -> ``indices`` ``[T, 1, W]`` int32 unchanged (both number a slot ``page * page_tokens +
  offset``), ``-1`` padded to a multiple of 64 columns (``flashmla_library.aligned_columns``);
  lengths -> ``topk_length`` ``[T]`` int32, clamped to ``[0, W]``
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

Prefill: sglang runs a non-speculative extend of more than 11673 query rows
(:data:`PREFILL_ROWS`; or any with ``SGLANG_OPT_FLASHMLA_SPARSE_PREFILL``) through
``flash_mla_sparse_fwd`` instead, and so does this variant for a call of more than
:data:`PREFILL_ROWS` rows outside a CUDA-graph capture (``flashmla_library.sparse_prefill``,
which synchronises once; the ``flashmla_prefill`` variant runs every call through it). Every
other call, extend rows included, goes through the decode kernel, as sglang does below that
threshold.

Not run here: ``flash_mla`` needs CUDA; the tests check the arguments against its documented
signature with a stand-in module and compare the result with ``sparse_attention_torch``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.attention.common import (
    AttentionCall,
    checked_num_splits,
)
from dsv4_backend.kernels.attention.flashmla_library import (
    PREFILL_FUNCTIONS,
    aligned_columns,
    fp8_cache_unsupported_reason,
    kernel_queries,
    library,
    library_unsupported_reason,
    prefill_arguments,
    sparse_prefill,
)

#: What the variant's decode calls of ``flash_mla``.
DECODE_FUNCTIONS = ("flash_mla_with_kvcache", "get_mla_metadata")
#: sglang's built-in runs a non-speculative extend of more query rows than this through
#: FlashMLA's sparse prefill (``srt/layers/attention/dsv4/metadata.py``,
#: ``_LARGE_INDEXER_QUERY_THRESHOLD``).
PREFILL_ROWS = 11673
_prefill_rows: list[int] = []


@contextlib.contextmanager
def flashmla_prefill_above(rows: int) -> Iterator[None]:
    """Inside the block, the variant takes the prefill kernel for calls of more than ``rows``
    rows (the self-check lowers it so that its extends check that kernel too)."""
    _prefill_rows.append(rows)
    try:
        yield
    finally:
        _prefill_rows.pop()


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
    capability; None reads it from ``device`` (tests pass one). Checked in order: fp8 caches
    FlashMLA reads in place (``flashmla_library.fp8_cache_unsupported_reason``), then the
    device, heads, package and capability (``flashmla_library.library_unsupported_reason``).
    """
    for name, cache in (("window", window), ("extra", extra)):
        reason = None if cache is None else fp8_cache_unsupported_reason(name, cache)
        if reason is not None:
            return reason
    functions = DECODE_FUNCTIONS + PREFILL_FUNCTIONS
    return library_unsupported_reason(device, heads, dim, capability, functions)


def flashmla_schedule() -> Any:
    """An empty ``FlashMLASchedMeta`` (``flash_mla.get_mla_metadata()[0]``) that the first
    call fills. Calls may share one only with the same shapes and the same lengths (FlashMLA
    does not check the lengths): sglang shares one per compress ratio across a forward's
    layers (``DSV4AttnMetadata.get_flashmla_metadata``)."""
    return library().get_mla_metadata()[0]


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
    """``([T, 1, W'] int32, [T] int32)``: ``indices`` ``[T, W]`` -1 padded to ``W'``
    (``flashmla_library.aligned_columns``) and ``lengths`` clamped to ``[0, W]``."""
    return aligned_columns(indices)[:, None, :], lengths.clamp(0, indices.shape[1]).contiguous()


def flashmla_arguments(call: AttentionCall, schedule: Any) -> dict[str, Any]:
    """Keyword arguments of ``flash_mla.flash_mla_with_kvcache`` for the op's checked call
    (its caches accepted by :func:`flashmla_unsupported_reason`); the module docstring maps
    them. Pure torch: runs on any device."""
    q, window, swa_indices, swa_lengths, extra_span, sink, softmax_scale = call.parts()
    dim = q.shape[2]
    q, sink = kernel_queries(q, sink)
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
        q=q[:, None],
        k_cache=flashmla_cache(window),
        block_table=None,
        cache_seqlens=None,
        head_dim_v=dim,
        tile_scheduler_metadata=schedule,
        softmax_scale=softmax_scale,
        is_fp8_kvcache=True,
        indices=indices,
        topk_length=topk_length,
        attn_sink=sink,
        use_legacy=True,
        **extra,
    )


def sparse_attention_flashmla(
    call: AttentionCall,
    *,
    num_splits: int | None = None,
    schedule: Any = None,
) -> torch.Tensor:
    """``sparse_attention_with_sink`` on FlashMLA's sparse FP8 decode (its sparse prefill above
    :data:`PREFILL_ROWS` rows, the module docstring): the same arguments (``[T, H, D]``
    queries, window and extra caches with their ``[T, W]`` int32 slots and ``[T]`` int32
    lengths, ``[H]`` fp32 sink) and result, ``[T, H, D]`` bf16; rows without a valid key are 0.

    ``num_splits``: checked, else unused (FlashMLA schedules its own splits);
    ``rows_per_group``, the op's argument, is not used (one row a query). ``schedule``: a
    :func:`flashmla_schedule` shared with calls of the same shapes and lengths; None makes a
    fresh one. Raises ``BatchError`` / ``ContractError`` for bad inputs (the op's checks) and
    ``BatchError`` naming :func:`flashmla_unsupported_reason`'s reason.
    """
    q = call.q
    if num_splits is not None:
        checked_num_splits(num_splits)
    rows, heads, dim = q.shape
    reason = flashmla_unsupported_reason(q.device, call.window, call.extra_cache, heads, dim)
    if reason is not None:
        raise BatchError(reason)
    threshold = _prefill_rows[-1] if _prefill_rows else PREFILL_ROWS
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if rows > threshold and not capturing:
        return sparse_prefill(prefill_arguments(call), heads)
    if rows == 0:  # FlashMLA needs a batch
        return torch.empty((0, heads, dim), dtype=torch.bfloat16, device=q.device)
    kwargs = flashmla_arguments(call, flashmla_schedule() if schedule is None else schedule)
    out = library().flash_mla_with_kvcache(**kwargs)[0]  # [T, 1, Hk, D] bf16
    return out[:, 0, :heads].contiguous()
