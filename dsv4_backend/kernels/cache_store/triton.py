"""The cache store's Triton path: one program per row (:func:`launch_store`), storing with the
row stores of ``kernels/device/cache_rows.py``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache, Fp4IndexKeyLayout
from dsv4_backend.cache.fp8_format import Fp8IndexerLayout, Fp8TokenLayout
from dsv4_backend.cache.token_cache import SlotCache
from dsv4_backend.errors import ContractError
from dsv4_backend.kernels.device.cache_rows import (
    store_dense_row,
    store_fp8_indexer_row,
    store_fp8_token_row,
)
from dsv4_backend.kernels.device.fp4 import e2m1_code, ue8m0_exponent
from dsv4_backend.kernels.device.fp8 import triton_constexprs

_MAX_BLOCK_D = 1024


# ------------------------------------------------------------------------------------ kernels
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


@triton.jit
def _store_fp4_index_kernel(
    storage_ptr,  # uint8 [num_pages, PAGE_TOKENS * (DIM / 2 + DIM / 32)]
    rows_ptr,  # [N, DIM] float, row stride stride_r
    slots_ptr,  # [N] int64
    stride_r,
    DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    FLOOR: tl.constexpr,  # Ue8m0Rounding.amax_floor
    EXACT: tl.constexpr,  # Ue8m0Rounding.exact_exponent
    TIES_EVEN: tl.constexpr,  # Ue8m0Rounding.ties_even
):
    """One row quantised to fp4 with a ue8m0 exponent per 32 channels and packed into its
    page (``Fp4IndexKeyLayout``). The row is held as ``[DIM / 32, 16]`` tiles of its even and
    odd channels: a tile line is a scale block, and the two tiles' elements are the low and
    high nibbles of the same payload bytes."""
    LINES: tl.constexpr = DIM // 32
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    even = tl.arange(0, LINES)[:, None] * 32 + 2 * tl.arange(0, 16)[None, :]
    xe = tl.load(rows_ptr + row * stride_r + even).to(tl.float32)
    xo = tl.load(rows_ptr + row * stride_r + even + 1).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))  # [LINES]
    exponent = ue8m0_exponent(amax, FLOOR, EXACT)
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)[:, None]
    ce = e2m1_code(tl.minimum(tl.maximum(tl.math.div_rn(xe, scale), -6.0), 6.0), TIES_EVEN)
    co = e2m1_code(tl.minimum(tl.maximum(tl.math.div_rn(xo, scale), -6.0), 6.0), TIES_EVEN)
    page, t = tl.maximum(slot, 0) // PAGE_TOKENS, tl.maximum(slot, 0) % PAGE_TOKENS
    base = page * (PAGE_TOKENS * (DIM // 2 + LINES))
    keep = slot >= 0
    payload = storage_ptr + base + t * (DIM // 2) + even // 2
    tl.store(payload, (ce | (co << 4)).to(tl.uint8), mask=keep)
    exponents = storage_ptr + base + PAGE_TOKENS * (DIM // 2) + t * LINES + tl.arange(0, LINES)
    tl.store(exponents, (exponent + 127).to(tl.uint8), mask=keep)


# ---------------------------------------------------------------------------------- launchers
def launch_store(cache: SlotCache, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Run the store kernel of ``cache``'s format; arguments already validated."""
    n = rows.shape[0]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    slots = slots.contiguous()
    layout = cache.layout
    # The paged formats' kernels take the same first arguments.
    paged = (cache.storage, rows, slots, rows.stride(0))
    if isinstance(cache, Fp4IndexKeyCache) and layout is None:
        cache.store(rows[slots >= 0], slots[slots >= 0])  # dense fp4 keys: a tests' format
    elif layout is None:
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
            *paged,
            BLOCK_R=triton.next_power_of_2(max(layout.rope_dim, 1)),
            **triton_constexprs(layout),
        )
    elif isinstance(layout, Fp8IndexerLayout):
        _store_fp8_indexer_kernel[(n,)](
            *paged,
            BLOCK_D=triton.next_power_of_2(layout.dim),
            **triton_constexprs(layout),
        )
    elif isinstance(layout, Fp4IndexKeyLayout):
        lines = layout.dim // 32
        if lines & (lines - 1):
            raise ContractError(
                f"fp4 index keys of dim {layout.dim}: the store kernel takes a power-of-two "
                "number of 32-channel scale blocks"
            )
        rounding = layout.rounding
        _store_fp4_index_kernel[(n,)](
            *paged,
            DIM=layout.dim,
            PAGE_TOKENS=layout.page_tokens,
            FLOOR=rounding.amax_floor,
            EXACT=rounding.exact_exponent,
            TIES_EVEN=rounding.ties_even,
        )
    else:
        raise ContractError(f"the cache store has no kernel for {type(layout).__name__} caches")
