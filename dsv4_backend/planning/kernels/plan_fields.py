"""Every field of a plan in one Triton launch (the fused planner, ``planning.plan``'s GPU path),
after one launch of the batch checks.

The kernel computes, for each query row ``t``, what ``planning/planner.py``'s torch body builds
with some forty torch ops (field definitions: ``planning/metadata.py``):

* the row expansion: request ``b``, position, first new position, the request's length and the
  length the write plan keeps (uniform kinds from ``seq_lens``; extend kinds from the host's
  per-request starts and prefixes, window floors and kept lengths, uploaded as one ``[5, B]``
  tensor; a ragged verify's table computed on the device, its rows past the requests'
  padding rows);
* ``page_table``, ``swa_page_indices`` (through ``full_to_swa``), the write slots, causal
  lengths, window lengths;
* per compress ratio, the per-row fields of ``planning/kernels/row_fields.py`` (c4
  ``page_indices`` filled with ``-1``, c128 indices from the page table) and the compress /
  write plans of ``planning/kernels/compress_plan_torch.py``. The plans need no scan: a
  request's rows are consecutive positions, so the number of rows it contributes to each plan
  has a closed form, and a row's record index is the sum over earlier requests plus its rank
  inside its own;
* per DeepSeek-V4.1 low ratio (1, 2; ``planning/planner.py``'s ``LOW_RATIO_PLAN`` ``fused``),
  the fields of ``planning/low_ratio.py``: the entry slot the row completes, its visible
  entries, the ``-1`` selections (and candidate blocks) its index sources fill.

``check_rows`` runs first, one program looping over the rows: the batch checks of
``planning/planner.py``'s ``checked_rows`` (its torch twin; the record layout of
``planning/checks.py``) and a ``[B]`` mask of the requests with a failing row, which the plan
kernel plans as writing nothing (pool row 0, position 1, no write slot, no plan record: the
per-request closed forms then simply skip those requests).

Grid ``(row blocks, column blocks)``: column block ``c`` writes columns ``[c * BLOCK_C, ...)``
of the wide fields; column block 0 also writes the per-row fields and the plan records. Shapes
depend only on ``T``, ``B`` and the widths, and nothing is read on the host, so a graph kind
plans inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields as dc_fields
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from dsv4_backend.config import compress_span

if TYPE_CHECKING:
    from dsv4_backend.planning.metadata import (
        AttentionMetadata,
        CompressedMetadata,
        LowRatioMetadata,
    )


@dataclass(frozen=True)
class PlannerTiles:
    """Tile sizes of the planner's two kernels (upper bounds: tiles shrink to a batch's many
    requests or to narrow fields)."""

    rows: int  # rows a ``_plan_kernel`` program
    columns: int  # wide-field columns a ``_plan_kernel`` program
    request_tile: int  # elements of the ``[rows, requests]`` tile reduced for the plan offsets
    check_rows: int  # rows a step of ``_check_kernel``'s single program
    check_read_tile: int  # elements of its two ``[entries, requests]`` read-check tiles


#: On a GPU: 8 rows and 64 columns a program fill the SMs; read-check tiles of 1024 elements
#: spill 12-16 B at sm_90a beside the row checks' registers, 512 do not.
GPU_TILES = PlannerTiles(rows=8, columns=64, request_tile=1024, check_rows=128, check_read_tile=512)
#: In Triton's interpreter, which pays per program and per operation rather than per element:
#: an extend of 900 rows is 15 programs of every column, not 113 x the column blocks (the
#: tiles are any power of two; ``tests/planning/test_planner.py`` also runs the GPU's).
INTERPRETER_TILES = PlannerTiles(
    rows=64, columns=1024, request_tile=16384, check_rows=1024, check_read_tile=8192
)


def planner_tiles(device: torch.device) -> PlannerTiles:
    """The tiles of the planner kernels for tensors on ``device``."""
    return GPU_TILES if device.type == "cuda" else INTERPRETER_TILES


def plan_block_c(tiles: PlannerTiles, widest: int) -> int:
    """Wide-field columns a ``_plan_kernel`` program for fields at most ``widest`` columns:
    ``tiles.columns``, or the widest field's power of two when narrower."""
    return min(tiles.columns, triton.next_power_of_2(max(widest, 1)))


