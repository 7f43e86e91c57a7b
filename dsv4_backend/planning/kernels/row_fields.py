"""Per-row compression fields of one ratio (the ``row_compression_metadata`` op).

docs/design.md §3-4: row ``t`` at position ``p`` (a decode row of length ``p + 1``) gets

* ``out_loc = raw_out_loc // ratio`` where ``(p + 1) % ratio == 0`` (the row completes an
  entry), else ``-1``;
* ``raw = (p + 1) // ratio``, ``clamp1 = max(raw, 1)``, ``sparse = min(clamp1, K)`` (ratio 4)
  or ``clamp1`` (ratio 128);
* ratio 128 only: ``page_indices[t, j] = page_table[t, j // 2] * 2 + j % 2`` (the c128 slot of
  entry ``j``; 2 c128 entries per 256-token page) for ``j < raw`` with ``j // 2 < Pw``, ``-1``
  elsewhere.

The Triton kernel, its launcher :func:`row_fields_triton` and the torch twin
:func:`row_fields_torch` (the kernel matches it exactly: floor division and modulo, as torch's,
also for negative values); ``planning/kernels/table.py`` chooses between them. Shapes: ``T``
rows, ``Pw`` page-table width, ``N128`` c128 index width, ``K`` ``index_topk``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.config import check_compressed_ratio, entries_per_page
from dsv4_backend.errors import ConfigError, ContractError

#: Rows per program.
BLOCK_T = 64
#: c128 index columns per program.
BLOCK_N = 64


class RowFields(NamedTuple):
    """``T`` rows of one ratio; dtypes as in ``CompressedMetadata``."""

    out_loc: torch.Tensor  # [T] int64
    topk_lengths_raw: torch.Tensor  # [T] int32
    topk_lengths_clamp1: torch.Tensor  # [T] int32
    sparse_topk_lengths: torch.Tensor  # [T] int32
    page_indices: torch.Tensor | None  # ratio 128: [T, c128_width] int32; ratio 4: None


# --------------------------------------------------------------------------------- kernel
@triton.jit
def _floor_mod(a, D: tl.constexpr):
    """``a mod D`` in ``[0, D)`` for ``D > 0`` (Triton's ``%`` truncates toward zero)."""
    r = a % D
    return tl.where(r < 0, r + D, r)


@triton.jit
def _floor_div(a, D: tl.constexpr):
    """``floor(a / D)`` for ``D > 0``; ``a - mod`` is a multiple of ``D``, so ``//`` is exact."""
    return (a - _floor_mod(a, D)) // D


@triton.jit
def _row_fields_kernel(
    positions_ptr,  # [T] int64
    raw_out_loc_ptr,  # [T] int64
    page_table_ptr,  # [T, Pw] int32 (read for ratio 128 only)
    out_loc_ptr,  # [T] int64
    raw_ptr,  # [T] int32
    clamp1_ptr,  # [T] int32
    sparse_ptr,  # [T] int32
    page_indices_ptr,  # [T, N128] int32 (ratio 128 only)
    num_rows,  # T
    page_width,  # Pw
    c128_width,  # N128
    index_topk,  # K
    stride_pos,
    stride_loc,
    stride_pt_t,
    stride_pt_p,
    stride_pi_t,
    RATIO: tl.constexpr,
    PER_PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rows ``[t0, t0 + BLOCK_T)``; column block ``program_id(1)`` of the c128 indices.

    Column block 0 also writes the per-row fields.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_rows
    next_len = tl.load(positions_ptr + rows * stride_pos, mask=row_mask, other=0) + 1  # p + 1
    raw = _floor_div(next_len, RATIO)  # [BLOCK_T] int64
    if tl.program_id(1) == 0:
        loc = tl.load(raw_out_loc_ptr + rows * stride_loc, mask=row_mask, other=0)
        completes = _floor_mod(next_len, RATIO) == 0
        tl.store(out_loc_ptr + rows, tl.where(completes, _floor_div(loc, RATIO), -1), mask=row_mask)
        raw32 = raw.to(tl.int32)
        clamp1 = tl.maximum(raw32, 1)
        sparse = tl.minimum(clamp1, index_topk) if RATIO == 4 else clamp1
        tl.store(raw_ptr + rows, raw32, mask=row_mask)
        tl.store(clamp1_ptr + rows, clamp1, mask=row_mask)
        tl.store(sparse_ptr + rows, sparse, mask=row_mask)
    if RATIO == 128:
        cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_matrix = row_mask[:, None] & (cols < c128_width)[None, :]
        column = cols // PER_PAGE
        # Entries not yet complete, or on a page the table does not hold, get -1.
        visible = in_matrix & (cols[None, :] < raw.to(tl.int32)[:, None])
        visible &= (column < page_width)[None, :]
        pages = tl.load(
            page_table_ptr + rows[:, None] * stride_pt_t + column[None, :] * stride_pt_p,
            mask=visible,
            other=0,
        )
        slots = pages.to(tl.int64) * PER_PAGE + (cols % PER_PAGE)[None, :]
        tl.store(
            page_indices_ptr + rows[:, None] * stride_pi_t + cols[None, :],
            tl.where(visible, slots, -1).to(tl.int32),
            mask=in_matrix,
        )


# ------------------------------------------------------------------------------- launcher
def check_row_field_inputs(
    positions: torch.Tensor,
    raw_out_loc: torch.Tensor,
    page_table: torch.Tensor,
    ratio: int,
    index_topk: int,
    c128_width: int,
) -> None:
    check_compressed_ratio(ratio, "row fields")
    if index_topk < 1 or c128_width < 0:
        raise ConfigError(
            f"index_topk={index_topk}, c128_width={c128_width}; expected >= 1 and >= 0"
        )
    rows = positions.shape[0] if positions.dim() == 1 else -1
    checks = {
        "positions": (positions, positions.dim() == 1, torch.int64, "[T]"),
        "raw_out_loc": (raw_out_loc, tuple(raw_out_loc.shape) == (rows,), torch.int64, "[T]"),
        "page_table": (
            page_table, page_table.dim() == 2 and page_table.shape[0] == rows, torch.int32,
            "[T, Pw]",
        ),
    }  # fmt: skip
    for name, (tensor, shape_ok, dtype, shape) in checks.items():
        if not shape_ok or tensor.dtype != dtype:
            raise ContractError(
                f"{name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; expected "
                f"{shape} {dtype} (positions has shape {tuple(positions.shape)})"
            )
        if tensor.device != positions.device:
            raise ContractError(f"{name} is on {tensor.device}; positions is on {positions.device}")
    if ratio == 128 and rows > 0 and page_table.shape[1] == 0:
        raise ContractError("page_table has width 0; c128 page indices need Pw >= 1 when T > 0")


def row_fields_triton(
    positions: torch.Tensor,
    raw_out_loc: torch.Tensor,
    page_table: torch.Tensor,
    *,
    ratio: int,
    index_topk: int,
    c128_width: int,
) -> RowFields:
    """Triton path: :func:`row_fields_torch`'s arguments and result, one launch."""
    rows, device = positions.shape[0], positions.device
    out_loc = torch.empty(rows, dtype=torch.int64, device=device)
    raw, clamp1, sparse = (torch.empty(rows, dtype=torch.int32, device=device) for _ in range(3))
    page_indices = None
    width = 0
    if ratio == 128:
        width = c128_width
        page_indices = torch.empty(rows, width, dtype=torch.int32, device=device)
    if rows == 0:
        return RowFields(out_loc, raw, clamp1, sparse, page_indices)
    # Without c128 indices the output pointer is unused; any int32 tensor stands in.
    indices_arg = page_indices if page_indices is not None else raw
    grid = (triton.cdiv(rows, BLOCK_T), max(1, triton.cdiv(width, BLOCK_N)))
    _row_fields_kernel[grid](
        positions, raw_out_loc, page_table,
        out_loc, raw, clamp1, sparse, indices_arg,
        rows, page_table.shape[1], width, index_topk,
        positions.stride(0), raw_out_loc.stride(0),
        page_table.stride(0), page_table.stride(1),
        indices_arg.stride(0),
        RATIO=ratio,
        PER_PAGE=entries_per_page(ratio),
        BLOCK_T=BLOCK_T,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return RowFields(out_loc, raw, clamp1, sparse, page_indices)


# ---------------------------------------------------------------------------- torch path
def row_fields_torch(
    positions: torch.Tensor,
    raw_out_loc: torch.Tensor,
    page_table: torch.Tensor,
    *,
    ratio: int,
    index_topk: int,
    c128_width: int,
) -> RowFields:
    """The per-row fields of ``ratio`` for ``T`` query rows.

    Parameters
    ----------
    positions : ``[T]`` int64 — absolute position ``p`` of each row.
    raw_out_loc : ``[T]`` int64 — full-cache slot each row writes.
    page_table : ``[T, Pw]`` int32 — full-cache page of each page of the row's request
        (``Pw >= 1`` when ``T > 0``); read for ratio 128 only.
    ratio : 4 or 128.
    index_topk : ``K``, c4 entries kept per query (ratio 4).
    c128_width : ``N128``, columns of the c128 page indices (ratio 128).

    Returns
    -------
    ``RowFields``: ``out_loc = raw_out_loc // ratio`` where ``(p + 1) % ratio == 0`` else -1;
    ``raw = (p + 1) // ratio``; ``clamp1 = max(raw, 1)``; ``sparse = min(clamp1, K)`` for ratio 4
    and ``clamp1`` for ratio 128; for ratio 128 ``page_indices[t, j]`` is the c128 slot of entry
    ``j``, ``page_table[t, j // 2] * 2 + j % 2``, for ``j < raw`` and -1 elsewhere (also where
    column ``j // 2`` lies beyond the table's ``Pw``: a page the table does not hold).
    """
    check_compressed_ratio(ratio, "row fields")
    positions = positions.long()
    completes = (positions + 1) % ratio == 0
    out_loc = torch.where(completes, raw_out_loc.long() // ratio, -1)
    raw = ((positions + 1) // ratio).to(torch.int32)
    clamp1 = torch.clamp(raw, min=1)
    sparse = torch.clamp(clamp1, max=index_topk) if ratio == 4 else clamp1.clone()
    page_indices = None
    if ratio == 128:
        per_page = entries_per_page(ratio)
        entry = torch.arange(c128_width, device=positions.device)
        column = entry // per_page
        known = column < page_table.shape[1]
        # Clamping keeps the masked-out columns in bounds.
        pages = page_table[:, column.clamp(max=max(page_table.shape[1] - 1, 0))].long()
        slots = pages * per_page + entry % per_page
        page_indices = torch.where((entry < raw[:, None]) & known, slots, -1).to(torch.int32)
    return RowFields(out_loc, raw, clamp1, sparse, page_indices)
