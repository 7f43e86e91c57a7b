"""Device code of the sparse-attention op shared by its variants (``@triton.jit``; the ws
kernels call these from Gluon): the log2-domain constant, the e4m3 -> bf16 rebias and the
deal of a program row's key blocks to its splits."""

from __future__ import annotations

import math

import triton
import triton.language as tl

#: exp(x) = exp2(x * LOG2E): the kernels work in the log2 domain.
LOG2E = tl.constexpr(math.log2(math.e))


@triton.jit
def e4m3_rebiased_bf16(code):
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
def split_blocks(win_len_ptr, ext_len_ptr, prog, split, grid_splits, win_width, ext_width,
                 HAS_EXTRA: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Program row ``prog``'s window and extra key counts, its window blocks (``cdiv(n_win,
    BLOCK_N)``, then the extra blocks), its splits (whole blocks a split: of the grid's
    ``grid_splits`` only those that get one run, at least one, which finalises a row without
    keys) and this ``split``'s first block and block count. Shared with the ws kernels."""
    n_win = tl.minimum(tl.maximum(tl.load(win_len_ptr + prog), 0), win_width)
    win_blocks = tl.cdiv(n_win, BLOCK_N)
    n_ext = 0
    if HAS_EXTRA:
        n_ext = tl.minimum(tl.maximum(tl.load(ext_len_ptr + prog), 0), ext_width)
    all_blocks = win_blocks + tl.cdiv(n_ext, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(all_blocks, grid_splits), 1)
    splits = tl.maximum(tl.cdiv(all_blocks, per_split), 1)
    first = split * per_split
    return n_win, n_ext, win_blocks, splits, first, tl.minimum(per_split, all_blocks - first)
