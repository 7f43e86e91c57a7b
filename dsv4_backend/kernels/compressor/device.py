"""``@triton.jit`` helpers both Triton compressor kernels inline (``entries.py``'s
``_compress_entry_kernel`` and ``_ring_write_kernel``, ``fused.py``'s
``_compress_fused_kernel``): where a span's slots come from, their ``(kv, score)`` tiles, the
online softmax step, the rows that complete no entry, and one write record's ring row."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def slot_tile(
    kv_ptr,
    score_ptr,
    ape_ptr,
    ring_base,  # [BLOCK_S] pointers to each slot's ring row (masked where not from the ring)
    rows,  # [BLOCK_S] int64 ragged row of each slot (masked where not from this forward)
    ape_row,  # [BLOCK_S] int64
    col,  # [BLOCK_S, BLOCK_P] projection column of each (slot, channel)
    m_rows,  # [BLOCK_S, BLOCK_P] bool: from this forward's rows
    m_ring,  # [BLOCK_S, BLOCK_P] bool: from the ring
    stride_kv,
    stride_score,
    stride_ape,
    CD,  # offset of the score half in a ring row
):
    """``(kv, score)`` ``[BLOCK_S, BLOCK_P]`` fp32 of a span chunk; missing slots kv 0, -inf."""
    kv = tl.load(kv_ptr + rows[:, None] * stride_kv + col, mask=m_rows, other=0.0)
    kv = kv.to(tl.float32) + tl.load(ring_base[:, None] + col, mask=m_ring, other=0.0)
    score = tl.load(score_ptr + rows[:, None] * stride_score + col, mask=m_rows, other=0.0)
    score = score.to(tl.float32) + tl.load(
        ape_ptr + ape_row[:, None] * stride_ape + col, mask=m_rows, other=0.0
    ).to(tl.float32)
    score_ring = tl.load(ring_base[:, None] + CD + col, mask=m_ring, other=0.0)
    score = tl.where(m_rows, score, tl.where(m_ring, score_ring, float("-inf")))
    return kv, score


@triton.jit
def online_softmax_step(m, l, acc, kv, score):
    """Fold a ``[BLOCK_S, BLOCK_P]`` chunk into the per-channel running max / sum / kv sum."""
    m_new = tl.maximum(m, tl.max(score, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all slots so far missing
    alpha = tl.exp(m - m_safe)
    p = tl.exp(score - m_safe[None, :])
    return m_new, l * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p * kv, axis=0)


@triton.jit
def _zero_rows(out_ptr, start, stop, D, stride_out, BLOCK_D: tl.constexpr, ZERO_ROWS: tl.constexpr):
    """Zero output rows ``start ... stop - 1``, ``[ZERO_ROWS, BLOCK_D]`` a step."""
    r = tl.arange(0, ZERO_ROWS).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    zeros = tl.zeros([ZERO_ROWS, BLOCK_D], tl.float32)
    for r0 in range(start, stop, ZERO_ROWS):
        rows = r0 + r
        mask = (rows < stop)[:, None] & (d < D)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + d[None, :], zeros, mask=mask)


@triton.jit
def zero_gaps(
    plan_ptr,
    out_ptr,
    rec,
    num_rows,
    D,
    stride_plan,
    stride_out,
    BLOCK_D: tl.constexpr,
    ZERO_ROWS: tl.constexpr,
):
    """Zero the output rows that complete no entry around compress record ``rec``: the gap
    before it and (last record, or record 0 of an empty plan) the rows up to ``T``. Returns
    the record's ragged row (``< 0``: padding)."""
    ragged = tl.load(plan_ptr + rec * stride_plan)
    valid = ragged >= 0
    if valid | (rec == 0):  # padding records past the first have nothing to zero
        prev = tl.load(plan_ptr + (rec - 1) * stride_plan, mask=rec > 0, other=-1)
        nxt = tl.load(plan_ptr + (rec + 1) * stride_plan, mask=rec + 1 < num_rows, other=-1)
        gap_from = tl.where(valid, prev + 1, 0).to(tl.int64)
        _zero_rows(
            out_ptr,
            gap_from,
            tl.where(valid, ragged, 0).to(tl.int64),
            D,
            stride_out,
            BLOCK_D,
            ZERO_ROWS,
        )
        tail_to = tl.where(~valid | (nxt < 0), num_rows, 0).to(tl.int64)  # ~valid: record 0
        _zero_rows(
            out_ptr,
            tl.where(valid, ragged + 1, 0).to(tl.int64),
            tail_to,
            D,
            stride_out,
            BLOCK_D,
            ZERO_ROWS,
        )
    return ragged


