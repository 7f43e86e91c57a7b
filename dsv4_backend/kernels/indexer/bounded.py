"""The lightning indexer's length-bounded Triton variant (the interpreter's default; on CUDA
named, or with ``DSV4_UNVERIFIED_KERNELS=1``, until it passes ``scripts/gpu_check.sh``).

Three launches whose work follows each row's own candidate count, not the page table's width
(under CUDA graphs that width is the server's maximum context). ``_row_scores_kernel`` runs
``score_splits`` programs a row (a fixed count: 512 programs in all on a GPU); each loads the
row's queries once and loops over its blocks below the count, FP8 keys converted by the
hardware (``fp8_device.e4m3_decode``), fp4 pages decoded with their ue8m0 scales (exact in
bf16). The top-k reads only those scores, a long row split over
several programs (``topk_parts``): ``_topk_chunks_kernel`` keeps each chunk's ``K`` best (a
radix select, then an ascending pass), ``_merge_topk_slots_kernel`` selects the row's ``K``
best among them the same way and writes the slots. Columns past a row's count are never read
or written (:func:`index_scores_bounded` fills them with ``-inf`` for ``index_scores``'
callers; :func:`run_indexer_bounded` does not).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels.device.fp4 import load_fp4_index_block
from dsv4_backend.kernels.device.fp8 import (
    e4m3_decode,
    fp8_indexer_addresses,
    load_dense_block,
)
from dsv4_backend.kernels.indexer.common import (
    BLOCK_N,
    C4_ENTRIES_PER_PAGE,
    IndexCall,
    SelectCall,
)
from dsv4_backend.kernels.indexer.device import (
    FP4_KEYS,
    FP8_KEYS,
    candidate_slots,
    key_format,
    row_queries,
    score_arguments,
)

#: Programs the length-bounded scores aim for in all (a few per SM of an H200's 132).
SCORE_PROGRAMS = 512
#: Warps of a row-scores program over fp4 keys (their decoded tile and the queries do not fit
#: four warps' registers without spilling: ``tests/compiled/``).
FP4_ROW_WARPS = 8
#: Programs a row in the interpreter (two, so that a program steps over several blocks).
INTERPRETER_SPLITS = 2
#: Score columns per step of the length-bounded top-k on a GPU.
TOPK_BLOCK_C = 1024
#: Programs the length-bounded top-k's chunks aim for in all on a GPU (two per SM of an H200).
TOPK_PROGRAMS = 264
#: Top-k programs a row in the interpreter (the tests' long rows still split into chunks).
INTERPRETER_TOPK_PARTS = 2


@triton.jit
def _key_dots(keys, q_t, GPU: tl.constexpr):
    """``[BLOCK_N, BLOCK_H]`` fp32 dots of a key tile with the transposed queries."""
    if GPU:
        return tl.dot(keys.to(tl.bfloat16), q_t)
    else:  # the interpreter's bf16 dot is wrong: fp32 operands, exact products
        return tl.dot(keys, q_t, input_precision="ieee")


@triton.jit
def _row_scores_kernel(
    q_ptr,  # [T, HI, DIM] fp32 / bf16
    w_ptr,  # [T, HI] float
    key_ptr,  # dense [num_slots, DIM] float, or fp8 / fp4 pages uint8 (KEYS)
    page_table_ptr,  # [T, Pw] int32
    num_ptr,  # [T] int32 candidates per row
    out_ptr,  # [T, N] fp32; only columns < min(num, N) are written
    stride_qt,
    stride_qh,
    stride_qd,
    stride_wt,
    stride_wh,
    stride_key_slot,  # dense only: elements between slots
    stride_pt_t,
    stride_pt_p,
    stride_out_t,
    num_cols,  # N
    HI: tl.constexpr,
    DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,  # fp8 / fp4 layouts: entries per key page
    E: tl.constexpr,  # c4 entries per full-cache page
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEYS: tl.constexpr,  # device.py's DENSE_KEYS, FP8_KEYS or FP4_KEYS
    GPU: tl.constexpr,  # compiled: bf16 tensor-core dots, hardware e4m3 conversion
):
    """Program ``(row, split)`` of ``S = num_programs(1)``: the row's queries and head weights
    loaded once, then candidate blocks ``split, split + S, ...`` below the row's own count:
    ``[BLOCK_N, DIM]`` gathered keys times ``[DIM, HI]`` queries, the key scale, ReLU, the head
    weights and the head sum. A program past the row's count reads only the count, so the work
    follows the rows' lengths, not the page table's width."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    step = tl.num_programs(1) * BLOCK_N
    num = tl.minimum(tl.load(num_ptr + row), num_cols)
    if split * BLOCK_N < num:
        d = tl.arange(0, BLOCK_D)
        q, w = row_queries(
            q_ptr,
            w_ptr,
            row,
            stride_qt,
            stride_qh,
            stride_qd,
            stride_wt,
            stride_wh,
            HI,
            DIM,
            BLOCK_H,
            BLOCK_D,
        )
        q_t = tl.trans(q.to(tl.bfloat16) if GPU else q.to(tl.float32))  # [BLOCK_D, BLOCK_H]
        for n0 in range(split * BLOCK_N, num, step):
            cols = n0 + tl.arange(0, BLOCK_N)
            valid = cols < num
            slots = candidate_slots(page_table_ptr, row, cols, valid, stride_pt_t, stride_pt_p, E)
            if KEYS == FP4_KEYS:  # decoded with their scales: exact, also in bf16
                keys = load_fp4_index_block(key_ptr, slots, d, valid, DIM, PAGE_TOKENS)
                scale = tl.full([BLOCK_N], 1.0, tl.float32)
                dots = _key_dots(keys, q_t, GPU)
            elif KEYS == FP8_KEYS:
                data, scale_at, _ = fp8_indexer_addresses(slots, valid, DIM, PAGE_TOKENS)
                m = valid[:, None] & (d < DIM)[None, :]
                code = tl.load(key_ptr + data[:, None] + d[None, :], mask=m, other=0)
                keys = e4m3_decode(code, GPU)  # [BLOCK_N, BLOCK_D] unscaled e4m3 values
                scale_ptrs = (key_ptr + scale_at).to(tl.pointer_type(tl.float32))
                scale = tl.load(scale_ptrs, mask=valid, other=0.0)
                dots = _key_dots(keys, q_t, GPU)
            else:
                keys = load_dense_block(key_ptr, stride_key_slot, slots, d, valid, DIM)
                scale = tl.full([BLOCK_N], 1.0, tl.float32)
                dots = _key_dots(keys, q_t, GPU)
            # The key's scale is positive: it commutes with the ReLU.
            dots = tl.maximum(dots * scale[:, None], 0.0)
            scores = tl.sum(dots * w[None, :], axis=1)
            tl.store(out_ptr + row * stride_out_t + cols, scores, mask=valid)


