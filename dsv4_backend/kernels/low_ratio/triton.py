"""DeepSeek-V4.1's low-ratio ops, Triton variants (``table.py``):

* ``pair_pool_triton``: a ratio-2 kv source's pair pooling, a program per rows and 128
  channels: the row and its partner (the previous row, or the pair ring's row), pooled by the
  per-channel softmax of their scores; then a second launch writes the ring (a request's first
  row reads a ring row its later rows may overwrite), each ring row by the request's last row
  mapping to it.
* ``fp4_rows_triton``: a program of rows (a row's head each, for ``[N, H, D]`` queries) runs
  each row's bf16 rounding, RMSNorm, RoPE and fp4 block rounding (``cache.fp4_format``) and, for
  index keys, packs the fp4 codes and ue8m0 exponents straight into the kv source's fp4 pages.
  A row is held as its even and odd channels (``[D / B, B / 2]`` tiles a scale block of
  ``B`` channels a line), so RoPE's interleaved pairs and the packed bytes' nibble pairs are
  the same elements of the two tiles, and a block's amax is one reduction over a line.

Roundings are bit operations (``kernels/device/fp8.py``), exact on a GPU and in the
interpreter; the division by an e4m3 scale is rounded to nearest (``div_rn``), as torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.cache.fp4_format import (
    E2M1_MAX,
    E4M3_BLOCK,
    E4M3_SCALE_MAX,
    E4M3_SCALE_MIN,
    UE8M0_AMAX_FLOOR,
    UE8M0_BLOCK,
    Fp4IndexKeyLayout,
)
from dsv4_backend.errors import ContractError
from dsv4_backend.kernels.device.fp4 import e2m1_code, e2m1_to_fp32, ue8m0_exponent
from dsv4_backend.kernels.device.fp8 import (
    bf16_bits_to_fp32,
    e4m3_to_fp32,
    fp32_to_bf16_bits,
    fp32_to_e4m3,
)
from dsv4_backend.kernels.low_ratio.common import PairCall, RowsCall

# The format's constants as the kernels read them (a compiled kernel reads constexpr globals).
_MAX = tl.constexpr(E2M1_MAX)
_SCALE_MIN = tl.constexpr(E4M3_SCALE_MIN)
_SCALE_MAX = tl.constexpr(E4M3_SCALE_MAX)
_AMAX_FLOOR = tl.constexpr(UE8M0_AMAX_FLOOR)


@triton.jit
def _bf16(x):
    """fp32 ``x`` rounded to bf16 (nearest even), as fp32."""
    return bf16_bits_to_fp32(fp32_to_bf16_bits(x))


@triton.jit
def _fp4_rows_kernel(
    x_ptr,  # [N * HEADS, D] float (row r * HEADS + h)
    weight_ptr,  # [D] float (NORM)
    cos_ptr,  # [N, ROPE / 2] float32
    sin_ptr,
    out_ptr,  # [N * HEADS, D] float32
    normed_ptr,  # [N * HEADS, D] float32 (NORM)
    pages_ptr,  # uint8 [num_pages, PAGE_TOKENS * (D / 2 + D / 32)] (STORE)
    slots_ptr,  # [N] int (STORE; -1: the padding slot 0)
    eps,
    num_rows,
    stride_x,
    stride_cs,
    D: tl.constexpr,
    ROPE: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
    UE8M0: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """``ROWS`` rows a program, each as ``[D / BLOCK, BLOCK / 2]`` even / odd channel tiles."""
    HALF: tl.constexpr = BLOCK // 2
    LINES: tl.constexpr = D // BLOCK
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    live = (row < num_rows)[:, None, None]
    lines = tl.arange(0, LINES)[None, :, None]
    even = lines * BLOCK + 2 * tl.arange(0, HALF)[None, None, :]  # [1, LINES, HALF] channels
    at = row[:, None, None] * stride_x + even
    xe = _bf16(tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32))
    xo = _bf16(tl.load(x_ptr + at + 1, mask=live, other=0.0).to(tl.float32))
    own = row[:, None, None] * D + even  # the row's channels in the outputs
    if NORM:
        squares = tl.sum(tl.sum(xe * xe, axis=2), axis=1) + tl.sum(tl.sum(xo * xo, axis=2), axis=1)
        inv = tl.math.div_rn(1.0, tl.sqrt_rn(squares / D + eps))[:, None, None]
        xe = _bf16(xe * inv * tl.load(weight_ptr + even).to(tl.float32))
        xo = _bf16(xo * inv * tl.load(weight_ptr + even + 1).to(tl.float32))
        tl.store(normed_ptr + own, xe, mask=live)
        tl.store(normed_ptr + own + 1, xo, mask=live)
    rotates = even >= D - ROPE
    pair = tl.where(rotates, (even - (D - ROPE)) // 2, 0)
    trig = (row // HEADS)[:, None, None] * stride_cs + pair
    c = tl.load(cos_ptr + trig, mask=rotates & live, other=1.0)
    s = tl.load(sin_ptr + trig, mask=rotates & live, other=0.0)
    ye = _bf16(tl.where(rotates, xe * c - xo * s, xe))
    yo = _bf16(tl.where(rotates, xe * s + xo * c, xo))
    amax = tl.maximum(tl.max(tl.abs(ye), axis=2), tl.max(tl.abs(yo), axis=2))  # [ROWS, LINES]
    if UE8M0:
        exponent = ue8m0_exponent(amax, _AMAX_FLOOR, True)
        scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    else:
        raw = tl.minimum(tl.maximum(tl.math.div_rn(amax, _MAX), _SCALE_MIN), _SCALE_MAX)
        scale = e4m3_to_fp32(fp32_to_e4m3(raw))
    scale3 = scale[:, :, None]
    ce = e2m1_code(tl.minimum(tl.maximum(tl.math.div_rn(ye, scale3), -_MAX), _MAX), True)
    co = e2m1_code(tl.minimum(tl.maximum(tl.math.div_rn(yo, scale3), -_MAX), _MAX), True)
    tl.store(out_ptr + own, e2m1_to_fp32(ce) * scale3, mask=live)
    tl.store(out_ptr + own + 1, e2m1_to_fp32(co) * scale3, mask=live)
    if STORE:
        slot = tl.maximum(tl.load(slots_ptr + row, mask=row < num_rows, other=0).to(tl.int64), 0)
        page, t = slot // PAGE_TOKENS, slot % PAGE_TOKENS
        base = page * (PAGE_TOKENS * (D // 2 + LINES))
        payload = (base + t * (D // 2))[:, None, None] + even // 2
        tl.store(pages_ptr + payload, (ce | (co << 4)).to(tl.uint8), mask=live)
        exponents = (base + PAGE_TOKENS * (D // 2) + t * LINES)[:, None] + tl.arange(0, LINES)
        tl.store(
            pages_ptr + exponents, (exponent + 127).to(tl.uint8), mask=(row < num_rows)[:, None]
        )


#: Rows a program of the rows and pair kernels takes: 4 on a GPU (a 512-channel row is 4 values
#: a thread of 4 warps), 64 in the interpreter (which pays for every operation of a program).
ROWS_PER_PROGRAM = {"cuda": 4, "cpu": 64}


def fp4_rows_triton(call: RowsCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``table.low_ratio_rows`` in one launch. An fp4-paged ``store`` is written by the kernel
    with each block's exponent from the unrounded values (a one-pass quantiser; decoding gives
    the same values as the torch store, which re-derives it from the rounded ones); a dense one
    (tests) by ``Fp4IndexKeyCache.store``."""
    x, cos, sin, scale, norm, store = (
        call.x,
        call.cos,
        call.sin,
        call.scale,
        call.norm,
        call.store,
    )
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    d, heads = x.shape[-1], rows.shape[0] // max(cos.shape[0], 1)
    block = E4M3_BLOCK if scale == "e4m3" else UE8M0_BLOCK
    if d % block or (d // block) & (d // block - 1) or x.shape[0] != cos.shape[0]:
        raise ContractError(
            f"fp4 rows of shape {tuple(x.shape)} with cos {tuple(cos.shape)}: the Triton "
            f"kernel takes a power-of-two number of {block}-channel blocks and one position a "
            "leading index"
        )
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    normed = torch.empty_like(out) if norm is not None else None
    # An fp4-paged store is packed by the kernel; a dense one (tests) written after it.
    pages, slots, page_tokens = out, out, 1
    if store is not None:
        cache, slots = store
        cache.check_slots(slots)
        if isinstance(cache.layout, Fp4IndexKeyLayout):
            if scale != "ue8m0":
                raise ContractError("fp4 index-key pages hold ue8m0 scales; got scale 'e4m3'")
            pages, page_tokens = cache.storage, cache.layout.page_tokens
    weight, eps = norm if norm is not None else (out, 0.0)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if rows.shape[0]:
        per = ROWS_PER_PROGRAM.get(x.device.type, 4)
        _fp4_rows_kernel[(triton.cdiv(rows.shape[0], per),)](
            rows,
            weight,
            cos,
            sin,
            out,
            out if normed is None else normed,
            pages,
            slots,
            eps,
            rows.shape[0],
            rows.stride(0),
            cos.stride(0),
            D=d,
            ROPE=2 * cos.shape[-1],
            HEADS=heads,
            BLOCK=block,
            UE8M0=scale == "ue8m0",
            NORM=norm is not None,
            STORE=pages is not out,
            PAGE_TOKENS=page_tokens,
            ROWS=per,
        )
    if store is not None and pages is out:
        store[0].store(out, store[1])
    return out.reshape(x.shape), None if normed is None else normed.reshape(x.shape)


@triton.jit
def _pair_rows(req_ptr, pos_ptr, valid_ptr, t, live):
    """Rows ``t``'s request pool rows (0 for padding rows), positions and validity."""
    valid = tl.load(valid_ptr + t, mask=live, other=0) != 0
    return (
        tl.where(valid, tl.load(req_ptr + t, mask=live, other=0), 0),
        tl.load(pos_ptr + t, mask=live, other=0),
        valid,
    )


@triton.jit
def _pair_pool_kernel(
    kv_ptr,  # [T, D] float32
    score_ptr,  # [T, D] float32
    ring_ptr,  # [slots, R, 2 * D] float32 rows [kv | score]
    req_ptr,  # [T] int64 request pool row of each row
    pos_ptr,  # [T] int64
    valid_ptr,  # [T] bool (False: a padding row, which reads pool row 0's ring)
    out_ptr,  # [T, D] float32
    T,
    stride_kv,
    stride_score,
    stride_slot,
    D: tl.constexpr,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
):
    """``ROWS`` rows (program 0) pooled with their partners over ``BLOCK_D`` channels."""
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = t < T
    d = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]
    m = live[:, None] & (d < D)
    req, p, _ = _pair_rows(req_ptr, pos_ptr, valid_ptr, t, live)
    before = tl.maximum(t - 1, 0)
    req_before, p_before, valid_before = _pair_rows(req_ptr, pos_ptr, valid_ptr, before, live)
    previous = ((t > 0) & (req_before == req) & (p_before == p - 1) & valid_before)[:, None]
    kv = tl.load(kv_ptr + t[:, None] * stride_kv + d, mask=m, other=0.0)
    score = tl.load(score_ptr + t[:, None] * stride_score + d, mask=m, other=0.0)
    ring_row = ring_ptr + (req * stride_slot + (((p - 1) % R + R) % R) * (2 * D))[:, None]
    m_prev, m_ring = m & previous, m & ~previous
    partner_kv = tl.load(kv_ptr + before[:, None] * stride_kv + d, mask=m_prev, other=0.0)
    partner_kv += tl.load(ring_row + d, mask=m_ring, other=0.0)
    partner_score = tl.load(score_ptr + before[:, None] * stride_score + d, mask=m_prev, other=0.0)
    partner_score += tl.load(ring_row + D + d, mask=m_ring, other=0.0)
    top = tl.maximum(partner_score, score)
    a = tl.exp(partner_score - top)
    b = tl.exp(score - top)
    total = a + b
    pooled = tl.math.div_rn(a, total) * partner_kv + tl.math.div_rn(b, total) * kv
    tl.store(out_ptr + t[:, None] * D + d, pooled, mask=m)


