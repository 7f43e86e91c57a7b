"""Sparse attention with a per-head sink over window keys plus compressed keys: the default
``triton`` variant (its entry :func:`sparse_attention_triton`; the op's dispatching entry
``sparse_attention_with_sink`` is in ``table.py``, the host helpers it shares with the other
variants -- input checks, split counts, row groups, key spans, dtypes -- in ``common.py``).

docs/design.md §2. Query row ``t`` attends, with all ``H`` heads, to the union of

* window keys: ``window`` cache slots ``swa_indices[t, c]`` for ``c < swa_lengths[t]``;
* extra keys (c4 top-k or c128 entries): ``extra`` cache slots ``extra_indices[t, c]`` for
  ``c < extra_lengths[t]``;

skipping slot ``-1``. K = V (one shared KV head, all ``D`` dims)::

    l = scale * q_h . k        o_h = sum exp(l) k / (sum exp(l) + exp(sink_h))

A row with no valid key outputs 0. Shapes: ``T`` rows, ``H`` heads, ``D`` head dim, ``Ws``
window index width, ``Ke`` extra index width, ``S`` key splits.

Triton kernel, designed like FlashMLA's sparse decode. Grid ``(T / G, cdiv(H, BLOCK_H), S)``:

* M side = heads (of ``G`` rows, see below; ``G = 1`` for decode). A program takes
  ``BLOCK_H`` heads of one row (all 64 of Flash; at least 16, the smallest dot M), so each key
  row is gathered once per program and K = V serves both dots: ``s = q k^T`` (``[M, D] x [D,
  BLOCK_N]``) and ``acc += p v`` (``[M, BLOCK_N] x [BLOCK_N, D]``), one loop over the split's
  key blocks, window blocks then extra blocks, with an fp32 online softmax in the log2
  domain.
* Operands. On a GPU q, keys and p are bf16 and the dots accumulate in fp32 (Hopper wgmma,
  Blackwell tcgen05); the constexpr ``INTERPRETER`` keeps fp32 operands in the Triton
  interpreter (its bf16 dot is wrong). FP8 keys are dequantised in the kernel by exponent
  rebias: the e4m3 bits placed under bf16's exponent field are the key times 2^-120 (exact,
  subnormals too), the group's ue8m0 scale times 2^120 is one power of two, the rope is bf16
  as stored -- so the tensor cores see the same keys the torch path dequantises (the
  interpreter does the same in fp32 bits).
* Registers (D = 512, 8 warps = two warpgroups): the ``[64, 512]`` fp32 accumulator is split
  by output channels between the warpgroups (``m64n256`` each, 128 registers a thread); q
  (bf16 ``[64, 512]``) and the key block stay in shared memory as wgmma operands. The whole
  head dimension is one tile: the key block is loaded once and feeds both dots. Dense key
  blocks stream through a 3-stage cp.async pipeline; fp8 blocks are dequantised in registers.
  ``benchmarks/sass_report.py`` reports registers, spills, shared memory and the key loop's
  instructions per configuration, for sm_90a and sm_100a.
* Splits. With ``S = 1`` the program folds in the sink and writes the output (bf16 for bf16
  queries on a GPU: :func:`output_dtype`); otherwise it writes an unnormalised partial (in
  the output dtype) and ``_merge_splits_kernel``, grid ``(T, H)`` on a GPU (all heads a
  program in the interpreter: :func:`merge_heads_per_program`), merges the ``S`` partials
  with the sink. Splits share a row's key blocks evenly (one block apart at most), so none is
  empty unless the row has fewer blocks than splits; the merge does not read the numerator of
  a split that saw no key. ``S`` is picked so the grid fills the SMs
  (:func:`default_num_splits`); callers and tests can set it (``num_splits``,
  :func:`force_num_splits`).

Fewer than 64 heads (attention TP: 16 or 32 a rank; the tiny config's 8). One row a program
(decode) takes ``BLOCK_H`` = 16 or 32 heads and Triton emits ``mma.sync`` (bf16, fp32
accumulation) instead of wgmma, whose M is 64 a warpgroup. Rows that share keys -- the rows of
one verify, draft-extend or extend request (``rows_per_group``) -- go together instead:

* A program takes ``G`` consecutive rows (:func:`group_rows`: ``G * BLOCK_H`` = 64 M lines,
  ``BLOCK_H`` the heads rounded up to a power of two), so its dots are wgmma again.
* It walks its group's union key list (``kernels/attention/key_union.py``, one launch before
  this one): each key once for all ``G`` rows, masked per M line by the key's row bits. A
  request's window is ``128 + G (G - 1) / 2`` keys instead of ``128 G``, its c128 entries are
  read once; c4 top-k lists that differ fall back to each row's own keys (as many bytes as one row
  a program, ``G`` times the dot work: at 16-32 heads these rows are at 23-55 FLOP/B,
  bandwidth-bound, against an H200 ridge of 206).
* The result does not depend on ``G``: every row sees exactly its own keys, in another order.
  ``benchmarks/bench_attention.py`` prints the bytes (verify table).

Every launch shape depends only on tensor shapes (no host reads of lengths), so the op can be
captured in a CUDA graph once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.attention.common import (
    AttentionCall,
    key_spans,
    launch_num_splits,
    output_dtype,
)
from dsv4_backend.kernels.attention.device import LOG2E, e4m3_rebiased_bf16
from dsv4_backend.kernels.device.fp8 import (
    bf16_bits_to_fp32,
    fp8_token_addresses,
    pow2_of_biased,
)

#: Warps of the merge kernel.
MERGE_WARPS = 4


# --------------------------------------------------------------------------------- kernels
@triton.jit
def _load_key_block(
    cache_ptr,  # dense: [num_slots, D] float; fp8: [num_pages, page_bytes] uint8
    stride_row,  # dense: elements per slot (fp8: unused)
    slots,  # [BLOCK_N] int32 cache slots, -1 = none
    mask_n,  # [BLOCK_N] bool columns inside the span
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """Keys at ``slots`` as ``[BLOCK_N, BLOCK_D]`` dot operands (bf16 on a GPU, fp32 in the
    interpreter); 0 where masked, where the slot is -1 and in channels ``>= D``.

    fp8: the tile is read as ``[BLOCK_N, BLOCK_D // 64, 64]`` so that each 64-channel group
    multiplies by its token's one ue8m0 scale (one scale load per group, not per channel); the
    rope channels are bf16 bit patterns. e4m3 * 2^k and bf16 are exact in bf16, so the keys the
    tensor cores see equal the torch path's dequantised keys.
    """
    OP_DTYPE: tl.constexpr = tl.float32 if INTERPRETER else tl.bfloat16
    if FP8:
        GROUPS: tl.constexpr = BLOCK_D // 64
        data_base, scale_base, valid = fp8_token_addresses(
            slots, mask_n, NOPE_DIM, D - NOPE_DIM, PAGE_TOKENS
        )
        offs_g = tl.arange(0, GROUPS)
        chan = offs_g[:, None] * 64 + tl.arange(0, 64)[None, :]  # [GROUPS, 64] head channel
        is_nope = (offs_g < NOPE_DIM // 64)[None, :, None]
        row_ok = valid[:, None, None]
        code = tl.load(
            cache_ptr + data_base[:, None, None] + chan[None, :, :],
            mask=row_ok & is_nope,
            other=0,
        )
        e = tl.load(
            cache_ptr + scale_base[:, None] + offs_g[None, :],
            mask=valid[:, None] & (offs_g < NOPE_DIM // 64)[None, :],
            other=127,
        )
        # The rebiased codes are the keys times 2^-120; the group's scale 2^(E - 127) times
        # 2^120 is 2^(E - 7) (biased E + 120; 255, inf, past fp32 and bf16: E > 134 is a
        # group amax over 448 * 2^7, which normed keys never reach).
        scale = pow2_of_biased(tl.minimum(e.to(tl.int32) + 120, 255))[:, :, None]
        # Rope channels step in 2-byte units from a 2-byte pointer, so they are contiguous and
        # load 8 to a 16-byte access (token and page sizes keep the rope 64-byte aligned).
        is_rope = ((chan >= NOPE_DIM) & (chan < D))[None, :, :]
        rope_base = (cache_ptr + data_base + NOPE_DIM).to(tl.pointer_type(tl.uint16))
        rope_ptr = rope_base[:, None, None] + (chan - NOPE_DIM)[None]
        rope = tl.load(rope_ptr, mask=row_ok & is_rope, other=0)
        if INTERPRETER:  # the same bits as fp32 (the interpreter's bf16 casts truncate)
            c = code.to(tl.int32)
            nope = (((c & 0x7F) << 20) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)
            k = tl.where(is_nope, nope * scale, bf16_bits_to_fp32(rope))
        else:  # bf16 throughout: a power-of-two scale keeps the product exact
            nope = e4m3_rebiased_bf16(code) * scale.to(tl.bfloat16)
            k = tl.where(is_nope, nope, rope.to(tl.bfloat16, bitcast=True))
        k = tl.reshape(k, [mask_n.shape[0], BLOCK_D]).to(OP_DTYPE)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        valid = mask_n & (slots >= 0)
        rows = tl.where(valid, slots, 0).to(tl.int64)
        # A mask constant along D keeps the loads vectorised.
        mask = valid[:, None] if BLOCK_D == D else valid[:, None] & (offs_d < D)[None, :]
        k = tl.load(
            cache_ptr + rows[:, None] * stride_row + offs_d[None, :], mask=mask, other=0.0
        ).to(OP_DTYPE)
    return k


@triton.jit
def _gather_block(
    cache_ptr,  # key cache storage (see _load_key_block)
    stride_row,
    idx_ptr,  # [width] int32 slots of this row's span, -1 = none
    start,  # first column of the block
    hi,  # one past the last column of the span this program covers
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """``(slots [BLOCK_N] int32, keys [BLOCK_N, BLOCK_D])`` of columns ``start ...`` (-1 and
    0 past ``hi``)."""
    cols = start + tl.arange(0, BLOCK_N)
    in_span = cols < hi
    slots = tl.load(idx_ptr + cols, mask=in_span, other=-1)
    k = _load_key_block(
        cache_ptr, stride_row, slots, in_span, D, BLOCK_D, FP8, NOPE_DIM, PAGE_TOKENS, INTERPRETER
    )
    return slots, k


@triton.jit
def _sparse_attention_kernel(
    q_ptr,  # [T, H, D] fp32 / bf16
    win_ptr,  # window cache storage
    win_idx_ptr,  # [T, Ws] int32 (GROUP > 1: [T / G, G Ws] union slots, row bits bits_offset on)
    win_len_ptr,  # [T] int32 (GROUP > 1: [T / G])
    ext_ptr,  # extra cache storage (window's when HAS_EXTRA is false)
    ext_idx_ptr,  # [T, Ke] int32 (as win_idx_ptr)
    ext_len_ptr,  # [T] int32 (as win_len_ptr)
    sink_ptr,  # [H] fp32
    out_ptr,  # S == 1: [T, H, D] output; S > 1: [T, H, S, D] partial numerators (fp32 / bf16)
    m_ptr,  # [T, H, S] fp32 log2-domain max per split (S > 1 only)
    l_ptr,  # [T, H, S] fp32 denominator per split (S > 1 only)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_win_row,
    stride_win_idx_t,
    stride_ext_row,
    stride_ext_idx_t,
    stride_ot,
    stride_oh,
    stride_os,
    stride_mt,
    stride_mh,
    H,
    num_rows,
    win_width,
    ext_width,
    bits_offset,
    qk_scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    WIN_FP8: tl.constexpr,
    WIN_PAGE_TOKENS: tl.constexpr,
    EXT_FP8: tl.constexpr,
    EXT_PAGE_TOKENS: tl.constexpr,
    ONE_GATHER: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    # Program row: a query row (GROUP == 1) or a group of GROUP rows sharing a union key list.
    prog = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_H * BLOCK_G)  # M side: BLOCK_G rows x BLOCK_H heads
    offs_h = tl.program_id(1) * BLOCK_H + offs_m % BLOCK_H
    if GROUP == 1:  # scalar row addressing: fewer registers where H = 64 needs them all
        m_mask = offs_h < H
        q_rows = prog * stride_qt
        out_rows = prog * stride_ot
        ml_rows = prog * stride_mt
    else:
        m_row = offs_m // BLOCK_H  # the row of the group each M line belongs to
        rows = prog * GROUP + m_row
        m_mask = (offs_h < H) & (m_row < GROUP) & (rows < num_rows)
        q_rows = (rows * stride_qt)[:, None]
        out_rows = (rows * stride_ot)[:, None]
        ml_rows = rows * stride_mt
    # A mask constant along D keeps the q loads and output stores vectorised (and, at D = 512,
    # the epilogue within registers).
    md_mask = m_mask[:, None] if BLOCK_D == D else m_mask[:, None] & (offs_d < D)[None, :]

    q_ptrs = q_ptr + q_rows + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=md_mask, other=0.0).to(tl.float32 if INTERPRETER else tl.bfloat16)

    # Lengths beyond the index width have no columns to read: clamp like the torch path.
    n_win = tl.minimum(tl.maximum(tl.load(win_len_ptr + prog), 0), win_width)
    n_ext = 0
    if HAS_EXTRA:
        n_ext = tl.minimum(tl.maximum(tl.load(ext_len_ptr + prog), 0), ext_width)
    # This split's share of the concatenated key list's blocks: splits differ by one block at
    # most, and none is empty unless the row has fewer blocks than splits.
    row_blocks = tl.cdiv(n_win + n_ext, BLOCK_N)
    lo = (split * row_blocks // NUM_SPLITS) * BLOCK_N
    hi = tl.minimum(((split + 1) * row_blocks // NUM_SPLITS) * BLOCK_N, n_win + n_ext)

    # One loop over this split's key blocks, window blocks first, then extra blocks (a block
    # never straddles the two spans): one loop body keeps registers as low as a single span.
    win_hi = tl.minimum(hi, n_win)
    win_blocks = tl.cdiv(tl.maximum(win_hi - lo, 0), BLOCK_N)
    ext_lo = tl.maximum(lo, n_win) - n_win
    ext_hi = hi - n_win
    num_blocks = win_blocks
    if HAS_EXTRA:
        num_blocks += tl.cdiv(tl.maximum(ext_hi - ext_lo, 0), BLOCK_N)
    win_idx_row = win_idx_ptr + prog * stride_win_idx_t
    ext_idx_row = ext_idx_ptr + prog * stride_ext_idx_t
    acc = tl.zeros([BLOCK_H * BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H * BLOCK_G], dtype=tl.float32)
    for block in range(0, num_blocks):
        in_win = block < win_blocks
        idx_row = tl.where(in_win, win_idx_row, ext_idx_row)
        start = tl.where(in_win, lo + block * BLOCK_N, ext_lo + (block - win_blocks) * BLOCK_N)
        span_hi = tl.where(in_win, win_hi, ext_hi)
        if ONE_GATHER:  # one gather, its source picked by scalars: a single copy of the
            # gather code holds registers down (no spills at D = 512)
            slots, k = _gather_block(
                tl.where(in_win, win_ptr, ext_ptr),
                tl.where(in_win, stride_win_row, stride_ext_row),
                idx_row,
                start,
                span_hi,
                D,
                BLOCK_D,
                BLOCK_N,
                False,
                NOPE_DIM,
                WIN_PAGE_TOKENS,
                INTERPRETER,
            )
        elif in_win:
            slots, k = _gather_block(
                win_ptr,
                stride_win_row,
                idx_row,
                start,
                span_hi,
                D,
                BLOCK_D,
                BLOCK_N,
                WIN_FP8,
                NOPE_DIM,
                WIN_PAGE_TOKENS,
                INTERPRETER,
            )
        else:
            slots, k = _gather_block(
                ext_ptr,
                stride_ext_row,
                idx_row,
                start,
                span_hi,
                D,
                BLOCK_D,
                BLOCK_N,
                EXT_FP8,
                NOPE_DIM,
                EXT_PAGE_TOKENS,
                INTERPRETER,
            )
        # The block serves both dots: q k^T for all M lines, and p v with v = k.
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N] fp32, log2 domain
        if GROUP == 1:
            seen = (slots >= 0)[None, :]
        else:  # a union key counts for the rows whose bit it carries
            cols = start + tl.arange(0, BLOCK_N)
            bits = tl.load(idx_row + bits_offset + cols, mask=cols < span_hi, other=0)
            seen = (slots >= 0)[None, :] & (((bits[None, :] >> m_row[:, None]) & 1) != 0)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # While no key was seen m_new is -inf; subtract 0 then so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None])
        m_i = m_new

    out_ptrs = out_ptr + out_rows + offs_h[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:
        sink = tl.load(sink_ptr + offs_h, mask=m_mask, other=0.0) * LOG2E
        m_fin = tl.maximum(m_i, sink)
        m_ref = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.exp2(m_i - m_ref)
        denom = l_i * alpha + tl.exp2(sink - m_ref)
        # denom is 0 only for a -inf sink and no key: output 0, not NaN.
        scale = alpha / tl.where(denom > 0, denom, 1.0)
        tl.store(out_ptrs, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=md_mask)
    else:
        tl.store(out_ptrs + split * stride_os, acc.to(out_ptr.dtype.element_ty), mask=md_mask)
        ml_off = ml_rows + offs_h * stride_mh + split
        tl.store(m_ptr + ml_off, m_i, mask=m_mask)
        tl.store(l_ptr + ml_off, l_i, mask=m_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr,  # [T, H, S, D] fp32 / bf16 partial numerators
    m_ptr,  # [T, H, S] fp32 log2-domain max per split
    l_ptr,  # [T, H, S] fp32 denominator per split
    sink_ptr,  # [H] fp32
    out_ptr,  # [T, H, D] fp32 / bf16
    stride_pt,
    stride_ph,
    stride_ps,
    stride_mt,
    stride_mh,
    stride_ot,
    stride_oh,
    heads,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < heads
    d_ok = offs_d < D
    hs_mask = h_mask[:, None] & (offs_s < NUM_SPLITS)[None, :]  # [HP, BLOCK_S]
    ml_ptrs = row * stride_mt + offs_h[:, None] * stride_mh + offs_s[None, :]
    m = tl.load(m_ptr + ml_ptrs, mask=hs_mask, other=float("-inf"))
    l_s = tl.load(l_ptr + ml_ptrs, mask=hs_mask, other=0.0)
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * LOG2E  # [HP]
    m_fin = tl.maximum(tl.max(m, axis=1), sink)
    m_ref = tl.where(m_fin == float("-inf"), 0.0, m_fin)
    w = tl.exp2(m - m_ref[:, None])  # [HP, BLOCK_S]
    denom = tl.sum(w * l_s, axis=1) + tl.exp2(sink - m_ref)
    w = w / tl.where(denom > 0, denom, 1.0)[:, None]
    part_ptrs = (
        part_ptr
        + row * stride_pt
        + offs_h[:, None, None] * stride_ph
        + offs_s[None, :, None] * stride_ps
        + offs_d[None, None, :]
    )
    # Splits without a key (m = -inf, weight 0) hold a zero numerator: not read.
    seen = hs_mask & (m > float("-inf"))
    part = tl.load(part_ptrs, mask=seen[:, :, None] & d_ok[None, None, :], other=0.0)
    out = tl.sum(part.to(tl.float32) * w[:, :, None], axis=1).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + row * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out, mask=h_mask[:, None] & d_ok[None, :])


def merge_heads_per_program(heads: int, device: torch.device) -> int:
    """Heads a merge program takes: one on a GPU (rows x heads programs fill the SMs), all of
    them in the interpreter, whose cost is per program and per op, not per element."""
    return 1 if device.type == "cuda" else triton.next_power_of_2(heads)


# ------------------------------------------------------------------------------ launcher
def _launch_config(dim: int, fp8: bool, block_m: int) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` of the attention kernel for ``block_m`` M lines a
    program (heads, times rows when a program takes several).

    Chosen from the compiled code for sm_90a and sm_100a (Triton 3.8, compiled ahead of time
    on the CPU; not yet timed on a GPU). What holds, and is checked at every configuration:
    no spills (``tests/compiled/test_sparse_attention_sm90.py::test_nothing_spills``), both
    dots bf16 wgmma / tcgen05 (``test_attention_dots_are_bf16_wgmma``,
    ``test_blackwell_dots_are_tcgen05_with_bf16_operands``), the dense key gather pipelined
    (``test_dense_key_gather_is_pipelined``); the figures themselves (registers, instructions
    a key) are ``benchmarks/sass_report.py``'s (docs/kernels.md). At D = 512 the fp32
    ``[64, 512]`` accumulator takes 8 warps; dense keys: 32-key blocks in a 3-stage cp.async
    pipeline (the gather of the next blocks overlaps the dots); 64-key blocks would cut the
    key loop's instructions but spill with the bf16 output. FP8 keys are dequantised in
    registers, which Triton does not pipeline: 16-key blocks, one stage. D <= 256: 4 warps.
    ``block_m`` < 64 (attention TP, 16 or 32 local heads, one row a program) compiles to
    ``mma.sync`` (Triton's wgmma needs M = 64 a warpgroup), fp8 at 16 lines over 4 warps
    (over 8 it spills); 64 lines of 2 or 4 rows compile as 64 heads do.
    """
    if dim <= 256:
        return 32, 4, 1
    if fp8:
        return 16, 4 if block_m <= 16 else 8, 1
    return 32, 8, 3


def sparse_attention_triton(
    call: AttentionCall,
    *,
    num_splits: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton path of :func:`sparse_attention_with_sink`.

    ``num_splits`` (1 ... ``MAX_SPLITS``) splits each program's key list across that many
    programs; None takes the count pinned by :func:`force_num_splits`, else
    :func:`default_num_splits` on a GPU, else 1. ``rows_per_group``: see
    :func:`sparse_attention_with_sink`. ``out_dtype``: float32 or bfloat16, None for
    :func:`output_dtype` (the kernel writes it directly, and key-split partials in it).
    """
    q, window, swa_indices, swa_lengths, extra_span, sink, softmax_scale = call.parts()
    rows_per_group = call.rows_per_group
    out_dtype = out_dtype or output_dtype(q)
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise BatchError(f"out_dtype={out_dtype}; expected torch.float32 or torch.bfloat16")
    rows, heads, dim = q.shape
    spans = key_spans(window, swa_indices, swa_lengths, extra_span, heads, rows_per_group)
    sink = sink.contiguous()
    block_g = triton.next_power_of_2(spans.group)
    block_n, num_warps, num_stages = _launch_config(
        dim, "fp8" in (window.fmt, spans.ext_cache.fmt), spans.block_h * block_g
    )
    splits = launch_num_splits(num_splits, spans.programs, heads, spans.width, block_n, q.device)

    out = torch.empty((rows, heads, dim), dtype=out_dtype, device=q.device)
    if rows == 0:
        return out
    if splits == 1:
        part, m, l_s = out, out, out  # m / l unused when the kernel finalises
        stride_ps = stride_mt = stride_mh = 0
    else:
        # Partial numerators in the output dtype (bf16 halves their bytes; its rounding is
        # one more bf16 roundoff, within attention_tolerance), maxima and sums in fp32.
        part = torch.empty((rows, heads, splits, dim), dtype=out_dtype, device=q.device)
        m = torch.empty((rows, heads, splits), dtype=torch.float32, device=q.device)
        l_s = torch.empty_like(m)
        stride_ps, stride_mt, stride_mh = part.stride(2), m.stride(0), m.stride(1)
    block_d = max(16, triton.next_power_of_2(dim))  # tl.dot needs K >= 16 on a GPU
    grid = (spans.programs, triton.cdiv(heads, spans.block_h), splits)
    ext_cache = spans.ext_cache
    _sparse_attention_kernel[grid](
        q,
        window.storage,
        spans.swa_indices,
        spans.swa_lengths,
        ext_cache.storage,
        spans.ext_indices,
        spans.ext_lengths,
        sink,
        part,
        m,
        l_s,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        window.storage.stride(0),
        spans.swa_indices.stride(0),
        ext_cache.storage.stride(0),
        spans.ext_indices.stride(0),
        part.stride(0),
        part.stride(1),
        stride_ps,
        stride_mt,
        stride_mh,
        heads,
        rows,
        spans.swa_indices.shape[1],
        spans.ext_indices.shape[1],
        spans.bits_offset,
        softmax_scale * LOG2E.value,
        D=dim,
        BLOCK_D=block_d,
        BLOCK_H=spans.block_h,
        GROUP=spans.group,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        HAS_EXTRA=spans.has_extra,
        NOPE_DIM=dim - window.rope_dim,
        WIN_FP8=window.fmt == "fp8",
        WIN_PAGE_TOKENS=window.page_tokens,
        EXT_FP8=ext_cache.fmt == "fp8",
        EXT_PAGE_TOKENS=ext_cache.page_tokens,
        ONE_GATHER=window.fmt == ext_cache.fmt == "dense"
        and window.storage.dtype == ext_cache.storage.dtype,
        INTERPRETER=not q.is_cuda,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        merge_heads = merge_heads_per_program(heads, q.device)
        _merge_splits_kernel[(rows, triton.cdiv(heads, merge_heads))](
            part,
            m,
            l_s,
            sink,
            out,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            m.stride(0),
            m.stride(1),
            out.stride(0),
            out.stride(1),
            heads,
            D=dim,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            HEADS_PER_PROGRAM=merge_heads,
            num_warps=MERGE_WARPS,
        )
    return out