def row_block(tiles: PlannerTiles, rows: int, block_b: int) -> int:
    """Rows a tile of ``rows`` at most, beside ``block_b`` requests in a request tile."""
    return max(1, min(rows, tiles.request_tile // block_b))


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
def _page_ends(x, R: tl.constexpr, PAGE: tl.constexpr):
    """Positions ``q < x`` (``x >= 0``) among the last ``R`` of their page: the c4 write plan
    keeps them besides the request's tail (the block a cached page-aligned prefix needs)."""
    return _floor_div(x, PAGE) * R + tl.maximum(_floor_mod(x, PAGE) - (PAGE - R), 0)


@triton.jit
def _plan_counts(p0, n, keep, R: tl.constexpr, OVERLAP_BACK: tl.constexpr, PAGE: tl.constexpr):
    """Rows of a request (positions ``p0 ... p0 + n - 1``) in the compress and write plans."""
    compress = _floor_div(p0 + n, R) - _floor_div(p0, R)
    keep_from = _floor_div(keep, R) * R - OVERLAP_BACK
    tail_from = tl.maximum(p0, keep_from)
    write = tl.minimum(tl.maximum(p0 + n - tail_from, 0), n)
    if R == 4:  # page ends before the tail
        write += _page_ends(tl.minimum(p0 + n, tail_from), R, PAGE) - _page_ends(p0, R, PAGE)
    return compress, write


@triton.jit
def _ratio_fields(
    t,  # [BLOCK_T] int64 rows
    row_ok,  # [BLOCK_T] bool: a row of the plan
    planned,  # [BLOCK_T] bool: a row of the plan whose request passed the checks (records)
    live,  # [BLOCK_T] bool: a row of the plan or a padded row (written with sentinels)
    b,  # [BLOCK_T] int64 request of each row
    i,  # [BLOCK_T] int64 rank of the row inside its request
    pos,  # [BLOCK_T] int64
    p0,  # [BLOCK_T] int64 first new position of the row's request
    out_loc,  # [BLOCK_T] int64
    r,  # [BLOCK_B] request ids
    req_p0,  # [BLOCK_B] int64 per request: first new position
    req_n,  # [BLOCK_B] int64 rows
    req_keep,  # [BLOCK_B] int64 kept length
    req_ok,  # [BLOCK_B] bool
    keep,  # [BLOCK_T] int64 the row's request's kept length
    first_col,  # the column block's first column
    req_to_token_ptr,
    stride_rt,
    req,  # [BLOCK_T] int64 pool row of each row's request
    page_width,
    index_topk,
    c128_width,
    out_loc_ptr,  # [T] int64
    raw_ptr,  # [T] int32
    sparse_ptr,  # [T] int32
    indices_ptr,  # [T, K] (ratio 4) or [T, N128] (ratio 128) int32
    stride_idx,
    compress_ptr,  # [T, 4] int32
    write_ptr,  # [T, 4] int32
    R: tl.constexpr,
    SPAN: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The fields of one compress ratio ``R`` for a block of rows."""
    OVERLAP_BACK: tl.constexpr = R if R == 4 else 0
    next_len = pos + 1
    raw = _floor_div(next_len, R)
    cols = first_col + tl.arange(0, BLOCK_C)
    in_width = (cols < (index_topk if R == 4 else c128_width))[None, :]
    col_mask = row_ok[:, None] & in_width
    if R == 4:  # filled by the indexer's top-k later
        value = (t[:, None] * 0 + cols[None, :] * 0 - 1).to(tl.int32)
    else:
        # c128 entry j lives on page j // 2 of the request (2 entries per 256-token page); it
        # is visible once complete (j < raw), which also puts its page inside the request.
        per_page: tl.constexpr = PAGE // R
        visible = (
            col_mask & (cols[None, :] < raw[:, None]) & (cols // per_page < page_width)[None, :]
        )
        token = (cols // per_page)[None, :] * PAGE
        slot = tl.load(req_to_token_ptr + req[:, None] * stride_rt + token, mask=visible, other=0)
        page = slot.to(tl.int64) // PAGE
        value = tl.where(visible, page * per_page + (cols % per_page)[None, :], -1).to(tl.int32)
    tl.store(
        indices_ptr + t[:, None] * stride_idx + cols[None, :], value, mask=live[:, None] & in_width
    )
    if first_col == 0:
        completes = _floor_mod(next_len, R) == 0
        entry_loc = tl.where(completes & row_ok, _floor_div(out_loc, R), -1)
        tl.store(out_loc_ptr + t, entry_loc, mask=live)
        raw32 = raw.to(tl.int32)
        clamp1 = tl.maximum(raw32, 1)
        tl.store(raw_ptr + t, tl.where(row_ok, raw32, 0), mask=live)
        sparse = tl.minimum(clamp1, index_topk) if R == 4 else clamp1
        tl.store(sparse_ptr + t, tl.where(row_ok, sparse, 1), mask=live)
        # Plan records: earlier requests' counts plus the row's rank in its request.
        c_req, w_req = _plan_counts(req_p0, req_n, req_keep, R, OVERLAP_BACK, PAGE)
        earlier = (r[None, :] < b[:, None]) & req_ok[None, :]
        c_before = tl.sum(tl.where(earlier, c_req[None, :], 0), axis=1)
        w_before = tl.sum(tl.where(earlier, w_req[None, :], 0), axis=1)
        c_total = tl.sum(tl.where(req_ok, c_req, 0), axis=0)
        w_total = tl.sum(tl.where(req_ok, w_req, 0), axis=0)
        keep_from = _floor_div(keep, R) * R - OVERLAP_BACK
        c_idx = c_before + _floor_div(pos, R) - _floor_div(p0, R)  # earlier completing rows
        # Earlier kept rows of the request: page ends before the tail, then the tail's.
        tail_from = tl.maximum(p0, keep_from)
        w_idx = w_before + tl.maximum(pos - tail_from, 0)
        writes = pos >= keep_from
        if R == 4:
            w_idx += _page_ends(tl.minimum(pos, tail_from), R, PAGE) - _page_ends(p0, R, PAGE)
            writes |= _floor_mod(pos, PAGE) >= PAGE - R
        window = tl.minimum(pos - p0 + 1, SPAN)
        field = tl.arange(0, 4)[None, :]
        record = tl.where(field == 0, t[:, None], tl.where(field == 1, b[:, None], pos[:, None]))
        record = tl.where(field == 3, window[:, None], record).to(tl.int32)
        kept = (planned & completes)[:, None] & (field < 4)
        tl.store(compress_ptr + c_idx[:, None] * 4 + field, record, mask=kept)
        kept = (planned & writes)[:, None] & (field < 4)
        tl.store(write_ptr + w_idx[:, None] * 4 + field, record, mask=kept)
        # Records past each plan's total are -1 (no valid record lands there).
        pad = record * 0 - 1
        tail = (live & (t >= c_total))[:, None] & (field < 4)
        tl.store(compress_ptr + t[:, None] * 4 + field, pad, mask=tail)
        tail = (live & (t >= w_total))[:, None] & (field < 4)
        tl.store(write_ptr + t[:, None] * 4 + field, pad, mask=tail)


@triton.jit
def _low_ratio_fields(
    t,  # [BLOCK_T] int64 rows
    row_ok,  # [BLOCK_T] bool: a row of the plan
    live,  # [BLOCK_T] bool: a row of the plan or a padded row (written with sentinels)
    pos,  # [BLOCK_T] int64
    loc,  # [BLOCK_T] int64 the row's full-cache write slot, -1 when it writes nothing
    first_col,
    index_topk,  # K
    candidate_width,  # NB
    out_loc_ptr,  # [T] int64
    raw_ptr,  # [T] int32
    sparse_ptr,  # [T] int32
    indices_ptr,  # [T, K] int32
    candidates_ptr,  # [T, NB] int32 (HAS_CANDIDATES)
    R: tl.constexpr,
    HAS_CANDIDATES: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """DeepSeek-V4.1's fields of low ratio ``R`` (1 or 2) for a block of rows (the torch
    twin: ``planning/low_ratio.py``): the entry slot the row completes, its visible entries,
    and the selections (``page_indices``, ``candidate_blocks``) filled with -1."""
    cols = first_col + tl.arange(0, BLOCK_C)
    none = (t[:, None] * 0 + cols[None, :] * 0 - 1).to(tl.int32)
    in_width = (cols < index_topk)[None, :]
    tl.store(
        indices_ptr + t[:, None] * index_topk + cols[None, :], none, mask=live[:, None] & in_width
    )
    if HAS_CANDIDATES:
        in_width = (cols < candidate_width)[None, :]
        tl.store(
            candidates_ptr + t[:, None] * candidate_width + cols[None, :],
            none,
            mask=live[:, None] & in_width,
        )
    if first_col == 0:
        writes = row_ok & (loc >= 0)
        if R == 1:
            entry_loc = tl.where(writes, loc, -1)
        else:  # a pair's second (odd) token completes its entry
            entry_loc = tl.where(writes & (_floor_mod(pos, 2) == 1), _floor_div(loc, 2), -1)
        tl.store(out_loc_ptr + t, entry_loc, mask=live)
        visible = tl.where(writes, _floor_div(pos + 1, R), 0).to(tl.int32)
        tl.store(raw_ptr + t, visible, mask=live)
        sparse = tl.maximum(tl.minimum(visible, index_topk), 1)
        tl.store(sparse_ptr + t, sparse, mask=live)


@triton.jit
def _expand_rows(
    t,
    row_ok,
    r,
    req_ok,
    seq_ptr,
    host_ptr,
    out_cache_loc_ptr,
    num_rows,
    batch_size,
    rows_per_request,
    pos_shift,
    loc_stride,
    loc_offset,
    EXTEND: tl.constexpr,
):
    """Rows ``t`` ``[BLOCK_T]``: request ``b``, rank ``i`` in it, its first new position
    ``p0``, its length, kept length and the row's write slot (all int64; see ``RowLayout``).
    A row is its request's where ``i < length - p0`` (always, but past a ragged verify's
    requests' rows)."""
    if EXTEND:
        req_start = tl.load(host_ptr + r, mask=req_ok, other=num_rows)
        # A row's request: the last one starting at or before it (empty requests skipped).
        b = tl.sum((req_start[None, :] <= t[:, None]).to(tl.int64), axis=1) - 1
        b = tl.maximum(b, 0)
        start = tl.load(host_ptr + b, mask=row_ok, other=0)
        p0 = tl.load(host_ptr + batch_size + b, mask=row_ok, other=0)
        n = tl.load(host_ptr + 2 * batch_size + b, mask=row_ok, other=0)
        i = t - start
        length = p0 + n
        keep = tl.load(host_ptr + 4 * batch_size + b, mask=row_ok, other=0)
        loc = tl.load(out_cache_loc_ptr + t, mask=row_ok, other=0).to(tl.int64)
    else:
        b = t // rows_per_request
        i = t - b * rows_per_request
        p0 = tl.load(seq_ptr + b, mask=row_ok, other=1).to(tl.int64) + pos_shift
        length = p0 + rows_per_request
        keep = p0 + 1
        loc_idx = b * loc_stride + loc_offset + i
        loc = tl.load(out_cache_loc_ptr + loc_idx, mask=row_ok, other=0).to(tl.int64)
    return b, i, p0, length, keep, loc


@triton.jit
def _first_bad(bad, t, value, expected, rec):
    """Carry ``rec`` = (found, first bad index, its value, expected) over a block of entries."""
    found, index, found_value, found_expected = rec
    first = tl.min(tl.where(bad, t, 2**62), axis=0)
    fresh = (found == 0) & (first < 2**62)
    at = t == first
    index = tl.where(fresh, first, index)
    found_value = tl.where(fresh, tl.sum(tl.where(at, value, 0), axis=0), found_value)
    found_expected = tl.where(fresh, tl.sum(tl.where(at, expected, 0), axis=0), found_expected)
    return tl.where(fresh, 1, found), index, found_value, found_expected


@triton.jit
def _first_bad_2d(bad, order, index, value, expected, rec):
    """``_first_bad`` over a ``[E, BLOCK_B]`` tile of entries: the first bad one by ``order``
    (unique per entry); its request ``index`` (``[BLOCK_B]``) is reported as the index."""
    found, found_index, found_value, found_expected = rec
    first = tl.min(tl.min(tl.where(bad, order, 2**62), axis=1), axis=0)
    fresh = (found == 0) & (first < 2**62)
    at = order == first
    at_index = tl.sum(tl.sum(tl.where(at, index[None, :] + order * 0, 0), axis=1), axis=0)
    at_value = tl.sum(tl.sum(tl.where(at, value, 0), axis=1), axis=0)
    at_expected = tl.sum(tl.sum(tl.where(at, expected, 0), axis=1), axis=0)
    found_index = tl.where(fresh, at_index, found_index)
    found_value = tl.where(fresh, at_value, found_value)
    found_expected = tl.where(fresh, at_expected, found_expected)
    return tl.where(fresh, 1, found), found_index, found_value, found_expected


@triton.jit
def _check_kernel(
    seq_ptr,
    host_ptr,
    req_pool_ptr,
    out_cache_loc_ptr,
    req_to_token_ptr,
    full_to_swa_ptr,
    record_ptr,  # [7, 4] int64 out: per check (failed, first bad index, its value, expected)
    failed_ptr,  # [B] int8 out: the request has a failing row (or a bad pool row)
    num_rows,
    batch_size,
    pool_rows,
    context,
    stride_rt,
    slot_limit,
    swa_limit,  # -1: no upper limit
    rows_per_request,
    pos_shift,
    loc_stride,
    loc_offset,
    window,
    page_width,
    EXTEND: tl.constexpr,
    HAS_SWA_MAP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """The batch checks of ``planning/planner.py``'s ``checked_rows`` in one program: pool
    rows, positions, write slots in range, each write slot the one ``req_to_token`` holds for
    its row (pool row 0, slot 0 exempt: sglang's padding), each write's window slot in range;
    then per request what the plan reads besides (``_checked_reads``): the window keys before
    its first new position and the page table's slots. Loops over rows in blocks, then over
    the read entries in ``[BLOCK_E, BLOCK_B]`` tiles (entries x requests)."""
    r = tl.arange(0, BLOCK_B)
    req_ok = r < batch_size
    requests = tl.load(req_pool_ptr + r, mask=req_ok, other=0).to(tl.int64)
    bad_request = req_ok & ((requests < 0) | (requests >= pool_rows))
    zero = tl.sum(requests * 0, axis=0)
    rec0 = _first_bad(bad_request, r.to(tl.int64), requests, requests, (zero, zero, zero, zero))
    rec1 = (zero, zero, zero, zero)
    rec2 = (zero, zero, zero, zero)
    rec3 = (zero, zero, zero, zero)
    rec4 = (zero, zero, zero, zero)
    rec5 = (zero, zero, zero, zero)
    rec6 = (zero, zero, zero, zero)
    req_failed = bad_request
    for t0 in range(0, num_rows, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        row_ok = t < num_rows
        b, i, p0, length, _, loc = _expand_rows(
            t,
            row_ok,
            r,
            req_ok,
            seq_ptr,
            host_ptr,
            out_cache_loc_ptr,
            num_rows,
            batch_size,
            rows_per_request,
            pos_shift,
            loc_stride,
            loc_offset,
            EXTEND,
        )
        row_ok = row_ok & (p0 + i < length)
        pos = p0 + i
        req = tl.load(req_pool_ptr + b, mask=row_ok, other=0).to(tl.int64)
        req = tl.where((req < 0) | (req >= pool_rows), 0, req)
        bad_position = row_ok & ((pos < 0) | (pos >= context))
        held_pos = tl.minimum(tl.maximum(pos, 0), context - 1)
        held = tl.load(req_to_token_ptr + req * stride_rt + held_pos, mask=row_ok, other=0)
        held = held.to(tl.int64)
        bad_slot = row_ok & _out_of(loc, slot_limit)
        foreign = row_ok & (loc != held) & ~((req == 0) & (loc == 0))
        swa = _window_slot(full_to_swa_ptr, loc, row_ok & ~bad_slot, HAS_SWA_MAP)
        bad_window = row_ok & ~bad_slot & _out_of(swa, swa_limit)
        rec1 = _first_bad(bad_position, t, pos, pos, rec1)
        rec2 = _first_bad(bad_slot, t, loc, loc, rec2)
        rec3 = _first_bad(foreign, t, loc, held, rec3)
        rec4 = _first_bad(bad_window, t, swa, loc, rec4)
        row_failed = bad_position | bad_slot | foreign | bad_window
        hit = row_failed[:, None] & (b[:, None] == r[None, :])
        req_failed = req_failed | (tl.max(hit.to(tl.int32), axis=0) > 0)
    # Per request: its pool row (in range), first new position and length.
    req = tl.where(bad_request, 0, requests)
    if EXTEND:
        first_new = tl.load(host_ptr + batch_size + r, mask=req_ok, other=0)
        length = first_new + tl.load(host_ptr + 2 * batch_size + r, mask=req_ok, other=0)
    else:
        first_new = tl.load(seq_ptr + r, mask=req_ok, other=1).to(tl.int64) + pos_shift
        length = first_new + rows_per_request
    rb = r.to(tl.int64)
    e = tl.arange(0, BLOCK_E).to(tl.int64)
    for e0 in range(0, window - 1, BLOCK_E):  # window keys before the first new position
        j = e0 + e  # key position first_new - 1 - j
        key_pos = first_new[None, :] - 1 - j[:, None]
        valid = req_ok[None, :] & (j[:, None] < window - 1) & (key_pos >= 0)
        valid = valid & (key_pos < context)
        full = tl.load(req_to_token_ptr + req[None, :] * stride_rt + key_pos, mask=valid, other=0)
        full = full.to(tl.int64)
        bad_full = valid & _out_of(full, slot_limit)
        swa = _window_slot(full_to_swa_ptr, full, valid & ~bad_full, HAS_SWA_MAP)
        bad_swa = valid & ~bad_full & _out_of(swa, swa_limit)
        order = j[:, None] * BLOCK_B + rb[None, :]  # entry-major, as the torch twin's
        rec5 = _first_bad_2d(bad_full, order, rb, full, key_pos, rec5)
        rec6 = _first_bad_2d(bad_swa, order, rb, swa, key_pos, rec6)
        req_failed = req_failed | (tl.max((bad_full | bad_swa).to(tl.int32), axis=0) > 0)
    for e0 in range(0, page_width, BLOCK_E):  # the page table's slots
        k = e0 + e
        token = k[:, None] * PAGE + rb[None, :] * 0
        valid = req_ok[None, :] & (k[:, None] < page_width) & (token < length[None, :])
        valid = valid & (token < context)
        full = tl.load(req_to_token_ptr + req[None, :] * stride_rt + token, mask=valid, other=0)
        full = full.to(tl.int64)
        bad_full = valid & _out_of(full, slot_limit)
        order = k[:, None] * BLOCK_B + rb[None, :]
        rec5 = _first_bad_2d(bad_full, order, rb, full, token, rec5)
        req_failed = req_failed | (tl.max(bad_full.to(tl.int32), axis=0) > 0)
    tl.store(failed_ptr + r, req_failed.to(tl.int8), mask=req_ok)
    _store_record(record_ptr, 0, rec0)
    _store_record(record_ptr, 1, rec1)
    _store_record(record_ptr, 2, rec2)
    _store_record(record_ptr, 3, rec3)
    _store_record(record_ptr, 4, rec4)
    _store_record(record_ptr, 5, rec5)
    _store_record(record_ptr, 6, rec6)


@triton.jit
def _out_of(values, limit):
    """``values < 0`` or ``>= limit`` (``limit`` -1: no upper bound)."""
    return (values < 0) | ((limit >= 0) & (values >= limit))


@triton.jit
def _window_slot(full_to_swa_ptr, full, mask, HAS_SWA_MAP: tl.constexpr):
    """Window slots (int64) of full slots ``full`` where ``mask`` (in range); else ``full``."""
    if HAS_SWA_MAP:
        return tl.load(full_to_swa_ptr + tl.maximum(full, 0), mask=mask, other=0).to(tl.int64)
    return full


@triton.jit
def _store_record(record_ptr, k, rec):
    found, index, value, expected = rec
    field = tl.arange(0, 4)
    row = tl.where(field == 0, found, tl.where(field == 1, index, value))
    tl.store(record_ptr + k * 4 + field, tl.where(field == 3, expected, row))


@triton.jit
def _plan_kernel(
    seq_ptr,  # [B] int request lengths before this forward (uniform kinds)
    host_ptr,  # [5, B] int64 extend kinds, ragged verify: first row, first new position, rows,
    # window floor, kept length
    req_pool_ptr,  # [B] int
    out_cache_loc_ptr,  # [N] int64
    req_to_token_ptr,  # [pool_rows, ctx] int
    full_to_swa_ptr,  # [num_full_slots] int (HAS_SWA_MAP)
    failed_ptr,  # [B] int8 requests that failed a batch check (``_check_kernel``)
    # outputs
    batch_ids_ptr,  # [T] int32
    positions_ptr,  # [T] int64
    swa_out_loc_ptr,  # [T] int64
    swa_lengths_ptr,  # [T] int32
    page_table_ptr,  # [T, Pw] int32
    swa_indices_ptr,  # [T, Ws] int32
    c4_out_loc_ptr,
    c4_raw_ptr,
    c4_sparse_ptr,
    c4_indices_ptr,
    c4_compress_ptr,
    c4_write_ptr,
    c128_out_loc_ptr,
    c128_raw_ptr,
    c128_sparse_ptr,
    c128_indices_ptr,
    c128_compress_ptr,
    c128_write_ptr,
    c1_out_loc_ptr,
    c1_raw_ptr,
    c1_sparse_ptr,
    c1_indices_ptr,
    c1_candidates_ptr,
    c2_out_loc_ptr,
    c2_raw_ptr,
    c2_sparse_ptr,
    c2_indices_ptr,
    c2_candidates_ptr,
    num_rows,  # T
    padded_rows,  # rows written: T plus padded rows (sentinels) up to a graph's row count
    batch_size,  # B
    context,  # req_to_token columns
    stride_rt,
    page_width,  # Pw
    swa_width,  # Ws
    index_topk,  # K
    c128_width,  # N128
    candidate_width,  # NB: DeepSeek-V4.1's candidate blocks
    rows_per_request,  # uniform kinds: rows of each request
    pos_shift,  # uniform kinds: first new position = seq_len + pos_shift
    loc_stride,  # uniform kinds: out_cache_loc index = b * loc_stride + loc_offset + i
    loc_offset,
    window,  # window_size
    EXTEND: tl.constexpr,
    HAS_FLOORS: tl.constexpr,  # extend kinds: the requests' window floors (the host table)
    HAS_SWA_MAP: tl.constexpr,
    HAS_C4: tl.constexpr,
    HAS_C128: tl.constexpr,
    HAS_C1: tl.constexpr,
    HAS_C2: tl.constexpr,
    CANDIDATE_RATIO: tl.constexpr,  # the low ratio with candidate blocks, 0 for none
    PAGE: tl.constexpr,
    SPAN4: tl.constexpr,
    SPAN128: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Rows ``[t0, t0 + BLOCK_T)``, columns ``[c0, c0 + BLOCK_C)`` of the wide fields."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < num_rows
    live = t < padded_rows
    first_col = tl.program_id(1) * BLOCK_C
    # Per request: first new position, rows, kept length (the write plans keep state for it).
    r = tl.arange(0, BLOCK_B)
    req_ok = r < batch_size
    if EXTEND:
        req_p0 = tl.load(host_ptr + batch_size + r, mask=req_ok, other=0)
        req_n = tl.load(host_ptr + 2 * batch_size + r, mask=req_ok, other=0)
        req_keep = tl.load(host_ptr + 4 * batch_size + r, mask=req_ok, other=0)
    else:
        req_p0 = tl.load(seq_ptr + r, mask=req_ok, other=0).to(tl.int64) + pos_shift
        req_n = tl.where(req_ok, rows_per_request, 0).to(tl.int64)
        req_keep = req_p0 + 1  # decode / draft: the row itself; verify: drafts may be rejected
    b, i, p0, length, keep, loc = _expand_rows(
        t,
        row_ok,
        r,
        req_ok,
        seq_ptr,
        host_ptr,
        out_cache_loc_ptr,
        num_rows,
        batch_size,
        rows_per_request,
        pos_shift,
        loc_stride,
        loc_offset,
        EXTEND,
    )
    row_ok = row_ok & (p0 + i < length)  # a ragged verify's padding rows: sentinels
    req = tl.load(req_pool_ptr + b, mask=row_ok, other=0).to(tl.int64)
    # Deferred checks (planning/checks.py): a request with a failing row writes nothing and
    # reads pool row 0 only; its rows sit at position 1 and leave no plan record.
    req_failed = tl.load(failed_ptr + r, mask=req_ok, other=0) != 0
    req_ok = req_ok & ~req_failed
    failed = tl.load(failed_ptr + b, mask=row_ok, other=0) != 0
    req = tl.where(failed, 0, req)
    p0 = tl.where(failed, 1, p0)
    loc = tl.where(failed, -1, loc)
    pos = tl.where(failed, 1, p0 + i)
    planned = row_ok & ~failed
    cols = first_col + tl.arange(0, BLOCK_C)
    # page_table[t, k]: page of the request's token k * PAGE, -1 past its length.
    m = row_ok[:, None] & (cols < page_width)[None, :]
    token = cols.to(tl.int64)[None, :] * PAGE
    in_req = m & (token < length[:, None])
    slot = tl.load(
        req_to_token_ptr + req[:, None] * stride_rt + tl.minimum(token, context - 1),
        mask=in_req,
        other=0,
    ).to(tl.int64)
    page = tl.where(in_req, slot // PAGE, -1).to(tl.int32)
    m = live[:, None] & (cols < page_width)[None, :]
    tl.store(page_table_ptr + t[:, None] * page_width + cols[None, :], page, mask=m)
    # swa_page_indices[t, j]: window slot of position pos - j inside the window and at or
    # after the row's window floor (extend kinds: the host table's fourth row), else -1.
    if HAS_FLOORS:
        floor = tl.load(host_ptr + 3 * batch_size + b, mask=row_ok, other=0)
        floor = tl.minimum(floor, pos)  # a failed request's rows sit at position 1
    else:
        floor = pos * 0
    m = row_ok[:, None] & (cols < swa_width)[None, :]
    key_pos = pos[:, None] - cols[None, :]
    valid = m & (cols < window)[None, :] & (key_pos >= floor[:, None])
    slot = tl.load(
        req_to_token_ptr + req[:, None] * stride_rt + tl.maximum(key_pos, 0), mask=valid, other=0
    ).to(tl.int64)
    if HAS_SWA_MAP:
        slot = tl.load(full_to_swa_ptr + slot, mask=valid, other=0).to(tl.int64)
    swa = tl.where(valid, slot, -1).to(tl.int32)
    m = live[:, None] & (cols < swa_width)[None, :]
    tl.store(swa_indices_ptr + t[:, None] * swa_width + cols[None, :], swa, mask=m)
    if first_col == 0:
        # Padded rows get the sentinels of planning/metadata.py (``sentinel``).
        tl.store(batch_ids_ptr + t, tl.where(row_ok, b, 0).to(tl.int32), mask=live)
        tl.store(positions_ptr + t, tl.where(row_ok, pos, 0), mask=live)
        if HAS_SWA_MAP:
            writes = row_ok & (loc >= 0)
            swa_loc = tl.load(full_to_swa_ptr + tl.maximum(loc, 0), mask=writes, other=0)
            swa_loc = tl.where(writes, swa_loc.to(tl.int64), -1)
        else:
            swa_loc = tl.where(row_ok, loc, -1)
        tl.store(swa_out_loc_ptr + t, swa_loc, mask=live)
        swa_len = tl.where(row_ok, tl.minimum(pos + 1 - floor, window), 1).to(tl.int32)
        tl.store(swa_lengths_ptr + t, swa_len, mask=live)
    per_request = (r, req_p0, req_n, req_keep, req_ok)
    if HAS_C4:
        _ratio_fields(
            t,
            row_ok,
            planned,
            live,
            b,
            i,
            pos,
            p0,
            loc,
            *per_request,
            keep,
            first_col,
            req_to_token_ptr,
            stride_rt,
            req,
            page_width,
            index_topk,
            c128_width,
            c4_out_loc_ptr,
            c4_raw_ptr,
            c4_sparse_ptr,
            c4_indices_ptr,
            index_topk,
            c4_compress_ptr,
            c4_write_ptr,
            R=4,
            SPAN=SPAN4,
            PAGE=PAGE,
            BLOCK_C=BLOCK_C,
        )
    if HAS_C128:
        _ratio_fields(
            t,
            row_ok,
            planned,
            live,
            b,
            i,
            pos,
            p0,
            loc,
            *per_request,
            keep,
            first_col,
            req_to_token_ptr,
            stride_rt,
            req,
            page_width,
            index_topk,
            c128_width,
            c128_out_loc_ptr,
            c128_raw_ptr,
            c128_sparse_ptr,
            c128_indices_ptr,
            c128_width,
            c128_compress_ptr,
            c128_write_ptr,
            R=128,
            SPAN=SPAN128,
            PAGE=PAGE,
            BLOCK_C=BLOCK_C,
        )
    if HAS_C1:
        _low_ratio_fields(
            t,
            row_ok,
            live,
            pos,
            loc,
            first_col,
            index_topk,
            candidate_width,
            c1_out_loc_ptr,
            c1_raw_ptr,
            c1_sparse_ptr,
            c1_indices_ptr,
            c1_candidates_ptr,
            R=1,
            HAS_CANDIDATES=CANDIDATE_RATIO == 1,
            BLOCK_C=BLOCK_C,
        )
    if HAS_C2:
        _low_ratio_fields(
            t,
            row_ok,
            live,
            pos,
            loc,
            first_col,
            index_topk,
            candidate_width,
            c2_out_loc_ptr,
            c2_raw_ptr,
            c2_sparse_ptr,
            c2_indices_ptr,
            c2_candidates_ptr,
            R=2,
            HAS_CANDIDATES=CANDIDATE_RATIO == 2,
            BLOCK_C=BLOCK_C,
        )


@dataclass(frozen=True)
class RowLayout:
    """How a batch's requests expand into rows, for ``plan_fields``.

    Uniform kinds: request ``b`` has ``rows_per_request`` rows from position
    ``seq_lens[b] + pos_shift``, writing ``out_cache_loc[b * loc_stride + loc_offset + i]``.
    Extend kinds and a ragged verify (``host`` given): ``host`` is ``[5, B]`` int64 (first row,
    first new position, rows, window floor and the length the write plans keep, of each
    request; an extend's uploaded from its host lengths, a ragged verify's computed on the
    device) and row ``t`` writes ``out_cache_loc[t]``; rows past a request's (a ragged verify's
    bucket) are padding rows, planned with the sentinels.
    """

    rows_per_request: int = 1
    pos_shift: int = 0
    loc_stride: int = 1
    loc_offset: int = 0
    host: torch.Tensor | None = None
    #: Extend kinds: the host table's window floors apply (``BatchView.window_floors``).
    floors: bool = False


def check_rows(
    *,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa: torch.Tensor | None,
    layout: RowLayout,
    num_rows: int,
    slot_limit: int | None,
    swa_limit: int | None,
    window: int,
    page_size: int,
    page_width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``_check_kernel`` once: the batch checks of ``num_rows`` rows and of what the
    plan reads from ``req_to_token`` (``window - 1`` keys before each request's first new
    position, ``page_width`` page-table slots of ``page_size`` tokens).

    Returns the record ``[7, 4]`` int64 (per check: failed, first bad index, its value, the
    expected value; the checks and their order are ``planning/planner.py``'s
    ``check_messages``) and ``[B]`` int8 marking the requests with a failing row, which
    ``plan_fields`` plans as writing nothing.
    """
    bs = req_pool_indices.numel()
    device = req_to_token.device
    record = torch.empty(7, 4, dtype=torch.int64, device=device)
    failed = torch.empty(bs, dtype=torch.int8, device=device)
    block_b = triton.next_power_of_2(max(bs, 1))
    tiles = planner_tiles(device)
    host = record if layout.host is None else layout.host
    _check_kernel[(1,)](
        seq_lens,
        host,
        req_pool_indices,
        out_cache_loc,
        req_to_token,
        record if full_to_swa is None else full_to_swa,
        record,
        failed,
        num_rows,
        bs,
        req_to_token.shape[0],
        req_to_token.shape[1],
        req_to_token.stride(0),
        -1 if slot_limit is None else slot_limit,
        -1 if swa_limit is None else swa_limit,
        layout.rows_per_request,
        layout.pos_shift,
        layout.loc_stride,
        layout.loc_offset,
        window,
        page_width,
        EXTEND=layout.host is not None,
        HAS_SWA_MAP=full_to_swa is not None,
        PAGE=page_size,
        BLOCK_T=row_block(tiles, tiles.check_rows, block_b),
        BLOCK_B=block_b,
        BLOCK_E=check_block_e(tiles, window, block_b),
    )
    return record, failed


def check_block_e(tiles: PlannerTiles, window: int, block_b: int) -> int:
    """Read entries per tile of ``_check_kernel`` (``[BLOCK_E, BLOCK_B]`` tiles of the window
    keys before each request's first new position, then of its page-table slots), for a
    ``window`` of keys and ``block_b`` requests a tile: the two tiles at most
    ``tiles.check_read_tile`` elements."""
    per_tile = tiles.check_read_tile // 2
    return max(1, min(triton.next_power_of_2(max(window - 1, 1)), per_tile // block_b))


def plan_fields(
    *,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa: torch.Tensor | None,
    failed: torch.Tensor,
    layout: RowLayout,
    num_rows: int,
    out: AttentionMetadata,
    window: int,
    index_topk: int,
    page_size: int,
) -> None:
    """Launch ``_plan_kernel`` once: fill ``out``'s tensors with the plan of ``num_rows`` rows.

    ``out``'s tensors (contiguous) fix the widths: ``page_table`` ``Pw``, ``swa_page_indices``
    ``Ws``, the c4 / c128 ``page_indices`` ``K`` / ``N128``, and its ratios (c4, c128, c1, c2
    not None) the ratios planned. ``failed``
    ``[B]`` (``check_rows``): requests planned as writing nothing (deferred checks). Rows of
    ``out`` past ``num_rows`` (a graph bucket larger than the batch) get the sentinels of
    ``planning/graph_buffers.py``.
    """
    padded_rows, bs = out.row_batch_ids.shape[0], req_pool_indices.numel()
    if padded_rows == 0:
        return
    page_width, swa_width = out.page_table.shape[1], out.swa_page_indices.shape[1]
    c128_width = 0 if out.c128 is None else out.c128.page_indices.shape[1]
    parts = [part for part in (out.c4, out.c128, out.c1, out.c2) if part is not None]
    index_widths = [part.page_indices.shape[1] for part in parts]
    candidates = {
        low.ratio: low.candidate_blocks
        for low in (out.c1, out.c2)
        if low is not None and low.candidate_blocks is not None
    }
    candidate_ratio, candidate_blocks = next(iter(candidates.items()), (0, None))
    candidate_width = 0 if candidate_blocks is None else candidate_blocks.shape[1]
    index_widths.append(candidate_width)
    block_b = triton.next_power_of_2(max(bs, 1))
    tiles = planner_tiles(out.page_table.device)
    block_t = row_block(tiles, tiles.rows, block_b)
    widest = max(page_width, swa_width, *index_widths)
    block_c = plan_block_c(tiles, widest)
    grid = (triton.cdiv(padded_rows, block_t), triton.cdiv(widest, block_c))

    def part_args(part: CompressedMetadata | LowRatioMetadata | None, count: int) -> tuple:
        """A ratio's tensors in field order (``count`` of them), stand-ins (``swa_out_loc``,
        never written) for an absent ratio or candidate blocks."""
        if part is None:
            return (out.swa_out_loc,) * count
        values = [getattr(part, f.name) for f in dc_fields(part) if f.name != "ratio"]
        return tuple(out.swa_out_loc if v is None else v for v in values)

    host = out.swa_out_loc if layout.host is None else layout.host
    _plan_kernel[grid](
        seq_lens,
        host,
        req_pool_indices,
        out_cache_loc,
        req_to_token,
        out.swa_out_loc if full_to_swa is None else full_to_swa,
        failed,
        out.row_batch_ids,
        out.positions_causal,
        out.swa_out_loc,
        out.swa_topk_lengths,
        out.page_table,
        out.swa_page_indices,
        *part_args(out.c4, 6),
        *part_args(out.c128, 6),
        *part_args(out.c1, 5),
        *part_args(out.c2, 5),
        num_rows,
        padded_rows,
        bs,
        req_to_token.shape[1],
        req_to_token.stride(0),
        page_width,
        swa_width,
        index_topk,
        c128_width,
        candidate_width,
        layout.rows_per_request,
        layout.pos_shift,
        layout.loc_stride,
        layout.loc_offset,
        window,
        EXTEND=layout.host is not None,
        HAS_FLOORS=layout.floors,
        HAS_SWA_MAP=full_to_swa is not None,
        HAS_C4=out.c4 is not None,
        HAS_C128=out.c128 is not None,
        HAS_C1=out.c1 is not None,
        HAS_C2=out.c2 is not None,
        CANDIDATE_RATIO=candidate_ratio,
        PAGE=page_size,
        SPAN4=compress_span(4),
        SPAN128=compress_span(128),
        BLOCK_T=block_t,
        BLOCK_B=block_b,
        BLOCK_C=block_c,
    )
