"""Triton device helpers for the FP8 cache layouts of :mod:`dsv4_backend.cache.fp8_format`.

The kernels that read or write the caches import these: bit-exact e4m3 / ue8m0 / bf16
conversions, the byte addresses of a slot's data and scales, and block loaders that return
dequantised fp32 tiles. They decode bits arithmetically, which is exact on GPUs and in the
Triton interpreter alike (the interpreter has no fp8 and truncates bf16 conversions);
``e4m3_decode`` uses the GPU's own conversion instead where a kernel is compiled.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4_backend.cache.fp8_format import Fp8IndexerLayout, Fp8TokenLayout


@triton.jit
def e4m3_to_fp32(code):
    """uint8 e4m3fn bit patterns (any shape) -> fp32; 0x7F/0xFF -> NaN, like torch."""
    c = code.to(tl.int32) & 0xFF
    sign = (c >> 7) & 1
    exp = (c >> 3) & 15
    man = c & 7
    normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # man * 2^-9
    sub = tl.where(sign == 1, -sub, sub)
    val = tl.where(exp == 0, sub, normal)
    nan = tl.full(c.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where((c & 0x7F) == 0x7F, nan, val)


@triton.jit
def e4m3_decode(code, HARDWARE: tl.constexpr):
    """uint8 e4m3fn bit patterns -> bf16 through the GPU's fp8 conversion (``HARDWARE``: a
    compiled kernel; exact, every e4m3 value is a bf16 value), else fp32 decoded
    arithmetically (the interpreter, which has no fp8)."""
    if HARDWARE:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    else:
        return e4m3_to_fp32(code)


@triton.jit
def fp32_to_e4m3(v):
    """fp32 (any shape) -> uint8 e4m3fn bits: round to nearest even, saturate to +-448.

    Keeps the 24-bit significand ``m`` of ``|v| = m * 2^(e-23)`` and drops ``shift`` low bits:
    20 for e4m3 normals (e >= -6), more below (subnormals, step 2^-9); a carry into the next
    binade is absorbed by adding ``q`` to ``(e + 6) * 8``.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    mag = bits & 0x7FFFFFFF
    e = (mag >> 23) - 127
    m = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(14 - e, 20), 24)
    q = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.maximum(e + 6, 0) * 8 + q
    code = tl.where(e < -10, 0, tl.minimum(code, 126))
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN stays NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def ue8m0_exponent_of(amax):
    """Biased ue8m0 exponent (int32) of ``2^ceil(log2(amax / 448))``, as the torch
    ``fp8_format.ue8m0_exponent``."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.maximum(e, 0)
    return tl.where(amax == 0, 127, e)


@triton.jit
def pow2_of_biased(biased):
    """``2^(biased - 127)`` as fp32 for int32 ``biased`` in [0, 254] (0 -> 2^-127)."""
    return tl.where(biased > 0, biased << 23, 0x400000).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16_bits(x):
    """fp32 -> bf16 bit patterns (uint16), round to nearest even (NaN/inf preserved)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).to(tl.uint16)


