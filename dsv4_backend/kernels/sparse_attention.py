"""Sparse attention with a per-head sink over window keys plus compressed keys.

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
* It walks its group's union key list (``kernels/key_union.py``, one launch before this one):
  each key once for all ``G`` rows, masked per M line by the key's row bits. A request's
  window is ``128 + G (G - 1) / 2`` keys instead of ``128 G``, its c128 entries are read
  once; c4 top-k lists that differ fall back to each row's own keys (as many bytes as one row
  a program, ``G`` times the dot work: at 16-32 heads these rows are at 23-55 FLOP/B,
  bandwidth-bound, against an H200 ridge of 206).
* The result does not depend on ``G``: every row sees exactly its own keys, in another order.
  ``benchmarks/bench_attention.py`` prints the bytes (verify table).

Every launch shape depends only on tensor shapes (no host reads of lengths), so the op can be
captured in a CUDA graph once compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.errors import BatchError, ContractError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.device.fp8 import (
    bf16_bits_to_fp32,
    fp8_token_addresses,
    pow2_of_biased,
)
from dsv4_backend.kernels.key_union import MAX_GROUP, key_union

#: exp(x) = exp2(x * LOG2E): the kernels work in the log2 domain.
LOG2E = tl.constexpr(math.log2(math.e))
#: Most heads per program: one wgmma M tile (all 64 heads of DeepSeek-V4-Flash).
MAX_BLOCK_H = 64
#: Upper bound of key splits per row (the merge kernel takes them in one tile).
MAX_SPLITS = 32
#: Warps of the merge kernel.
MERGE_WARPS = 4
#: Rows per chunk of the torch path, so its gathered ``[rows, Ws + Ke, D]`` keys stay bounded.
_TORCH_CHUNK_ELEMENTS = 1 << 26


# --------------------------------------------------------------------------------- kernels
@triton.jit
def _e4m3_rebiased_bf16(code):
    """uint8 e4m3fn bit patterns (any shape) -> bf16 of value * 2^-120, exact: the 7 exponent
    and mantissa bits go under bf16's exponent field, where bias 127 reads bias 7 (e4m3
    subnormals land on bf16 subnormals alike). The NaN codes 0x7F / 0xFF become finite (no
    cache write stores them). Inline PTX on 4 codes a register: a byte permute, a shift, an
    and and a 3-input logic op per 2 keys' channels. GPU only."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 lo, hi, t;
        prmt.b32 lo, $2, 0, 0x1404;
        prmt.b32 hi, $2, 0, 0x3424;
        shr.b32 t, lo, 4;
        and.b32 t, t, 0x07F007F0;
        lop3.b32 $0, lo, 0x80008000, t, 0xEA;
        shr.b32 t, hi, 4;
        and.b32 t, t, 0x07F007F0;
        lop3.b32 $1, hi, 0x80008000, t, 0xEA;
        }""",
        constraints="=r,=r,r",
        args=[code],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


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
            nope = _e4m3_rebiased_bf16(code) * scale.to(tl.bfloat16)
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
                tl.where(in_win, stride_win_row, stride_ext_row), idx_row, start, span_hi,
                D, BLOCK_D, BLOCK_N, False, NOPE_DIM, WIN_PAGE_TOKENS, INTERPRETER,
            )  # fmt: skip
        elif in_win:
            slots, k = _gather_block(
                win_ptr, stride_win_row, idx_row, start, span_hi, D, BLOCK_D, BLOCK_N,
                WIN_FP8, NOPE_DIM, WIN_PAGE_TOKENS, INTERPRETER,
            )  # fmt: skip
        else:
            slots, k = _gather_block(
                ext_ptr, stride_ext_row, idx_row, start, span_hi, D, BLOCK_D, BLOCK_N,
                EXT_FP8, NOPE_DIM, EXT_PAGE_TOKENS, INTERPRETER,
            )  # fmt: skip
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


# ------------------------------------------------------------------------------- checks
#: A compressed layer's keys: ``(extra cache, [T, Ke] int32 slots, [T] int32 lengths)``.
ExtraSpan = tuple[TokenCache, torch.Tensor, torch.Tensor]


def _extra_span(
    extra: TokenCache | None, extra_indices: torch.Tensor | None, extra_lengths: torch.Tensor | None
) -> ExtraSpan | None:
    """The compressed keys as one triple, None on a window-only layer (``_check_inputs``
    refuses a partial triple)."""
    if extra is None or extra_indices is None or extra_lengths is None:
        return None
    return extra, extra_indices, extra_lengths


def _check_inputs(
    q: torch.Tensor,
    window: TokenCache,
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra: TokenCache | None,
    extra_indices: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    sink: torch.Tensor,
    softmax_scale: float,
) -> ExtraSpan | None:
    """Raise ``BatchError`` / ``ContractError`` naming the first input that does not fit;
    return the compressed keys as one triple (None on a window-only layer)."""
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16):
        raise BatchError(
            f"q has shape {tuple(q.shape)} and dtype {q.dtype}; expected [T, H, D] float32 or "
            "bfloat16"
        )
    rows, heads, dim = q.shape
    if sink.shape != (heads,) or sink.dtype != torch.float32:
        raise BatchError(
            f"sink has shape {tuple(sink.shape)} and dtype {sink.dtype}; expected [{heads}] "
            "float32 (one logit per head of q)"
        )
    if not (
        isinstance(softmax_scale, (int, float))
        and math.isfinite(softmax_scale)
        and softmax_scale > 0
    ):
        raise BatchError(f"softmax_scale={softmax_scale!r}; expected a finite positive float")
    extra_given = [p is not None for p in (extra, extra_indices, extra_lengths)]
    if any(extra_given) and not all(extra_given):
        raise BatchError(
            "extra, extra_indices and extra_lengths must all be given (compressed layer) or all "
            f"be None (window-only layer); got given={extra_given}"
        )
    spans = [("window", window, "swa_indices", swa_indices, "swa_lengths", swa_lengths)]
    extra_span = _extra_span(extra, extra_indices, extra_lengths)
    if extra_span is not None:
        ext, ext_indices, ext_lengths = extra_span
        spans.append(("extra", ext, "extra_indices", ext_indices, "extra_lengths", ext_lengths))
    tensors = {"sink": sink}
    for cache_name, cache, idx_name, idx, len_name, lengths in spans:
        if cache.dim != dim or cache.rope_dim != window.rope_dim:
            raise BatchError(
                f"the {cache_name} cache holds head_dim {cache.dim} (rope_dim "
                f"{cache.rope_dim}); q has D={dim} and the window cache rope_dim "
                f"{window.rope_dim}"
            )
        tensors[f"{cache_name} cache"] = cache.storage
        if idx.dim() != 2 or idx.dtype != torch.int32 or idx.shape[1] == 0:
            raise BatchError(
                f"{idx_name} has shape {tuple(idx.shape)} and dtype {idx.dtype}; expected "
                "[T, width] int32 with width >= 1"
            )
        if lengths.shape != (idx.shape[0],) or lengths.dtype != torch.int32:
            raise BatchError(
                f"{len_name} has shape {tuple(lengths.shape)} and dtype {lengths.dtype}; "
                f"expected [{idx.shape[0]}] int32 (one length per row of {idx_name})"
            )
        if idx.shape[0] != rows:
            raise ContractError(
                f"{idx_name} has {idx.shape[0]} rows but q has T={rows}: the attention "
                "metadata was planned for another batch (plan after the batch is padded)"
            )
        tensors[idx_name] = idx
        tensors[len_name] = lengths
    for name, tensor in tensors.items():
        if tensor.device != q.device:
            raise BatchError(f"{name} is on {tensor.device}; q is on {q.device}")
    for _, cache, idx_name, idx, _, _ in spans:
        cache.check_slots(idx, idx_name)  # slot range, checked on the CPU only (no GPU sync)
    return extra_span


# ------------------------------------------------------------------------------ launcher
def _block_h(heads: int) -> int:
    """Heads per program: all of them up to 64 (one wgmma M tile), at least 16 (the smallest
    ``tl.dot`` M)."""
    return min(MAX_BLOCK_H, max(16, triton.next_power_of_2(heads)))


def _launch_config(dim: int, fp8: bool, block_m: int) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` of the attention kernel for ``block_m`` M lines a
    program (heads, times rows when a program takes several).

    Chosen from ptxas reports for sm_90a and sm_100a (Triton 3.8, compiled ahead of time on
    the CPU: ``benchmarks/sass_report.py``; not yet timed on a GPU). At D = 512 the fp32
    ``[64, 512]`` accumulator is 128 registers a thread over 8 warps. Dense keys: 32-key
    blocks in a 3-stage cp.async pipeline (the gather of the next blocks overlaps the dots),
    240-254 registers, no spills. 64-key blocks in 2 stages cut the key loop from 199 to 150
    instructions a key (QK m64n32), but with the bf16 output they spill 48-56 B (outside the
    loop; 0 with an fp32 output) and 16-32 B at 64 lines of several rows. FP8 keys are
    dequantised in registers, which Triton does not pipeline: 16-key blocks, one stage,
    237-251 registers (32-key blocks: 285 instructions a key instead of 418, 8-24 B spilled).
    D <= 256: 4 warps. ``block_m`` < 64 (attention TP, 16 or 32 local heads, one row a
    program) compiles to ``mma.sync`` (Triton's wgmma needs M = 64 a warpgroup); fp8 at 16
    lines spills over 8 warps (36 B) and not over 4 (218 registers). 64 lines of 2 or 4 rows
    compile as 64 heads do (234-255 registers, no spills).
    """
    if dim <= 256:
        return 32, 4, 1
    if fp8:
        return 16, 4 if block_m <= 16 else 8, 1
    return 32, 8, 3


