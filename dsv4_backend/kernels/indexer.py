"""Lightning indexer: score a row's visible c4 entries and keep the top-k as c4 cache slots.

docs/design.md §2. For query row ``t`` (position ``p``) and c4 entry ``s``::

    score[t, s] = sum_h w[t, h] * relu(q_idx[t, h] . K[s])      for s < num_candidates[t]

``num_candidates = c4.topk_lengths_raw = (p + 1) // 4``; ``K[s]`` is the indexer key cache row
at the c4 slot of entry ``s``: ``page_table[t, s * 4 // 256] * 64 + s % 64``. The selection keeps
every candidate when there are at most ``topk``, else the ``topk`` best scores; equal scores at
the boundary go to the smaller entry index, so every path selects the same set. Selected
entries are written in ascending entry order, as c4 slots, ``-1`` padded
(``c4.page_indices``).

Shapes: ``T`` rows, ``HI`` indexer heads, ``DI`` indexer head dim, ``Pw`` page-table width,
``N`` score columns (``max_candidates``), ``K`` ``topk``. Every output shape depends only on
``(T, N, K)`` and nothing reads a tensor value on the host, so the indexer can be captured in
a CUDA graph (warm it up first: the first call compiles).

Paths (``dispatch.use_triton``; every path selects the same set: ties go to the smaller index):

* **length-bounded** (``dispatch.use_unverified("indexer")``: the interpreter's default, CUDA
  with ``DSV4_UNVERIFIED_KERNELS=1`` until it passes ``scripts/gpu_check.sh``): three launches
  whose work follows each row's own candidate count, not the page table's width (under CUDA
  graphs that width is the server's maximum context). ``_row_scores_kernel`` runs
  ``score_splits`` programs a row (a fixed count: 512 programs in all on a GPU); each loads
  the row's queries once and loops over its blocks below the count, FP8 keys converted by the
  hardware (``fp8_device.e4m3_decode``). The top-k reads only those scores, a long row split
  over several programs (``topk_parts``): ``_topk_chunks_kernel`` keeps each chunk's ``K``
  best (a radix select, then an ascending pass), ``_merge_topk_slots_kernel`` selects the
  row's ``K`` best among them the same way and writes the slots. Columns past a row's count
  are never read or written (``index_scores`` fills them with ``-inf`` for its callers).
* **replaced** (the CUDA default): ``_indexer_scores_kernel`` with one program per 64
  columns of the width, flashinfer's radix top-k on CUDA (a stable torch sort elsewhere) over
  the whole ``[T, N]`` matrix, then ``_selected_slots_kernel``.
* **torch**: the plain implementation (CPU without the interpreter, meta tensors).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from dsv4_backend.errors import ContractError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.device.fp8 import (
    e4m3_decode,
    fp8_indexer_addresses,
    load_dense_block,
    load_fp8_indexer_block,
)
from dsv4_backend.ops.launches import launch

if TYPE_CHECKING:
    from dsv4_backend.cache.indexer_cache import IndexerKeyCache

#: c4 entries per full-cache page (page size 256 / ratio 4).
C4_ENTRIES_PER_PAGE = 64
#: Candidate columns per Triton program (per loop step of the length-bounded kernel).
BLOCK_N = 64
#: Programs the length-bounded scores aim for in all (a few per SM of an H200's 132).
SCORE_PROGRAMS = 512
#: Programs a row in the interpreter (two, so that a program steps over several blocks).
INTERPRETER_SPLITS = 2
#: Score columns per step of the length-bounded top-k on a GPU.
TOPK_BLOCK_C = 1024
#: Programs the length-bounded top-k's chunks aim for in all on a GPU (two per SM of an H200).
TOPK_PROGRAMS = 264
#: Top-k programs a row in the interpreter (the tests' long rows still split into chunks).
INTERPRETER_TOPK_PARTS = 2


# --------------------------------------------------------------------------------- kernel
@triton.jit
def _row_queries(
    q_ptr, w_ptr, row, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh,
    HI: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Row ``row``'s queries ``[BLOCK_H, BLOCK_D]`` (as stored) and fp32 head weights
    ``[BLOCK_H]``; padded heads load q = 0 and w = 0, so they add nothing (``tl.dot`` needs
    >= 16 rows)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    q_mask = (h < HI)[:, None] & (d < DIM)[None, :]
    q_ptrs = q_ptr + row * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    w = tl.load(w_ptr + row * stride_wt + h * stride_wh, mask=h < HI, other=0.0)
    return q, w.to(tl.float32)


@triton.jit
def _candidate_slots(page_table_ptr, row, cols, valid, stride_pt_t, stride_pt_p, E: tl.constexpr):
    """c4 slots (int64) of row ``row``'s entries ``cols``; -1 where not ``valid``."""
    page_ptrs = page_table_ptr + row * stride_pt_t + (cols // E) * stride_pt_p
    page = tl.load(page_ptrs, mask=valid, other=0).to(tl.int64)
    return tl.where(valid, page * E + cols % E, -1)


@triton.jit
def _indexer_scores_kernel(
    q_ptr,  # [T, HI, DIM] fp32 / bf16
    w_ptr,  # [T, HI] float
    key_ptr,  # dense [num_slots, DIM] float, or fp8 [num_pages, PAGE_TOKENS * (DIM + 4)] uint8
    page_table_ptr,  # [T, Pw] int32
    num_ptr,  # [T] int32 candidates per row
    out_ptr,  # [T, N] fp32
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
    PAGE_TOKENS: tl.constexpr,  # fp8 layout: entries per key page
    E: tl.constexpr,  # c4 entries per full-cache page
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    DOT_BF16: tl.constexpr,  # bf16 tensor-core dots (GPU); fp32 in the interpreter
):
    """One program: row ``program_id(0)``, candidate columns ``[n0, n0 + BLOCK_N)``: the
    ``[BLOCK_N, DIM]`` gathered keys (dequantised in registers) times the row's ``[DIM, HI]``
    queries on tensor cores, then ReLU, the head weights and the head sum."""
    row = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    in_matrix = cols < num_cols
    num = tl.minimum(tl.load(num_ptr + row), num_cols)
    out_ptrs = out_ptr + row * stride_out_t + cols
    if n0 < num:
        valid = cols < num
        d = tl.arange(0, BLOCK_D)
        q, w = _row_queries(
            q_ptr, w_ptr, row, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh,
            HI, DIM, BLOCK_H, BLOCK_D,
        )  # fmt: skip
        q = q.to(tl.float32)  # [BLOCK_H, BLOCK_D]
        slots = _candidate_slots(page_table_ptr, row, cols, valid, stride_pt_t, stride_pt_p, E)
        if FP8:
            keys = load_fp8_indexer_block(key_ptr, slots, d, valid, DIM, PAGE_TOKENS)
        else:
            keys = load_dense_block(key_ptr, stride_key_slot, slots, d, valid, DIM)
        if DOT_BF16:
            dots = tl.dot(keys.to(tl.bfloat16), tl.trans(q.to(tl.bfloat16)))
        else:  # the interpreter's bf16 dot is wrong: fp32 operands, exact products
            dots = tl.dot(keys, tl.trans(q), input_precision="ieee")  # [BLOCK_N, BLOCK_H]
        scores = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)
        tl.store(out_ptrs, tl.where(valid, scores, float("-inf")), mask=in_matrix)
    else:
        tl.store(out_ptrs, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=in_matrix)