@triton.jit
def _ordered_bits(x):
    """fp32 -> uint32 whose unsigned order is the float order (-inf lowest)."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _chunk_length(num, K, parts, BLOCK_C: tl.constexpr):
    """Entries of each top-k chunk of a row of ``num > K`` candidates split over ``parts``
    programs: about ``sqrt(num * K)`` (a chunk's scan then costs about what the merge of the
    chunks' ``K`` best costs), at least ``num / parts``, a multiple of ``BLOCK_C``. Every
    chunk but the last is longer than ``K``."""
    balanced = tl.sqrt(num.to(tl.float32) * K).to(tl.int32) + 1
    length = tl.maximum((num + parts - 1) // parts, balanced)
    return (length + BLOCK_C - 1) // BLOCK_C * BLOCK_C


@triton.jit
def _select_threshold(scores_ptr, n, K, BLOCK_C: tl.constexpr):
    """``(key, need)`` for the ``n`` scores at ``scores_ptr``: the ordered bits of the
    ``K``-th largest and how many scores equal to it are kept (the first ones), found by a
    radix select (4 passes of 8-bit histograms); ``(0, K)`` keeps all when ``n <= K``."""
    prefix = tl.full([], 0, tl.uint32)  # the high bits of the K-th largest found so far
    need = K  # its rank among the scores that share ``prefix``
    if n > K:
        c = tl.arange(0, BLOCK_C)
        bins = tl.arange(0, 256)
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.full([256], 0, tl.int32)
            for c0 in range(0, n, BLOCK_C):
                m = c0 + c < n
                key = _ordered_bits(tl.load(scores_ptr + c0 + c, mask=m, other=0.0))
                if p > 0:
                    m &= (key >> (shift + 8)) == (prefix >> (shift + 8))
                hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=m)
            above = tl.cumsum(hist, axis=0, reverse=True) - hist  # scores in higher bins
            hit = (above < need) & (above + hist >= need)
            digit = tl.max(tl.where(hit, bins, 0), axis=0)
            need -= tl.sum(tl.where(bins == digit, above, 0), axis=0)
            prefix |= digit.to(tl.uint32) << shift
    return prefix, need


@triton.jit
def _write_selected(
    scores_ptr,
    n,
    K,
    cols_ptr,
    col0,
    dst_scores_ptr,
    dst_ptr,
    pt_row,
    stride_pt_p,
    E: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Write the ``min(n, K)`` best of the ``n`` scores at ``scores_ptr`` (ties to the first)
    in their order, at ``dst_ptr[0:]``. ``SLOTS``: the scores' entries are ``cols_ptr[i]``,
    written as c4 slots through the page table row ``pt_row``; else the entry of score ``i``
    is ``col0 + i``, written with its score (``dst_scores_ptr``) as a merge candidate."""
    prefix, need = _select_threshold(scores_ptr, n, K, BLOCK_C)
    c = tl.arange(0, BLOCK_C)
    written = tl.full([], 0, tl.int32)
    equal_seen = tl.full([], 0, tl.int32)
    for c0 in range(0, n, BLOCK_C):
        i = c0 + c
        m = i < n
        score = tl.load(scores_ptr + i, mask=m, other=0.0)
        key = _ordered_bits(score)
        equal = (m & (key == prefix)).to(tl.int32)
        equal_rank = equal_seen + tl.cumsum(equal, axis=0) - equal
        keep = (m & (key > prefix)) | ((equal == 1) & (equal_rank < need))
        keep_i = keep.to(tl.int32)
        at = written + tl.cumsum(keep_i, axis=0) - keep_i
        if SLOTS:
            col = tl.load(cols_ptr + i, mask=keep, other=0)
            page = tl.load(pt_row + (col // E) * stride_pt_p, mask=keep, other=0)
            tl.store(dst_ptr + at, page * E + col % E, mask=keep)
        else:
            tl.store(dst_scores_ptr + at, score, mask=keep)
            tl.store(dst_ptr + at, col0 + i, mask=keep)
        written += tl.sum(keep_i, axis=0)
        equal_seen += tl.sum(equal, axis=0)


@triton.jit
def _topk_chunks_kernel(
    scores_ptr,  # [T, N] fp32; only columns < min(num, N) are read
    num_ptr,  # [T] int32 candidates per row
    cand_scores_ptr,  # [T, W] fp32 merge candidates, W >= min(N, parts * K)
    cand_cols_ptr,  # [T, W] int32 their entries
    stride_scores_t,
    stride_cand_t,
    num_cols,  # N
    K,
    BLOCK_C: tl.constexpr,
):
    """Program ``(row, part)``: chunk ``part`` of a row with more than ``K`` candidates
    (``_chunk_length`` entries each): its ``K`` best (ties to the smaller entry), or all of
    a shorter last chunk, with their entries in ascending order at candidate ``part * K``.
    The global ``K`` best of a row are among its chunks' ``K`` best, and the candidates lie
    in ascending entry order without gaps (every chunk but the last keeps exactly ``K``).
    Programs past the row's chunks, and rows of at most ``K``, read only the count."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    num = tl.minimum(tl.maximum(tl.load(num_ptr + row), 0), num_cols)
    if num > K:
        length = _chunk_length(num, K, tl.num_programs(1), BLOCK_C)
        lo = part * length
        if lo < num:
            # Candidates with their entries, not slots (cols_ptr and the page table unused).
            _write_selected(
                scores_ptr + row * stride_scores_t + lo,
                tl.minimum(length, num - lo),
                K,
                cand_cols_ptr,
                lo,
                cand_scores_ptr + row * stride_cand_t + part * K,
                cand_cols_ptr + row * stride_cand_t + part * K,
                num_ptr,
                0,
                1,
                False,
                BLOCK_C,
            )


@triton.jit
def _merge_topk_slots_kernel(
    cand_scores_ptr,  # [T, W] fp32 (``_topk_chunks_kernel``)
    cand_cols_ptr,  # [T, W] int32
    num_ptr,  # [T] int32 candidates per row
    page_table_ptr,  # [T, Pw] int32
    out_ptr,  # [T, K] int32 c4 slots, ascending entry order, -1 padded
    stride_cand_t,
    stride_pt_t,
    stride_pt_p,
    stride_out_t,
    num_cols,  # N
    K,
    parts,  # programs a row of ``_topk_chunks_kernel``
    E: tl.constexpr,  # c4 entries per full-cache page
    BLOCK_K: tl.constexpr,  # >= K
    BLOCK_C: tl.constexpr,  # as ``_topk_chunks_kernel``'s
):
    """One row: every candidate's slot when it has at most ``K``, else the ``K`` best of its
    chunks' candidates (ties to the smaller entry: candidates are in entry order) as slots
    in ascending entry order. Reads only the row's candidates."""
    row = tl.program_id(0).to(tl.int64)
    num = tl.minimum(tl.maximum(tl.load(num_ptr + row), 0), num_cols)
    out_row = out_ptr + row * stride_out_t
    pt_row = page_table_ptr + row * stride_pt_t
    if num <= K:  # every candidate
        k = tl.arange(0, BLOCK_K)
        valid = k < num
        page = tl.load(pt_row + (k // E) * stride_pt_p, mask=valid, other=0)
        tl.store(out_row + k, tl.where(valid, page * E + k % E, -1), mask=k < K)
    else:
        length = _chunk_length(num, K, parts, BLOCK_C)
        full = (num - 1) // length  # chunks before the last, K candidates each
        total = full * K + tl.minimum(num - full * length, K)
        # Slots through the page table (col0 = 0 and dst_scores_ptr unused).
        _write_selected(
            cand_scores_ptr + row * stride_cand_t,
            total,
            K,
            cand_cols_ptr + row * stride_cand_t,
            0,
            cand_scores_ptr,
            out_row,
            pt_row,
            stride_pt_p,
            E,
            True,
            BLOCK_C,
        )


def score_splits(rows: int, max_candidates: int, device: torch.device) -> int:
    """Programs a row's scores are split over: enough for ``SCORE_PROGRAMS`` in all on a GPU
    (``INTERPRETER_SPLITS`` a row in the interpreter, which runs programs one by one), never
    more than the row's column blocks. It depends on the batch's row count and (only below
    that many blocks) on the width, so a long maximum context adds no programs."""
    splits = triton.cdiv(SCORE_PROGRAMS, rows) if device.type == "cuda" else INTERPRETER_SPLITS
    return max(1, min(triton.cdiv(max_candidates, BLOCK_N), splits))


def row_scores_triton(call: IndexCall, out: torch.Tensor) -> None:
    """Launch ``_row_scores_kernel``: ``out`` ``[T, N]`` receives each row's scores at
    columns ``< min(num_candidates, N)``; nothing else is read or written."""
    rows, cols = out.shape
    if rows == 0 or cols == 0:
        return
    arguments, constexprs = score_arguments(call, out)
    _row_scores_kernel[(rows, score_splits(rows, cols, call.q_idx.device))](
        *arguments,
        **constexprs,
        GPU=call.q_idx.device.type == "cuda",
        num_warps=FP4_ROW_WARPS if key_format(call.keys) == FP4_KEYS.value else 4,
    )


def topk_parts(rows: int, cols: int, topk: int, device: torch.device) -> int:
    """Programs a row's top-k is split over (the grid's second axis, fixed under CUDA graphs):
    enough for ``TOPK_PROGRAMS`` in all on a GPU (``INTERPRETER_TOPK_PARTS`` in the
    interpreter), never more than a row of ``cols`` entries can fill (its chunks are at least
    ``sqrt(cols * topk)`` long: ``_chunk_length``). Past the chunks of a row's own count a
    program reads only the count, so a long maximum context adds no work."""
    parts = triton.cdiv(TOPK_PROGRAMS, rows) if device.type == "cuda" else INTERPRETER_TOPK_PARTS
    return max(1, min(parts, math.isqrt(cols // max(topk, 1)) + 1))


def _topk_slots_triton(call: SelectCall) -> None:
    """Launch ``_topk_chunks_kernel`` (``topk_parts`` programs a row; skipped when no row can
    have more than ``topk`` candidates) and ``_merge_topk_slots_kernel`` (one a row). They
    read each row's own ``num`` scores, and its chunks' candidates, only.

    The candidate buffers are ``[T, min(N, parts * topk)]``: a row's candidates are at most
    its count and ``topk`` a chunk."""
    scores, page_table, topk, out = call.scores, call.page_table, call.topk, call.out
    rows, cols = scores.shape
    if rows == 0 or topk == 0:
        return
    device = scores.device
    block_c = TOPK_BLOCK_C if device.type == "cuda" else BLOCK_N
    num_candidates = call.num_candidates.contiguous()  # read with unit stride
    parts = topk_parts(rows, cols, topk, device)
    width = min(cols, parts * topk)
    cand_scores = torch.empty(rows, width, dtype=torch.float32, device=device)
    cand_cols = torch.empty(rows, width, dtype=torch.int32, device=device)
    if cols > topk:
        _topk_chunks_kernel[(rows, parts)](
            scores,
            num_candidates,
            cand_scores,
            cand_cols,
            scores.stride(0),
            cand_scores.stride(0),
            cols,
            topk,
            BLOCK_C=block_c,
        )
    _merge_topk_slots_kernel[(rows,)](
        cand_scores,
        cand_cols,
        num_candidates,
        page_table,
        out,
        cand_scores.stride(0),
        page_table.stride(0),
        page_table.stride(1),
        out.stride(0),
        cols,
        topk,
        parts,
        E=C4_ENTRIES_PER_PAGE,
        BLOCK_K=triton.next_power_of_2(topk),
        BLOCK_C=block_c,
    )


def index_scores_bounded(call: IndexCall) -> torch.Tensor:
    """``table.index_scores``: the row scores over ``-inf``."""
    q_idx = call.q_idx
    out = torch.full((q_idx.shape[0], call.max_candidates), float("-inf"), device=q_idx.device)
    row_scores_triton(call, out)
    return out


def select_topk_bounded(call: SelectCall) -> None:
    """``table.select_topk``: the chunked top-k of each row's scores below its count."""
    _topk_slots_triton(replace(call, scores=call.scores.float().contiguous()))


def run_indexer_bounded(call: IndexCall, topk: int, out: torch.Tensor) -> None:
    """``table.run_indexer`` (inputs checked) in three launches.

    The scores are full width but never cleared: a row's scores are written and read below
    its own count only. Under CUDA graphs every shape is fixed at capture and any row may have
    ``N`` candidates; packing the rows tighter would need each row's offset and a bound on the
    batch's total, which the plan does not carry.
    """
    scores = torch.empty(call.q_idx.shape[0], call.max_candidates, device=call.q_idx.device)
    row_scores_triton(call, scores)
    _topk_slots_triton(SelectCall(scores, call.num_candidates, call.page_table, topk, out))