def default_num_splits(rows: int, heads: int, width: int, block_n: int, sms: int) -> int:
    """Key splits per program row (a query row, or a group of rows taken together) so that
    the grid fills the SMs in one wave.

    ``rows * cdiv(heads, BLOCK_H)`` programs share ``sms`` SMs (one program per SM: its
    registers fill one); each row gets ``sms // programs`` splits (a partial second wave would
    cost as much as a full one), at most ``cdiv(width, block_n)`` (a key block per split) and
    at most ``MAX_SPLITS``. One split when the rows alone fill the GPU: no partials, no merge.
    """
    programs = max(1, rows * triton.cdiv(heads, _block_h(heads)))  # rows may be 0
    return max(1, min(sms // programs, triton.cdiv(width, block_n), MAX_SPLITS))


def checked_num_splits(splits: int) -> int:
    """``splits`` when it is a key-split count the kernels take, else ``BatchError``."""
    if not 1 <= splits <= MAX_SPLITS:
        raise BatchError(f"num_splits={splits}; expected 1 ... {MAX_SPLITS}")
    return splits


#: Split count pinned by :func:`force_num_splits` (tests run every schedule with splits > 1).
_forced_splits: list[int] = []


@contextlib.contextmanager
def force_num_splits(splits: int) -> Iterator[None]:
    """Inside the block every Triton launch without an explicit ``num_splits`` uses ``splits``,
    on any device (splits past a row's keys are empty and merge as nothing)."""
    _forced_splits.append(checked_num_splits(splits))
    try:
        yield
    finally:
        _forced_splits.pop()


def launch_num_splits(
    num_splits: int | None, rows: int, heads: int, width: int, block_n: int, device: torch.device
) -> int:
    """The key splits of a launch: ``num_splits`` (checked by :func:`checked_num_splits`), or
    for None the forced count, else :func:`default_num_splits` on a GPU, else 1 (the
    interpreter runs programs one by one)."""
    if num_splits is not None:
        return checked_num_splits(num_splits)
    if _forced_splits:
        return _forced_splits[-1]
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return default_num_splits(rows, heads, width, block_n, sms)


def group_rows(heads: int, rows_per_group: int) -> int:
    """Rows a program takes together (``G``): as many of the ``rows_per_group`` consecutive
    rows as fill the 64 lines of one wgmma M tile with their heads (``64 // BLOCK_H``, at most
    ``key_union.MAX_GROUP``); 1 where the heads alone fill it (H = 64) or the tile would be
    below the 16 lines of the smallest dot."""
    block_h = triton.next_power_of_2(heads)
    group = min(rows_per_group, MAX_BLOCK_H // block_h, MAX_GROUP)
    return group if group > 1 and block_h * triton.next_power_of_2(group) >= 16 else 1


def program_heads(heads: int, group: int) -> int:
    """Heads a program takes (``BLOCK_H``) when it takes ``group`` rows: all of them, rounded
    up to a power of two, for a group (``G * BLOCK_H`` fills the M tile); else
    :func:`_block_h`."""
    return _block_h(heads) if group == 1 else triton.next_power_of_2(heads)


@dataclasses.dataclass(frozen=True)
class KeySpans:
    """The key lists of one attention launch, as every kernel of the op walks them (one key
    loop over a program row's window columns, then its extra columns). ``P`` program rows:
    the query rows (``group`` 1: the caller's lists, unit-stride along columns) or groups of
    ``group`` rows (their union lists, ``kernels/key_union.py``)."""

    #: The extra cache; the window's on a window-only layer (any valid pointer: never read).
    ext_cache: TokenCache
    #: ``[P, Ws]`` int32 window slots (a group: union slots, row bits ``bits_offset`` on).
    swa_indices: torch.Tensor
    #: ``[P]`` int32 valid leading columns of ``swa_indices``.
    swa_lengths: torch.Tensor
    #: ``[P, Ke]`` int32 extra slots, as ``swa_indices`` (the window's when not ``has_extra``).
    ext_indices: torch.Tensor
    #: ``[P]`` int32 valid leading columns of ``ext_indices``.
    ext_lengths: torch.Tensor
    has_extra: bool
    #: Rows a program takes (:func:`group_rows`).
    group: int
    #: Elements from a union slot to its row bits (``key_union``'s table[1]); 0 for no group.
    bits_offset: int
    #: Heads a program takes (:func:`program_heads`).
    block_h: int

    @property
    def programs(self) -> int:
        """``P``: program rows."""
        return self.swa_indices.shape[0]

    @property
    def width(self) -> int:
        """Index columns a program row walks at most (window plus extra)."""
        return self.swa_indices.shape[1] + (self.ext_indices.shape[1] if self.has_extra else 0)


def key_spans(
    window: TokenCache,
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra_span: ExtraSpan | None,
    heads: int,
    rows_per_group: int = 1,
) -> KeySpans:
    """The :class:`KeySpans` of inputs ``_check_inputs`` accepted (``extra_span``: what it
    returned), packing up to
    ``rows_per_group`` rows a program (:func:`group_rows`; the union lists cost a
    ``key_union`` launch). ``BatchError`` for a ``rows_per_group`` below 1 or a cache whose
    storage is not contiguous (the kernels address rows and pages from its base)."""
    if not isinstance(rows_per_group, int) or rows_per_group < 1:
        raise BatchError(f"rows_per_group={rows_per_group!r}; expected an int >= 1")
    ext_cache, ext_indices, ext_lengths = extra_span or (window, swa_indices, swa_lengths)
    for name, cache in (("window", window), ("extra", ext_cache)):
        if not cache.storage.is_contiguous():
            raise BatchError(
                f"the {name} cache storage has strides {cache.storage.stride()}; the kernel "
                "needs it contiguous"
            )
    group = group_rows(heads, rows_per_group)
    if group == 1:
        # The kernels step index columns and lengths with unit stride (no-ops when so).
        win = (swa_indices.contiguous(), swa_lengths.contiguous())
        ext = (ext_indices.contiguous(), ext_lengths.contiguous())
        bits_offset = 0
    else:
        union = key_union(
            swa_indices, swa_lengths, extra_span and ext_indices, extra_span and ext_lengths, group
        )
        slots = union.table[0]
        win = (slots[:, : union.extra_column], union.lengths[0])
        ext = (slots[:, union.extra_column :], union.lengths[1]) if extra_span else win
        bits_offset = union.table.stride(0)  # table[1] (row bits) beside table[0] (slots)
    return KeySpans(
        ext_cache, *win, *ext, extra_span is not None, group, bits_offset,
        program_heads(heads, group),
    )  # fmt: skip


def sparse_attention_triton(
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
    rows_per_group: int = 1,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton path of :func:`sparse_attention_with_sink`.

    ``num_splits`` (1 ... ``MAX_SPLITS``) splits each program's key list across that many
    programs; None takes the count pinned by :func:`force_num_splits`, else
    :func:`default_num_splits` on a GPU, else 1. ``rows_per_group``: see
    :func:`sparse_attention_with_sink`. ``out_dtype``: float32 or bfloat16, None for
    :func:`output_dtype` (the kernel writes it directly, and key-split partials in it).
    """
    extra_span = _check_inputs(
        q, window, swa_indices, swa_lengths, extra, extra_indices, extra_lengths, sink,
        softmax_scale,
    )  # fmt: skip
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
        q, window.storage, spans.swa_indices, spans.swa_lengths,
        ext_cache.storage, spans.ext_indices, spans.ext_lengths, sink,
        part, m, l_s,
        q.stride(0), q.stride(1), q.stride(2),
        window.storage.stride(0), spans.swa_indices.stride(0),
        ext_cache.storage.stride(0), spans.ext_indices.stride(0),
        part.stride(0), part.stride(1), stride_ps, stride_mt, stride_mh,
        heads, rows, spans.swa_indices.shape[1], spans.ext_indices.shape[1], spans.bits_offset,
        softmax_scale * LOG2E.value,
        D=dim, BLOCK_D=block_d, BLOCK_H=spans.block_h, GROUP=spans.group, BLOCK_G=block_g,
        BLOCK_N=block_n, NUM_SPLITS=splits, HAS_EXTRA=spans.has_extra,
        NOPE_DIM=dim - window.rope_dim,
        WIN_FP8=window.fmt == "fp8", WIN_PAGE_TOKENS=window.page_tokens,
        EXT_FP8=ext_cache.fmt == "fp8", EXT_PAGE_TOKENS=ext_cache.page_tokens,
        ONE_GATHER=window.fmt == ext_cache.fmt == "dense"
        and window.storage.dtype == ext_cache.storage.dtype,
        INTERPRETER=not q.is_cuda, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        merge_heads = merge_heads_per_program(heads, q.device)
        _merge_splits_kernel[(rows, triton.cdiv(heads, merge_heads))](
            part, m, l_s, sink, out,
            part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1),
            out.stride(0), out.stride(1), heads,
            D=dim, BLOCK_D=block_d, NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits), HEADS_PER_PROGRAM=merge_heads,
            num_warps=MERGE_WARPS,
        )  # fmt: skip
    return out


def output_dtype(q: torch.Tensor) -> torch.dtype:
    """The op's output dtype for queries ``q``: bf16 for bf16 queries on a GPU (the caller's
    dtype, half the bytes the fp32 output cost: 23 % of an fp8 decode's roofline bytes),
    else float32 (the interpreter and the torch path, exact to the fp32 reference)."""
    return torch.bfloat16 if q.is_cuda and q.dtype == torch.bfloat16 else torch.float32


def dot_operand_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype of the attention dots' operands for tensors on ``device``: bf16 on a GPU
    (tensor cores, fp32 accumulation), fp32 in the interpreter and the torch path."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


#: Output error per unit roundoff of the dot operands (q, keys and weights each rounded once),
#: against the fp32 reference: TF32 operands (roundoff 2^-11) gave 2.0-2.4e-3 on the tiny
#: model, about 5 roundoffs; bf16 rounding emulated on random rows (tests) reaches about 6.
#: 12 leaves a 2x margin.
ROUNDOFFS_PER_OUTPUT = 12
#: Floor of the tolerance: fp32 sums in another order.
FP32_ATOL = 2e-5


def attention_tolerance(device: torch.device | str) -> float:
    """Absolute tolerance of this op's output against an fp32 reference (outputs of order 1),
    derived from :func:`dot_operand_dtype`: bf16 (roundoff 2^-8) gives 12 * 2^-8 = 0.047."""
    roundoff = torch.finfo(dot_operand_dtype(device)).eps / 2
    return max(FP32_ATOL, ROUNDOFFS_PER_OUTPUT * roundoff)


# ---------------------------------------------------------------------------- torch path
def sparse_attention_torch(
    q: torch.Tensor,
    window: TokenCache,
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra: TokenCache | None,
    extra_indices: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    sink: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Torch path of :func:`sparse_attention_with_sink`: gather, then one masked softmax."""
    extra_span = _check_inputs(
        q, window, swa_indices, swa_lengths, extra, extra_indices, extra_lengths, sink,
        softmax_scale,
    )  # fmt: skip
    spans = [(window, swa_indices, swa_lengths)]
    if extra_span is not None:
        spans.append(extra_span)
    rows, heads, dim = q.shape
    out = torch.empty((rows, heads, dim), dtype=torch.float32, device=q.device)
    width = sum(idx.shape[1] for _, idx, _ in spans)
    step = max(1, _TORCH_CHUNK_ELEMENTS // (width * max(dim, heads)))
    for r0 in range(0, rows, step):
        keys, valid = [], []
        for cache, idx, lengths in spans:
            idx = idx[r0 : r0 + step].long()
            cols = torch.arange(idx.shape[1], device=idx.device)
            ok = (cols[None, :] < lengths[r0 : r0 + step, None]) & (idx >= 0)
            keys.append(cache.gather(torch.where(ok, idx, -1)))  # [t, width, D] fp32
            valid.append(ok)
        k = torch.cat(keys, dim=1)
        logits = torch.einsum("thd,tnd->thn", q[r0 : r0 + step].float(), k) * softmax_scale
        logits = logits.masked_fill(~torch.cat(valid, dim=1)[:, None, :], float("-inf"))
        m = torch.maximum(logits.amax(dim=-1), sink[None, :])  # [t, H]
        m = m.masked_fill(m == float("-inf"), 0.0)
        p = torch.exp(logits - m[..., None])
        denom = p.sum(dim=-1) + torch.exp(sink[None, :] - m)
        denom = denom.masked_fill(denom == 0, 1.0)  # -inf sink and no key: output 0
        out[r0 : r0 + step] = torch.einsum("thn,tnd->thd", p, k) / denom[..., None]
    return out.to(output_dtype(q))


# ---------------------------------------------------------------------------- public op
def sparse_attention_with_sink(
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
    rows_per_group: int = 1,
) -> torch.Tensor:
    """Attention of each query row over its window keys plus its compressed keys, with sink.

    Parameters
    ----------
    q : ``[T, H, D]`` float32 or bfloat16, already normed and roped.
    window : this layer's window cache (dense or fp8), addressed by window slot.
    swa_indices : ``[T, Ws]`` int32 window slots (-1 = none).
    swa_lengths : ``[T]`` int32 valid leading columns of ``swa_indices``.
    extra : this layer's c4 or c128 cache, or None for a window-only layer.
    extra_indices : ``[T, Ke]`` int32 compressed slots (-1 = none): c4 top-k or c128 entries;
        None with ``extra``.
    extra_lengths : ``[T]`` int32 valid leading columns of ``extra_indices``; None with
        ``extra``.
    sink : ``[H]`` float32 finite per-head sink logit (adds ``exp(sink)`` to the denominator).
    softmax_scale : logit scale, ``head_dim ** -0.5``.
    rows_per_group : how many consecutive rows mostly share keys (the rows of one verify or
        draft-extend request; 1 for decode). The Triton path packs up to that many rows into
        one program (:func:`group_rows`) and gathers their union of keys once
        (``kernels/key_union.py``); the result does not depend on it.

    Returns
    -------
    ``[T, H, D]`` in :func:`output_dtype` (bf16 for bf16 queries on a GPU, else float32; the
    caller casts). Rows without a valid key are 0.
    """
    args = (q, window, swa_indices, swa_lengths, extra, extra_indices, extra_lengths, sink)
    if dispatch.use_triton(q.device):
        return sparse_attention_triton(*args, softmax_scale, rows_per_group=rows_per_group)
    return sparse_attention_torch(*args, softmax_scale)