@triton.jit
def _selected_slots_kernel(
    picked_ptr,  # [T, K] int top-k columns of each row, any order (unused without HAS_PICKED)
    num_ptr,  # [T] int32 candidates per row
    page_table_ptr,  # [T, Pw] int32
    out_ptr,  # [T, K] int32 c4 slots, ascending entry order, -1 padded
    stride_picked_t,
    stride_pt_t,
    stride_pt_p,
    stride_out_t,
    num_cols,  # N
    K,
    E: tl.constexpr,  # c4 entries per full-cache page
    HAS_PICKED: tl.constexpr,  # False when N <= K: every column is picked
    BLOCK_K: tl.constexpr,
):
    """One row: keep the picked columns below its candidate count, sort them, write slots."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    num = tl.minimum(tl.maximum(tl.load(num_ptr + row), 0), num_cols)
    if HAS_PICKED:
        col = tl.load(picked_ptr + row * stride_picked_t + k, mask=k < K, other=num_cols)
        col = col.to(tl.int32)
    else:
        col = k
    col = tl.sort(tl.where((col < num) & (k < K), col, num_cols))  # dropped columns last
    valid = col < num
    page = tl.load(page_table_ptr + row * stride_pt_t + (col // E) * stride_pt_p, mask=valid)
    slots = tl.where(valid, page * E + col % E, -1)
    tl.store(out_ptr + row * stride_out_t + k, slots, mask=k < K)


@triton.jit
def _row_scores_kernel(
    q_ptr,  # [T, HI, DIM] fp32 / bf16
    w_ptr,  # [T, HI] float
    key_ptr,  # dense [num_slots, DIM] float, or fp8 [num_pages, PAGE_TOKENS * (DIM + 4)] uint8
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
    PAGE_TOKENS: tl.constexpr,  # fp8 layout: entries per key page
    E: tl.constexpr,  # c4 entries per full-cache page
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
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
        q, w = _row_queries(
            q_ptr, w_ptr, row, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh,
            HI, DIM, BLOCK_H, BLOCK_D,
        )  # fmt: skip
        q_t = tl.trans(q.to(tl.bfloat16) if GPU else q.to(tl.float32))  # [BLOCK_D, BLOCK_H]
        for n0 in range(split * BLOCK_N, num, step):
            cols = n0 + tl.arange(0, BLOCK_N)
            valid = cols < num
            slots = _candidate_slots(page_table_ptr, row, cols, valid, stride_pt_t, stride_pt_p, E)
            if FP8:
                data, scale_at, _ = fp8_indexer_addresses(slots, valid, DIM, PAGE_TOKENS)
                m = valid[:, None] & (d < DIM)[None, :]
                code = tl.load(key_ptr + data[:, None] + d[None, :], mask=m, other=0)
                keys = e4m3_decode(code, GPU)  # [BLOCK_N, BLOCK_D] unscaled e4m3 values
                scale_ptrs = (key_ptr + scale_at).to(tl.pointer_type(tl.float32))
                scale = tl.load(scale_ptrs, mask=valid, other=0.0)
            else:
                keys = load_dense_block(key_ptr, stride_key_slot, slots, d, valid, DIM)
                scale = tl.full([BLOCK_N], 1.0, tl.float32)
            if GPU:
                dots = tl.dot(keys.to(tl.bfloat16), q_t)
            else:  # the interpreter's bf16 dot is wrong: fp32 operands, exact products
                dots = tl.dot(keys, q_t, input_precision="ieee")  # [BLOCK_N, BLOCK_H]
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
    scores_ptr, n, K, cols_ptr, col0, dst_scores_ptr, dst_ptr, pt_row, stride_pt_p,
    E: tl.constexpr, SLOTS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
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
                scores_ptr + row * stride_scores_t + lo, tl.minimum(length, num - lo), K,
                cand_cols_ptr, lo,
                cand_scores_ptr + row * stride_cand_t + part * K,
                cand_cols_ptr + row * stride_cand_t + part * K,
                num_ptr, 0, 1, False, BLOCK_C,
            )  # fmt: skip


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
            cand_scores_ptr + row * stride_cand_t, total, K,
            cand_cols_ptr + row * stride_cand_t, 0, cand_scores_ptr, out_row,
            pt_row, stride_pt_p, E, True, BLOCK_C,
        )  # fmt: skip


# ------------------------------------------------------------------------------- helpers
def _check_inputs(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    keys: IndexerKeyCache,
    page_table: torch.Tensor,
    num_candidates: torch.Tensor,
    max_candidates: int,
) -> None:
    if q_idx.dim() != 3 or not q_idx.is_floating_point():
        raise ContractError(
            f"q_idx has shape {tuple(q_idx.shape)} and dtype {q_idx.dtype}; expected a float "
            "tensor [T, HI, DI]"
        )
    rows, heads, dim = q_idx.shape
    # name -> (tensor, expected shape (None: any size), expected dtype (None: any float))
    expected = {
        "weights": (weights, (rows, heads), None),
        "page_table": (page_table, (rows, None), torch.int32),
        "num_candidates": (num_candidates, (rows,), torch.int32),
    }
    for name, (tensor, shape, dtype) in expected.items():
        shape_ok = tensor.dim() == len(shape) and all(
            want is None or got == want for got, want in zip(tensor.shape, shape, strict=True)
        )
        dtype_ok = tensor.is_floating_point() if dtype is None else tensor.dtype == dtype
        if not (shape_ok and dtype_ok):
            want = "[" + ", ".join("Pw" if n is None else str(n) for n in shape) + "]"
            raise ContractError(
                f"{name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; expected "
                f"{want} {dtype or 'float'} (q_idx is [T={rows}, HI={heads}, DI={dim}])"
            )
    for name, device in (
        ("weights", weights.device),
        ("page_table", page_table.device),
        ("num_candidates", num_candidates.device),
        ("the indexer key cache", keys.device),
    ):
        if device != q_idx.device:
            raise ContractError(f"{name} is on {device}; q_idx is on {q_idx.device}")
    if keys.dim != dim:
        raise ContractError(f"the indexer key cache has dim {keys.dim}; q_idx has DI={dim}")
    if keys.fmt == "dense" and keys.storage.stride(1) != 1:
        raise ContractError(
            f"the dense indexer key cache has channel stride {keys.storage.stride(1)}; "
            "expected contiguous rows (stride(1) == 1)"
        )
    if max_candidates < 0:
        raise ContractError(f"max_candidates={max_candidates}; expected >= 0")


def c4_entry_slots(page_table: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """c4 cache slots of per-row entry indices.

    Parameters
    ----------
    page_table : ``[T, Pw]`` int32 full-cache pages of each row's request.
    entries : ``[T, n]`` integer entry indices; negative means none.

    Returns ``[T, n]`` int64: ``page_table[t, e // 64] * 64 + e % 64``, -1 where ``e < 0``.
    """
    valid = entries >= 0
    entries = torch.where(valid, entries, 0).long()
    pages = page_table.gather(1, entries // C4_ENTRIES_PER_PAGE).long()
    slots = pages * C4_ENTRIES_PER_PAGE + entries % C4_ENTRIES_PER_PAGE
    return torch.where(valid, slots, -1)


# ---------------------------------------------------------------------------------- scores
def _index_scores_torch(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    keys: IndexerKeyCache,
    page_table: torch.Tensor,
    num_candidates: torch.Tensor,
    max_candidates: int,
) -> torch.Tensor:
    cols = torch.arange(max_candidates, device=q_idx.device)
    valid = cols[None, :] < num_candidates[:, None]
    k = keys.gather(c4_entry_slots(page_table, torch.where(valid, cols, -1)))  # [T, N, DI]
    dots = torch.einsum("thd,tnd->thn", q_idx.float(), k)
    scores = torch.einsum("th,thn->tn", weights.float(), dots.relu())
    return scores.masked_fill(~valid, float("-inf"))


def _index_scores_triton(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    keys: IndexerKeyCache,
    page_table: torch.Tensor,
    num_candidates: torch.Tensor,
    max_candidates: int,
) -> torch.Tensor:
    rows, heads, dim = q_idx.shape
    out = torch.empty(rows, max_candidates, dtype=torch.float32, device=q_idx.device)
    if rows == 0 or max_candidates == 0:
        return out
    num_candidates = num_candidates.contiguous()  # read with unit stride
    grid = (rows, triton.cdiv(max_candidates, BLOCK_N))
    _indexer_scores_kernel[grid](
        q_idx, weights, keys.storage, page_table, num_candidates, out,
        q_idx.stride(0), q_idx.stride(1), q_idx.stride(2),
        weights.stride(0), weights.stride(1),
        keys.storage.stride(0),
        page_table.stride(0), page_table.stride(1),
        out.stride(0),
        max_candidates,
        HI=heads,
        DIM=dim,
        PAGE_TOKENS=keys.page_tokens,  # fp8 layout only
        E=C4_ENTRIES_PER_PAGE,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=BLOCK_N,
        FP8=keys.fmt == "fp8",
        DOT_BF16=q_idx.device.type == "cuda",
    )  # fmt: skip
    return out


def score_splits(rows: int, max_candidates: int, device: torch.device) -> int:
    """Programs a row's scores are split over: enough for ``SCORE_PROGRAMS`` in all on a GPU
    (``INTERPRETER_SPLITS`` a row in the interpreter, which runs programs one by one), never
    more than the row's column blocks. It depends on the batch's row count and (only below
    that many blocks) on the width, so a long maximum context adds no programs."""
    splits = triton.cdiv(SCORE_PROGRAMS, rows) if device.type == "cuda" else INTERPRETER_SPLITS
    return max(1, min(triton.cdiv(max_candidates, BLOCK_N), splits))


def _row_scores_triton(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    keys: IndexerKeyCache,
    page_table: torch.Tensor,
    num_candidates: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Launch ``_row_scores_kernel``: ``out`` ``[T, N]`` receives each row's scores at
    columns ``< min(num_candidates, N)``; nothing else is read or written."""
    rows, heads, dim = q_idx.shape
    cols = out.shape[1]
    if rows == 0 or cols == 0:
        return
    _row_scores_kernel[(rows, score_splits(rows, cols, q_idx.device))](
        q_idx, weights, keys.storage, page_table, num_candidates.contiguous(), out,
        q_idx.stride(0), q_idx.stride(1), q_idx.stride(2),
        weights.stride(0), weights.stride(1),
        keys.storage.stride(0),
        page_table.stride(0), page_table.stride(1),
        out.stride(0),
        cols,
        HI=heads,
        DIM=dim,
        PAGE_TOKENS=keys.page_tokens,  # fp8 layout only
        E=C4_ENTRIES_PER_PAGE,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=BLOCK_N,
        FP8=keys.fmt == "fp8",
        GPU=q_idx.device.type == "cuda",
    )  # fmt: skip


def topk_parts(rows: int, cols: int, topk: int, device: torch.device) -> int:
    """Programs a row's top-k is split over (the grid's second axis, fixed under CUDA graphs):
    enough for ``TOPK_PROGRAMS`` in all on a GPU (``INTERPRETER_TOPK_PARTS`` in the
    interpreter), never more than a row of ``cols`` entries can fill (its chunks are at least
    ``sqrt(cols * topk)`` long: ``_chunk_length``). Past the chunks of a row's own count a
    program reads only the count, so a long maximum context adds no work."""
    parts = triton.cdiv(TOPK_PROGRAMS, rows) if device.type == "cuda" else INTERPRETER_TOPK_PARTS
    return max(1, min(parts, math.isqrt(cols // max(topk, 1)) + 1))


def _topk_slots_triton(
    scores: torch.Tensor,
    num_candidates: torch.Tensor,
    page_table: torch.Tensor,
    topk: int,
    out: torch.Tensor,
) -> None:
    """Launch ``_topk_chunks_kernel`` (``topk_parts`` programs a row; skipped when no row can
    have more than ``topk`` candidates) and ``_merge_topk_slots_kernel`` (one a row). They
    read each row's own ``num`` scores, and its chunks' candidates, only.

    The candidate buffers are ``[T, min(N, parts * topk)]``: a row's candidates are at most
    its count and ``topk`` a chunk."""
    rows, cols = scores.shape
    if rows == 0 or topk == 0:
        return
    device = scores.device
    block_c = TOPK_BLOCK_C if device.type == "cuda" else BLOCK_N
    num_candidates = num_candidates.contiguous()  # read with unit stride
    parts = topk_parts(rows, cols, topk, device)
    width = min(cols, parts * topk)
    cand_scores = torch.empty(rows, width, dtype=torch.float32, device=device)
    cand_cols = torch.empty(rows, width, dtype=torch.int32, device=device)
    if cols > topk:
        _topk_chunks_kernel[(rows, parts)](
            scores, num_candidates, cand_scores, cand_cols,
            scores.stride(0), cand_scores.stride(0),
            cols, topk,
            BLOCK_C=block_c,
        )  # fmt: skip
    _merge_topk_slots_kernel[(rows,)](
        cand_scores, cand_cols, num_candidates, page_table, out,
        cand_scores.stride(0), page_table.stride(0), page_table.stride(1), out.stride(0),
        cols, topk, parts,
        E=C4_ENTRIES_PER_PAGE,
        BLOCK_K=triton.next_power_of_2(topk),
        BLOCK_C=block_c,
    )  # fmt: skip


def _bounded(device: torch.device) -> bool:
    """The length-bounded kernels (``_row_scores_kernel``, ``_topk_chunks_kernel``,
    ``_merge_topk_slots_kernel``) run."""
    return dispatch.use_triton(device) and dispatch.use_unverified("indexer", device)


def index_scores(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    keys: IndexerKeyCache,
    page_table: torch.Tensor,
    num_candidates: torch.Tensor,
    max_candidates: int,
) -> torch.Tensor:
    """Indexer scores of every row's candidate c4 entries.

    Parameters
    ----------
    q_idx : ``[T, HI, DI]`` fp32 / bf16 indexer queries, already roped.
    weights : ``[T, HI]`` float head weights, already scaled by ``DI^-0.5 * HI^-0.5``.
    keys : the layer's indexer key cache (dense or fp8), addressed by c4 slot.
    page_table : ``[T, Pw]`` int32 full-cache pages of each row's request.
    num_candidates : ``[T]`` int32 visible entries, ``c4.topk_lengths_raw`` (``(p+1)//4``);
        values above ``max_candidates`` are clamped to it.
    max_candidates : ``N``, the score columns; static under CUDA graphs.

    Returns ``[T, N]`` fp32 scores, ``-inf`` at columns ``>= num_candidates``.
    """
    _check_inputs(q_idx, weights, keys, page_table, num_candidates, max_candidates)
    if _bounded(q_idx.device):
        rows = q_idx.shape[0]
        out = torch.full((rows, max_candidates), float("-inf"), device=q_idx.device)
        _row_scores_triton(q_idx, weights, keys, page_table, num_candidates, out)
        return out
    if dispatch.use_triton(q_idx.device):
        return _index_scores_triton(
            q_idx, weights, keys, page_table, num_candidates, max_candidates
        )
    return _index_scores_torch(q_idx, weights, keys, page_table, num_candidates, max_candidates)


# ---------------------------------------------------------------------------------- top-k
def _use_flashinfer_topk(device: torch.device) -> bool:
    return dispatch.topk_path(device)[0] == "flashinfer"


def _best_columns(masked: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, k]`` int64 columns of the ``k`` largest values per row, ties to the smaller column."""
    if _use_flashinfer_topk(masked.device):
        import flashinfer

        with launch("flashinfer.top_k"):  # its radix kernel (plus an int64 cast of the ids)
            return flashinfer.top_k(
                masked, k, tie_break=flashinfer.TopKTieBreak.SMALL, dsa_graph_safe=True
            )[1]
    # A stable descending sort keeps equal scores in column order (torch.topk does not promise
    # which of equal scores it keeps, and relu makes exact ties common).
    return torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :k]


def warm_up_topk(device: torch.device | str, topk: int) -> None:
    """Build flashinfer's top-k kernels and its workspace on ``device`` (no-op elsewhere).

    Its first call JIT-compiles and allocates, which must not happen inside a CUDA-graph
    capture: call this before capturing.
    """
    if _use_flashinfer_topk(torch.device(device)):
        _best_columns(torch.zeros(1, topk + 1, device=device), topk)


def select_entries(scores: torch.Tensor, num_candidates: torch.Tensor, topk: int) -> torch.Tensor:
    """Selected entry indices per row: ``[T, topk]`` int64, ascending, ``-1`` padded.

    Every candidate when ``num_candidates[t] <= topk``, else the ``topk`` best scores (ties to
    the smaller index). ``scores`` is ``[T, N]`` float (``index_scores``' output); candidates
    beyond ``N`` are ignored.
    """
    rows, cols = scores.shape
    num = num_candidates.clamp(0, cols).long()[:, None]
    column = torch.arange(cols, device=scores.device)
    if cols > topk:
        # Valid scores are finite, so they outrank the -inf padding of short rows.
        masked = scores.float().masked_fill(column >= num, float("-inf"))
        picked = _best_columns(masked, topk)
    else:
        picked = column.expand(rows, cols)
    picked = torch.where(picked < num, picked, cols).sort(dim=1).values
    picked = torch.where(picked < cols, picked, -1)
    return torch.nn.functional.pad(picked, (0, topk - picked.shape[1]), value=-1)


def select_topk(
    scores: torch.Tensor,
    num_candidates: torch.Tensor,
    page_table: torch.Tensor,
    topk: int,
    out: torch.Tensor,
) -> None:
    """Write the c4 slots of each row's selected entries into ``out``.

    Parameters
    ----------
    scores : ``[T, N]`` float (``index_scores``).
    num_candidates : ``[T]`` int32 candidates per row.
    page_table : ``[T, Pw]`` int32 full-cache pages of each row's request.
    topk : ``K``, entries kept per row (``index_topk``).
    out : ``[T, K]`` int32, e.g. ``c4.page_indices``; receives the slots of the selected
        entries in ascending entry order, then ``-1`` (rows with 0 candidates are all ``-1``).
    """
    _check_selection(scores, num_candidates, page_table, topk, out)
    if _bounded(scores.device):
        _topk_slots_triton(scores.float().contiguous(), num_candidates, page_table, topk, out)
        return
    if dispatch.use_triton(scores.device):
        column = torch.arange(scores.shape[1], device=scores.device)
        scores = scores.float().masked_fill(column >= num_candidates[:, None], float("-inf"))
    _select_masked(scores, num_candidates, page_table, topk, out)


def _check_selection(
    scores: torch.Tensor,
    num_candidates: torch.Tensor,
    page_table: torch.Tensor,
    topk: int,
    out: torch.Tensor,
) -> None:
    if scores.dim() != 2 or num_candidates.shape != scores.shape[:1]:
        raise ContractError(
            f"scores {tuple(scores.shape)} and num_candidates {tuple(num_candidates.shape)}; "
            "expected [T, N] and [T]"
        )
    rows = scores.shape[0]
    if tuple(out.shape) != (rows, topk) or out.dtype != torch.int32:
        raise ContractError(
            f"out has shape {tuple(out.shape)} and dtype {out.dtype}; expected [{rows}, "
            f"{topk}] int32 (topk={topk})"
        )
    if page_table.dim() != 2 or page_table.shape[0] != rows:
        raise ContractError(
            f"page_table has shape {tuple(page_table.shape)}; expected [{rows}, Pw]"
        )


def _select_masked(
    scores: torch.Tensor,
    num_candidates: torch.Tensor,
    page_table: torch.Tensor,
    topk: int,
    out: torch.Tensor,
) -> None:
    """``select_topk`` for scores already ``-inf`` at columns ``>= num_candidates`` (on the
    Triton path: the top-k, then ``_selected_slots_kernel``; two launches)."""
    if not dispatch.use_triton(scores.device):
        out.copy_(c4_entry_slots(page_table, select_entries(scores, num_candidates, topk)))
        return
    rows, cols = scores.shape
    if rows == 0 or topk == 0:
        return
    picked = _best_columns(scores, topk) if cols > topk else None
    _selected_slots_kernel[(rows,)](
        out if picked is None else picked, num_candidates, page_table, out,
        0 if picked is None else picked.stride(0),
        page_table.stride(0), page_table.stride(1), out.stride(0),
        cols, topk,
        E=C4_ENTRIES_PER_PAGE,
        HAS_PICKED=picked is not None,
        BLOCK_K=triton.next_power_of_2(topk),
    )  # fmt: skip


def run_indexer(
    q_idx: torch.Tensor,
    weights: torch.Tensor,
    keys: IndexerKeyCache,
    page_table: torch.Tensor,
    num_candidates: torch.Tensor,
    topk: int,
    out: torch.Tensor,
    max_candidates: int | None = None,
) -> None:
    """Score and select: fill ``out`` (``[T, topk]`` int32, ``c4.page_indices``) with slots.

    ``max_candidates`` defaults to every entry the page table can address (``Pw * 64``); pass
    a smaller static bound for long prefills (the score matrix is ``[T, max_candidates]``).
    Other arguments as in ``index_scores`` and ``select_topk``.
    """
    if max_candidates is None:
        max_candidates = page_table.shape[-1] * C4_ENTRIES_PER_PAGE
    if _bounded(q_idx.device):
        _check_inputs(q_idx, weights, keys, page_table, num_candidates, max_candidates)
        # Full width but never cleared: a row's scores are written and read below its own
        # count only. Under CUDA graphs every shape is fixed at capture and any row may have
        # N candidates; packing the rows tighter would need each row's offset and a bound on
        # the batch's total, which the plan does not carry.
        scores = torch.empty(q_idx.shape[0], max_candidates, device=q_idx.device)
        _row_scores_triton(q_idx, weights, keys, page_table, num_candidates, scores)
        _check_selection(scores, num_candidates, page_table, topk, out)
        _topk_slots_triton(scores, num_candidates, page_table, topk, out)
        return
    scores = index_scores(q_idx, weights, keys, page_table, num_candidates, max_candidates)
    _check_selection(scores, num_candidates, page_table, topk, out)
    _select_masked(scores, num_candidates, page_table, topk, out)
