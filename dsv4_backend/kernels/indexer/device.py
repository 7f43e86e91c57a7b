"""``@triton.jit`` helpers of both Triton variants of the lightning indexer (``triton.py``,
``bounded.py``): a row's queries and head weights, the c4 slots of its candidate entries."""

import triton
import triton.language as tl


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
