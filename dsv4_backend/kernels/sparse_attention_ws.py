"""FP8 sparse attention with sink, warp-specialised in Gluon: the ``ws`` attention kernel.

The design plain Triton cannot express (``kernels/sparse_attention_pipelined.py``), after
FlashMLA's SM90 sparse FP8 decode, for H = 64 heads a program row and D = 512 (448 e4m3 + 64
bf16 channels, 584-byte tokens):

* a producer partition (4 warps, few registers) gathers each 64-key block with 16-byte loads,
  dequantises it to bf16 and stores it in a ring of ``NUM_BUF`` shared-memory buffers, running
  up to ``NUM_BUF`` blocks ahead of the consumers (``ready`` / ``empty`` mbarriers);
* the consumer partition (8 warps = two warpgroups) runs ``s = q k^T`` once per block (each
  warpgroup 32 of the 64 keys, wgmma from shared memory), the online softmax and ``acc += p
  k`` (each warpgroup 256 of the 512 output channels), so dequantisation overlaps the MMAs and
  the accumulator and a dequantised block never share registers;
* splits, the merge in the last split and the bf16 output as in the pipelined kernel.

Gluon does not run in the Triton interpreter: this kernel is compiled ahead of time on the CPU
(``tests/pipelined_compile.py``) and has never run, so it is checked from its SASS only.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.sparse_attention import (
    LOG2E,
    _check_inputs,
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
#: Warps of the consumer partition (two warpgroups) and of the producer.
CONSUMER_WARPS = 8
PRODUCER_WARPS = 4
#: Registers a producer thread keeps (the consumers get the rest).
PRODUCER_REGS = 88

#: Heads (M lines) and head dim the kernel is written for (DeepSeek-V4-Flash).
BLOCK_M = 64
HEAD_DIM = 512


@gluon.jit
def _pow2_of_biased(biased):
    """``2^(biased - 127)`` as fp32 for int32 ``biased`` in [0, 254] (0 -> 2^-127)."""
    return gl.where(biased > 0, biased << 23, 0x400000).to(gl.float32, bitcast=True)


@gluon.jit
def _load_group(cache, data, scale, valid, chan, g: gl.constexpr):
    """``(codes [BLOCK_N, 64] uint8, exponents [BLOCK_N] int32)`` of nope group ``g``."""
    code = gl.load(cache + data[:, None] + (g * 64 + chan)[None, :], mask=valid[:, None], other=0)
    e = gl.load(cache + scale + g, mask=valid, other=127).to(gl.int32)
    return code, e


@gluon.jit
def _store_group(k_buf, code_and_e, g: gl.constexpr):
    """Dequantise nope group ``g`` (e4m3 * 2^(e - 127), exact in bf16) into the key buffer."""
    code, e = code_and_e
    val = code.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _pow2_of_biased(e)[:, None]
    k_buf.slice(g * 64, 64, dim=1).store(val.to(gl.bfloat16))


@gluon.jit
def _producer(
    win_ptr, ext_ptr, win_idx_row, ext_idx_row, n_win, n_ext, win_blocks, first, num_blocks,
    win_page_shift, win_page_bytes, win_scale_region,
    ext_page_shift, ext_page_bytes, ext_scale_region,
    k_ring, ready, empty,
    NOPE_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
):  # fmt: skip
    """Gather, dequantise and store each block's keys ``[BLOCK_N, D]`` bf16 in the ring."""
    CODE: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    ROPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    TOKEN_BYTES: gl.constexpr = NOPE_DIM + 128
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CODE))
    chan = gl.arange(0, 64, layout=gl.SliceLayout(0, CODE))
    rope_chan = gl.arange(0, 64, layout=gl.SliceLayout(0, ROPE))
    for i in range(num_blocks):
        buf = i % NUM_BUF
        # The first pass over the ring finds every buffer free (phase 1 of a fresh barrier).
        mbarrier.wait(empty.index(buf), ((i // NUM_BUF) & 1) ^ 1)
        block = first + i
        in_win = block < win_blocks
        start = gl.where(in_win, block, block - win_blocks) * BLOCK_N
        cols = start + keys
        idx_row = gl.where(in_win, win_idx_row, ext_idx_row)
        slots = gl.load(idx_row + cols, mask=cols < gl.where(in_win, n_win, n_ext), other=-1)
        cache = gl.where(in_win, win_ptr, ext_ptr)
        shift = gl.where(in_win, win_page_shift, ext_page_shift)
        valid = slots >= 0
        s = gl.where(valid, slots, 0).to(gl.int64)
        page_base = (s >> shift) * gl.where(in_win, win_page_bytes, ext_page_bytes)
        t = s & ((1 << shift) - 1)
        data = page_base + t * TOKEN_BYTES
        scale = page_base + gl.where(in_win, win_scale_region, ext_scale_region) + t * 8
        k_buf = k_ring.index(buf)
        # Loads are issued ahead of the stores they feed (the rope part first, then the nope
        # groups two at a time), so each thread keeps several 16-byte loads in flight.
        data_r = gl.convert_layout(data, gl.SliceLayout(1, ROPE))
        valid_r = gl.convert_layout(valid, gl.SliceLayout(1, ROPE))
        rope_base = (cache + data_r + NOPE_DIM).to(gl.pointer_type(gl.uint16))
        rope = gl.load(rope_base[:, None] + rope_chan[None, :], mask=valid_r[:, None], other=0)
        for g in gl.static_range(0, NOPE_DIM // 64, 2):
            code_a = _load_group(cache, data, scale, valid, chan, g)
            if g + 1 < NOPE_DIM // 64:
                code_b = _load_group(cache, data, scale, valid, chan, g + 1)
                _store_group(k_buf, code_a, g)
                _store_group(k_buf, code_b, g + 1)
            else:
                _store_group(k_buf, code_a, g)
        k_buf.slice(NOPE_DIM, 64, dim=1).store(rope.to(gl.bfloat16, bitcast=True))
        gl.barrier()  # every producer thread's stores, then one arrive
        fence_async_shared()  # generic-proxy stores before the consumers' wgmma reads
        mbarrier.arrive(ready.index(buf))


@gluon.jit
def _consumer(
    q_smem, k_ring, ready, empty, win_idx_row, ext_idx_row, n_win, n_ext, win_blocks, first,
    num_blocks, qk_scale,
    BLOCK_M: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
):  # fmt: skip
    """Both dots and the online softmax over the ring's blocks; returns ``(acc [M, D] fp32,
    m [M], l [M])`` in the accumulator's layout."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16]
    )
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=ACC)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    for i in range(num_blocks):
        buf = i % NUM_BUF
        block = first + i
        in_win = block < win_blocks
        cols = gl.where(in_win, block, block - win_blocks) * BLOCK_N + keys
        idx_row = gl.where(in_win, win_idx_row, ext_idx_row)
        slots = gl.load(idx_row + cols, mask=cols < gl.where(in_win, n_win, n_ext), other=-1)
        mbarrier.wait(ready.index(buf), (i // NUM_BUF) & 1)
        k = k_ring.index(buf)
        s = warpgroup_mma(
            q_smem, k.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT),
            use_acc=False,
        )  # fmt: skip
        s = gl.where((slots >= 0)[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_ref[:, None])
        alpha = gl.exp2(m_i - m_ref)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        alpha_acc = gl.convert_layout(alpha, gl.SliceLayout(1, ACC))
        p_op = gl.convert_layout(p.to(gl.bfloat16), P_OPERAND)
        acc = warpgroup_mma(p_op, k, acc * alpha_acc[:, None])
        # Both warpgroups' (synchronous) wgmma have read the buffer; then one arrive frees it.
        gl.barrier()
        mbarrier.arrive(empty.index(buf))
        m_i = m_new
    return acc, m_i, l_i


@gluon.jit
def _ws_attention_kernel(
    q_ptr,  # [T, H, D] bf16
    win_ptr,  # uint8 window cache pages
    win_idx_ptr,  # [T, Ws] int32
    win_len_ptr,  # [T] int32
    ext_ptr,  # uint8 extra cache pages (the window's on a window-only layer)
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
    NUM_BUF: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
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
    Q_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
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
    ready = mbarrier.allocate_mbarrier(batch=NUM_BUF)
    empty = mbarrier.allocate_mbarrier(batch=NUM_BUF)
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(empty.index(b), count=1)
    fence_async_shared()  # q and the barriers, before any partition's wgmma or wait
    gl.barrier()

    win_idx_row = win_idx_ptr + row * stride_win_idx_t
    ext_idx_row = ext_idx_ptr + row * stride_ext_idx_t
    acc, m_i, l_i = gl.warp_specialize(
        [
            (_consumer, (q_smem, k_ring, ready, empty, win_idx_row, ext_idx_row, n_win, n_ext,
                         win_blocks, first, num_blocks, qk_scale, BLOCK_M, D, BLOCK_N, NUM_BUF)),
            (_producer, (win_ptr, ext_ptr, win_idx_row, ext_idx_row, n_win, n_ext, win_blocks,
                         first, num_blocks, win_page_shift, win_page_bytes, win_scale_region,
                         ext_page_shift, ext_page_bytes, ext_scale_region, k_ring, ready, empty,
                         NOPE_DIM, BLOCK_N, NUM_BUF)),
        ],
        [PRODUCER_WARPS],
        [PRODUCER_REGS],
    )  # fmt: skip

    ACC: gl.constexpr = acc.type.layout
    ML: gl.constexpr = gl.SliceLayout(1, ACC)
    m_i = gl.convert_layout(m_i, ML)
    l_i = gl.convert_layout(l_i, ML)
    lines = gl.arange(0, BLOCK_M, layout=ML)
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ACC))
    line_ok = (lines < H)[:, None]
    sink = gl.load(sink_ptr + lines, mask=lines < H, other=0.0) * LOG2E
    if splits == 1:
        m_fin = gl.maximum(m_i, sink)
        m_ref = gl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = gl.exp2(m_i - m_ref)
        denom = l_i * alpha + gl.exp2(sink - m_ref)
        scale = alpha / gl.where(denom > 0, denom, 1.0)
        out = (acc * scale[:, None]).to(gl.bfloat16)
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
            _merge(part_ptr, ml_ptr, out_ptr, row, stride_pt, stride_mt, stride_ot, H, sink,
                   splits, D, BLOCK_M, BLOCK_S)  # fmt: skip


@gluon.jit
def _merge(part_ptr, ml_ptr, out_ptr, row, stride_pt, stride_mt, stride_ot, H, sink_acc, splits,
           D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_S: gl.constexpr):  # fmt: skip
    """Combine the ``splits`` partials of the row's 64 lines with the sink into bf16."""
    TILE: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [8, 1], [1, 0])
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
    no interpreter) for fp8 caches, at most 64 heads and head dim 512."""
    if device.type != "cuda":
        return "Gluon kernels run on CUDA devices only (no interpreter)"
    reason = pipelined_unsupported_reason(window, extra, dim)
    if reason is None and (heads > BLOCK_M or dim != HEAD_DIM):
        reason = f"{heads} heads of dim {dim}; the ws kernel takes <= {BLOCK_M} heads of {HEAD_DIM}"
    return reason


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
        *_page_geometry(window), *_page_geometry(spans.ext_cache), softmax_scale * LOG2E.value,
        D=dim, NOPE_DIM=dim - window.rope_dim, BLOCK_N=BLOCK_N,
        BLOCK_S=triton.next_power_of_2(splits), HAS_EXTRA=spans.has_extra,
        NUM_BUF=NUM_BUF, PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=CONSUMER_WARPS,
    )  # fmt: skip
    return out
