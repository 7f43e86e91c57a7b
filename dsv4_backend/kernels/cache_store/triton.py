"""The cache store's Triton path: one program per row (:func:`launch_store`), storing with the
row stores of ``kernels/device/cache_rows.py``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.cache.fp8_format import Fp8IndexerLayout, Fp8TokenLayout
from dsv4_backend.cache.token_cache import SlotCache
from dsv4_backend.errors import ContractError
from dsv4_backend.kernels.device.cache_rows import (
    store_dense_row,
    store_fp8_indexer_row,
    store_fp8_token_row,
)
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


# ---------------------------------------------------------------------------------- launchers
def launch_store(cache: SlotCache, rows: torch.Tensor, slots: torch.Tensor) -> None:
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
    elif isinstance(layout, Fp8IndexerLayout):
        _store_fp8_indexer_kernel[(n,)](
            cache.storage,
            rows,
            slots,
            rows.stride(0),
            BLOCK_D=triton.next_power_of_2(layout.dim),
            **triton_constexprs(layout),
        )
    else:
        raise ContractError(
            f"the cache store has no kernel for {type(layout).__name__} caches (the fp4 index "
            "keys are written by Fp4IndexKeyCache.store)"
        )
