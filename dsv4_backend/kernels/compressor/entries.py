"""The compressor's replaced path, the CUDA default: ``_compress_entry_kernel`` (pool, norm,
RoPE and the zero rows, even / odd channel tiles, :func:`entries_triton`),
``_ring_write_kernel`` (:func:`write_triton`), then the cache store: 3 launches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.config import compress_overlap, compress_span
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.kernels.compressor.common import POOL_TILE, CompressCall, entry_cos_sin
from dsv4_backend.kernels.compressor.device import (
    online_softmax_step,
    ring_write_row,
    slot_tile,
    span_sources,
    zero_gaps,
)
from dsv4_backend.ops.rope import RopeTable

#: Columns per ring-write program.
WRITE_BLOCK = 256


# --------------------------------------------------------------------------------- kernels
@triton.jit
def _compress_entry_kernel(
    kv_ptr,  # [T, C*D] float kv projection
    score_ptr,  # [T, C*D] float score projection (without ape)
    ape_ptr,  # [RATIO, C*D] float
    ring_ptr,  # [num_slots, ring_rows, 2*C*D] fp32 [kv | score + ape]
    pool_ptr,  # [B] int request pool index of each batch id (request-scoped rings)
    window_ptr,  # [T, >= SPAN] int window slot of positions p, p-1, ... (page-scoped rings)
    plan_ptr,  # [T, 4] int32 compress plan records
    norm_ptr,  # [D] float RMSNorm weight
    cos_ptr,  # [N, ROPE_PAIRS] fp32 RoPE cos: rows by position (a RopeTable) or by ragged row
    sin_ptr,  # [N, ROPE_PAIRS] fp32 RoPE sin, same rows
    out_ptr,  # [T, D] fp32 finished entries aligned to rows
    num_rows,
    D,
    ring_rows,
    eps,
    stride_kv,
    stride_score,
    stride_ape,
    stride_ring_slot,
    stride_ring_row,
    stride_window,
    stride_plan,
    stride_out,
    stride_rope,
    RATIO: tl.constexpr,
    SPAN: tl.constexpr,
    OVERLAP: tl.constexpr,
    WINDOW_PAGE: tl.constexpr,  # > 0: ring slot = window slot // WINDOW_PAGE; 0: pool index
    ROPE_PAIRS: tl.constexpr,
    ROPE_BY_ROW: tl.constexpr,  # cos / sin rows are ragged rows, not positions
    BLOCK_P: tl.constexpr,  # channel pairs per program (>= D / 2)
    BLOCK_S: tl.constexpr,  # span slots per pooling step
):
    """One compress-plan record: pool its entry, RMSNorm, RoPE, store at its row.

    Channels are handled as pairs ``(2i, 2i + 1)`` (even and odd tiles), the layout the
    interleaved RoPE rotates. Rows that complete no entry are zeroed by the record before
    them (the gap up to its own row, and after the last record, up to ``T``), so every output
    row is written exactly once without a separate fill.
    """
    rec = tl.program_id(0)
    ragged = zero_gaps(plan_ptr, out_ptr, rec, num_rows, D, stride_plan, stride_out, 2 * BLOCK_P, 1)
    pair = tl.arange(0, BLOCK_P)
    pair_ok = pair < D // 2
    zeros = tl.zeros([BLOCK_P], tl.float32)
    if ragged >= 0:
        row = ragged.to(tl.int64)
        batch = tl.load(plan_ptr + rec * stride_plan + 1)
        pos = tl.load(plan_ptr + rec * stride_plan + 2).to(tl.int64)
        window_len = tl.load(plan_ptr + rec * stride_plan + 3).to(tl.int64)
        request_ring = ring_ptr
        if WINDOW_PAGE == 0:
            request_ring += tl.load(pool_ptr + batch).to(tl.int64) * stride_ring_slot
        m_e = tl.full([BLOCK_P], float("-inf"), tl.float32)
        m_o, l_e, l_o, acc_e, acc_o = m_e, zeros, zeros, zeros, zeros
        for j0 in range(0, SPAN, BLOCK_S):
            j = j0 + tl.arange(0, BLOCK_S)
            from_rows, from_ring, rows, ring_base, ape_row = span_sources(
                j,
                pos,
                window_len,
                row,
                request_ring,
                window_ptr,
                ring_rows,
                stride_ring_slot,
                stride_ring_row,
                stride_window,
                SPAN,
                RATIO,
                WINDOW_PAGE,
            )
            # Ratio 4: slots RATIO.. (the current block) read the projection's second half.
            col = (j >= RATIO).to(tl.int64)[:, None] * D + 2 * pair[None, :]
            m_rows = from_rows[:, None] & pair_ok[None, :]
            m_ring = from_ring[:, None] & pair_ok[None, :]
            args = (stride_kv, stride_score, stride_ape, OVERLAP * D)
            kv, score = slot_tile(
                kv_ptr, score_ptr, ape_ptr, ring_base, rows, ape_row, col, m_rows, m_ring, *args
            )
            score = tl.where(pair_ok[None, :], score, 0.0)  # padded channels: finite, unused
            m_e, l_e, acc_e = online_softmax_step(m_e, l_e, acc_e, kv, score)
            kv, score = slot_tile(
                kv_ptr,
                score_ptr,
                ape_ptr,
                ring_base,
                rows,
                ape_row,
                col + 1,
                m_rows,
                m_ring,
                *args,
            )
            score = tl.where(pair_ok[None, :], score, 0.0)
            m_o, l_o, acc_o = online_softmax_step(m_o, l_o, acc_o, kv, score)
        even, odd = acc_e / l_e, acc_o / l_o
        # RMSNorm over the D channels (padded pairs pooled to 0).
        inv = tl.math.rsqrt((tl.sum(even * even, axis=0) + tl.sum(odd * odd, axis=0)) / D + eps)
        even *= inv * tl.load(norm_ptr + 2 * pair, mask=pair_ok, other=0.0).to(tl.float32)
        odd *= inv * tl.load(norm_ptr + 2 * pair + 1, mask=pair_ok, other=0.0).to(tl.float32)
        # RoPE of the trailing ROPE_PAIRS pairs at the entry's first position.
        rope_pair = pair - (D // 2 - ROPE_PAIRS)
        is_rope = (rope_pair >= 0) & pair_ok
        rope_row = row if ROPE_BY_ROW else pos + 1 - RATIO
        cos = tl.load(cos_ptr + rope_row * stride_rope + rope_pair, mask=is_rope, other=1.0)
        sin = tl.load(sin_ptr + rope_row * stride_rope + rope_pair, mask=is_rope, other=0.0)
        rot_e = tl.where(is_rope, even * cos - odd * sin, even)
        rot_o = tl.where(is_rope, even * sin + odd * cos, odd)
        tl.store(out_ptr + row * stride_out + 2 * pair, rot_e, mask=pair_ok)
        tl.store(out_ptr + row * stride_out + 2 * pair + 1, rot_o, mask=pair_ok)


@triton.jit
def _ring_write_kernel(
    kv_ptr,  # [T, C*D] float kv projection
    score_ptr,  # [T, C*D] float score projection (without ape)
    ape_ptr,  # [RATIO, C*D] float
    ring_ptr,  # [num_slots, ring_rows, 2*C*D] fp32
    pool_ptr,  # [B] int request pool index of each batch id (request-scoped rings)
    window_ptr,  # [T, >= 1] int window slot of each row's position (page-scoped rings)
    plan_ptr,  # [T, 4] int32 write plan records
    CD,
    ring_rows,
    stride_kv,
    stride_score,
    stride_ape,
    stride_ring_slot,
    stride_ring_row,
    stride_window,
    stride_plan,
    RATIO: tl.constexpr,
    WINDOW_PAGE: tl.constexpr,  # > 0: ring slot = window slot // WINDOW_PAGE; 0: pool index
    BLOCK: tl.constexpr,
):
    """One (record, column block): ``ring[slot, p % R] = [kv | score + ape[p % RATIO]]``."""
    ring_write_row(
        kv_ptr,
        score_ptr,
        ape_ptr,
        ring_ptr,
        pool_ptr,
        window_ptr,
        plan_ptr,
        tl.program_id(0),
        tl.program_id(1) * BLOCK,
        CD,
        ring_rows,
        stride_kv,
        stride_score,
        stride_ape,
        stride_ring_slot,
        stride_ring_row,
        stride_window,
        stride_plan,
        RATIO,
        WINDOW_PAGE,
        BLOCK,
        BLOCK,
    )


# ------------------------------------------------------------------------------- launchers
def entries_triton(call: CompressCall) -> torch.Tensor:
    """Launch ``_compress_entry_kernel``: ``[T, D]`` fp32 finished entries aligned to rows.

    A ``RopeTable`` is read in place (row = entry position); any other ``CosSin`` is first
    evaluated at the entry position of each row (``positions`` ``[T]``; torch ops, tests only).
    """
    compress_plan, norm_weight = call.compress_plan.contiguous(), call.norm_weight.contiguous()
    state, rope = call.state, call.rope
    d, ratio, ring = state.head_dim, state.ratio, state.ring
    rows = call.kv_proj.shape[0]
    out = torch.empty(rows, d, dtype=torch.float32, device=call.kv_proj.device)
    if rows == 0:
        return out
    cos, sin = entry_cos_sin(rope, call.positions, ratio)
    span = compress_span(ratio)
    block_p = triton.next_power_of_2(max(d // 2, 1))
    block_s = min(span, max(POOL_TILE // (2 * block_p), 1))
    _compress_entry_kernel[(rows,)](
        *call.sources,
        compress_plan,
        norm_weight,
        cos,
        sin,
        out,
        rows,
        d,
        ring.shape[1],
        call.norm_eps,
        *call.source_strides,
        compress_plan.stride(0),
        out.stride(0),
        cos.stride(0),
        RATIO=ratio,
        SPAN=span,
        OVERLAP=compress_overlap(ratio),
        WINDOW_PAGE=state.window_page,
        ROPE_PAIRS=cos.shape[-1],
        ROPE_BY_ROW=not isinstance(rope, RopeTable),
        BLOCK_P=block_p,
        BLOCK_S=block_s,
    )
    return out


def write_triton(call: CompressCall) -> None:
    """Launch ``_ring_write_kernel`` for every write-plan record."""
    state, write_plan = call.state, call.write_plan.contiguous()
    cd = call.kv_proj.shape[1]
    grid = (write_plan.shape[0], triton.cdiv(cd, WRITE_BLOCK))
    _ring_write_kernel[grid](
        *call.sources,
        write_plan,
        cd,
        state.ring.shape[1],
        *call.source_strides,
        write_plan.stride(0),
        RATIO=state.ratio,
        WINDOW_PAGE=state.window_page,
        BLOCK=WRITE_BLOCK,
    )


def compress_entries(call: CompressCall) -> torch.Tensor:
    """``table.compress_forward`` (inputs checked, channels of unit stride) in three launches:
    the entries, the ring writes, the cache store (``max_rows_per_request`` is not used)."""
    entries = entries_triton(call)
    write_triton(call)
    if call.store is not None:
        store_rows(call.store[0], entries, call.store[1])
    return entries
