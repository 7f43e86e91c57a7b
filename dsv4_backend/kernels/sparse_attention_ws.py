"""FP8 sparse attention with sink, warp-specialised in Gluon: the ``ws`` attention kernel.

The design plain Triton cannot express (``kernels/sparse_attention_pipelined.py``), after
FlashMLA's SM90 sparse FP8 decode, for H = 64 heads a program row and D = 512 (448 e4m3 + 64
bf16 channels, 584-byte tokens):

* a producer partition (4 warps, few registers) streams each 64-key block global -> shared
  with cp.async, one nope group (64 e4m3 bytes a key) a unit with ``NUM_STAGES - 1`` units in
  flight across block boundaries, the rope part straight into the key buffer; it dequantises
  each landed unit to bf16 into a ring of ``NUM_BUF`` key buffers (``ready`` / ``empty``
  mbarriers) and leaves the keys' validity beside them;
* warpgroup 0 (``_softmax_partition``) runs ``s = q k^T`` once a block over all 64 keys
  (wgmma m64n64 from shared memory), the online softmax and ``acc += p k`` over the first 256
  output channels (``p`` from registers); it hands ``p`` (bf16) and the rescale to warpgroup 1
  through shared memory (``p_ready`` / ``p_free``);
* warpgroup 1 (``_value_partition``) runs ``acc += p k`` over the other 256 channels (``p``
  from shared memory) and stores its half of the output;
* so dequantisation overlaps the MMAs, q k^T is computed once, and the accumulators and a
  dequantised block never share registers; splits, the merge in the last split and the bf16
  output as in the pipelined kernel.

Gluon does not run in the Triton interpreter: this kernel is compiled ahead of time on the CPU
(``tests/pipelined_compile.py``) and has never run, so it is checked from its SASS only.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.fp8_device import pow2_of_biased
from dsv4_backend.kernels.sparse_attention import (
    LOG2E,
    _check_inputs,
    _e4m3_rebiased_bf16,
    key_spans,
    launch_num_splits,
)
from dsv4_backend.kernels.sparse_attention_pipelined import (
    _page_geometry,
    pipelined_unsupported_reason,
)

#: Keys a block (the N of ``q k^T``).
BLOCK_N = 64
#: Shared-memory key buffers the producer fills ahead of the consumers.
NUM_BUF = 2
#: Shared-memory stages of the producer's cp.async stream (one nope group of a block each).
NUM_STAGES = 6
#: Warps of each consumer partition (one warpgroup each) and of the producer.
CONSUMER_WARPS = 4
PRODUCER_WARPS = 4
#: Registers a thread of warpgroup 1 (``p k`` only) and of the producer keep (warpgroup 0,
#: which also runs ``q k^T`` and the softmax, gets the rest).
VALUE_REGS = 160
PRODUCER_REGS = 88

#: Heads (M lines) and head dim the kernel is written for (DeepSeek-V4-Flash).
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
def _producer(
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
            k_buf.slice(g * 64, 64, dim=1).store(_e4m3_rebiased_bf16(code) * scale[:, None])
        valid_ring.index(buf).store(rows[3].to(gl.int8))  # which keys warpgroup 0 masks
        rows = next_rows
        next_slots = later_slots
        gl.barrier()  # every producer thread's stores (and its rope copy), then one arrive
        fence_async_shared()  # generic-proxy writes before the consumers' wgmma reads
        mbarrier.arrive(ready.index(buf))
    async_copy.wait_group(0)


@gluon.jit
def _softmax_partition(
    q_smem, k_ring, valid_ring, p_smem, alpha_smem, scale_smem, ready, empty, p_ready, p_free,
    done, num_blocks, qk_scale, sink_ptr, H, splits,
    BLOCK_M: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
):  # fmt: skip
    """Warpgroup 0: ``s = q k^T`` once a block over all its keys (m64n64), the online softmax,
    ``p`` (bf16) and the rescale ``alpha`` handed to warpgroup 1 through shared memory, and
    ``acc += p k`` over output channels ``[0, D/2)``. Returns ``(acc [M, D/2] fp32, m [M],
    l [M])``; before returning it leaves the lines' final output scale (one split) for
    warpgroup 1 in ``scale_smem`` and arrives on ``done``."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16]
    )
    LINES: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    acc = gl.zeros([BLOCK_M, D // 2], gl.float32, layout=ACC)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=LINES)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=LINES)
    for i in range(num_blocks):
        buf = i % NUM_BUF
        mbarrier.wait(ready.index(buf), (i // NUM_BUF) & 1)
        k = k_ring.index(buf)
        s = warpgroup_mma(
            q_smem, k.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT),
            use_acc=False,
        )  # fmt: skip
        valid = valid_ring.index(buf).load(gl.SliceLayout(0, S_LAYOUT)) != 0
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        p_fp32 = gl.exp2(s - m_ref[:, None])
        alpha = gl.exp2(m_i - m_ref)
        l_i = l_i * alpha + gl.sum(p_fp32, axis=1)
        m_i = m_new
        p = p_fp32.to(gl.bfloat16)
        # Warpgroup 1 has read the previous block's p and alpha (a fresh barrier passes).
        mbarrier.wait(p_free, (i & 1) ^ 1)
        p_smem.store(p)
        alpha_smem.store(alpha)
        gl.barrier()  # every thread's stores, then one arrive
        fence_async_shared()  # p's generic-proxy stores before warpgroup 1's wgmma reads
        mbarrier.arrive(p_ready)
        alpha_acc = gl.convert_layout(alpha, gl.SliceLayout(1, ACC))
        acc = warpgroup_mma(
            gl.convert_layout(p, P_OPERAND), k.slice(0, D // 2, dim=1), acc * alpha_acc[:, None]
        )
        gl.barrier()  # the (synchronous) wgmma has read the buffer; then one arrive
        mbarrier.arrive(empty.index(buf))
    lines = gl.arange(0, BLOCK_M, layout=LINES)
    sink = gl.load(sink_ptr + lines, mask=lines < H, other=0.0) * LOG2E
    if splits == 1:
        scale_smem.store(_final_scale(m_i, l_i, sink))
        gl.barrier()
        mbarrier.arrive(done)
    return acc, m_i, l_i


@gluon.jit
def _final_scale(m_i, l_i, sink):
    """A line's output scale ``alpha / (l alpha + e^sink)`` once its keys are done (one split):
    the sink joins the softmax as a key with no value."""
    m_fin = gl.maximum(m_i, sink)
    m_ref = gl.where(m_fin == float("-inf"), 0.0, m_fin)
    alpha = gl.exp2(m_i - m_ref)
    denom = l_i * alpha + gl.exp2(sink - m_ref)
    return alpha / gl.where(denom > 0, denom, 1.0)


@gluon.jit
def _gpu_fence(WARPS: gl.constexpr):
    """``fence.acq_rel.gpu`` once a thread (of a ``WARPS``-warp partition): its global stores
    are ordered before a release that another partition's thread makes after the join."""
    token = gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    gl.inline_asm_elementwise(
        "fence.acq_rel.gpu;\n mov.b32 $0, $1;",
        "=r,r",
        [token],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _value_partition(
    k_ring, p_smem, alpha_smem, scale_smem, ready, empty, p_ready, p_free, done, out_ptr,
    part_ptr, row, stride_ot, stride_pt, H, split, splits, num_blocks, BLOCK_M: gl.constexpr,
    D: gl.constexpr, NUM_BUF: gl.constexpr,
):  # fmt: skip
    """Warpgroup 1: ``acc += p k`` over output channels ``[D/2, D)``, with ``p`` and ``alpha``
    from warpgroup 0's shared memory, then that half of the output (one split: bf16, scaled by
    warpgroup 0's final scale) or of the partial numerator (fp32)."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16]
    )
    LINES: gl.constexpr = gl.SliceLayout(1, ACC)
    acc = gl.zeros([BLOCK_M, D // 2], gl.float32, layout=ACC)
    for i in range(num_blocks):
        buf = i % NUM_BUF
        mbarrier.wait(ready.index(buf), (i // NUM_BUF) & 1)
        mbarrier.wait(p_ready, i & 1)
        alpha = alpha_smem.load(LINES)
        acc = warpgroup_mma(p_smem, k_ring.index(buf).slice(D // 2, D // 2, dim=1),
                            acc * alpha[:, None])  # fmt: skip
        gl.barrier()  # the (synchronous) wgmma has read p and the buffer; then one arrive each
        mbarrier.arrive(p_free)
        mbarrier.arrive(empty.index(buf))
    lines = gl.arange(0, BLOCK_M, layout=LINES)
    chans = D // 2 + gl.arange(0, D // 2, layout=gl.SliceLayout(0, ACC))
    line_ok = (lines < H)[:, None]
    if splits == 1:
        mbarrier.wait(done, 0)
        out = (acc * scale_smem.load(LINES)[:, None]).to(gl.bfloat16)
        gl.store(out_ptr + row * stride_ot + lines[:, None] * D + chans[None, :], out, mask=line_ok)
    else:
        part_rows = row * stride_pt + lines * (gl.num_programs(1) * D)
        gl.store(part_ptr + part_rows[:, None] + split * D + chans[None, :], acc, mask=line_ok)
        _gpu_fence(4)  # before warpgroup 0's release of the split count


@gluon.jit
def _ws_attention_kernel(
    q_ptr,  # [T, H, D] bf16
    win_ptr,  # uint8 window cache pages (dense: [slots, D] bf16 rows)
    win_idx_ptr,  # [T, Ws] int32
    win_len_ptr,  # [T] int32
    ext_ptr,  # the extra cache, as win_ptr (the window's on a window-only layer)
    ext_idx_ptr,  # [T, Ke] int32
    ext_len_ptr,  # [T] int32
    sink_ptr,  # [H] fp32
    out_ptr,  # [T, H, D] bf16
    part_ptr,  # [T, H, S, D] fp32 partial numerators (S > 1)
    ml_ptr,  # [T, H, S, 2] fp32 (log2-domain max, denominator) per split (S > 1)
    count_ptr,  # [T] int32 finished splits, zeroed by the launcher (S > 1)
    stride_qt,
    stride_win_idx_t,
    stride_ext_idx_t,
    stride_ot,
    stride_pt,
    stride_mt,
    H,
    win_width,
    ext_width,
    win_page_shift,
    win_page_bytes,
    win_scale_region,
    ext_page_shift,
    ext_page_bytes,
    ext_scale_region,
    qk_scale,
    D: gl.constexpr,
    NOPE_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_S: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    FP8: gl.constexpr,
    NUM_BUF: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CONSUMER_WARPS: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
    VALUE_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = 64
    row = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    n_win = gl.minimum(gl.maximum(gl.load(win_len_ptr + row), 0), win_width)
    win_blocks = gl.cdiv(n_win, BLOCK_N)
    n_ext = 0
    if HAS_EXTRA:
        n_ext = gl.minimum(gl.maximum(gl.load(ext_len_ptr + row), 0), ext_width)
    all_blocks = win_blocks + gl.cdiv(n_ext, BLOCK_N)
    per_split = gl.maximum(gl.cdiv(all_blocks, gl.num_programs(1)), 1)
    splits = gl.maximum(gl.cdiv(all_blocks, per_split), 1)
    if split >= splits:  # no empty splits: this one has no block
        return
    first = split * per_split
    num_blocks = gl.minimum(per_split, all_blocks - first)

    # q [64 heads, D] bf16 into shared memory once (heads past H read as 0).
    Q_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    heads = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, Q_LOAD))
    chans = gl.arange(0, D, layout=gl.SliceLayout(0, Q_LOAD))
    q_ptrs = q_ptr + row * stride_qt + heads[:, None] * D + chans[None, :]
    q = gl.load(q_ptrs, mask=(heads < H)[:, None], other=0.0).to(gl.bfloat16)
    q_smem = gl.allocate_shared_memory(
        gl.bfloat16, [BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.bfloat16)
    )
    q_smem.store(q)
    k_ring = gl.allocate_shared_memory(
        gl.bfloat16,
        [NUM_BUF, BLOCK_N, D],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16),
    )
    p_smem = gl.allocate_shared_memory(
        gl.bfloat16,
        [BLOCK_M, BLOCK_N],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16),
    )
    LINE_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    valid_ring = gl.allocate_shared_memory(gl.int8, [NUM_BUF, BLOCK_N], LINE_SMEM)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], LINE_SMEM)
    scale_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], LINE_SMEM)
    ready = mbarrier.allocate_mbarrier(batch=NUM_BUF)
    empty = mbarrier.allocate_mbarrier(batch=NUM_BUF)
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(empty.index(b), count=2)  # both warpgroups' p k
    p_ready = mbarrier.allocate_mbarrier()
    p_free = mbarrier.allocate_mbarrier()
    done = mbarrier.allocate_mbarrier()
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(done, count=1)
    fence_async_shared()  # q and the barriers, before any partition's wgmma or wait
    gl.barrier()

    win_idx_row = win_idx_ptr + row * stride_win_idx_t
    ext_idx_row = ext_idx_ptr + row * stride_ext_idx_t
    acc, m_i, l_i = gl.warp_specialize(
        [
            (_softmax_partition, (q_smem, k_ring, valid_ring, p_smem, alpha_smem, scale_smem,
                                  ready, empty, p_ready, p_free, done, num_blocks, qk_scale,
                                  sink_ptr, H, splits, BLOCK_M, D, BLOCK_N, NUM_BUF)),
            (_value_partition, (k_ring, p_smem, alpha_smem, scale_smem, ready, empty, p_ready,
                                p_free, done, out_ptr, part_ptr, row, stride_ot, stride_pt, H,
                                split, splits, num_blocks, BLOCK_M, D, NUM_BUF)),
            (_producer, (win_ptr, ext_ptr, win_idx_row, ext_idx_row, n_win, n_ext, win_blocks,
                         first, num_blocks, win_page_shift, win_page_bytes, win_scale_region,
                         ext_page_shift, ext_page_bytes, ext_scale_region, k_ring, valid_ring,
                         ready, empty, FP8, D, NOPE_DIM, BLOCK_N, NUM_BUF, NUM_STAGES)),
        ],
        [CONSUMER_WARPS, PRODUCER_WARPS],
        [VALUE_REGS, PRODUCER_REGS],
    )  # fmt: skip

    # Warpgroup 0's half of the output channels (warpgroup 1 stored the other half).
    ACC: gl.constexpr = acc.type.layout
    ML: gl.constexpr = gl.SliceLayout(1, ACC)
    m_i = gl.convert_layout(m_i, ML)
    l_i = gl.convert_layout(l_i, ML)
    lines = gl.arange(0, BLOCK_M, layout=ML)
    offs_d = gl.arange(0, D // 2, layout=gl.SliceLayout(0, ACC))
    line_ok = (lines < H)[:, None]
    if splits == 1:
        out = (acc * scale_smem.load(ML)[:, None]).to(gl.bfloat16)
        gl.store(
            out_ptr + row * stride_ot + lines[:, None] * D + offs_d[None, :], out, mask=line_ok
        )
    else:
        part_rows = row * stride_pt + lines * (gl.num_programs(1) * D)
        gl.store(part_ptr + part_rows[:, None] + split * D + offs_d[None, :], acc, mask=line_ok)
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


# ------------------------------------------------------------------------------ launcher
def ws_unsupported_reason(
    device: torch.device, window: TokenCache, extra: TokenCache | None, heads: int, dim: int
) -> str | None:
    """Why the ws kernel cannot run here (None when it can): a compiled GPU kernel (Gluon has
    no interpreter) for caches of one format, fp8 (as the pipelined kernel takes them) or dense
    bf16, at most 64 heads and head dim 512."""
    if device.type != "cuda":
        return "Gluon kernels run on CUDA devices only (no interpreter)"
    caches = [("window", window)] + ([("extra", extra)] if extra is not None else [])
    if extra is not None and extra.fmt != window.fmt:
        return f"window cache {window.fmt}, extra {extra.fmt}; the ws kernel takes one format"
    reason = None
    if window.fmt == "fp8":
        reason = pipelined_unsupported_reason(window, extra, dim)
    for name, cache in caches:
        if cache.fmt == "dense" and cache.storage.dtype != torch.bfloat16:
            reason = f"the {name} cache stores {cache.storage.dtype}; dense caches must be bf16"
    if reason is None and (heads > BLOCK_M or dim != HEAD_DIM):
        reason = f"{heads} heads of dim {dim}; the ws kernel takes <= {BLOCK_M} heads of {HEAD_DIM}"
    return reason


def _geometry(cache: TokenCache) -> tuple[int, int, int]:
    """The fp8 page geometry (``_page_geometry``); zeros for a dense cache (rows of D)."""
    return _page_geometry(cache) if cache.fmt == "fp8" else (0, 0, 0)


def sparse_attention_ws(
    q: torch.Tensor,
    window: TokenCache,
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra: TokenCache | None,
    extra_indices: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    sink: torch.Tensor,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The ws kernel's path of ``sparse_attention_with_sink``: ``[T, H, D]`` bf16, one row
    a program (heads padded to 64 M lines). Raises ``BatchError`` where
    :func:`ws_unsupported_reason` names a reason."""
    extra_span = _check_inputs(
        q, window, swa_indices, swa_lengths, extra, extra_indices, extra_lengths, sink,
        softmax_scale,
    )  # fmt: skip
    rows, heads, dim = q.shape
    reason = ws_unsupported_reason(q.device, window, extra, heads, dim)
    if reason is not None:
        raise BatchError(reason)
    q = q.contiguous()
    spans = key_spans(window, swa_indices, swa_lengths, extra_span, heads)
    splits = launch_num_splits(num_splits, rows, heads, spans.width, BLOCK_N, q.device)
    out = torch.empty((rows, heads, dim), dtype=torch.bfloat16, device=q.device)
    if rows == 0:
        return out
    part = torch.empty((rows, heads, splits, dim) if splits > 1 else (1,), device=q.device)
    ml = torch.empty((rows, heads, splits, 2) if splits > 1 else (1,), device=q.device)
    count = torch.zeros(rows, dtype=torch.int32, device=q.device)
    win_idx, ext_idx = spans.swa_indices, spans.ext_indices
    _ws_attention_kernel[(rows, splits)](
        q, window.storage, win_idx, spans.swa_lengths, spans.ext_cache.storage, ext_idx,
        spans.ext_lengths, sink.contiguous(), out, part, ml, count,
        q.stride(0), win_idx.stride(0), ext_idx.stride(0), out.stride(0),
        part.stride(0), ml.stride(0), heads, win_idx.shape[1], ext_idx.shape[1],
        *_geometry(window), *_geometry(spans.ext_cache), softmax_scale * LOG2E.value,
        D=dim, NOPE_DIM=dim - window.rope_dim, BLOCK_N=BLOCK_N,
        BLOCK_S=triton.next_power_of_2(splits), HAS_EXTRA=spans.has_extra,
        FP8=window.fmt == "fp8", NUM_BUF=NUM_BUF, NUM_STAGES=NUM_STAGES,
        CONSUMER_WARPS=CONSUMER_WARPS, PRODUCER_WARPS=PRODUCER_WARPS, VALUE_REGS=VALUE_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=CONSUMER_WARPS,
    )  # fmt: skip
    return out
