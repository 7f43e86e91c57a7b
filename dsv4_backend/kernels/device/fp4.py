"""The device side of the fp4 formats (``cache.fp4_format``): the e2m1 codes and ue8m0
exponents of both roundings (``Ue8m0Rounding``: DeepSeek-V4.1's, sglang's c4 fp4 indexer's),
and the reader of the fp4 index-key pages (``Fp4IndexKeyLayout``): ``PAGE_TOKENS`` entries a
page, ``DIM / 2`` payload bytes each (element ``2i`` in the low nibble), then ``DIM / 32``
biased ue8m0 exponents each."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e2m1_code(scaled, TIES_EVEN: tl.constexpr):
    """e2m1 codes (int32, sign in bit 3 of nonzero magnitudes) of ``scaled`` in [-6, 6]:
    nearest; a tie to the even code (``TIES_EVEN``: at 0.75, 1.75, 3.5 the code above is
    even) or down (sglang's strict thresholds), as ``fp4_format.e2m1_codes``."""
    m = tl.abs(scaled)
    if TIES_EVEN:
        code = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
        code += (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
    else:
        code = (m > 0.25).to(tl.int32) + (m > 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
        code += (m > 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m > 3.5).to(tl.int32)
    code += (m > 5.0).to(tl.int32)
    # No negative zero: a value rounding to magnitude 0 stores code 0, as sglang's kernels do.
    return code | (((scaled < 0) & (code > 0)).to(tl.int32) << 3)


@triton.jit
def ue8m0_exponent(amax, FLOOR: tl.constexpr, EXACT: tl.constexpr):
    """A block's unbiased exponent ``e`` from its amax floored at ``FLOOR``, ``a``
    (``fp4_format.ue8m0_exponents``): ``EXACT``, the smallest ``e`` with ``6 * 2^e >= a``
    (``frexp(a / 6)``'s exponent from the bits, settled by exact comparisons); else the float32
    quotient ``a / 6`` rounded up to a power of two (its exponent field, plus one for a
    nonzero mantissa: sglang's ``cast_to_ue8m0``)."""
    a = tl.maximum(amax, FLOOR)
    bits = tl.math.div_rn(a, 6.0).to(tl.int32, bitcast=True)
    if EXACT:
        e = ((bits >> 23) & 0xFF) - 126
        below = ((e - 1 + 127) << 23).to(tl.float32, bitcast=True) * 6.0
        e -= (below >= a).to(tl.int32)
        at = ((e + 127) << 23).to(tl.float32, bitcast=True) * 6.0
        e += (at < a).to(tl.int32)
    else:
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return e


@triton.jit
def e2m1_to_fp32(code):
    """fp32 values of e2m1 codes (int, sign in bit 3): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    m = code & 7
    low = m.to(tl.float32) * 0.5  # codes 0-3: 0, 0.5, 1, 1.5
    high = tl.where(m == 7, 6.0, (m - 2).to(tl.float32))  # codes 4-7: 2, 3, 4, 6
    magnitude = tl.where(m < 4, low, high)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def load_fp4_index_block(
    cache_ptr,  # uint8 [num_pages, PAGE_TOKENS * (DIM / 2 + DIM / 32)] (contiguous)
    slots,  # [BLOCK_N] int slot ids (< 0: no slot -> 0)
    offs_d,  # [BLOCK_D] int32 channel ids (>= DIM -> 0)
    mask_n,  # [BLOCK_N] bool rows to load
    DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """Dequantised index keys ``[BLOCK_N, BLOCK_D]`` fp32 (``e2m1 * 2^(e - 127)``, exact: the
    scale is built from its exponent bits)."""
    valid = mask_n & (slots >= 0)
    s = tl.where(valid, slots, 0).to(tl.int64)
    page, t = s // PAGE_TOKENS, s % PAGE_TOKENS
    base = page * (PAGE_TOKENS * (DIM // 2 + DIM // 32))
    m = valid[:, None] & (offs_d < DIM)[None, :]
    byte = tl.load(cache_ptr + (base + t * (DIM // 2))[:, None] + (offs_d // 2)[None, :], mask=m)
    code = (byte.to(tl.int32) >> (4 * (offs_d % 2))[None, :]) & 15
    scale_at = base + PAGE_TOKENS * (DIM // 2) + t * (DIM // 32)
    exponent = tl.load(cache_ptr + scale_at[:, None] + (offs_d // 32)[None, :], mask=m, other=127)
    scale = (exponent.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return tl.where(m, e2m1_to_fp32(code) * scale, 0.0)
