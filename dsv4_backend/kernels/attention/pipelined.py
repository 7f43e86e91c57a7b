"""FP8 sparse attention with sink, gathers in flight: the ``pipelined`` attention kernel.

Same op, inputs and result as ``table.sparse_attention_with_sink`` (its torch path is
this kernel's twin, ``testing.reference`` its reference), but bf16, for fp8 window and
compressed caches (``cache/fp8_format.py``: 584 bytes a Flash token), every row kind (decode,
verify, draft extend, prefill) and layer kind (window-only, c4, c128), on the same cache bytes
and metadata. ``kernels/attention/table.py`` runs it where ``DSV4_ATTENTION_KERNEL=pipelined``
or ``variants.force_variant`` selects it; NOT the GPU default: it has never run on a
GPU.

Plain Triton 3.8, so it compiles ahead of time on the CPU and runs in ``TRITON_INTERPRET=1``
against the reference. What it takes from FlashMLA's SM90 sparse FP8 decode:

* The gather is asynchronous: one key loop whose loads Triton's pipeliner turns into
  ``cp.async`` copies ``NUM_STAGES - 1`` = 2 blocks ahead, so block ``i + 1`` and ``i + 2`` are in
  flight while block ``i`` is dequantised and multiplied. Pipelining needs every load outside
  any branch: one gather whose cache, index row and page geometry are picked by scalars (window
  blocks, then extra blocks; a block never straddles the spans); page sizes are powers of two
  (256 / 64 / 2 tokens), so a slot's page is a shift.
* Each block's bytes load as three tiles, all ``cp.async`` (4 to 16 bytes a copy): the
  token's first ``D`` bytes as e4m3 codes ``[N, D / 64, 64]`` (the last group's bytes are rope
  bytes, replaced), its 8 ue8m0 scale bytes as one 64-bit word ``[N]`` and its bf16 rope part
  ``[N, 64]`` as 16-bit words. ``k = e4m3 *
  2^(e - 127)`` per 64-channel group, rope as is, then bf16: exact, so the tensor cores see
  the torch path's dequantised keys.
* No empty splits: a row's ``nb`` blocks are dealt to ``min(S, nb)`` splits of whole blocks;
  programs past them return at once and write nothing. The merge is folded into the last
  split: each split writes an fp32 partial and bumps a per-(row, head block) counter, the one
  that bumps it last combines the partials with the sink. bf16 output.
* M = 64 lines: the 64 heads of one row, or (fewer heads a rank) the heads of ``G`` rows of one
  request over their union key list (``kernels/attention/key_union.py``), as today's kernel.

* The accumulator's rescale (128 multiplies a thread a block at D = 512) runs only when a
  line's block max passes the reference max by more than 2^``RESCALE_SLACK``.

What plain Triton 3.8 does not give (read from the compile, ``tools/aot_compile``):
``tl.range(..., warp_specialize=True)`` leaves this loop unpartitioned on Hopper (no producer
warps: the consumers dequantise), Triton's rule for a dot feeding a dot puts all 8 warps along
M, so at M = 64 both warpgroups compute the whole ``q k^T``, and the dequantised tile plus the
``[64, 512]`` fp32 accumulator in the same registers spill above 16-key blocks at D = 512
(``_block_n``). ``q k^T``'s N is half the block over 8 warps at M = 64 (m64n8 at 16 keys,
m64n32 at 64 keys with 280 B spilled); N = 64 takes 128-key blocks (280 KB of shared memory,
1 KB spilled) or 4 warps (64 keys: 4.5 KB spilled, the accumulator does not fit). Computing
``q k^T`` a block ahead (its result carried across the loop, so no dot follows it in the
iteration) splits it between the warpgroups (32 MMAs a block, not 64; 828 instructions, not
954), but then the pipeliner loads two of the three index copies synchronously. Those need
explicit warp specialisation (Gluon or CUDA C).

Shapes: ``T`` rows, ``H`` heads, ``D`` head dim (128, 256 or 512; 64 rope channels last),
``S`` splits, ``N`` keys a block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.attention.common import (
    ROPE_DIM,
    AttentionCall,
    key_spans,
    launch_num_splits,
    page_geometry,
    pipelined_unsupported_reason,
)
from dsv4_backend.kernels.attention.device import LOG2E, split_blocks
from dsv4_backend.kernels.device.fp8 import bf16_bits_to_fp32, e4m3_to_fp32, pow2_of_biased

#: Warps: two warpgroups hold a ``[64, 512]`` fp32 accumulator (128 registers a thread).
NUM_WARPS = 8
#: Pipeline depth of the gather: the block being multiplied plus 2 in flight.
NUM_STAGES = 3
#: log2 of the largest softmax weight before the reference max moves (see the key loop).
RESCALE_SLACK = tl.constexpr(8.0)
#: Channels the merging split combines at a time (keeps its ``[M, MERGE_D]`` tiles small).
MERGE_D = 64


@triton.jit
def _gather_dequant(
    cache_ptr,  # uint8 [num_pages, page_bytes] fp8 token cache (flat)
    slots,  # [BLOCK_N] int32 cache slots, -1 = none
    page_shift,  # log2(page tokens)
    page_bytes,  # bytes of a page (multiple of 16)
    scale_region,  # byte offset of a page's scale region (page tokens * token bytes)
    D: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """Dequantised keys at ``slots``: ``[BLOCK_N, D]`` bf16 (fp32 in the interpreter), 0 where
    the slot is -1."""
    GROUPS: tl.constexpr = D // 64
    TOKEN_BYTES: tl.constexpr = NOPE_DIM + 2 * (D - NOPE_DIM)
    valid = slots >= 0
    s = tl.where(valid, slots, 0).to(tl.int64)
    page_base = (s >> page_shift) * page_bytes
    t = s & ((1 << page_shift) - 1)
    data = page_base + t * TOKEN_BYTES  # [BLOCK_N] byte offset of the token's data
    offs_g = tl.arange(0, GROUPS)
    chan = offs_g[:, None] * 64 + tl.arange(0, 64)[None, :]  # [GROUPS, 64]
    row_ok = valid[:, None, None]
    # The first D bytes: e4m3 codes of the nope groups (the last group reads rope bytes,
    # replaced below); unmasked along channels so each thread loads 16 bytes at once.
    code = tl.load(cache_ptr + data[:, None, None] + chan[None, :, :], mask=row_ok, other=0)
    # A token's 8 scale bytes as one 64-bit word (cp.async copies 4, 8 or 16 bytes; 1-byte
    # loads stayed synchronous), then its GROUPS biased exponents (rope's, the last, unused).
    scale_word = (cache_ptr + page_base + scale_region + t * 8).to(tl.pointer_type(tl.uint64))
    word = tl.load(scale_word, mask=valid, other=0x7F7F7F7F7F7F7F7F)  # no slot: scales 2^0
    e = (word[:, None] >> (offs_g[None, :] * 8).to(tl.uint64)) & 0xFF  # [BLOCK_N, GROUPS]
    # Rope as 16-bit words from a 16-bit base pointer: contiguous, so 16-byte loads.
    rope_base = (cache_ptr + data + NOPE_DIM).to(tl.pointer_type(tl.uint16))
    rope = tl.load(rope_base[:, None] + tl.arange(0, 64)[None, :], mask=valid[:, None], other=0)
    if INTERPRETER:  # no fp8 type in the interpreter: decode the bits arithmetically
        nope = e4m3_to_fp32(code)
    else:
        nope = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    nope = nope * pow2_of_biased(e.to(tl.int32))[:, :, None]
    rope_val = bf16_bits_to_fp32(rope)
    is_nope = (offs_g < NOPE_DIM // 64)[None, :, None]
    k = tl.where(is_nope, nope, rope_val[:, None, :])
    return tl.reshape(k, [slots.shape[0], D]).to(tl.float32 if INTERPRETER else tl.bfloat16)


@triton.jit
def _pipelined_attention_kernel(
    q_ptr,  # [T, H, D] bf16 / fp32
    win_ptr,  # uint8 window cache pages
    win_idx_ptr,  # [T, Ws] int32 (GROUP > 1: [T / G, G Ws] union slots, row bits bits_offset on)
    win_len_ptr,  # [T] int32 (GROUP > 1: [T / G])
    ext_ptr,  # uint8 extra cache pages (the window's on a window-only layer)
    ext_idx_ptr,  # [T, Ke] int32 (as win_idx_ptr)
    ext_len_ptr,  # [T] int32 (as win_len_ptr)
    sink_ptr,  # [H] fp32
    out_ptr,  # [T, H, D] bf16
    part_ptr,  # [T, H, S, D] fp32 partial numerators (S > 1)
    ml_ptr,  # [T, H, S, 2] fp32 (log2-domain max, denominator) per split (S > 1)
    count_ptr,  # [T / G, cdiv(H, BLOCK_H)] int32 finished splits, zeroed by the launcher (S > 1)
    stride_qt,
    stride_qh,
    stride_win_idx_t,
    stride_ext_idx_t,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_mt,
    stride_mh,
    H,
    num_rows,
    win_width,
    ext_width,
    bits_offset,
    win_page_shift,
    win_page_bytes,
    win_scale_region,
    ext_page_shift,
    ext_page_bytes,
    ext_scale_region,
    qk_scale,
    D: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    MERGE_D: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    prog = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_H * BLOCK_G
    offs_m = tl.arange(0, BLOCK_M)
    offs_h = head_block * BLOCK_H + offs_m % BLOCK_H
    m_row = offs_m // BLOCK_H  # the row of the group each M line belongs to
    rows = prog * GROUP + m_row
    m_mask = (offs_h < H) & (m_row < GROUP) & (rows < num_rows)

    n_win, n_ext, win_blocks, splits, first, num_blocks = split_blocks(
        win_len_ptr,
        ext_len_ptr,
        prog,
        split,
        tl.num_programs(2),
        win_width,
        ext_width,
        HAS_EXTRA,
        BLOCK_N,
    )
    if split >= splits:
        return

    offs_d = tl.arange(0, D)
    q_rows = rows * stride_qt + offs_h * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=m_mask[:, None], other=0.0)
    q = q.to(tl.float32 if INTERPRETER else tl.bfloat16)
    win_idx_row = win_idx_ptr + prog * stride_win_idx_t
    ext_idx_row = ext_idx_ptr + prog * stride_ext_idx_t
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # warp_specialize: Triton 3.8 leaves this loop unpartitioned on sm_90a and sm_100a (no
    # descriptor loads), but on sm_100a it schedules it in 766 instructions, not 3377.
    for i in tl.range(0, num_blocks, num_stages=NUM_STAGES, warp_specialize=True):
        block = first + i
        in_win = block < win_blocks
        start = tl.where(in_win, block, block - win_blocks) * BLOCK_N
        cols = start + tl.arange(0, BLOCK_N)
        in_span = cols < tl.where(in_win, n_win, n_ext)
        idx_row = tl.where(in_win, win_idx_row, ext_idx_row)
        slots = tl.load(idx_row + cols, mask=in_span, other=-1)
        k = _gather_dequant(
            tl.where(in_win, win_ptr, ext_ptr),
            slots,
            tl.where(in_win, win_page_shift, ext_page_shift),
            tl.where(in_win, win_page_bytes, ext_page_bytes),
            tl.where(in_win, win_scale_region, ext_scale_region),
            D,
            NOPE_DIM,
            INTERPRETER,
        )
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N] fp32, log2 domain
        seen = (slots >= 0)[None, :]
        if GROUP > 1:  # a union key counts for the rows whose bit it carries
            bits = tl.load(idx_row + bits_offset + cols, mask=in_span, other=0)
            seen = seen & (((bits[None, :] >> m_row[:, None]) & 1) != 0)
        s = tl.where(seen, s, float("-inf"))
        # The reference max m_i moves only when a line's block max passes it by more than
        # RESCALE_SLACK: weights stay below 2^RESCALE_SLACK, and most blocks skip rescaling
        # the accumulator (128 multiplies a thread at D = 512).
        m_blk = tl.max(s, axis=1)
        if tl.max((m_blk > m_i + RESCALE_SLACK).to(tl.int32), axis=0) > 0:
            m_new = tl.maximum(m_i, m_blk)
            # A line that has seen no key keeps m_i = -inf (and acc = 0): subtract 0, not -inf.
            alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_i += tl.sum(p, axis=1)
        acc = tl.dot(p.to(k.dtype), k, acc)

    sink = tl.load(sink_ptr + offs_h, mask=m_mask, other=0.0) * LOG2E
    out_rows = rows * stride_ot + offs_h * stride_oh
    md_mask = m_mask[:, None]
    if splits == 1:
        m_fin = tl.maximum(m_i, sink)
        m_ref = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.exp2(m_i - m_ref)
        denom = l_i * alpha + tl.exp2(sink - m_ref)
        # denom is 0 only for a -inf sink and no key: output 0, not NaN.
        scale = alpha / tl.where(denom > 0, denom, 1.0)
        out = (acc * scale[:, None]).to(tl.bfloat16)
        tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], out, mask=md_mask)
    else:
        part_rows = rows * stride_pt + offs_h * stride_ph
        tl.store(part_ptr + part_rows[:, None] + split * D + offs_d[None, :], acc, mask=md_mask)
        ml_rows = rows * stride_mt + offs_h * stride_mh
        tl.store(ml_ptr + ml_rows + split * 2, m_i, mask=m_mask)
        tl.store(ml_ptr + ml_rows + split * 2 + 1, l_i, mask=m_mask)
        # The barrier orders every thread's stores before the (one-thread) atomic; acq_rel
        # makes them visible to the split that sees the last count, which sees every split's.
        count = count_ptr + prog * tl.num_programs(1) + head_block
        tl.debug_barrier()
        if tl.atomic_add(count, 1, sem="acq_rel") == splits - 1:
            _merge_splits(
                part_ptr,
                ml_ptr,
                out_ptr,
                part_rows,
                ml_rows,
                out_rows,
                m_mask,
                sink,
                splits,
                D,
                MERGE_D,
                BLOCK_S,
            )


@triton.jit
def _merge_splits(
    part_ptr,
    ml_ptr,
    out_ptr,
    part_rows,  # [BLOCK_M] element offsets of each M line's partials
    ml_rows,  # [BLOCK_M] element offsets of each M line's (max, denominator) pairs
    out_rows,  # [BLOCK_M] element offsets of each M line's output
    m_mask,  # [BLOCK_M] bool lines to write
    sink,  # [BLOCK_M] fp32 log2-domain sink logits
    splits,  # splits that ran
    D: tl.constexpr,
    MERGE_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Combine the ``splits`` partials of each M line with its sink into the bf16 output."""
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = m_mask[:, None] & (offs_s < splits)[None, :]
    ml = ml_ptr + ml_rows[:, None] + offs_s[None, :] * 2
    m_s = tl.load(ml, mask=s_mask, other=float("-inf"), cache_modifier=".cg")  # [M, S]
    l_s = tl.load(ml + 1, mask=s_mask, other=0.0, cache_modifier=".cg")
    m_fin = tl.maximum(tl.max(m_s, axis=1), sink)
    m_ref = tl.where(m_fin == float("-inf"), 0.0, m_fin)
    w = tl.exp2(m_s - m_ref[:, None])  # [M, S]
    denom = tl.sum(w * l_s, axis=1) + tl.exp2(sink - m_ref)
    w = w / tl.where(denom > 0, denom, 1.0)[:, None]
    offs_c = tl.arange(0, MERGE_D)
    for c0 in tl.static_range(0, D, MERGE_D):
        out = tl.zeros([m_mask.shape[0], MERGE_D], dtype=tl.float32)
        for j in range(0, splits):
            w_j = tl.sum(tl.where(offs_s[None, :] == j, w, 0.0), axis=1)
            part = tl.load(
                part_ptr + part_rows[:, None] + j * D + c0 + offs_c[None, :],
                mask=m_mask[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            out += part * w_j[:, None]
        ptrs = out_ptr + out_rows[:, None] + c0 + offs_c[None, :]
        tl.store(ptrs, out.to(tl.bfloat16), mask=m_mask[:, None])


# ------------------------------------------------------------------------------ launcher
def _block_n(dim: int) -> int:
    """Keys a block. At D = 512 the consumers hold the fp32 accumulator and the dequantised
    block: 16 keys compile without spills on sm_90a
    (``tests/compiled/test_sparse_attention_pipelined_sm90.py::test_no_spills_on_sm90``), 32
    spill; smaller heads take 64-key blocks."""
    return 16 if dim > 256 else 64


def sparse_attention_pipelined(
    call: AttentionCall,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The pipelined kernel's path of ``sparse_attention_with_sink``: ``[T, H, D]`` bf16.

    ``num_splits`` and ``rows_per_group`` as for ``sparse_attention_triton``. Raises
    ``BatchError`` for caches the kernel does not read (:func:`pipelined_unsupported_reason`).
    """
    q, window, swa_indices, swa_lengths, extra_span, sink, softmax_scale = call.parts()
    extra = call.extra_cache
    rows_per_group = call.rows_per_group
    rows, heads, dim = q.shape
    reason = pipelined_unsupported_reason(window, extra, dim)
    if reason is not None:
        raise BatchError(reason)
    if q.stride(2) != 1:  # the kernel steps channels with unit stride
        q = q.contiguous()
    spans = key_spans(window, swa_indices, swa_lengths, extra_span, heads, rows_per_group)
    block_n = _block_n(dim)
    splits = launch_num_splits(num_splits, spans.programs, heads, spans.width, block_n, q.device)
    out = torch.empty((rows, heads, dim), dtype=torch.bfloat16, device=q.device)
    if rows == 0:
        return out
    head_blocks = triton.cdiv(heads, spans.block_h)
    block_s = triton.next_power_of_2(splits)
    if splits > 1:
        part = torch.empty((rows, heads, splits, dim), dtype=torch.float32, device=q.device)
        ml = torch.empty((rows, heads, splits, 2), dtype=torch.float32, device=q.device)
        count = torch.zeros((spans.programs, head_blocks), dtype=torch.int32, device=q.device)
    else:  # unused: the one split finalises
        part = ml = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
        count = torch.empty(1, dtype=torch.int32, device=q.device)
    win_idx, ext_idx = spans.swa_indices, spans.ext_indices
    _pipelined_attention_kernel[(spans.programs, head_blocks, splits)](
        q,
        window.storage,
        win_idx,
        spans.swa_lengths,
        spans.ext_cache.storage,
        ext_idx,
        spans.ext_lengths,
        sink.contiguous(),
        out,
        part,
        ml,
        count,
        q.stride(0),
        q.stride(1),
        win_idx.stride(0),
        ext_idx.stride(0),
        out.stride(0),
        out.stride(1),
        part.stride(0),
        part.stride(1),
        ml.stride(0),
        ml.stride(1),
        heads,
        rows,
        win_idx.shape[1],
        ext_idx.shape[1],
        spans.bits_offset,
        *page_geometry(window),
        *page_geometry(spans.ext_cache),
        softmax_scale * LOG2E.value,
        D=dim,
        NOPE_DIM=dim - ROPE_DIM,
        BLOCK_H=spans.block_h,
        GROUP=spans.group,
        BLOCK_G=triton.next_power_of_2(spans.group),
        BLOCK_N=block_n,
        BLOCK_S=block_s,
        HAS_EXTRA=spans.has_extra,
        NUM_STAGES=NUM_STAGES,
        MERGE_D=MERGE_D,
        INTERPRETER=not q.is_cuda,
        num_warps=NUM_WARPS,
    )
    return out
