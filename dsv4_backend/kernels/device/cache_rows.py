"""The cache row stores every writer inlines: a ``@triton.jit`` function a format that stores
one row (see :mod:`dsv4_backend.cache.fp8_format`):

* dense (:func:`store_dense_row`): the row converted to the storage dtype (bf16 rounded to
  nearest even);
* fp8 token (:func:`store_fp8_token_row`): per 64-channel group an exact ue8m0 scale, e4m3 nope
  bytes, bf16 rope bytes;
* fp8 indexer (:func:`store_fp8_indexer_row`): one fp32 scale ``amax / 448`` per key, e4m3
  bytes.

:func:`store_row` stores in the format its ``STORE`` constexpr names (``STORE_*``,
:func:`row_store_constexprs`), for kernels that finish a row and store it in the same launch
(the one-launch compressor, ``kernels/compressor/fused.py``); the cache store's kernels
(``kernels/cache_store/triton.py``) are one program a row. They encode arithmetically and
produce the same bytes as the torch implementation (``Fp8*Layout.pack_tokens``), which the tests
check byte for byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.cache.fp8_format import Fp8TokenLayout
from dsv4_backend.cache.token_cache import SlotCache
from dsv4_backend.kernels.device.fp8 import (
    fp8_indexer_addresses,
    fp8_token_addresses,
    fp32_to_bf16_bits,
    fp32_to_e4m3,
    pow2_of_biased,
    triton_constexprs,
    ue8m0_exponent_of,
)


@triton.jit
def store_dense_row(
    storage_ptr,  # [num_slots, D] float, row stride stride_s
    row_ptr,  # the row's first element
    slot,  # int64 slot (< 0: skip)
    offs,  # [BLOCK_D] int32 channel ids
    stride_s,
    D: tl.constexpr,
    BF16_BITS: tl.constexpr,  # storage is bf16: round in integer arithmetic (interpreter-exact)
):
    m = (offs < D) & (slot >= 0)
    x = tl.load(row_ptr + offs, mask=m, other=0.0)
    dst = storage_ptr + tl.maximum(slot, 0) * stride_s + offs
    if BF16_BITS:
        tl.store(dst.to(tl.pointer_type(tl.uint16)), fp32_to_bf16_bits(x.to(tl.float32)), mask=m)
    else:
        tl.store(dst, x.to(storage_ptr.dtype.element_ty), mask=m)


@triton.jit
def store_fp8_token_row(
    storage_ptr,  # uint8 [num_pages, PAGE_BYTES]
    row_ptr,  # the row's first element ([NOPE_DIM + ROPE_DIM] float)
    slot,  # int64 slot (< 0: skip)
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_R: tl.constexpr,  # next power of two >= ROPE_DIM
):
    data_base, scale_base, valid = fp8_token_addresses(
        slot, slot >= 0, NOPE_DIM, ROPE_DIM, PAGE_TOKENS
    )
    # Nope as an [8 groups, 64 channels] tile: one scale byte per group (8 per token);
    # groups past NOPE_DIM load zeros, so their scale byte is written as 0 padding.
    g = tl.arange(0, 8)
    ch = g[:, None] * 64 + tl.arange(0, 64)[None, :]
    m = (ch < NOPE_DIM) & valid
    x = tl.load(row_ptr + ch, mask=m, other=0.0).to(tl.float32)
    e = ue8m0_exponent_of(tl.max(tl.abs(x), axis=1))  # [8] biased exponents
    codes = fp32_to_e4m3(x * pow2_of_biased(254 - e)[:, None])  # x / 2^(e - 127), exact
    tl.store(storage_ptr + data_base + ch, codes, mask=m)
    e = tl.where(g < NOPE_DIM // 64, e, 0).to(tl.uint8)
    tl.store(storage_ptr + scale_base + g, e, mask=valid)
    r = tl.arange(0, BLOCK_R)
    mr = (r < ROPE_DIM) & valid
    xr = tl.load(row_ptr + NOPE_DIM + r, mask=mr, other=0.0).to(tl.float32)
    rope_ptr = (storage_ptr + data_base + NOPE_DIM + 2 * r).to(tl.pointer_type(tl.uint16))
    tl.store(rope_ptr, fp32_to_bf16_bits(xr), mask=mr)


@triton.jit
def store_fp8_indexer_row(
    storage_ptr,  # uint8 [num_pages, PAGE_TOKENS * (DIM + 4)]
    row_ptr,  # the row's first element ([DIM] float)
    slot,  # int64 slot (< 0: skip)
    DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= DIM
):
    data_base, scale_base, valid = fp8_indexer_addresses(slot, slot >= 0, DIM, PAGE_TOKENS)
    d = tl.arange(0, BLOCK_D)
    m = (d < DIM) & valid
    x = tl.load(row_ptr + d, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    # div_rn: correctly rounded like torch's division (plain '/' is approximate on GPUs).
    scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, 448.0))
    codes = fp32_to_e4m3(tl.math.div_rn(x, scale))
    tl.store(storage_ptr + data_base + d, codes, mask=m)
    tl.store((storage_ptr + scale_base).to(tl.pointer_type(tl.float32)), scale, mask=valid)


#: ``STORE`` of ``store_row``: what a fused kernel does with a finished row.
STORE_NONE, STORE_DENSE, STORE_FP8_TOKEN, STORE_FP8_INDEXER = range(4)


@triton.jit
def store_row(
    storage_ptr,
    row_ptr,  # the row's first element ([D] float)
    slot,  # int64 slot (< 0: skip)
    stride_s,  # dense only: elements between slots
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= D
    STORE: tl.constexpr,  # STORE_* (constexpr ints 0-3)
    BF16_BITS: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Store one ``D``-channel row in the cache format ``STORE`` (``row_store_constexprs``)."""
    if STORE == 1:
        offs = tl.arange(0, BLOCK_D)
        store_dense_row(storage_ptr, row_ptr, slot, offs, stride_s, D, BF16_BITS)
    elif STORE == 2:
        store_fp8_token_row(storage_ptr, row_ptr, slot, NOPE_DIM, ROPE_DIM, PAGE_TOKENS, BLOCK_R)
    elif STORE == 3:
        store_fp8_indexer_row(storage_ptr, row_ptr, slot, D, PAGE_TOKENS, BLOCK_D)


def row_store_constexprs(cache: SlotCache | None) -> dict[str, int | bool]:
    """``store_row``'s constexprs for ``cache`` (``None``: ``STORE_NONE``), keyed by name."""
    out: dict[str, int | bool] = dict(
        STORE=STORE_NONE, BF16_BITS=False, NOPE_DIM=0, ROPE_DIM=0, PAGE_TOKENS=1, BLOCK_R=1
    )
    if cache is None:
        return out
    layout = cache.layout
    if layout is None:
        out.update(STORE=STORE_DENSE, BF16_BITS=cache.storage.dtype == torch.bfloat16)
    elif isinstance(layout, Fp8TokenLayout):
        out.update(STORE=STORE_FP8_TOKEN, BLOCK_R=triton.next_power_of_2(max(layout.rope_dim, 1)))
        out.update(triton_constexprs(layout))
    else:
        out.update(STORE=STORE_FP8_INDEXER, PAGE_TOKENS=layout.page_tokens)
    return out
