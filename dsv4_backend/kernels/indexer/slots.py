"""The selection of the indexer's Triton and DeepGEMM variants: the top-k columns of the whole
``[T, N]`` score matrix (``topk.py``), then ``_selected_slots_kernel`` writes their c4 slots in
ascending entry order."""

from __future__ import annotations

from dataclasses import replace

import triton
import triton.language as tl

from dsv4_backend.kernels.indexer.common import C4_ENTRIES_PER_PAGE, SelectCall, mask_past_count
from dsv4_backend.kernels.indexer.topk import best_columns


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


def select_padded_slots(call: SelectCall) -> None:
    """``table.select_topk`` of scores already ``-inf`` at columns ``>= num_candidates``: the
    top-k (``topk.best_columns``), then ``_selected_slots_kernel``; two launches."""
    scores, page_table, topk, out = call.scores, call.page_table, call.topk, call.out
    rows, cols = scores.shape
    if rows == 0 or topk == 0:
        return
    picked = best_columns(scores, topk) if cols > topk else None
    _selected_slots_kernel[(rows,)](
        out if picked is None else picked,
        call.num_candidates,
        page_table,
        out,
        0 if picked is None else picked.stride(0),
        page_table.stride(0),
        page_table.stride(1),
        out.stride(0),
        cols,
        topk,
        E=C4_ENTRIES_PER_PAGE,
        HAS_PICKED=picked is not None,
        BLOCK_K=triton.next_power_of_2(topk),
    )


def select_slots(call: SelectCall) -> None:
    """``table.select_topk``: :func:`select_padded_slots` of the scores made ``-inf`` past
    each row's count."""
    select_padded_slots(replace(call, scores=mask_past_count(call.scores, call.num_candidates)))
