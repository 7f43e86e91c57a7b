"""Cache store: write rows at planned slots (slot -1 = skip) into a token or indexer cache.

One program per row. Formats (see :mod:`dsv4_backend.cache.fp8_format`):

* dense: the row converted to the storage dtype (bf16 rounded to nearest even);
* fp8 token: per 64-channel group an exact ue8m0 scale, e4m3 nope bytes, bf16 rope bytes;
* fp8 indexer: one fp32 scale ``amax / 448`` per key, e4m3 bytes.

The Triton kernels encode arithmetically and produce the same bytes as the torch
implementation (``Fp8*Layout.pack_tokens``), which the tests check byte for byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.cache.fp8_format import Fp8TokenLayout
from dsv4_backend.cache.token_cache import SlotCache
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.device.fp8 import (
    fp8_indexer_addresses,
    fp8_token_addresses,
    fp32_to_bf16_bits,
    fp32_to_e4m3,
    pow2_of_biased,
    triton_constexprs,
    ue8m0_exponent_of,
)
from dsv4_backend.kernels.dispatch import use_triton

_MAX_BLOCK_D = 1024


# ------------------------------------------------------------------------------------ kernels
# One row each. The row helpers are shared with kernels that finish a row and store it in the
# same launch (the compressor); the kernels below are one program a row.
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


@triton.jit
def _store_dense_kernel(
    storage_ptr,  # [num_slots, D] float, row stride stride_s
    rows_ptr,  # [N, D] float, row stride stride_r
    slots_ptr,  # [N] int64
    stride_s,
    stride_r,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    slot = tl.load(slots_ptr + row)
    store_dense_row(storage_ptr, rows_ptr + row * stride_r, slot, offs, stride_s, D, BF16_BITS)


@triton.jit
def _store_fp8_token_kernel(
    storage_ptr,  # uint8 [num_pages, PAGE_BYTES]
    rows_ptr,  # [N, NOPE_DIM + ROPE_DIM] float, row stride stride_r
    slots_ptr,  # [N] int64
    stride_r,
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    store_fp8_token_row(
        storage_ptr, rows_ptr + row * stride_r, slot, NOPE_DIM, ROPE_DIM, PAGE_TOKENS, BLOCK_R
    )


@triton.jit
def _store_fp8_indexer_kernel(
    storage_ptr,  # uint8 [num_pages, PAGE_TOKENS * (DIM + 4)]
    rows_ptr,  # [N, DIM] float, row stride stride_r
    slots_ptr,  # [N] int64
    stride_r,
    DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    store_fp8_indexer_row(storage_ptr, rows_ptr + row * stride_r, slot, DIM, PAGE_TOKENS, BLOCK_D)


# ---------------------------------------------------------------------------------- launchers
def _launch_store(cache: SlotCache, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Run the store kernel of ``cache``'s format; arguments already validated."""
    n = rows.shape[0]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    slots = slots.contiguous()
    layout = cache.layout
    if layout is None:
        block_d = min(triton.next_power_of_2(cache.dim), _MAX_BLOCK_D)
        grid = (n, triton.cdiv(cache.dim, block_d))
        _store_dense_kernel[grid](
            cache.storage,
            rows,
            slots,
            cache.storage.stride(0),
            rows.stride(0),
            D=cache.dim,
            BLOCK_D=block_d,
            BF16_BITS=cache.storage.dtype == torch.bfloat16,
        )
    elif isinstance(layout, Fp8TokenLayout):
        _store_fp8_token_kernel[(n,)](
            cache.storage,
            rows,
            slots,
            rows.stride(0),
            BLOCK_R=triton.next_power_of_2(max(layout.rope_dim, 1)),
            **triton_constexprs(layout),
        )
    else:
        _store_fp8_indexer_kernel[(n,)](
            cache.storage,
            rows,
            slots,
            rows.stride(0),
            BLOCK_D=triton.next_power_of_2(layout.dim),
            **triton_constexprs(layout),
        )


def _store_rows_torch(cache: SlotCache, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Torch implementation of the store (same bytes as the kernels)."""
    keep = slots >= 0
    rows, slots = rows[keep], slots[keep]
    if cache.layout is None:
        cache.storage[slots] = rows.to(cache.storage.dtype)
    else:
        cache.layout.write_tokens(cache.storage, slots, *cache.layout.pack_tokens(rows))


# -------------------------------------------------------------------------------------- public
def store_rows(cache: SlotCache, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``rows`` into ``cache`` at ``slots``, skipping slot -1.

    Parameters
    ----------
    cache : TokenCache or IndexerKeyCache
    rows : ``[N, cache.dim]`` float (fp32, bf16 or fp16), on the cache's device.
    slots : ``[N]`` integer slot ids in ``[0, num_slots)`` or -1 (skip). With duplicate slots,
        which row ends up stored is unspecified.
    """
    cache.check_slots(slots)
    slots = slots.long()
    if (
        not isinstance(rows, torch.Tensor)
        or rows.dim() != 2
        or rows.shape[1] != cache.dim
        or not rows.is_floating_point()
    ):
        got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, torch.Tensor) else rows
        raise BatchError(f"rows is {got}; expected a float tensor [N, {cache.dim}]")
    if slots.shape != (rows.shape[0],):
        raise BatchError(
            f"slots has shape {tuple(slots.shape)}; expected ({rows.shape[0]},), one per row"
        )
    if rows.device != cache.device:
        raise BatchError(f"rows is on {rows.device}; the cache is on {cache.device}")
    if rows.shape[0] == 0:
        return
    if use_triton(cache.device):
        _launch_store(cache, rows, slots)
    else:
        _store_rows_torch(cache, rows, slots)
