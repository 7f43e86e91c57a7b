"""The ``ws`` attention kernel for Blackwell (sm_100a): tcgen05 MMAs into tensor memory.

The Hopper kernel's producer partition (``kernels/attention/ws_parts.py``: cp.async
gather and dequantisation into a ring of bf16 key buffers), with Blackwell consumers:

* an MMA partition (one warp) issues ``s = q k^T`` (tcgen05 m64n64 from shared memory into
  tensor memory) and ``o += p k`` (two m64n256, ``p`` from shared memory), each arriving on an
  mbarrier when it completes: ``s_ready``, then ``empty[buf]`` and ``o_done``;
* the softmax partition (one warpgroup) reads ``s`` from tensor memory, masks the padding
  keys, keeps the running max and denominator, and writes ``p`` (bf16) to shared memory. It
  rescales ``o`` in tensor memory only when a line's max grows past ``RESCALE_LOG2`` (the
  softmax stays exact with the stale max: ``p`` is at most ``2^RESCALE_LOG2``), and stores the
  output (one split: bf16 with the sink) or the partials.

``s`` ``[64, 64]`` and ``o`` ``[64, 512]`` fp32 share the 512 columns of tensor memory (M = 64
blocks use half its lanes). Gluon has no interpreter: compiled ahead of time on the CPU
(``python -m dsv4_backend.tools.aot_compile``), never run.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout,
    allocate_tensor_memory,
    fence_async_shared,
    mbarrier,
    tcgen05_mma,
)

from dsv4_backend.kernels.attention.device import LOG2E, split_blocks
from dsv4_backend.kernels.attention.ws_parts import (
    final_scale,
    finish_splits,
    producer_partition,
    q_to_shared,
    ring_buffers,
)

#: A line's max may grow this much (log2) before ``o`` and ``l`` are rescaled.
RESCALE_LOG2 = gl.constexpr(8.0)
#: Output channels a chunk of the epilogue and the rescale load from tensor memory.
O_CHUNK = gl.constexpr(64)
#: Warps of the softmax partition (the kernel's own) and registers of the MMA warp.
SOFTMAX_WARPS = 4
MMA_REGS = 48


@gluon.jit
def _mma_partition(
    q_smem, k_ring, p_smem, s_tmem, o_tmem, ready, empty, s_ready, s_free, p_ready, o_done,
    num_blocks, D: gl.constexpr, NUM_BUF: gl.constexpr,
):  # fmt: skip
    """One warp: each block's ``s = q k^T`` once the softmax has read the previous ``s``, then
    ``o += p k`` once its ``p`` is in shared memory."""
    for i in range(num_blocks):
        buf = i % NUM_BUF
        k = k_ring.index(buf)
        mbarrier.wait(ready.index(buf), (i // NUM_BUF) & 1)
        mbarrier.wait(s_free, (i & 1) ^ 1)  # (a fresh barrier passes)
        tcgen05_mma(q_smem, k.permute((1, 0)), s_tmem, use_acc=False, mbarriers=[s_ready])
        mbarrier.wait(p_ready, i & 1)
        # Both halves asynchronous (the first's arrival predicated off): tcgen05 MMAs of one
        # thread complete in order, so the second's arrivals cover both.
        tcgen05_mma(p_smem, k.slice(0, D // 2, dim=1), o_tmem.slice(0, D // 2), use_acc=i > 0,
                    mbarriers=[o_done], mbarrier_preds=[False])  # fmt: skip
        tcgen05_mma(p_smem, k.slice(D // 2, D // 2, dim=1), o_tmem.slice(D // 2, D // 2),
                    use_acc=i > 0, mbarriers=[empty.index(buf), o_done])  # fmt: skip


@gluon.jit
def _rescale_o(o_tmem, alpha, D: gl.constexpr, O_CHUNK: gl.constexpr):
    """``o *= alpha`` per line, in tensor memory, ``O_CHUNK`` channels at a time."""
    for c in gl.static_range(0, D, O_CHUNK):
        chunk = o_tmem.slice(c, O_CHUNK)
        o = chunk.load()
        chunk.store(o * gl.convert_layout(alpha, gl.SliceLayout(1, o.type.layout))[:, None])


@gluon.jit
def _softmax_partition(
    s_tmem, o_tmem, p_smem, valid_ring, ready, s_ready, s_free, p_ready, o_done, num_blocks,
    qk_scale, sink_ptr, out_ptr, part_ptr, row, stride_ot, stride_pt, H, split, splits,
    BLOCK_M: gl.constexpr, D: gl.constexpr, NUM_BUF: gl.constexpr, RESCALE_LOG2: gl.constexpr,
    O_CHUNK: gl.constexpr,
):  # fmt: skip
    """One warpgroup: the online softmax over the MMA partition's ``s``, ``p`` for its
    ``o += p k``, the lazy rescale, then the output or the partial numerator. Returns the
    lines' ``(m [M], l [M])`` (log2-domain max used, denominator)."""
    s_layout: gl.constexpr = s_tmem.get_reg_layout()
    LINES: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=LINES)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=LINES)
    for i in range(num_blocks):
        buf = i % NUM_BUF
        mbarrier.wait(s_ready, i & 1)
        s = s_tmem.load(s_layout)
        gl.barrier()  # every thread has read s; then one arrive lets the next q k^T overwrite it
        mbarrier.arrive(s_free)
        # The producer's validity stores, acquired from its own barrier (already complete: the
        # MMA warp waited on it before this block's q k^T).
        mbarrier.wait(ready.index(buf), (i // NUM_BUF) & 1)
        valid = valid_ring.index(buf).load(gl.SliceLayout(0, s_layout)) != 0
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_blk = gl.max(s, axis=1)
        grow = gl.where(m_blk > m_i, m_blk - m_i, 0.0)  # +inf on a line's first key
        # The previous block's p k has finished: p may be rewritten and o rescaled.
        mbarrier.wait(o_done, (i & 1) ^ 1)
        if gl.max(grow, axis=0) > RESCALE_LOG2:
            m_new = gl.maximum(m_i, m_blk)
            alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
            l_i = l_i * alpha
            if i > 0:  # (block 0's p k overwrites o)
                _rescale_o(o_tmem, alpha, D, O_CHUNK)
            m_i = m_new
        p = gl.exp2(s - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_i = l_i + gl.sum(p, axis=1)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()  # generic-proxy stores (p, rescaled o) before the MMA reads
        gl.barrier()
        mbarrier.arrive(p_ready)
    if num_blocks > 0:
        mbarrier.wait(o_done, (num_blocks - 1) & 1)  # the last p k
    lines = gl.arange(0, BLOCK_M, layout=LINES)
    scale = final_scale(m_i, l_i, gl.load(sink_ptr + lines, mask=lines < H, other=0.0) * LOG2E)
    O_LAYOUT: gl.constexpr = o_tmem.slice(0, O_CHUNK).get_reg_layout()
    for c in gl.static_range(0, D, O_CHUNK):
        o = o_tmem.slice(c, O_CHUNK).load(O_LAYOUT)
        o = gl.where(num_blocks > 0, o, 0.0)  # (no block: tensor memory was never written)
        out_lines = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_LAYOUT))
        chans = c + gl.arange(0, O_CHUNK, layout=gl.SliceLayout(0, O_LAYOUT))
        line_ok = (out_lines < H)[:, None]
        if splits == 1:
            out = o * gl.convert_layout(scale, gl.SliceLayout(1, O_LAYOUT))[:, None]
            ptrs = out_ptr + row * stride_ot + out_lines[:, None] * D + chans[None, :]
            gl.store(ptrs, out.to(gl.bfloat16), mask=line_ok)
        else:
            part_rows = row * stride_pt + out_lines * (gl.num_programs(1) * D) + split * D
            gl.store(part_ptr + part_rows[:, None] + chans[None, :], o, mask=line_ok)
    return m_i, l_i


@gluon.jit
def _ws_attention_kernel_sm100(
    q_ptr, win_ptr, win_idx_ptr, win_len_ptr, ext_ptr, ext_idx_ptr, ext_len_ptr, sink_ptr,
    out_ptr, part_ptr, ml_ptr, count_ptr,
    stride_qt, stride_win_idx_t, stride_ext_idx_t, stride_ot, stride_pt, stride_mt,
    H, win_width, ext_width,
    win_page_shift, win_page_bytes, win_scale_region,
    ext_page_shift, ext_page_bytes, ext_scale_region,
    qk_scale,
    D: gl.constexpr, NOPE_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr,
    HAS_EXTRA: gl.constexpr, FP8: gl.constexpr, NUM_BUF: gl.constexpr,
    NUM_STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    MMA_REGS: gl.constexpr,
):  # fmt: skip
    """The arguments of the Hopper kernel (``ws._ws_attention_kernel``)."""
    BLOCK_M: gl.constexpr = 64
    row = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    n_win, n_ext, win_blocks, splits, first, num_blocks = split_blocks(
        win_len_ptr, ext_len_ptr, row, split, gl.num_programs(1), win_width, ext_width,
        HAS_EXTRA, BLOCK_N,
    )  # fmt: skip
    if split >= splits:  # no empty splits: this one has no block
        return
    q_smem = q_to_shared(q_ptr, row, stride_qt, H, BLOCK_M, D)
    k_ring, valid_ring, p_smem = ring_buffers(NUM_BUF, BLOCK_M, BLOCK_N, D)
    s_tmem = allocate_tensor_memory(
        gl.float32, [BLOCK_M, BLOCK_N], TensorMemoryLayout(block=(BLOCK_M, BLOCK_N), col_stride=1)
    )
    o_tmem = allocate_tensor_memory(
        gl.float32, [BLOCK_M, D], TensorMemoryLayout(block=(BLOCK_M, D // 2), col_stride=1)
    )
    ready = mbarrier.allocate_mbarrier(batch=NUM_BUF)
    empty = mbarrier.allocate_mbarrier(batch=NUM_BUF)
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(empty.index(b), count=1)  # the MMA partition's last p k
    s_ready = mbarrier.allocate_mbarrier()
    s_free = mbarrier.allocate_mbarrier()
    p_ready = mbarrier.allocate_mbarrier()
    o_done = mbarrier.allocate_mbarrier()
    mbarrier.init(s_ready, count=1)
    mbarrier.init(s_free, count=1)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(o_done, count=1)
    fence_async_shared()  # q and the barriers, before any partition's MMA or wait
    gl.barrier()

    win_idx_row = win_idx_ptr + row * stride_win_idx_t
    ext_idx_row = ext_idx_ptr + row * stride_ext_idx_t
    m_i, l_i = gl.warp_specialize(
        [
            (_softmax_partition, (s_tmem, o_tmem, p_smem, valid_ring, ready, s_ready, s_free,
                                  p_ready, o_done, num_blocks, qk_scale, sink_ptr, out_ptr,
                                  part_ptr, row, stride_ot, stride_pt, H, split, splits,
                                  BLOCK_M, D, NUM_BUF, RESCALE_LOG2, O_CHUNK)),
            (_mma_partition, (q_smem, k_ring, p_smem, s_tmem, o_tmem, ready, empty, s_ready,
                              s_free, p_ready, o_done, num_blocks, D, NUM_BUF)),
            (producer_partition, (win_ptr, ext_ptr, win_idx_row, ext_idx_row, n_win, n_ext,
                                  win_blocks, first, num_blocks, win_page_shift, win_page_bytes,
                                  win_scale_region, ext_page_shift, ext_page_bytes,
                                  ext_scale_region, k_ring, valid_ring, ready, empty, FP8, D,
                                  NOPE_DIM, BLOCK_N, NUM_BUF, NUM_STAGES)),
        ],
        [1, PRODUCER_WARPS],
        [MMA_REGS, PRODUCER_REGS],
    )  # fmt: skip
    if splits > 1:
        finish_splits(m_i, l_i, sink_ptr, part_ptr, ml_ptr, count_ptr, out_ptr, row, split,
                       splits, stride_pt, stride_mt, stride_ot, H, D, BLOCK_M, BLOCK_S)  # fmt: skip
