"""``@triton.jit`` helpers of both Triton variants of the lightning indexer (``triton.py``,
``bounded.py``): the key formats their kernels take (``KEYS``), a row's queries and head
weights, the slots of its candidate entries, and its dots with fp4 index keys (DeepSeek-V4.1's,
and the c4 keys of ``indexer_selection="fp4"``); the arguments their scores kernels share
(:func:`score_arguments`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from dsv4_backend.cache.fp4_format import Fp4IndexKeyLayout
from dsv4_backend.kernels.device.fp4 import load_fp4_index_block
from dsv4_backend.kernels.indexer.common import BLOCK_N, IndexCall

if TYPE_CHECKING:
    from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache
    from dsv4_backend.cache.indexer_cache import IndexerKeyCache

#: The scores kernels' key formats (their ``KEYS`` constexpr): dense rows, fp8 indexer pages,
#: fp4 index-key pages.
DENSE_KEYS: tl.constexpr = tl.constexpr(0)
FP8_KEYS: tl.constexpr = tl.constexpr(1)
FP4_KEYS: tl.constexpr = tl.constexpr(2)


def key_format(keys: IndexerKeyCache | Fp4IndexKeyCache) -> int:
    """The ``KEYS`` constexpr of the scores kernels for ``keys``' format."""
    if keys.layout is None:
        return DENSE_KEYS.value
    return (FP4_KEYS if isinstance(keys.layout, Fp4IndexKeyLayout) else FP8_KEYS).value


@triton.jit
def row_queries(
    q_ptr,
    w_ptr,
    row,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_wt,
    stride_wh,
    HI: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
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
def candidate_slots(page_table_ptr, row, cols, valid, stride_pt_t, stride_pt_p, E: tl.constexpr):
    """Slots (int64) of row ``row``'s entries ``cols`` (``E`` entries a full-cache page: c4
    64, c1 256, c2 128); -1 where not ``valid``."""
    page_ptrs = page_table_ptr + row * stride_pt_t + (cols // E) * stride_pt_p
    page = tl.load(page_ptrs, mask=valid, other=0).to(tl.int64)
    return tl.where(valid, page * E + cols % E, -1)


@triton.jit
def fp4_row_dots(
    q_ptr,
    key_ptr,
    row,
    slots,
    valid,
    stride_qt,
    stride_qh,
    stride_qd,
    HI: tl.constexpr,
    DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    """``[BLOCK_N, BLOCK_H]`` fp32 dots of row ``row``'s queries with the fp4 index keys at
    ``slots`` (DeepSeek-V4.1), one ue8m0 block of 32 channels at a time: the decoded keys of a
    block stay in registers next to its queries, not the whole ``[BLOCK_N, DIM]`` tile."""
    h = tl.arange(0, BLOCK_H)
    dots = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    for c in tl.static_range(DIM // 32):
        d = c * 32 + tl.arange(0, 32)
        q_ptrs = q_ptr + row * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=(h < HI)[:, None], other=0.0).to(tl.float32)
        keys = load_fp4_index_block(key_ptr, slots, d, valid, DIM, PAGE_TOKENS)
        if DOT_BF16:
            dots += tl.dot(keys.to(tl.bfloat16), tl.trans(q.to(tl.bfloat16)))
        else:  # the interpreter's bf16 dot is wrong: fp32 operands, exact products
            dots += tl.dot(keys, tl.trans(q), input_precision="ieee")
    return dots


def score_arguments(call: IndexCall, out: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(arguments, constexprs)`` both scores kernels (``triton.py``'s full-width one,
    ``bounded.py``'s row scores) take for ``call`` writing ``out`` ``[T, N]``: the tensors and
    their strides, ``N``, the shapes, the key format and ``call.entries_per_page``."""
    q_idx, weights, keys, page_table = call.q_idx, call.weights, call.keys, call.page_table
    _, heads, dim = q_idx.shape
    arguments = (
        q_idx,
        weights,
        keys.storage,
        page_table,
        call.num_candidates.contiguous(),  # read with unit stride
        out,
        q_idx.stride(0),
        q_idx.stride(1),
        q_idx.stride(2),
        weights.stride(0),
        weights.stride(1),
        keys.storage.stride(0),
        page_table.stride(0),
        page_table.stride(1),
        out.stride(0),
        out.shape[1],
    )
    constexprs = dict(
        HI=heads,
        DIM=dim,
        PAGE_TOKENS=keys.layout.page_tokens if keys.layout is not None else 1,
        E=call.entries_per_page,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=BLOCK_N,
        KEYS=key_format(keys),
    )
    return arguments, constexprs