@triton.jit
def _pair_ring_write_kernel(
    kv_ptr,
    score_ptr,
    ring_ptr,
    req_ptr,
    pos_ptr,
    valid_ptr,
    T,
    stride_kv,
    stride_score,
    stride_slot,
    D: tl.constexpr,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Ring row ``(request, p % R)`` takes row ``t``'s ``[kv | score]`` unless the request's row
    ``R`` later maps there too (a request's rows are consecutive with consecutive positions)."""
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = t < T
    d = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]
    req, p, _ = _pair_rows(req_ptr, pos_ptr, valid_ptr, t, live)
    later = tl.minimum(t + R, T - 1)
    req_later, p_later, _ = _pair_rows(req_ptr, pos_ptr, valid_ptr, later, live)
    overwritten = (t + R < T) & (req_later == req) & (p_later == p + R)
    m = (live & ~overwritten)[:, None] & (d < D)
    ring_row = ring_ptr + (req * stride_slot + (p % R) * (2 * D))[:, None]
    tl.store(ring_row + d, tl.load(kv_ptr + t[:, None] * stride_kv + d, mask=m), mask=m)
    tl.store(ring_row + D + d, tl.load(score_ptr + t[:, None] * stride_score + d, mask=m), mask=m)


#: Channels a program of the pair kernels covers.
PAIR_BLOCK_D = 128


def pair_pool_triton(call: PairCall) -> torch.Tensor:
    """``table.low_ratio_pairs`` in two launches: the pooling reads the ring, then the ring
    write (a request's first row reads a ring row its later rows may write)."""
    ring = call.rings.ring
    t, d = call.kv.shape
    out = torch.empty((t, d), dtype=torch.float32, device=call.kv.device)
    if t == 0:
        return out
    kv, score = call.kv.float().contiguous(), call.score.float().contiguous()
    if not ring.is_contiguous():
        raise ContractError("the pair ring must be contiguous [slots, R, 2 * D]")
    req, pos = call.req_rows.long().contiguous(), call.positions.long().contiguous()
    ok = call.valid.contiguous()
    per = ROWS_PER_PROGRAM.get(kv.device.type, 4)
    grid = (triton.cdiv(t, per), triton.cdiv(d, PAIR_BLOCK_D))
    common = dict(D=d, R=ring.shape[1], BLOCK_D=PAIR_BLOCK_D, ROWS=per)
    # Both kernels read the rows and the ring; the pooling also writes ``out``.
    rows = (kv, score, ring, req, pos, ok)
    sizes = (t, kv.stride(0), score.stride(0), ring.stride(0))
    _pair_pool_kernel[grid](*rows, out, *sizes, **common)
    _pair_ring_write_kernel[grid](*rows, *sizes, **common)
    return out
