"""The compressor's ``fused`` variant, one launch (the interpreter's default; on CUDA named or
with ``DSV4_UNVERIFIED_KERNELS=1`` until it passes ``scripts/gpu_check.sh``).

``_compress_fused_kernel``, one program per record (ratio 128 on a GPU: the entry as items of
32 channels, ``channel_splits``, taken by entry workers past the records' programs; the last
item to arrive normalises for all), pools over contiguous ``[BLOCK_S, channels]`` tiles in a
pipelined loop, normalises, ropes, stores the entry in the cache (``store=``) and writes the
ring row of the write record of the same index, in every mode. Where a write can replace a
ring row an entry of the forward reads (extend, verify without the speculative rings:
``ring_write_is_safe``), the program of the request's first entry pools its ring-reading
entries and then does those writes (``DEFER_WRITES``). Launcher: :func:`compress_fused`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from dsv4_backend.config import compress_overlap, compress_span
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels.compressor.common import (
    POOL_TILE,
    CompressCall,
    check_store,
    entry_cos_sin,
    ring_write_is_safe,
)
from dsv4_backend.kernels.compressor.device import (
    online_softmax_step,
    ring_write_row,
    slot_tile,
    span_sources,
    zero_gaps,
)
from dsv4_backend.kernels.device.cache_rows import row_store_constexprs, store_row
from dsv4_backend.ops.rope import RopeTable

#: On a GPU the one-launch kernel pools an entry of at least ``SPLIT_SPAN`` tokens (ratio
#: 128) in programs of ``SPLIT_CHANNELS`` channels each, so its span's loads spread over SMs.
SPLIT_SPAN = 128
SPLIT_CHANNELS = 32
#: The most entry workers (programs pooling split entries) a launch takes: about two an SM
#: (132 on an H200, 148 on a B200), so a forward with few entries wakes few programs.
MAX_ENTRY_WORKERS = 256

#: Channel splits pinned by :func:`force_channel_splits`.
_forced_channel_splits: list[int] = []


# --------------------------------------------------------------------------------- kernels
@triton.jit
def _pool_channels(
    kv_ptr,
    score_ptr,
    ape_ptr,
    ring_ptr,
    pool_ptr,
    window_ptr,
    row,  # int64 the record's ragged row
    batch,  # its batch id
    pos,  # int64 its position (the entry's last)
    window_len,  # int64 the span's rows from this forward
    c0,  # the first channel pooled
    D,
    ring_rows,
    stride_kv,
    stride_score,
    stride_ape,
    stride_ring_slot,
    stride_ring_row,
    stride_window,
    RATIO: tl.constexpr,
    SPAN: tl.constexpr,
    OVERLAP: tl.constexpr,
    WINDOW_PAGE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Channels ``c0 ... c0 + BLOCK_C - 1`` of one compress record's pooled entry
    (``[BLOCK_C]`` fp32, 0 past ``D``), over contiguous ``[BLOCK_S, BLOCK_C]`` tiles of the
    span (a pipelined loop)."""
    d = c0 + tl.arange(0, BLOCK_C)
    d_ok = d < D
    zeros = tl.zeros([BLOCK_C], tl.float32)
    request_ring = ring_ptr
    if WINDOW_PAGE == 0:
        request_ring += tl.load(pool_ptr + batch).to(tl.int64) * stride_ring_slot
    m_run = tl.full([BLOCK_C], float("-inf"), tl.float32)
    l_run, acc = zeros, zeros
    for j0 in tl.range(0, SPAN, BLOCK_S, num_stages=2):
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
        if OVERLAP == 2:  # ratio 4: slots RATIO.. (the current block) read the second half
            col = (j >= RATIO).to(tl.int64)[:, None] * D + d[None, :]
        else:
            col = d.to(tl.int64)[None, :]
        m_rows = from_rows[:, None] & d_ok[None, :]
        m_ring = from_ring[:, None] & d_ok[None, :]
        kv, score = slot_tile(
            kv_ptr,
            score_ptr,
            ape_ptr,
            ring_base,
            rows,
            ape_row,
            col,
            m_rows,
            m_ring,
            stride_kv,
            stride_score,
            stride_ape,
            OVERLAP * D,
        )
        score = tl.where(d_ok[None, :], score, 0.0)  # padded channels: finite, unused
        m_run, l_run, acc = online_softmax_step(m_run, l_run, acc, kv, score)
    return acc / l_run


