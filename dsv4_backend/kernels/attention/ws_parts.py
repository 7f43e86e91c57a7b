"""What both ``ws`` attention kernels share (``kernels/attention/ws.py``: Hopper;
``kernels/attention/ws_sm100.py``: Blackwell), in Gluon.

* :func:`producer_partition`: each 64-key block's keys into a ring of ``NUM_BUF`` bf16 key
  buffers in shared memory with their validity beside them (``ready`` / ``empty``
  mbarriers). fp8 caches stream global -> shared with cp.async, one nope group (64 e4m3
  bytes a key, 4 KiB a block) a unit with ``NUM_STAGES - 1`` units in flight across block
  boundaries, the rope part straight into the key buffer, each landed unit dequantised by
  exponent rebias; dense bf16 caches copy whole rows straight into the ring;
* :func:`q_to_shared`, :func:`ring_buffers`: a program's q as the MMA's A operand and the
  shared memory the partitions hand blocks through (its share of its row's key blocks is the
  ``device.split_blocks``, the pipelined kernel's: no split without a block);
* :func:`final_scale`, :func:`finish_splits`: the sink and the merge of a row's key splits
  in the split that finishes last (an acquire-release counter), bf16 out.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from dsv4_backend.kernels.attention.device import LOG2E, e4m3_rebiased_bf16
from dsv4_backend.kernels.device.fp8 import pow2_of_biased

#: Keys a block (the N of ``q k^T``).
BLOCK_N = 64
#: Shared-memory key buffers the producer fills ahead of the consumers.
NUM_BUF = 2
#: Shared-memory stages of the producer's cp.async stream (one nope group of a block each).
NUM_STAGES = 6
#: Warps and registers a thread of the producer partition.
PRODUCER_WARPS = 4
PRODUCER_REGS = 88
#: Heads (M lines) and head dim the kernels are written for (DeepSeek-V4-Flash).
BLOCK_M = 64
HEAD_DIM = 512


@gluon.jit
def _block_slots(block, win_idx_row, ext_idx_row, n_win, n_ext, win_blocks, keys,
                 BLOCK_N: gl.constexpr):  # fmt: skip
    """Block ``block``'s cache slots ``[BLOCK_N]`` int32 (-1 past its span's keys)."""
    in_win = block < win_blocks
    cols = gl.where(in_win, block, block - win_blocks) * BLOCK_N + keys
    idx_row = gl.where(in_win, win_idx_row, ext_idx_row)
    return gl.load(idx_row + cols, mask=cols < gl.where(in_win, n_win, n_ext), other=-1)


@gluon.jit
def _block_rows(
    block, slots, win_ptr, ext_ptr, win_blocks,
    win_page_shift, win_page_bytes, win_scale_region,
    ext_page_shift, ext_page_bytes, ext_scale_region,
    NOPE_DIM: gl.constexpr,
):  # fmt: skip
    """Where block ``block``'s keys (``slots``) live: ``(cache, data, scale, valid)``, the
    cache's uint8 base pointer and per key ``[BLOCK_N]`` the byte offsets of its 576 data bytes
    (16-byte aligned) and of its 8 ue8m0 scales, and whether it is a key."""
    in_win = block < win_blocks
    shift = gl.where(in_win, win_page_shift, ext_page_shift)
    valid = slots >= 0
    s = gl.where(valid, slots, 0).to(gl.int64)
    page_base = (s >> shift) * gl.where(in_win, win_page_bytes, ext_page_bytes)
    t = s & ((1 << shift) - 1)
    data = page_base + t * (NOPE_DIM + 128)
    scale = page_base + gl.where(in_win, win_scale_region, ext_scale_region) + t * 8
    return gl.where(in_win, win_ptr, ext_ptr), data, scale, valid


@gluon.jit
def _copy_group(stage, rows, chan, g):
    """cp.async nope group ``g``'s codes ``[BLOCK_N, 64]`` uint8 of ``rows`` into ``stage``
    (padding keys as zeros)."""
    cache, data, _, valid = rows
    async_copy.async_load(
        stage, cache + data[:, None] + (g * 64 + chan)[None, :], mask=valid[:, None]
    )


@gluon.jit
def _copy_rope_and_scales(k_buf, scale_stage, rows, chan, scale_chan, NOPE_DIM: gl.constexpr):
    """cp.async a block's rope part (``[BLOCK_N, 64]`` bf16, needing no dequantisation)
    straight into its key buffer and its ue8m0 scales ``[BLOCK_N, 8]`` into ``scale_stage``."""
    cache, data, scale, valid = rows
    rope = (cache + data + NOPE_DIM).to(gl.pointer_type(gl.bfloat16))
    async_copy.async_load(
        k_buf.slice(NOPE_DIM, 64, dim=1), rope[:, None] + chan[None, :], mask=valid[:, None]
    )
    # The same keys a thread as the codes' layout (a register-free conversion).
    scale_rows: gl.constexpr = scale_chan.type.layout.parent
    scales = cache + gl.convert_layout(scale, gl.SliceLayout(1, scale_rows))
    scale_valid = gl.convert_layout(valid, gl.SliceLayout(1, scale_rows))
    async_copy.async_load(
        scale_stage, scales[:, None] + scale_chan[None, :], mask=scale_valid[:, None]
    )


@gluon.jit
def producer_partition(
    win_ptr, ext_ptr, win_idx_row, ext_idx_row, n_win, n_ext, win_blocks, first, num_blocks,
    win_page_shift, win_page_bytes, win_scale_region,
    ext_page_shift, ext_page_bytes, ext_scale_region,
    k_ring, valid_ring, ready, empty,
    FP8: gl.constexpr, D: gl.constexpr, NOPE_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """The producer partition: each block's keys ``[BLOCK_N, D]`` bf16 into the ring, with
    their validity ``[BLOCK_N]`` int8 beside them (``ready[buf]`` once both have landed)."""
    if FP8:
        _fp8_producer(
            win_ptr, ext_ptr, win_idx_row, ext_idx_row, n_win, n_ext, win_blocks, first,
            num_blocks, win_page_shift, win_page_bytes, win_scale_region,
            ext_page_shift, ext_page_bytes, ext_scale_region, k_ring, valid_ring, ready, empty,
            NOPE_DIM, BLOCK_N, NUM_BUF, NUM_STAGES,
        )  # fmt: skip
    else:
        _dense_producer(
            win_ptr, ext_ptr, win_idx_row, ext_idx_row, n_win, n_ext, win_blocks, first,
            num_blocks, k_ring, valid_ring, ready, empty, D, BLOCK_N, NUM_BUF,
        )  # fmt: skip


@gluon.jit
def _dense_producer(
    win_ptr, ext_ptr, win_idx_row, ext_idx_row, n_win, n_ext, win_blocks, first, num_blocks,
    k_ring, valid_ring, ready, empty,
    D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
):  # fmt: skip
    """Dense bf16 caches (contiguous ``[num_slots, D]`` rows): cp.async each block's rows
    straight into its key buffer, the next block's copies in flight (64 KB) while one lands;
    the index row is loaded a block before its copies."""
    ROWS: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROWS))
    chan = gl.arange(0, D, layout=gl.SliceLayout(0, ROWS))
    spans = (win_idx_row, ext_idx_row, n_win, n_ext, win_blocks, keys, BLOCK_N)
    slots = _block_slots(first, *spans)
    _copy_rows(k_ring.index(0), first, slots, win_ptr, ext_ptr, win_blocks, chan, D)
    async_copy.commit_group()  # (its key buffer is free: a fresh barrier passes)
    next_slots = _block_slots(first + 1, *spans)
    for i in range(num_blocks):
        buf = i % NUM_BUF
        later_slots = _block_slots(first + i + 2, *spans)
        if i + 1 < num_blocks:
            next_buf = (i + 1) % NUM_BUF
            mbarrier.wait(empty.index(next_buf), (((i + 1) // NUM_BUF) & 1) ^ 1)
            _copy_rows(k_ring.index(next_buf), first + i + 1, next_slots, win_ptr, ext_ptr,
                       win_blocks, chan, D)  # fmt: skip
        async_copy.commit_group()  # (empty past the last block: the count stays uniform)
        async_copy.wait_group(1)  # block i has landed (this thread's copies)
        valid_ring.index(buf).store((slots >= 0).to(gl.int8))
        slots = next_slots
        next_slots = later_slots
        gl.barrier()  # every producer thread's copies and stores, then one arrive
        fence_async_shared()  # before the consumers' wgmma reads
        mbarrier.arrive(ready.index(buf))
    async_copy.wait_group(0)


@gluon.jit
def _copy_rows(k_buf, block, slots, win_ptr, ext_ptr, win_blocks, chan, D: gl.constexpr):
    """cp.async block ``block``'s dense bf16 rows at ``slots`` into ``k_buf`` (padding keys
    as zeros)."""
    valid = slots >= 0
    rows = gl.where(valid, slots, 0).to(gl.int64) * D
    cache = gl.where(block < win_blocks, win_ptr, ext_ptr)
    async_copy.async_load(k_buf, cache + rows[:, None] + chan[None, :], mask=valid[:, None])


@gluon.jit
def _fp8_producer(
    win_ptr, ext_ptr, win_idx_row, ext_idx_row, n_win, n_ext, win_blocks, first, num_blocks,
    win_page_shift, win_page_bytes, win_scale_region,
    ext_page_shift, ext_page_bytes, ext_scale_region,
    k_ring, valid_ring, ready, empty,
    NOPE_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """fp8 caches: gather each block's keys with cp.async and dequantise them into the ring.

    The copies stream in units of one nope group (``[BLOCK_N, 64]`` e4m3, 4 KB), the first
    unit of a block also carrying its rope part (copied straight into the key buffer) and its
    scales. ``NUM_STAGES - 1`` units are in flight while one is dequantised, across block
    boundaries."""
    CODE: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    SCALE: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    GROUPS: gl.constexpr = NOPE_DIM // 64
    gl.static_assert(NUM_STAGES - 1 <= GROUPS, "units in flight span at most two blocks")
    STAGE: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    stages = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BLOCK_N, 64], STAGE)
    scale_stages = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, 8], STAGE)  # by block parity
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CODE))
    chan = gl.arange(0, 64, layout=gl.SliceLayout(0, CODE))
    scale_chan = gl.arange(0, 8, layout=gl.SliceLayout(0, SCALE))
    spans = (win_idx_row, ext_idx_row, n_win, n_ext, win_blocks, keys, BLOCK_N)
    geometry = (win_ptr, ext_ptr, win_blocks, win_page_shift, win_page_bytes, win_scale_region,
                ext_page_shift, ext_page_bytes, ext_scale_region, NOPE_DIM)  # fmt: skip

    rows = _block_rows(first, _block_slots(first, *spans), *geometry)
    next_slots = _block_slots(first + 1, *spans)
    # Block 0's first NUM_STAGES - 1 units (its key buffer is free: a fresh barrier passes).
    _copy_rope_and_scales(k_ring.index(0), scale_stages.index(0), rows, chan, scale_chan,
                          NOPE_DIM)  # fmt: skip
    for g in gl.static_range(NUM_STAGES - 1):
        _copy_group(stages.index(g), rows, chan, g)
        async_copy.commit_group()
    for i in range(num_blocks):
        buf = i % NUM_BUF
        has_next = i + 1 < num_blocks
        # Indices are loaded a block before their copies are issued (the load never stalls).
        later_slots = _block_slots(first + i + 2, *spans)
        next_rows = _block_rows(first + i + 1, next_slots, *geometry)
        k_buf = k_ring.index(buf)
        for g in gl.static_range(GROUPS):
            unit = i * GROUPS + g
            # Unit `unit` has landed (for every thread: the barrier), and every thread has
            # dequantised the previous one, whose stage the next copy reuses.
            async_copy.wait_group(NUM_STAGES - 2)
            gl.barrier()
            ahead = g + NUM_STAGES - 1  # the unit issued now: this block's, or the next one's
            stage = stages.index((unit + NUM_STAGES - 1) % NUM_STAGES)
            if ahead < GROUPS:
                _copy_group(stage, rows, chan, ahead)
            elif has_next:
                if ahead == GROUPS:
                    next_buf = (i + 1) % NUM_BUF
                    mbarrier.wait(empty.index(next_buf), (((i + 1) // NUM_BUF) & 1) ^ 1)
                    _copy_rope_and_scales(k_ring.index(next_buf), scale_stages.index((i + 1) % 2),
                                          next_rows, chan, scale_chan, NOPE_DIM)  # fmt: skip
                _copy_group(stage, next_rows, chan, ahead - GROUPS)
            async_copy.commit_group()  # (empty past the last block: the count stays uniform)
            e = scale_stages.index(i % 2).load(SCALE).to(gl.int32)
            e = gl.sum(gl.where(scale_chan[None, :] == g, e, 0), axis=1)
            e = gl.convert_layout(e, gl.SliceLayout(1, CODE))
            code = stages.index(unit % NUM_STAGES).load(CODE)
            # As the default kernel: the rebiased codes are the keys times 2^-120, and the
            # group's scale times 2^120 is 2^(E - 7), exact in bf16 (E <= 134).
            scale = pow2_of_biased(gl.minimum(e + 120, 255)).to(gl.bfloat16)
            k_buf.slice(g * 64, 64, dim=1).store(e4m3_rebiased_bf16(code) * scale[:, None])
        valid_ring.index(buf).store(rows[3].to(gl.int8))  # which keys warpgroup 0 masks
        rows = next_rows
        next_slots = later_slots
        gl.barrier()  # every producer thread's stores (and its rope copy), then one arrive
        fence_async_shared()  # generic-proxy writes before the consumers' wgmma reads
        mbarrier.arrive(ready.index(buf))
    async_copy.wait_group(0)


@gluon.jit
def final_scale(m_i, l_i, sink):
    """A line's output scale ``alpha / (l alpha + e^sink)`` once its keys are done (one split):
    the sink joins the softmax as a key with no value."""
    m_fin = gl.maximum(m_i, sink)
    m_ref = gl.where(m_fin == float("-inf"), 0.0, m_fin)
    alpha = gl.exp2(m_i - m_ref)
    denom = l_i * alpha + gl.exp2(sink - m_ref)
    return alpha / gl.where(denom > 0, denom, 1.0)


@gluon.jit
def ring_buffers(NUM_BUF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 D: gl.constexpr):  # fmt: skip
    """The shared memory both kernels' partitions hand blocks through: ``(k_ring [NUM_BUF,
    BLOCK_N, D] bf16, valid_ring [NUM_BUF, BLOCK_N] int8, p_smem [BLOCK_M, BLOCK_N] bf16)``,
    the MMA operands in NVMMA layouts."""
    k_ring = gl.allocate_shared_memory(
        gl.bfloat16, [NUM_BUF, BLOCK_N, D],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16),
    )  # fmt: skip
    valid_ring = gl.allocate_shared_memory(
        gl.int8, [NUM_BUF, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )
    p_smem = gl.allocate_shared_memory(
        gl.bfloat16, [BLOCK_M, BLOCK_N],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16),
    )  # fmt: skip
    return k_ring, valid_ring, p_smem


@gluon.jit
def q_to_shared(q_ptr, row, stride_qt, H, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """Row ``row``'s q ``[64 heads, D]`` bf16 in shared memory (heads past ``H`` as 0), the
    MMA's A operand, loaded once by the kernel's (4) warps."""
    Q_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    heads = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, Q_LOAD))
    chans = gl.arange(0, D, layout=gl.SliceLayout(0, Q_LOAD))
    q_ptrs = q_ptr + row * stride_qt + heads[:, None] * D + chans[None, :]
    q = gl.load(q_ptrs, mask=(heads < H)[:, None], other=0.0).to(gl.bfloat16)
    q_smem = gl.allocate_shared_memory(
        gl.bfloat16, [BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.bfloat16)
    )
    q_smem.store(q)
    return q_smem


@gluon.jit
def finish_splits(
    m_i, l_i, sink_ptr, part_ptr, ml_ptr, count_ptr, out_ptr, row, split, splits, stride_pt,
    stride_mt, stride_ot, H, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_S: gl.constexpr,
):  # fmt: skip
    """A split's lines' ``(m, l)`` beside its stored partial numerator; the split that
    finishes a row last (an acquire-release counter) merges the row's splits."""
    lines = gl.arange(0, BLOCK_M, layout=m_i.type.layout)
    ml_rows = row * stride_mt + lines * (gl.num_programs(1) * 2) + split * 2
    gl.store(ml_ptr + ml_rows, m_i, mask=lines < H)
    gl.store(ml_ptr + ml_rows + 1, l_i, mask=lines < H)
    gl.barrier()
    if gl.atomic_add(count_ptr + row, 1, sem="acq_rel") == splits - 1:
        sink = gl.load(sink_ptr + lines, mask=lines < H, other=0.0) * LOG2E
        _merge(part_ptr, ml_ptr, out_ptr, row, stride_pt, stride_mt, stride_ot, H, sink,
               splits, D, BLOCK_M, BLOCK_S)  # fmt: skip


