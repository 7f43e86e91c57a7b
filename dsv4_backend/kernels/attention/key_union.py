"""The keys a group of consecutive query rows shares: one union list per group, with the rows
that see each key.

docs/design.md §2. Rows of one request (verify, draft extend, extend) see nearly the same keys:
row ``t + 1``'s window is row ``t``'s shifted by one position, every row of a request reads the
same c128 entries up to its own count, and below ``K`` candidates every row keeps all its c4
entries. :func:`sparse_attention_with_sink` packs ``G`` such rows into one program and gathers
their keys once from the union built here, instead of once per row.

Input per span (window, extra): ``indices [T, W]`` int32 slots (-1 = none) whose first
``lengths [T]`` columns are valid. Rows ``g G ... g G + G - 1`` form group ``g`` (the last group
may be short). Per group and span the union is:

* the **leader**'s valid columns, in order: the row with the longest list (the last such row
  on ties: the newest position);
* then every valid slot of another row ``r`` that is not at its aligned place in the leader's
  list, with ``r``'s bit only (by block of ``BLOCK_N`` columns, then row, then column).

Row ``r`` is aligned to the leader by its shift ``s_r``: the first of the leader's first
``BLOCK_N`` columns holding ``r``'s first slot (0 when there is none). Column ``j`` of the
leader is seen by ``r`` iff ``r``'s column ``j - s_r`` is valid and holds the same slot; bit
``r`` of the column's row bits says so. So every valid column of every row is covered exactly
once (by the leader's column it matches, or by an extra column of its own), for any lists: the
union is exact whatever the rows hold, and small when they are shifted or prefix copies of
each other. Newest-first windows of consecutive positions give ``W + G (G - 1) / 2`` columns
instead of ``G W``; c128 lists (one list, per-row lengths) give the longest; unrelated lists
(c4 top-k sets that differ) give their concatenation. Slots -1 inside a length stay in the
leader's columns (the attention kernel skips them) and never become extra columns.

Output (:class:`KeyUnion`): ``table [2, NG, U]`` int32 (``table[0]`` slots, ``table[1]`` row
bits, bit ``r`` = row ``g G + r``), ``U = G (Ws + We)`` with the window union in columns
``[0, G Ws)`` and the extra union from column ``G Ws``; ``lengths [spans, NG]`` int32 (window,
then extra if given). Columns past a length are unspecified. ``NG = cdiv(T, G)``, ``G <= 8``.
The table takes twice the bytes of the index tensors it unites, for the duration of one
attention call.

One Triton launch for both spans (grid ``(NG, spans)``; a program makes one pass over its
group's column blocks, all rows at once), its torch twin, their table :data:`KEY_UNION` and
the op's entry :func:`key_union`. Shapes depend only on tensor shapes, so the op can be
captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.variants import TRITON_PATHS, OpTable, Variant, resolve

#: Most rows a group (the row bits are an int32; eight covers 64-row programs of 8 heads).
MAX_GROUP = 8
#: Columns a program step reads.
BLOCK_N = 128


class KeyUnion(NamedTuple):
    """Union lists of the row groups (module docstring).

    table: ``[2, NG, U]`` int32; ``table[0]`` slots (-1 = none), ``table[1]`` row bits.
    lengths: ``[spans, NG]`` int32 valid leading columns of the window and (if given) of the
    extra union.
    extra_column: first column of the extra union (``G * Ws``).
    group: rows per group ``G``.
    """

    table: torch.Tensor
    lengths: torch.Tensor
    extra_column: int
    group: int


# --------------------------------------------------------------------------------- kernel
@triton.jit
def _key_union_kernel(
    win_idx_ptr,  # [T, Ws] int32
    win_len_ptr,  # [T] int32
    ext_idx_ptr,  # [T, We] int32 (the window's for a window-only layer)
    ext_len_ptr,  # [T] int32
    table_ptr,  # [2, NG, U] int32: slots, row bits
    union_len_ptr,  # [2, NG] int32
    rows,
    num_groups,
    stride_win_t,
    stride_ext_t,
    win_width,
    ext_width,
    stride_table_g,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    group = tl.program_id(0)
    is_win = tl.program_id(1) == 0
    # One body for both spans: the span's tensors picked by scalars.
    idx_ptr = tl.where(is_win, win_idx_ptr, ext_idx_ptr)
    len_ptr = tl.where(is_win, win_len_ptr, ext_len_ptr)
    stride_t = tl.where(is_win, stride_win_t, stride_ext_t).to(tl.int64)
    width = tl.where(is_win, win_width, ext_width)
    slot_out = (
        table_ptr + group.to(tl.int64) * stride_table_g + tl.where(is_win, 0, GROUP * win_width)
    )
    bits_out = slot_out + num_groups.to(tl.int64) * stride_table_g

    first = group * GROUP
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = (offs_g < GROUP) & (first + offs_g < rows)
    row_ptrs = idx_ptr + (first + offs_g).to(tl.int64) * stride_t  # [BLOCK_G]
    lens = tl.load(len_ptr + first + offs_g, mask=g_ok, other=0)
    lens = tl.where(g_ok, tl.minimum(tl.maximum(lens, 0), width), 0)
    # The leader: the longest list, the last such row on ties.
    leader = tl.max(tl.where(g_ok, lens * BLOCK_G + offs_g, -1), axis=0) % BLOCK_G
    n_lead = tl.max(tl.where(offs_g == leader, lens, 0), axis=0)
    lead_ptr = idx_ptr + (first + leader).to(tl.int64) * stride_t

    # Each row's shift: the column among the leader's first BLOCK_N holding the row's first
    # slot (rows farther apart just share nothing).
    cols = tl.arange(0, BLOCK_N)
    lead = tl.load(lead_ptr + cols, mask=cols < n_lead, other=-1)
    firsts = tl.load(row_ptrs, mask=lens > 0, other=-1)
    hit = (lead[None, :] == firsts[:, None]) & (firsts >= 0)[:, None]
    shift = tl.min(tl.where(hit, cols[None, :], BLOCK_N), axis=1)
    shift = tl.where(shift == BLOCK_N, 0, shift)

    # One pass over column blocks (the leader's list is the longest): the leader's columns,
    # each with the rows whose aligned column holds the same slot, then every other row's
    # valid slots in the block that are not at their aligned place in the leader's list.
    others = g_ok & (offs_g != leader)
    row_bit = 1 << offs_g
    count = n_lead
    for start in range(0, n_lead, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_lead = cols < n_lead
        lead = tl.load(lead_ptr + cols, mask=in_lead, other=-1)
        own = cols[None, :] - shift[:, None]  # [BLOCK_G, BLOCK_N] each row's aligned column
        own_ok = (own >= 0) & (own < lens[:, None]) & in_lead[None, :]
        mine = tl.load(row_ptrs[:, None] + own, mask=own_ok, other=-1)
        seen = own_ok & (mine == lead[None, :])
        bits = tl.sum(tl.where(seen, row_bit[:, None], 0), axis=0)  # distinct bits: sum = or
        tl.store(slot_out + cols, lead, mask=in_lead)
        tl.store(bits_out + cols, bits, mask=in_lead)

        in_row = (cols[None, :] < lens[:, None]) & others[:, None]
        mine = tl.load(row_ptrs[:, None] + cols[None, :], mask=in_row, other=-1)
        lead_col = cols[None, :] + shift[:, None]
        aligned = tl.load(lead_ptr + lead_col, mask=in_row & (lead_col < n_lead), other=-1)
        extra = tl.reshape(in_row & (mine >= 0) & (mine != aligned), [BLOCK_G * BLOCK_N])
        at = count + tl.cumsum(extra.to(tl.int32), axis=0) - 1  # row-major: row, then column
        tl.store(slot_out + at, tl.reshape(mine, [BLOCK_G * BLOCK_N]), mask=extra)
        bits = tl.broadcast_to(row_bit[:, None], [BLOCK_G, BLOCK_N])
        tl.store(bits_out + at, tl.reshape(bits, [BLOCK_G * BLOCK_N]), mask=extra)
        count += tl.sum(extra.to(tl.int32), axis=0)
    tl.store(union_len_ptr + tl.where(is_win, 0, num_groups) + group, count)


# ------------------------------------------------------------------------------ launcher
#: The spans of a union, checked: ``[(indices [T, W] int32, lengths [T] int32)]``, the
#: window's first, then the extra span's when given.
Spans = list[tuple[torch.Tensor, torch.Tensor]]


def _allocate(spans: Spans, group: int) -> KeyUnion:
    rows = spans[0][0].shape[0]
    num_groups = triton.cdiv(rows, group)
    widths = [group * idx.shape[1] for idx, _ in spans]
    device = spans[0][0].device
    table = torch.empty((2, num_groups, sum(widths)), dtype=torch.int32, device=device)
    # Every program writes its group's lengths: no fill launch.
    lengths = torch.empty((len(spans), num_groups), dtype=torch.int32, device=device)
    return KeyUnion(table, lengths, widths[0], group)


def key_union_triton(spans: Spans, union: KeyUnion) -> None:
    """Triton path of :func:`key_union`: fill ``union`` (allocated for ``spans``) in one
    launch, grid ``(NG, spans)``."""
    num_groups = union.table.shape[1]
    if num_groups == 0:
        return
    spans = [(idx.contiguous(), lengths.contiguous()) for idx, lengths in spans]
    (win_idx, win_len), (ext_idx, ext_len) = spans[0], spans[-1]
    _key_union_kernel[(num_groups, len(spans))](
        win_idx,
        win_len,
        ext_idx,
        ext_len,
        union.table,
        union.lengths,
        win_idx.shape[0],
        num_groups,
        win_idx.stride(0),
        ext_idx.stride(0),
        win_idx.shape[1],
        ext_idx.shape[1],
        union.table.stride(1),
        GROUP=union.group,
        BLOCK_G=triton.next_power_of_2(union.group),
        BLOCK_N=BLOCK_N,
        num_warps=4,
    )


def key_union_torch(spans: Spans, union: KeyUnion) -> None:
    """Torch path of :func:`key_union`: the same rule, group by group on the host."""
    group = union.group
    table = union.table.new_full(union.table.shape, -1).cpu()
    lengths = union.lengths.cpu()
    column = 0
    for span, (idx, span_lengths) in enumerate(spans):
        width = idx.shape[1]
        lists = [
            row[: max(0, min(int(n), width))].tolist()
            for row, n in zip(idx.cpu(), span_lengths.cpu(), strict=True)
        ]
        for g in range(table.shape[1]):
            members = lists[g * group : (g + 1) * group]
            leader = max(range(len(members)), key=lambda r: (len(members[r]), r))
            lead = members[leader]
            slots, bits = list(lead), [0] * len(lead)
            extras = []  # (column block, row, column, slot): the kernel's order
            for r, own in enumerate(members):
                head = lead[:BLOCK_N]
                shift = head.index(own[0]) if own and own[0] >= 0 and own[0] in head else 0
                for c, slot in enumerate(own):
                    if c + shift < len(lead) and lead[c + shift] == slot:
                        bits[c + shift] |= 1 << r
                    elif r != leader and slot >= 0:
                        extras.append((c // BLOCK_N, r, c, slot))
            for _, r, _, slot in sorted(extras):
                slots.append(slot)
                bits.append(1 << r)
            table[0, g, column : column + len(slots)] = torch.tensor(slots, dtype=torch.int32)
            table[1, g, column : column + len(slots)] = torch.tensor(bits, dtype=torch.int32)
            lengths[span, g] = len(slots)
        column += group * width
    union.table.copy_(table)
    union.lengths.copy_(lengths)


# ---------------------------------------------------------------------------- public op
def key_union(
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra_indices: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    group: int,
) -> KeyUnion:
    """Union lists of the window span and (if given) the extra span for groups of ``group``
    consecutive rows (module docstring).

    Parameters
    ----------
    swa_indices : ``[T, Ws]`` int32 window slots, -1 = none.
    swa_lengths : ``[T]`` int32 valid leading columns of ``swa_indices``.
    extra_indices : ``[T, We]`` int32 compressed slots, or None (window-only layer).
    extra_lengths : ``[T]`` int32 valid leading columns of ``extra_indices``, or None.
    group : rows per group, 1 ... ``MAX_GROUP``.

    ``BatchError`` for another group size or spans of other shapes or dtypes
    (``sparse_attention_with_sink`` checked them already; this op is also public).
    """
    if not 1 <= group <= MAX_GROUP:
        raise BatchError(f"group={group}; expected 1 ... {MAX_GROUP} rows a group")
    spans: Spans = [(swa_indices, swa_lengths)]
    if (extra_indices is None) != (extra_lengths is None):
        raise BatchError("extra_indices and extra_lengths must both be given or both be None")
    if extra_indices is not None and extra_lengths is not None:
        spans.append((extra_indices, extra_lengths))
    rows = swa_indices.shape[0]
    for idx, lengths in spans:
        if idx.dim() != 2 or idx.shape[0] != rows or idx.dtype != torch.int32:
            raise BatchError(
                f"indices of shape {tuple(idx.shape)} and dtype {idx.dtype}; expected "
                f"[{rows}, width] int32"
            )
        if lengths.shape != (rows,) or lengths.dtype != torch.int32:
            raise BatchError(
                f"lengths of shape {tuple(lengths.shape)} and dtype {lengths.dtype}; expected "
                f"[{rows}] int32"
            )
    union = _allocate(spans, group)
    resolve(KEY_UNION, swa_indices.device).variant.entry(spans, union)
    return union


#: The variants: each entry fills a ``KeyUnion`` allocated for the checked spans.
KEY_UNION: OpTable[Callable[[Spans, KeyUnion], None]] = OpTable(
    "attention_key_union",
    "the union key list of a group of rows (the triton attention variant's grouping)",
    (
        Variant(
            "triton",
            key_union_triton,
            (TRITON_PATHS,),
            "window and extra spans in one launch",
            baseline=True,
        ),
        Variant("torch", key_union_torch, (), "window and extra spans", baseline=True),
    ),
)