@triton.jit
def _finish_entry(
    entry,  # [BLOCK_D] fp32 the pooled entry (0 past D)
    norm_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    out_loc_ptr,
    cache_ptr,
    row,  # int64 the record's ragged row
    pos,  # int64 its position (the entry's last)
    D,
    eps,
    stride_out,
    stride_rope,
    stride_cache,
    RATIO: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    ROPE_BY_ROW: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE: tl.constexpr,
    BF16_BITS: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """RMSNorm and RoPE of a pooled entry, written to its row of ``out`` and stored in the
    cache at the row's ``out_loc``."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # RMSNorm over the D channels (padded channels pooled to 0).
    inv = tl.math.rsqrt(tl.sum(entry * entry, axis=0) / D + eps)
    entry *= inv * tl.load(norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    # RoPE of the trailing ROPE_PAIRS pairs (2i, 2i + 1) at the entry's first position.
    even, odd = tl.split(tl.reshape(entry, [BLOCK_D // 2, 2]))
    pair = tl.arange(0, BLOCK_D // 2)
    rope_pair = pair - (D // 2 - ROPE_PAIRS)
    is_rope = (rope_pair >= 0) & (pair < D // 2)
    rope_row = row if ROPE_BY_ROW else pos + 1 - RATIO
    cos = tl.load(cos_ptr + rope_row * stride_rope + rope_pair, mask=is_rope, other=1.0)
    sin = tl.load(sin_ptr + rope_row * stride_rope + rope_pair, mask=is_rope, other=0.0)
    rot_e = tl.where(is_rope, even * cos - odd * sin, even)
    rot_o = tl.where(is_rope, even * sin + odd * cos, odd)
    entry = tl.reshape(tl.join(rot_e, rot_o), [BLOCK_D])
    tl.store(out_ptr + row * stride_out + d, entry, mask=d_ok)
    if STORE != 0:
        tl.debug_barrier()  # the row is re-read by other threads in the cache's layout
        slot = tl.load(out_loc_ptr + row).to(tl.int64)
        store_row(
            cache_ptr,
            out_ptr + row * stride_out,
            slot,
            stride_cache,
            D,
            BLOCK_D,
            STORE,
            BF16_BITS,
            NOPE_DIM,
            ROPE_DIM,
            PAGE_TOKENS,
            BLOCK_R,
        )


@triton.jit
def _entry(
    kv_ptr,
    score_ptr,
    ape_ptr,
    ring_ptr,
    pool_ptr,
    window_ptr,
    norm_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    out_loc_ptr,
    cache_ptr,
    arrivals_ptr,
    rec,  # the compress record
    split,  # the program's channel split
    row,  # int64 the record's ragged row
    batch,  # its batch id
    pos,  # int64 its position (the entry's last)
    window_len,  # int64 the span's rows from this forward
    D,
    ring_rows,
    eps,
    stride_kv,
    stride_score,
    stride_ape,
    stride_ring_slot,
    stride_ring_row,
    stride_window,
    stride_out,
    stride_rope,
    stride_cache,
    RATIO: tl.constexpr,
    SPAN: tl.constexpr,
    OVERLAP: tl.constexpr,
    WINDOW_PAGE: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    ROPE_BY_ROW: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHANNEL_SPLITS: tl.constexpr,
    STORE: tl.constexpr,
    BF16_BITS: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One compress record's entry, pooled (``_pool_channels``) and finished
    (``_finish_entry``). Returns whether this program finished it.

    With ``CHANNEL_SPLITS`` > 1 each of the record's items (split ``split``, taken by an entry
    worker) pools ``BLOCK_D / CHANNEL_SPLITS`` channels into its row of ``out`` and counts its
    arrival on ``arrivals[rec]`` (acquire-release); the last to arrive reads the row back,
    finishes it and resets the counter, so the span's loads spread over the workers and
    RMSNorm still sees every channel."""
    sources = (
        kv_ptr,
        score_ptr,
        ape_ptr,
        ring_ptr,
        pool_ptr,
        window_ptr,
        row,
        batch,
        pos,
        window_len,
    )
    ring_strides = (
        D,
        ring_rows,
        stride_kv,
        stride_score,
        stride_ape,
        stride_ring_slot,
        stride_ring_row,
        stride_window,
    )
    finish = (
        norm_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        out_loc_ptr,
        cache_ptr,
        row,
        pos,
        D,
        eps,
        stride_out,
        stride_rope,
        stride_cache,
    )
    if CHANNEL_SPLITS == 1:
        entry = _pool_channels(
            *sources, 0, *ring_strides, RATIO, SPAN, OVERLAP, WINDOW_PAGE, BLOCK_D, BLOCK_S
        )
        _finish_entry(
            entry,
            *finish,
            RATIO,
            ROPE_PAIRS,
            ROPE_BY_ROW,
            BLOCK_D,
            STORE,
            BF16_BITS,
            NOPE_DIM,
            ROPE_DIM,
            PAGE_TOKENS,
            BLOCK_R,
        )
        done = row >= 0  # always: a tensor, as the split branch's
    else:
        c0 = split * (BLOCK_D // CHANNEL_SPLITS)
        part = _pool_channels(
            *sources,
            c0,
            *ring_strides,
            RATIO,
            SPAN,
            OVERLAP,
            WINDOW_PAGE,
            BLOCK_D // CHANNEL_SPLITS,
            BLOCK_S,
        )
        c = c0 + tl.arange(0, BLOCK_D // CHANNEL_SPLITS)
        tl.store(out_ptr + row * stride_out + c, part, mask=c < D)
        tl.debug_barrier()  # every thread's channels are stored before the arrival counts
        done = tl.atomic_add(arrivals_ptr + rec, 1, sem="acq_rel") == CHANNEL_SPLITS - 1
        if done:  # the last split: every channel is in out (read past L1, written elsewhere)
            tl.store(arrivals_ptr + rec, 0)
            d = tl.arange(0, BLOCK_D)
            entry = tl.load(
                out_ptr + row * stride_out + d, mask=d < D, other=0.0, cache_modifier=".cg"
            )
            _finish_entry(
                entry,
                *finish,
                RATIO,
                ROPE_PAIRS,
                ROPE_BY_ROW,
                BLOCK_D,
                STORE,
                BF16_BITS,
                NOPE_DIM,
                ROPE_DIM,
                PAGE_TOKENS,
                BLOCK_R,
            )
    return done


@triton.jit
def _lower_bound(
    plan_ptr, num_rows, search_steps, stride_plan, limit_row, batch, OTHER_BATCH: tl.constexpr
):
    """First plan record that is not a valid record of a row before ``limit_row`` (with
    ``OTHER_BATCH``: of a batch id other than ``batch``); binary search of ``search_steps``
    (``>= log2(num_rows + 1)``) steps over records that are in row order."""
    lo = tl.zeros([], tl.int64)
    hi = lo + num_rows
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        live = mid < hi
        ragged = tl.load(plan_ptr + mid * stride_plan, mask=live, other=-1)
        before = live & (ragged >= 0) & (ragged < limit_row)
        if OTHER_BATCH:
            before = before & (tl.load(plan_ptr + mid * stride_plan + 1, mask=live) != batch)
        lo = tl.where(before, mid + 1, lo)
        hi = tl.where(live & ~before, mid, hi)
    return lo


@triton.jit
def _first_entry(
    plan_ptr,  # [T, 4] compress plan
    w_row,  # int64 a write record's row, position, batch id and window length
    w_pos,
    w_batch,
    w_len,
    num_rows,
    search_steps,
    stride_plan,
    RATIO: tl.constexpr,
    SPAN: tl.constexpr,
):
    """``(first, e_row, e_pos)`` of the write record's request: its first position in this
    forward and the row / position of its first entry here (the only one, with the next for
    ratio 4, that reads the ring); ``e_pos >= w_pos`` where that entry does not come first."""
    if w_len < SPAN:  # the request's first row is within the span
        first = w_pos - w_len + 1
        e_pos = first + RATIO - 1 - first % RATIO
        e_row = w_row - (w_pos - e_pos)
    else:  # the request's first compress record, among the records before the row
        i = _lower_bound(plan_ptr, num_rows, search_steps, stride_plan, w_row, w_batch, True)
        hit = i < num_rows
        e_row = tl.load(plan_ptr + i * stride_plan, mask=hit, other=-1).to(tl.int64)
        e_batch = tl.load(plan_ptr + i * stride_plan + 1, mask=hit, other=-1)
        found = (e_row >= 0) & (e_row < w_row) & (e_batch == w_batch)
        e_pos = tl.load(plan_ptr + i * stride_plan + 2, mask=found, other=0).to(tl.int64)
        e_len = tl.load(plan_ptr + i * stride_plan + 3, mask=found, other=0).to(tl.int64)
        first = e_pos - e_len + 1
        e_pos = tl.where(found, e_pos, w_pos)
    return first, e_row, e_pos


@triton.jit
def _write_waits(
    window_ptr,
    w_row,  # int64 the write's row and position
    w_pos,
    first,  # int64 the request's first position in this forward
    e_row,  # int64 the row and position of its first entry in this forward
    e_pos,
    ring_rows,
    stride_window,
    SPAN: tl.constexpr,
    WINDOW_PAGE: tl.constexpr,
):
    """Whether the write of ``w_pos`` replaces a ring row the request's first entries still
    read: the ring row holds ``q``, the last position before ``first`` of the same residue,
    which they read if ``q`` is in the first entry's span and (page-scoped rings) in the
    write's window page."""
    q = w_pos - ring_rows * (((w_pos - first).to(tl.int32) // ring_rows).to(tl.int64) + 1)
    lag = e_pos - q
    waits = (e_pos < w_pos) & (q >= 0) & (lag < SPAN)
    if WINDOW_PAGE > 0:
        q_slot = tl.load(window_ptr + e_row * stride_window + lag, mask=waits, other=0)
        w_slot = tl.load(window_ptr + w_row * stride_window)
        waits = waits & (q_slot // WINDOW_PAGE == w_slot // WINDOW_PAGE)
    return waits


@triton.jit
def _record_entries(
    kv_ptr,
    score_ptr,
    ape_ptr,
    ring_ptr,
    pool_ptr,
    window_ptr,
    plan_ptr,
    write_plan_ptr,
    norm_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    out_loc_ptr,
    cache_ptr,
    arrivals_ptr,
    rec,  # a valid compress record
    split,  # the channel split this program pools
    num_rows,
    D,
    CD,
    ring_rows,
    eps,
    search_steps,
    stride_kv,
    stride_score,
    stride_ape,
    stride_ring_slot,
    stride_ring_row,
    stride_window,
    stride_plan,
    stride_out,
    stride_rope,
    stride_cache,
    RATIO: tl.constexpr,
    SPAN: tl.constexpr,
    OVERLAP: tl.constexpr,
    WINDOW_PAGE: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    ROPE_BY_ROW: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHANNEL_SPLITS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    DEFER_WRITES: tl.constexpr,
    STORE: tl.constexpr,
    BF16_BITS: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Compress record ``rec``'s entry (``_entry``, channel split ``split``) and, where the
    record is its request's owner (``DEFER_WRITES``, kernel docstring), the ratio-4 entry it
    pools for the next record and, once every read of the request's ring is done, the writes
    that wait for them."""
    record = (
        kv_ptr,
        score_ptr,
        ape_ptr,
        ring_ptr,
        pool_ptr,
        window_ptr,
        norm_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        out_loc_ptr,
        cache_ptr,
        arrivals_ptr,
    )
    strides = (
        D,
        ring_rows,
        eps,
        stride_kv,
        stride_score,
        stride_ape,
        stride_ring_slot,
        stride_ring_row,
        stride_window,
        stride_out,
        stride_rope,
        stride_cache,
    )
    row = tl.load(plan_ptr + rec * stride_plan).to(tl.int64)
    batch = tl.load(plan_ptr + rec * stride_plan + 1)
    pos = tl.load(plan_ptr + rec * stride_plan + 2).to(tl.int64)
    window_len = tl.load(plan_ptr + rec * stride_plan + 3).to(tl.int64)
    delegated = window_len < 0
    if DEFER_WRITES and RATIO < SPAN:
        # Ratio 4's second entry reading the ring: pooled by the owner (record rec - 1).
        delegated = (window_len > RATIO) & (window_len < SPAN)
    done = ~delegated  # this program finished the record's entry
    if not delegated:
        done = _entry(
            *record,
            rec,
            split,
            row,
            batch,
            pos,
            window_len,
            *strides,
            RATIO,
            SPAN,
            OVERLAP,
            WINDOW_PAGE,
            ROPE_PAIRS,
            ROPE_BY_ROW,
            BLOCK_D,
            BLOCK_S,
            CHANNEL_SPLITS,
            STORE,
            BF16_BITS,
            NOPE_DIM,
            ROPE_DIM,
            PAGE_TOKENS,
            BLOCK_R,
        )
    if DEFER_WRITES:
        first = pos - window_len + 1
        if (window_len <= RATIO) & (window_len < SPAN) & done:  # the request's owner
            if RATIO < SPAN:
                nxt = rec + 1
                live = nxt < num_rows
                n_row = tl.load(plan_ptr + nxt * stride_plan, mask=live, other=-1)
                n_batch = tl.load(plan_ptr + nxt * stride_plan + 1, mask=live, other=-1)
                n_pos = tl.load(plan_ptr + nxt * stride_plan + 2, mask=live, other=0)
                n_len = tl.load(plan_ptr + nxt * stride_plan + 3, mask=live, other=SPAN)
                if (n_row >= 0) & (n_batch == batch) & (n_len > RATIO) & (n_len < SPAN):
                    _entry(
                        *record,
                        nxt,
                        split,
                        n_row.to(tl.int64),
                        n_batch,
                        n_pos.to(tl.int64),
                        n_len.to(tl.int64),
                        *strides,
                        RATIO,
                        SPAN,
                        OVERLAP,
                        WINDOW_PAGE,
                        ROPE_PAIRS,
                        ROPE_BY_ROW,
                        BLOCK_D,
                        BLOCK_S,
                        CHANNEL_SPLITS,
                        STORE,
                        BF16_BITS,
                        NOPE_DIM,
                        ROPE_DIM,
                        PAGE_TOKENS,
                        BLOCK_R,
                    )
            tl.debug_barrier()  # every ring read of the request is done
            writes = (kv_ptr, score_ptr, ape_ptr, ring_ptr, pool_ptr, window_ptr, write_plan_ptr)
            write_strides = (
                CD,
                ring_rows,
                stride_kv,
                stride_score,
                stride_ape,
                stride_ring_slot,
                stride_ring_row,
                stride_window,
                stride_plan,
            )
            j = _lower_bound(
                write_plan_ptr, num_rows, search_steps, stride_plan, row + 1, batch, False
            )
            go = j < num_rows
            while go:
                w_row = tl.load(write_plan_ptr + j * stride_plan).to(tl.int64)
                w_batch = tl.load(write_plan_ptr + j * stride_plan + 1)
                w_pos = tl.load(write_plan_ptr + j * stride_plan + 2).to(tl.int64)
                go = (w_row >= 0) & (w_batch == batch)
                if WINDOW_PAGE > 0:  # a c4 write waits only in the same window page
                    go = go & (w_pos < first + WINDOW_PAGE)
                if go:
                    deferred = _write_waits(
                        window_ptr,
                        w_row,
                        w_pos,
                        first,
                        row,
                        pos,
                        ring_rows,
                        stride_window,
                        SPAN,
                        WINDOW_PAGE,
                    )
                    if deferred:
                        ring_write_row(
                            *writes,
                            j,
                            0,
                            *write_strides,
                            RATIO,
                            WINDOW_PAGE,
                            BLOCK_D * OVERLAP,
                            BLOCK_W,
                        )
                j += 1
                go = go & (j < num_rows)


@triton.jit
def _record_ring_write(
    kv_ptr,
    score_ptr,
    ape_ptr,
    ring_ptr,
    pool_ptr,
    window_ptr,
    plan_ptr,
    write_plan_ptr,
    rec,  # a write-plan record (padding: nothing)
    num_rows,
    CD,
    ring_rows,
    search_steps,
    stride_kv,
    stride_score,
    stride_ape,
    stride_ring_slot,
    stride_ring_row,
    stride_window,
    stride_plan,
    RATIO: tl.constexpr,
    SPAN: tl.constexpr,
    WINDOW_PAGE: tl.constexpr,
    COLUMNS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    DEFER_WRITES: tl.constexpr,
):
    """Write-plan record ``rec``'s ring row, unless (``DEFER_WRITES``) it replaces a row its
    request's first entries read: then their owner writes it (``_record_entries``)."""
    waits = rec < 0
    if DEFER_WRITES:
        w_row = tl.load(write_plan_ptr + rec * stride_plan).to(tl.int64)
        if w_row >= 0:
            w_batch = tl.load(write_plan_ptr + rec * stride_plan + 1)
            w_pos = tl.load(write_plan_ptr + rec * stride_plan + 2).to(tl.int64)
            w_len = tl.load(write_plan_ptr + rec * stride_plan + 3).to(tl.int64)
            first, e_row, e_pos = _first_entry(
                plan_ptr,
                w_row,
                w_pos,
                w_batch,
                w_len,
                num_rows,
                search_steps,
                stride_plan,
                RATIO,
                SPAN,
            )
            waits = _write_waits(
                window_ptr,
                w_row,
                w_pos,
                first,
                e_row,
                e_pos,
                ring_rows,
                stride_window,
                SPAN,
                WINDOW_PAGE,
            )
    if not waits:
        ring_write_row(
            kv_ptr,
            score_ptr,
            ape_ptr,
            ring_ptr,
            pool_ptr,
            window_ptr,
            write_plan_ptr,
            rec,
            0,
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
            COLUMNS,
            BLOCK_W,
        )


@triton.jit
def _compress_fused_kernel(
    kv_ptr,  # [T, C*D] float kv projection
    score_ptr,  # [T, C*D] float score projection (without ape)
    ape_ptr,  # [RATIO, C*D] float
    ring_ptr,  # [num_slots, ring_rows, 2*C*D] fp32 [kv | score + ape]
    pool_ptr,  # [B] int request pool index of each batch id (request-scoped rings)
    window_ptr,  # [T, >= SPAN] int window slot of positions p, p-1, ... (page-scoped rings)
    plan_ptr,  # [T, 4] int32 compress plan records
    write_plan_ptr,  # [T, 4] int32 write plan records
    norm_ptr,  # [D] float RMSNorm weight
    cos_ptr,  # [N, ROPE_PAIRS] fp32 RoPE cos: rows by position (a RopeTable) or by ragged row
    sin_ptr,  # [N, ROPE_PAIRS] fp32 RoPE sin, same rows
    out_ptr,  # [T, D] fp32 finished entries aligned to rows
    out_loc_ptr,  # [T] int cache slot of each row's entry, -1: none (read unless STORE_NONE)
    cache_ptr,  # the cache the entries are stored in (STORE)
    arrivals_ptr,  # [>= T] int32 zeros, left zero: arrivals at each record (CHANNEL_SPLITS > 1)
    num_rows,
    D,
    CD,
    ring_rows,
    eps,
    search_steps,  # >= log2(num_rows + 1): binary searches of the plans (DEFER_WRITES)
    stride_kv,
    stride_score,
    stride_ape,
    stride_ring_slot,
    stride_ring_row,
    stride_window,
    stride_plan,
    stride_out,
    stride_rope,
    stride_cache,  # dense caches: elements between slots
    RATIO: tl.constexpr,
    SPAN: tl.constexpr,
    OVERLAP: tl.constexpr,
    WINDOW_PAGE: tl.constexpr,  # > 0: ring slot = window slot // WINDOW_PAGE; 0: pool index
    ROPE_PAIRS: tl.constexpr,
    ROPE_BY_ROW: tl.constexpr,  # cos / sin rows are ragged rows, not positions
    BLOCK_D: tl.constexpr,  # channels of an entry (>= D)
    BLOCK_S: tl.constexpr,  # span slots per pooling step
    CHANNEL_SPLITS: tl.constexpr,  # programs pooling one entry (BLOCK_D / CHANNEL_SPLITS each)
    BLOCK_W: tl.constexpr,  # ring-row columns per write step (>= C*D / steps)
    ZERO_ROWS: tl.constexpr,  # output rows zeroed per step (rows that complete no entry)
    DEFER_WRITES: tl.constexpr,  # a write may replace a ring row an entry reads (extend)
    STORE: tl.constexpr,  # cache_rows.STORE_*: the format entries are stored in
    BF16_BITS: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program ``rec < T``: compress-plan record ``rec``'s entry, then the ring row of
    write-plan record ``rec``. With ``CHANNEL_SPLITS`` > 1 the entries go to the programs
    past ``T`` instead (*entry workers*): item ``k`` is split ``k % CHANNEL_SPLITS`` of
    record ``k // CHANNEL_SPLITS``, worker ``w`` takes items ``w, w + W, ...`` (``W``
    workers) up to the first of a padding record (valid records come first), and the last
    split of a record to arrive finishes it (``_entry``).

    Rows that complete no entry are zeroed by the program of the record before them (the gap up
    to its own row, and after the last record, up to ``T``), so no output row needs a fill.

    Only a request's first entry in the forward (ratio 4: and the next) reads the ring, and a
    write may replace a row it reads (``_write_waits``) where rows a request exceed
    ``R - span + 1`` (``ring_write_is_safe``). With ``DEFER_WRITES`` the program of that
    first entry (the request's *owner*) pools both ring-reading entries and then, after a
    barrier, does the writes that wait for it; every other write record's program does its
    own. A ring row is then read and replaced by one program, in that order. With channel
    splits, the owner's last split does them, once every split's reads are done.
    """
    pid = tl.program_id(0)
    pointers = (
        kv_ptr,
        score_ptr,
        ape_ptr,
        ring_ptr,
        pool_ptr,
        window_ptr,
        plan_ptr,
        write_plan_ptr,
        norm_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        out_loc_ptr,
        cache_ptr,
        arrivals_ptr,
    )
    sizes = (
        num_rows,
        D,
        CD,
        ring_rows,
        eps,
        search_steps,
        stride_kv,
        stride_score,
        stride_ape,
        stride_ring_slot,
        stride_ring_row,
        stride_window,
        stride_plan,
        stride_out,
        stride_rope,
        stride_cache,
    )
    writes = (kv_ptr, score_ptr, ape_ptr, ring_ptr, pool_ptr, window_ptr, plan_ptr, write_plan_ptr)
    write_sizes = (
        num_rows,
        CD,
        ring_rows,
        search_steps,
        stride_kv,
        stride_score,
        stride_ape,
        stride_ring_slot,
        stride_ring_row,
        stride_window,
        stride_plan,
    )
    if CHANNEL_SPLITS == 1:  # every program is a record's (under a pid bound check, the c4
        # kernels compile to twice the instructions)
        ragged = zero_gaps(
            plan_ptr, out_ptr, pid, num_rows, D, stride_plan, stride_out, BLOCK_D, ZERO_ROWS
        )
        # The ring write first: one that does not wait replaces no row an entry reads.
        _record_ring_write(
            *writes,
            pid,
            *write_sizes,
            RATIO,
            SPAN,
            WINDOW_PAGE,
            BLOCK_D * OVERLAP,
            BLOCK_W,
            DEFER_WRITES,
        )
        if ragged >= 0:
            _record_entries(
                *pointers,
                pid,
                0,
                *sizes,
                RATIO,
                SPAN,
                OVERLAP,
                WINDOW_PAGE,
                ROPE_PAIRS,
                ROPE_BY_ROW,
                BLOCK_D,
                BLOCK_S,
                CHANNEL_SPLITS,
                BLOCK_W,
                DEFER_WRITES,
                STORE,
                BF16_BITS,
                NOPE_DIM,
                ROPE_DIM,
                PAGE_TOKENS,
                BLOCK_R,
            )
    elif pid < num_rows:  # a record's program: the gap before it, the ring write
        zero_gaps(plan_ptr, out_ptr, pid, num_rows, D, stride_plan, stride_out, BLOCK_D, ZERO_ROWS)
        _record_ring_write(
            *writes,
            pid,
            *write_sizes,
            RATIO,
            SPAN,
            WINDOW_PAGE,
            BLOCK_D * OVERLAP,
            BLOCK_W,
            DEFER_WRITES,
        )
    else:  # an entry worker: items (record, split) pid - T, then every workers-th after
        workers = tl.num_programs(0) - num_rows
        item = pid - num_rows
        rec = item // CHANNEL_SPLITS
        go = tl.load(plan_ptr + rec * stride_plan, mask=rec < num_rows, other=-1) >= 0
        while go:  # valid records come first: the first padding one ends the worker's items
            _record_entries(
                *pointers,
                rec,
                item % CHANNEL_SPLITS,
                *sizes,
                RATIO,
                SPAN,
                OVERLAP,
                WINDOW_PAGE,
                ROPE_PAIRS,
                ROPE_BY_ROW,
                BLOCK_D,
                BLOCK_S,
                CHANNEL_SPLITS,
                BLOCK_W,
                DEFER_WRITES,
                STORE,
                BF16_BITS,
                NOPE_DIM,
                ROPE_DIM,
                PAGE_TOKENS,
                BLOCK_R,
            )
            item += workers
            rec = item // CHANNEL_SPLITS
            go = tl.load(plan_ptr + rec * stride_plan, mask=rec < num_rows, other=-1) >= 0


# ------------------------------------------------------------------------------- launchers
@contextlib.contextmanager
def force_channel_splits(splits: int) -> Iterator[None]:
    """Inside the block the one-launch kernel pools each entry of at least ``SPLIT_SPAN``
    tokens in ``splits`` programs (a power of two), on any device (tests: the interpreter
    takes 1)."""
    if splits < 1 or splits & (splits - 1):
        raise ConfigError(f"channel splits {splits}; expected a power of two")
    _forced_channel_splits.append(splits)
    try:
        yield
    finally:
        _forced_channel_splits.pop()


def channel_splits(block_d: int, span: int, device: torch.device) -> int:
    """Programs the one-launch kernel pools one entry in: for entries of at least
    ``SPLIT_SPAN`` tokens, ``block_d / SPLIT_CHANNELS`` on a GPU, the forced count
    (:func:`force_channel_splits`) where one is; else 1 (the interpreter runs its programs one
    by one: splitting an entry only adds programs)."""
    if span < SPLIT_SPAN:
        return 1
    if _forced_channel_splits:
        splits = _forced_channel_splits[-1]
        if splits > block_d:
            raise ConfigError(f"channel splits {splits} of a {block_d}-channel entry")
        return splits
    return max(block_d // SPLIT_CHANNELS, 1) if device.type == "cuda" else 1


def entry_workers(rows: int, splits: int) -> int:
    """Entry workers of a launch of ``rows`` records whose entries are pooled in ``splits``
    items each: one an item, at most ``MAX_ENTRY_WORKERS`` (a worker stops at the first
    item of a padding record, so a forward with few entries keeps few of them busy); 0
    unsplit."""
    return 0 if splits == 1 else min(rows * splits, MAX_ENTRY_WORKERS)


def fused_tiles(block_d: int, span: int, splits: int) -> dict[str, int]:
    """The tile constexprs of ``_compress_fused_kernel`` for ``block_d`` channels, entries of
    ``span`` tokens pooled by ``splits`` programs (:func:`channel_splits`): span slots a
    pooling step, ring-row columns a write step, output rows zeroed a step (``POOL_TILE``
    elements at most a tile)."""
    width = block_d // splits  # channels a program pools
    rows = max(POOL_TILE // block_d, 1)  # [rows, block_d] tiles
    # A split program's [BLOCK_S, width] tiles are a quarter of POOL_TILE: at D = 512 four
    # pipelined [32, 32] steps compile without spills on sm_90a and sm_100a, where two
    # [64, 32] steps spill on sm_100a (tests/compiled/test_indexer_compressor_sass.py).
    block_s = min(span, rows if splits == 1 else max(POOL_TILE // (4 * width), 1))
    return dict(BLOCK_S=block_s, CHANNEL_SPLITS=splits, BLOCK_W=block_d, ZERO_ROWS=rows)


def fused_warps(block_d: int) -> int:
    """Warps of ``_compress_fused_kernel``: 8 for a layer's 512 channels (sm_90a: 188
    registers, not 248 with 4), else 4."""
    return 8 if block_d >= 512 else 4


def compress_fused(call: CompressCall) -> torch.Tensor:
    """``table.compress_forward`` (inputs checked, channels of unit stride) in one launch of
    ``_compress_fused_kernel`` (``[T, D]`` fp32 entries aligned to rows), which also stores
    them in ``call.store = (cache, out_loc)`` and writes the ring; it defers the writes that
    wait for a ring read unless ``ring_write_is_safe``."""
    state, kv_proj = call.state, call.kv_proj
    compress_plan, write_plan = call.compress_plan.contiguous(), call.write_plan.contiguous()
    norm_weight, rope = call.norm_weight.contiguous(), call.rope
    store = call.store
    if store is not None:
        check_store(state, kv_proj.shape[0], *store)
        store = (store[0], store[1].contiguous())
    d, ratio, ring = state.head_dim, state.ratio, state.ring
    rows = kv_proj.shape[0]
    out = torch.empty(rows, d, dtype=torch.float32, device=kv_proj.device)
    if rows == 0:
        return out
    cos, sin = entry_cos_sin(rope, call.positions, ratio)
    span = compress_span(ratio)
    block_d = triton.next_power_of_2(max(d, 2))
    cache, out_loc = store if store is not None else (None, out)  # out: an unread pointer
    storage = out if cache is None else cache.storage
    splits = channel_splits(block_d, span, kv_proj.device)
    tiles = fused_tiles(block_d, span, splits)
    # One arrival counter per record (only split entries count; else an unread pointer).
    arrivals = state.arrivals.at_least(rows) if splits > 1 else compress_plan
    _compress_fused_kernel[(rows + entry_workers(rows, splits),)](
        *call.sources,
        compress_plan,
        write_plan,
        norm_weight,
        cos,
        sin,
        out,
        out_loc,
        storage,
        arrivals,
        rows,
        d,
        kv_proj.shape[1],
        ring.shape[1],
        call.norm_eps,
        rows.bit_length(),
        *call.source_strides,
        compress_plan.stride(0),
        out.stride(0),
        cos.stride(0),
        storage.stride(0),
        RATIO=ratio,
        SPAN=span,
        OVERLAP=compress_overlap(ratio),
        WINDOW_PAGE=state.window_page,
        ROPE_PAIRS=cos.shape[-1],
        ROPE_BY_ROW=not isinstance(rope, RopeTable),
        BLOCK_D=block_d,
        **tiles,
        DEFER_WRITES=not ring_write_is_safe(state, call.max_rows_per_request),
        **row_store_constexprs(cache),
        num_warps=fused_warps(block_d),
    )
    return out