@gluon.jit
def _merge(part_ptr, ml_ptr, out_ptr, row, stride_pt, stride_mt, stride_ot, H, sink_acc, splits,
           D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_S: gl.constexpr):  # fmt: skip
    """Combine the ``splits`` partials of the row's 64 lines with the sink into bf16."""
    TILE: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    lines = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, TILE))
    offs_s = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(0, TILE))
    ok = lines < H
    s_ok = ok[:, None] & (offs_s < splits)[None, :]
    S = gl.num_programs(1)
    ml = ml_ptr + row * stride_mt + (lines * (S * 2))[:, None] + offs_s[None, :] * 2
    m_s = gl.load(ml, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
    l_s = gl.load(ml + 1, mask=s_ok, other=0.0, cache_modifier=".cg")
    sink = gl.convert_layout(sink_acc, gl.SliceLayout(1, TILE))
    m_fin = gl.maximum(gl.max(m_s, axis=1), sink)
    m_ref = gl.where(m_fin == float("-inf"), 0.0, m_fin)
    w = gl.exp2(m_s - m_ref[:, None])
    denom = gl.sum(w * l_s, axis=1) + gl.exp2(sink - m_ref)
    w = w / gl.where(denom > 0, denom, 1.0)[:, None]
    offs_c = gl.arange(0, 64, layout=gl.SliceLayout(0, TILE))
    for c0 in gl.static_range(0, D, 64):
        out = gl.zeros([BLOCK_M, 64], gl.float32, layout=TILE)
        for j in range(0, splits):
            w_j = gl.sum(gl.where(offs_s[None, :] == j, w, 0.0), axis=1)
            part = gl.load(
                part_ptr + row * stride_pt + (lines * (S * D))[:, None] + j * D + c0
                + offs_c[None, :],
                mask=ok[:, None], other=0.0, cache_modifier=".cg",
            )  # fmt: skip
            out += part * w_j[:, None]
        ptrs = out_ptr + row * stride_ot + (lines * D)[:, None] + c0 + offs_c[None, :]
        gl.store(ptrs, out.to(gl.bfloat16), mask=ok[:, None])