@triton.jit
def span_sources(
    j,  # [BLOCK_S] span slots
    pos,  # int64 the entry's last position
    window_len,  # int64 the span's rows from this forward
    row,  # int64 the entry's ragged row
    request_ring,  # the request's ring (request-scoped) or the ring storage (page-scoped)
    window_ptr,
    ring_rows,
    stride_ring_slot,
    stride_ring_row,
    stride_window,
    SPAN: tl.constexpr,
    RATIO: tl.constexpr,
    WINDOW_PAGE: tl.constexpr,
):
    """Where span slots ``j`` come from: ``(from_rows, from_ring, rows, ring_base, ape_row)``,
    the slot's ragged row (this forward) or ring row pointer, and its ``ape`` row.
    ``ring_rows >= SPAN``."""
    q = pos - SPAN + 1 + j  # [BLOCK_S] token position of each slot
    from_rows = q > pos - window_len
    from_ring = (q >= 0) & ~from_rows
    rows = tl.where(from_rows, row - (pos - q), 0)
    # Ring row q % R from the entry's last row: a lag below SPAN <= R wraps at most once
    # (one int32 modulo, not one a slot).
    ring_row = (pos.to(tl.int32) % ring_rows).to(tl.int64) - (pos - q)
    ring_row = tl.where(ring_row < 0, ring_row + ring_rows, ring_row)
    ring_base = request_ring + tl.where(from_ring, ring_row, 0) * stride_ring_row
    if WINDOW_PAGE > 0:
        # Each slot's ring is the window page of its own position (lag pos - q).
        window = tl.load(window_ptr + row * stride_window + (pos - q), mask=from_ring)
        ring_base += (tl.where(from_ring, window, 0).to(tl.int64) // WINDOW_PAGE) * (
            stride_ring_slot
        )
    return from_rows, from_ring, rows, ring_base, tl.where(from_rows, q, 0) % RATIO


@triton.jit
def ring_write_row(
    kv_ptr,
    score_ptr,
    ape_ptr,
    ring_ptr,
    pool_ptr,
    window_ptr,
    plan_ptr,
    rec,  # write-plan record
    col0,  # the first column of the ring row's kv half written
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
    WINDOW_PAGE: tl.constexpr,
    COLUMNS: tl.constexpr,  # columns written from col0 (a multiple of BLOCK_W)
    BLOCK_W: tl.constexpr,
):
    """``ring[slot, p % R, cols] = [kv | score + ape[p % RATIO]]`` of one write record,
    ``cols`` ``col0 ... col0 + COLUMNS - 1`` (those ``< CD``), ``BLOCK_W`` a step."""
    ragged = tl.load(plan_ptr + rec * stride_plan).to(tl.int64)
    if ragged >= 0:  # not a padding record
        batch = tl.load(plan_ptr + rec * stride_plan + 1)
        pos = tl.load(plan_ptr + rec * stride_plan + 2)  # int32: an inline modulo (package doc)
        if WINDOW_PAGE > 0:
            slot = tl.load(window_ptr + ragged * stride_window).to(tl.int64) // WINDOW_PAGE
        else:
            slot = tl.load(pool_ptr + batch).to(tl.int64)
        row = ring_ptr + slot * stride_ring_slot + (pos % ring_rows).to(tl.int64) * stride_ring_row
        ape_row = ape_ptr + (pos % RATIO).to(tl.int64) * stride_ape
        for c0 in range(0, COLUMNS, BLOCK_W):
            cols = col0 + c0 + tl.arange(0, BLOCK_W)
            ok = cols < CD
            kv = tl.load(kv_ptr + ragged * stride_kv + cols, mask=ok, other=0.0)
            score = tl.load(score_ptr + ragged * stride_score + cols, mask=ok, other=0.0)
            ape = tl.load(ape_row + cols, mask=ok, other=0.0)
            tl.store(row + cols, kv.to(tl.float32), mask=ok)
            tl.store(row + CD + cols, score.to(tl.float32) + ape.to(tl.float32), mask=ok)
