"""Per-row compression fields of one ratio (the ``row_compression_metadata`` op).

docs/design.md §3-4: row ``t`` at position ``p`` (a decode row of length ``p + 1``) gets

* ``out_loc = raw_out_loc // ratio`` where ``(p + 1) % ratio == 0`` (the row completes an
  entry), else ``-1``;
* ``raw = (p + 1) // ratio``, ``clamp1 = max(raw, 1)``, ``sparse = min(clamp1, K)`` (ratio 4)
  or ``clamp1`` (ratio 128);
* ratio 128 only: ``page_indices[t, j] = page_table[t, j // 2] * 2 + j % 2`` (the c128 slot of
  entry ``j``; 2 c128 entries per 256-token page) for ``j < raw`` with ``j // 2 < Pw``, ``-1``
  elsewhere.

:func:`row_fields` computes them in torch for the torch planner (``planning/planner.py``); the
fused planner (``plan_fields.py``) computes the same fields inside its one launch on the
Triton paths, so no serving mode needs a kernel of its own here. Shapes: ``T`` rows, ``Pw``
page-table width, ``N128`` c128 index width, ``K`` ``index_topk``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsv4_backend.config import check_compressed_ratio, entries_per_page
from dsv4_backend.errors import ConfigError, ContractError


class RowFields(NamedTuple):
    """``T`` rows of one ratio; dtypes as in ``CompressedMetadata``."""

    out_loc: torch.Tensor  # [T] int64
    topk_lengths_raw: torch.Tensor  # [T] int32
    topk_lengths_clamp1: torch.Tensor  # [T] int32
    sparse_topk_lengths: torch.Tensor  # [T] int32
    page_indices: torch.Tensor | None  # ratio 128: [T, c128_width] int32; ratio 4: None


def row_fields(
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

    Raises ``ConfigError`` for a ratio other than 4 / 128 or bad sizes, ``ContractError`` for
    tensors of other shapes, dtypes or devices.
    """
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
            page_table,
            page_table.dim() == 2 and page_table.shape[0] == rows,
            torch.int32,
            "[T, Pw]",
        ),
    }
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
