"""The lightning indexer's Triton variant (the CUDA baseline): ``_indexer_scores_kernel``
with one program per 64 columns of the width; its selection is ``slots.py``'s (the top-k of the
whole ``[T, N]`` matrix, then the slots). The same kernel scores DeepSeek-V4.1's fp4 index keys
(``kernels/low_ratio/table.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels.device.fp8 import load_dense_block, load_fp8_indexer_block
from dsv4_backend.kernels.indexer.common import BLOCK_N, IndexCall
from dsv4_backend.kernels.indexer.device import (
    FP4_KEYS,
    FP8_KEYS,
    candidate_slots,
    fp4_row_dots,
    row_queries,
    score_arguments,
)


@triton.jit
def _indexer_scores_kernel(
    q_ptr,  # [T, HI, DIM] fp32 / bf16
    w_ptr,  # [T, HI] float
    key_ptr,  # dense [num_slots, DIM] float, or fp8 / fp4 pages uint8 (KEYS)
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
    PAGE_TOKENS: tl.constexpr,  # fp8 / fp4 layouts: entries per key page
    E: tl.constexpr,  # entries per full-cache page (c4 64; DeepSeek-V4.1's c1 256, c2 128)
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEYS: tl.constexpr,  # DENSE, FP8 (c4 indexer pages) or FP4 (fp4 index-key pages)
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
        q = q.to(tl.float32)  # [BLOCK_H, BLOCK_D]
        slots = candidate_slots(page_table_ptr, row, cols, valid, stride_pt_t, stride_pt_p, E)
        if KEYS == FP4_KEYS:
            dots = fp4_row_dots(
                q_ptr,
                key_ptr,
                row,
                slots,
                valid,
                stride_qt,
                stride_qh,
                stride_qd,
                HI,
                DIM,
                PAGE_TOKENS,
                BLOCK_H,
                BLOCK_N,
                DOT_BF16,
            )
        else:
            if KEYS == FP8_KEYS:
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


def indexer_scores_triton(call: IndexCall) -> torch.Tensor:
    """``[T, max_candidates]`` fp32 scores of each row's first ``num_candidates`` entries (the
    others -inf); ``keys`` a c4 indexer cache (fp8, dense or, ``indexer_selection="fp4"``, fp4
    pages), or (``entries_per_page`` 256 / 128) a DeepSeek-V4.1 kv source's fp4 index keys."""
    rows, max_candidates = call.q_idx.shape[0], call.max_candidates
    out = torch.empty(rows, max_candidates, dtype=torch.float32, device=call.q_idx.device)
    if rows == 0 or max_candidates == 0:
        return out
    arguments, constexprs = score_arguments(call, out)
    grid = (rows, triton.cdiv(max_candidates, BLOCK_N))
    _indexer_scores_kernel[grid](
        *arguments, **constexprs, DOT_BF16=call.q_idx.device.type == "cuda"
    )
    return out