@triton.jit
def bf16_bits_to_fp32(h):
    """bf16 bit patterns (uint16) -> fp32 (exact)."""
    return (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def paged_addresses(
    slots,  # [BLOCK_N] int (slot ids; < 0 means no slot)
    mask_n,  # [BLOCK_N] bool
    TOKEN_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
):
    """``(data_base, scale_base, valid)`` in pages of ``PAGE_BYTES`` holding ``PAGE_TOKENS``
    tokens' ``TOKEN_BYTES`` data bytes, then their ``SCALE_BYTES`` scale bytes: int64 byte
    offsets [BLOCK_N] of each slot's data and scales, and ``mask_n & (slots >= 0)``."""
    valid = mask_n & (slots >= 0)
    s = tl.where(valid, slots, 0).to(tl.int64)
    page_base = (s // PAGE_TOKENS) * PAGE_BYTES
    t = s % PAGE_TOKENS
    scale_base = page_base + PAGE_TOKENS * TOKEN_BYTES + t * SCALE_BYTES
    return page_base + t * TOKEN_BYTES, scale_base, valid


@triton.jit
def fp8_token_addresses(
    slots,  # [BLOCK_N] int (slot ids; < 0 means no slot)
    mask_n,  # [BLOCK_N] bool
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """``(data_base, scale_base, valid)`` for token-cache slots: int64 byte offsets [BLOCK_N] of
    each token's data and scale bytes in the flat storage, and ``mask_n & (slots >= 0)``.
    Mirrors ``Fp8TokenLayout.data_offsets`` / ``Fp8TokenLayout.scale_offsets``."""
    TOKEN_BYTES: tl.constexpr = NOPE_DIM + 2 * ROPE_DIM
    PAGE_BYTES: tl.constexpr = (
        (PAGE_TOKENS * (TOKEN_BYTES + 8) + TOKEN_BYTES - 1) // TOKEN_BYTES * TOKEN_BYTES
    )
    return paged_addresses(slots, mask_n, TOKEN_BYTES, 8, PAGE_TOKENS, PAGE_BYTES)


@triton.jit
def load_fp8_nope_block(
    cache_ptr,  # uint8 [num_pages, PAGE_BYTES] (contiguous)
    slots,  # [BLOCK_N] int slot ids (< 0: no slot -> 0)
    offs_d,  # [BLOCK_D] int32 nope channel ids (>= NOPE_DIM -> 0)
    mask_n,  # [BLOCK_N] bool rows to load
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """Dequantised nope channels ``offs_d`` of tokens ``slots``: ``[BLOCK_N, BLOCK_D]`` fp32."""
    data_base, scale_base, valid = fp8_token_addresses(
        slots, mask_n, NOPE_DIM, ROPE_DIM, PAGE_TOKENS
    )
    m = valid[:, None] & (offs_d < NOPE_DIM)[None, :]
    code = tl.load(cache_ptr + data_base[:, None] + offs_d[None, :], mask=m, other=0)
    e = tl.load(cache_ptr + scale_base[:, None] + (offs_d // 64)[None, :], mask=m, other=127)
    return e4m3_to_fp32(code) * pow2_of_biased(e.to(tl.int32))


@triton.jit
def load_bf16_rope_block(
    cache_ptr,  # uint8 [num_pages, PAGE_BYTES] (contiguous)
    slots,  # [BLOCK_N] int slot ids (< 0: no slot -> 0)
    offs_r,  # [BLOCK_R] int32 rope channel ids 0 .. ROPE_DIM-1 (others -> 0)
    mask_n,  # [BLOCK_N] bool rows to load
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """RoPE channels ``offs_r`` (counted from the first rope channel) as ``[BLOCK_N, BLOCK_R]``
    fp32, exact. Head channel ``NOPE_DIM + r`` is rope channel ``r``."""
    data_base, _, valid = fp8_token_addresses(slots, mask_n, NOPE_DIM, ROPE_DIM, PAGE_TOKENS)
    m = valid[:, None] & ((offs_r >= 0) & (offs_r < ROPE_DIM))[None, :]
    # Rope bytes start at an even offset (page and token sizes are even), so 16-bit loads align.
    ptr = (cache_ptr + data_base[:, None] + NOPE_DIM + 2 * offs_r[None, :]).to(
        tl.pointer_type(tl.uint16)
    )
    return bf16_bits_to_fp32(tl.load(ptr, mask=m, other=0))


@triton.jit
def load_fp8_token_block(
    cache_ptr,  # uint8 [num_pages, PAGE_BYTES] (contiguous)
    slots,  # [BLOCK_N] int slot ids (< 0: no slot -> 0)
    offs_d,  # [BLOCK_D] int32 head channel ids 0 .. NOPE_DIM+ROPE_DIM-1 (others -> 0)
    mask_n,  # [BLOCK_N] bool rows to load
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """Whole-head view: channels ``offs_d`` of ``[nope | rope]`` as ``[BLOCK_N, BLOCK_D]`` fp32."""
    nope = load_fp8_nope_block(cache_ptr, slots, offs_d, mask_n, NOPE_DIM, ROPE_DIM, PAGE_TOKENS)
    rope = load_bf16_rope_block(
        cache_ptr, slots, offs_d - NOPE_DIM, mask_n, NOPE_DIM, ROPE_DIM, PAGE_TOKENS
    )
    return nope + rope  # each is 0 where the other is defined


@triton.jit
def fp8_indexer_addresses(
    slots,  # [BLOCK_N] int (slot ids; < 0 means no slot)
    mask_n,  # [BLOCK_N] bool
    DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """``(data_base, scale_base, valid)`` for indexer slots, as :func:`fp8_token_addresses`."""
    PAGE_BYTES: tl.constexpr = PAGE_TOKENS * (DIM + 4)
    return paged_addresses(slots, mask_n, DIM, 4, PAGE_TOKENS, PAGE_BYTES)


@triton.jit
def load_fp8_indexer_block(
    cache_ptr,  # uint8 [num_pages, PAGE_TOKENS * (DIM + 4)] (contiguous)
    slots,  # [BLOCK_N] int slot ids (< 0: no slot -> 0)
    offs_d,  # [BLOCK_D] int32 channel ids (>= DIM -> 0)
    mask_n,  # [BLOCK_N] bool rows to load
    DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """Dequantised indexer keys ``[BLOCK_N, BLOCK_D]`` fp32 (``e4m3 * fp32 scale``)."""
    data_base, scale_base, valid = fp8_indexer_addresses(slots, mask_n, DIM, PAGE_TOKENS)
    m = valid[:, None] & (offs_d < DIM)[None, :]
    code = tl.load(cache_ptr + data_base[:, None] + offs_d[None, :], mask=m, other=0)
    scale = tl.load((cache_ptr + scale_base).to(tl.pointer_type(tl.float32)), mask=valid, other=0)
    return tl.where(m, e4m3_to_fp32(code) * scale[:, None], 0.0)


@triton.jit
def load_dense_block(
    cache_ptr,  # float [num_slots, DIM] (row stride stride_slot elements)
    stride_slot,  # elements between consecutive slots
    slots,  # [BLOCK_N] int slot ids (< 0: no slot -> 0)
    offs_d,  # [BLOCK_D] int32 channel ids (>= DIM -> 0)
    mask_n,  # [BLOCK_N] bool rows to load
    DIM: tl.constexpr,
):
    """Rows of a dense cache (token or indexer) as ``[BLOCK_N, BLOCK_D]`` fp32."""
    valid = mask_n & (slots >= 0)
    s = tl.where(valid, slots, 0).to(tl.int64)
    m = valid[:, None] & (offs_d < DIM)[None, :]
    x = tl.load(cache_ptr + s[:, None] * stride_slot + offs_d[None, :], mask=m, other=0.0)
    return x.to(tl.float32)


def triton_constexprs(layout: Fp8TokenLayout | Fp8IndexerLayout) -> dict[str, int]:
    """The layout constexprs the device helpers take, keyed by their parameter names."""
    if isinstance(layout, Fp8TokenLayout):
        return dict(
            NOPE_DIM=layout.nope_dim, ROPE_DIM=layout.rope_dim, PAGE_TOKENS=layout.page_tokens
        )
    return dict(DIM=layout.dim, PAGE_TOKENS=layout.page_tokens)
