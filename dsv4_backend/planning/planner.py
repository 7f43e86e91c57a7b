"""Metadata planning: a pure function from a ``BatchView`` to ``AttentionMetadata``.

Each ``ForwardKind`` only says how its requests expand into query rows (``_Rows``, see the row
table in ``planning/batch.py``); one shared body, ``_plan_rows``, builds every field of
docs/design.md §4 from those rows. Eager planning, CUDA-graph capture and replay all
run this same code; the graph path then copies the result into fixed buffers
(``planning/graph_buffers.py``). Planning never syncs with a CUDA device, except in strict
mode, where it reads the verdict of the batch checks (``checked_rows``, ``planning/checks.py``)
once per plan.

Graph safety: with ``widths`` given, the uniform kinds (``GRAPH_KINDS``) plan with shapes fixed by
the row count (no ``nonzero`` / ``masked_select``, no ``.item()`` / ``.tolist()``); lengths are
only checked where the batch already holds them on the host (``BatchView.host_seq_lens``). The
extend kinds size their rows from the host lists ``extend_prefix_lens`` / ``extend_seq_lens``.

Kernels (the :data:`PLAN` table, ``kernels/variants.py``): on the Triton paths
(``kernels/dispatch.py``) ``plan_into`` plans every kind in two launches of
``planning/kernels/plan_fields.py`` (three for extend kinds: their host lengths are uploaded
first; a ragged verify's row table is built on the device first, five torch ops):
``check_rows``, the batch checks (``checked_rows``'s twin), then the fused plan kernel, which
plans the requests that failed a deferred check as writing nothing;
``GraphMetadataBuffers.plan`` has it write straight into the graph buffers. The torch body
below serves the torch path; its per-row compression fields and compress / write plans run
the variants of ``planning/kernels/table.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict, cast

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ConfigError
from dsv4_backend.kernels.variants import TRITON_PATHS, OpTable, Variant, resolve
from dsv4_backend.ops.launches import launch
from dsv4_backend.planning import checks
from dsv4_backend.planning.batch import BatchView, ForwardKind, RaggedVerify
from dsv4_backend.planning.checks import Check, PendingChecks, run_checks
from dsv4_backend.planning.draft_slots import per_step_draft_out_cache_loc
from dsv4_backend.planning.kernels.plan_fields import RowLayout, check_rows, plan_fields
from dsv4_backend.planning.kernels.row_fields import row_fields
from dsv4_backend.planning.kernels.table import build_compress_plans
from dsv4_backend.planning.low_ratio import low_ratio_fields
from dsv4_backend.planning.metadata import (
    RECORD_FIELDS,
    AttentionMetadata,
    CompressedMetadata,
    LowRatioMetadata,
    sentinel,
)
from dsv4_backend.planning.tag import BatchTag


@dataclass(frozen=True)
class PlanWidths:
    """Column counts of the variable-width fields: ``page_table`` (``Pw``) and c128 (``N128``).

    Fixed widths make the plan's shapes independent of the batch's lengths (CUDA graphs); size
    them for the longest context with ``PlanWidths.for_max_len``.
    """

    page_table: int
    c128: int

    def __post_init__(self) -> None:
        if self.page_table < 1 or self.c128 < 1:
            raise ConfigError(
                f"PlanWidths(page_table={self.page_table}, c128={self.c128}); both must be >= 1"
            )

    @classmethod
    def for_max_len(cls, max_len: int, page_size: int = 256) -> PlanWidths:
        """Widths for requests of up to ``max_len`` tokens (at least one column each)."""
        return cls(page_table=max(1, math.ceil(max_len / page_size)), c128=max(1, max_len // 128))

    def covers(self, other: PlanWidths) -> bool:
        return self.page_table >= other.page_table and self.c128 >= other.c128


class _Rows(NamedTuple):
    """The query rows of a batch: what each kind's expansion computes, all the body reads."""

    batch_ids: torch.Tensor  # [T] int32: request of the row
    positions: torch.Tensor  # [T] int64
    out_loc: torch.Tensor  # [T] int64: full-cache slot the row writes
    first_new: torch.Tensor  # [T] int64: position of the request's first row in this forward
    request_lens: torch.Tensor  # [T] int32: the request's length after this forward
    keep_lens: torch.Tensor  # [T] int32: its shortest possible length after it (write plans)
    #: [T] bool: the row is its request's (None: every row); the others are padding rows,
    #: planned as writing nothing and attending to nothing (a ragged verify's bucket).
    live: torch.Tensor | None = None


# ------------------------------------------------------------------------- row expansions
def _decode_rows(batch: BatchView) -> _Rows:
    """One row per request (none for IDLE); a draft step writes its own slice of slots."""
    seq = batch.seq_lens.long()
    bs = batch.batch_size
    if batch.draft is None:
        positions, out_loc = seq - 1, batch.out_cache_loc
    else:
        step = batch.draft
        per_step = per_step_draft_out_cache_loc(batch.out_cache_loc, bs, step.topk, step.num_steps)
        positions, out_loc = seq + step.step_id, per_step[step.step_id]
    ids = torch.arange(bs, dtype=torch.int32, device=seq.device)
    lens = (positions + 1).int()
    return _Rows(ids, positions, out_loc.long(), positions, lens, lens)


#: The write plans' keep length of a row that must leave no record (no ring row kept).
_NEVER = torch.iinfo(torch.int32).max


def verify_rows(batch: BatchView) -> _Rows:
    """``num_draft_tokens`` rows per request, at ``seq_lens[b] ... seq_lens[b] + n - 1``; a
    ragged verify's own counts (``ragged_verify_rows``)."""
    if batch.ragged is not None:
        return ragged_verify_rows(batch)
    n = cast(int, batch.num_draft_tokens)  # BatchView requires it for TARGET_VERIFY
    seq = batch.seq_lens.long()
    row = torch.arange(batch.num_rows, device=seq.device)
    ids = row // n
    first = seq[ids]
    out_loc = batch.out_cache_loc.long()
    # Drafts may be rejected: keep the state that the shortest outcome (seq_lens + 1) needs.
    keep = (first + 1).int()
    return _Rows(ids.int(), first + row % n, out_loc, first, (first + n).int(), keep)


def max_request_rows(batch: BatchView) -> int | None:
    """``AttentionMetadata.max_request_rows`` of ``batch``: its rows a request (uniform kinds),
    a ragged verify's verify width (sglang's verify lengths are at most its
    ``speculative_num_draft_tokens``), None for extends."""
    if batch.ragged is not None:
        return batch.num_draft_tokens
    return batch.rows_per_request


def ragged_verify_rows(batch: BatchView) -> _Rows:
    """A ragged verify's rows (``BatchView.ragged``): ``lens[b]`` rows of request ``b`` at
    ``seq_lens[b] ... seq_lens[b] + lens[b] - 1``, packed request after request, then padding
    rows up to ``num_rows`` (``live`` False). Device ops only, no host sync (CUDA graphs).

    Drafts may be rejected, so the write plans keep ``seq_lens + 1`` as a verify's do. A
    padding row stands at position 1 of its (last) request with no write slot and no kept
    length: it completes no c4 / c128 entry, is no page end, and so leaves no plan record.
    """
    ragged = cast(RaggedVerify, batch.ragged)
    lens = ragged.lens.long()
    seq = batch.seq_lens.long()
    ends = torch.cumsum(lens, 0)
    row = torch.arange(ragged.num_rows, device=seq.device)
    ids = torch.searchsorted(ends, row, right=True).clamp(max=batch.batch_size - 1)
    within = row - (ends - lens)[ids]
    live = within < lens[ids]
    first = seq[ids]
    positions = torch.where(live, first + within, 1)
    out_loc = torch.where(live, batch.out_cache_loc.long(), -1)
    keep = torch.where(live, first + 1, _NEVER).int()
    return _Rows(ids.int(), positions, out_loc, first, (first + lens[ids]).int(), keep, live)


def _extend_rows(batch: BatchView) -> _Rows:
    """``extend_seq_lens[b]`` rows per request after its prefix (host lengths give the shape)."""
    device = batch.seq_lens.device
    prefix = torch.tensor(batch.extend_prefix_lens, dtype=torch.long, device=device)
    extend = torch.tensor(batch.extend_seq_lens, dtype=torch.long, device=device)
    num_rows = batch.num_rows
    ids = torch.repeat_interleave(
        torch.arange(batch.batch_size, device=device), extend, output_size=num_rows
    )
    row_in_request = torch.arange(num_rows, device=device) - (torch.cumsum(extend, 0) - extend)[ids]
    first = prefix[ids]
    lens = (prefix + extend)[ids].int()
    out_loc = batch.out_cache_loc.long()
    return _Rows(ids.int(), first + row_in_request, out_loc, first, lens, lens)


@dataclass(frozen=True)
class _KindPlan:
    expand: Callable[[BatchView], _Rows]
    #: False for the window-only MTP layer (no c4 / c128 fields).
    compressed: bool
    #: Uniform rows per request: plannable inside a CUDA graph when widths are given.
    graph: bool


_KINDS: dict[ForwardKind, _KindPlan] = {
    ForwardKind.IDLE: _KindPlan(_decode_rows, compressed=True, graph=True),
    ForwardKind.DECODE: _KindPlan(_decode_rows, compressed=True, graph=True),
    ForwardKind.TARGET_VERIFY: _KindPlan(verify_rows, compressed=True, graph=True),
    ForwardKind.EXTEND: _KindPlan(_extend_rows, compressed=True, graph=False),
    ForwardKind.DRAFT_EXTEND: _KindPlan(_extend_rows, compressed=False, graph=False),
}

#: Kinds whose plan can be captured in a CUDA graph (the one place this is declared).
GRAPH_KINDS = frozenset(kind for kind, spec in _KINDS.items() if spec.graph)


# ------------------------------------------------------------------------------ the body
def plan(
    config: DSV4AttentionConfig, batch: BatchView, *, widths: PlanWidths | None = None
) -> AttentionMetadata:
    """Plan the attention metadata of ``batch``: one row per query token.

    Parameters
    ----------
    config : the model's attention configuration.
    batch : the batch view (row semantics per kind in ``planning/batch.py``).
    widths : column counts of ``page_table`` and the c128 indices. ``None`` (eager) derives them
        from the batch's longest request; given, the plan's shapes depend on the row count only,
        and a uniform kind (``GRAPH_KINDS``) plans without any host sync.

    Raises
    ------
    BatchError : an unknown kind; no widths and no host lengths; a request longer than
        ``req_to_token`` or ``widths`` too small (checked when the host knows the lengths); an
        index out of range or a write slot that is not the one ``req_to_token`` holds for the
        row (``checked_rows``; on CUDA without strict mode these are returned pending in
        ``metadata.pending_checks`` instead, see ``planning/checks.py``).

    The plan is tagged (``metadata.tag``) with the batch's tensors, for ``check_batch``.
    """
    spec = _KINDS.get(batch.kind)
    if spec is None:
        raise BatchError(
            f"cannot plan forward kind {batch.kind!r}; expected one of "
            f"{[kind.name for kind in _KINDS]} (a DSpark draft block: "
            "planning.plan_dspark_block)"
        )
    device = batch.req_to_token.device
    variant = resolve(PLAN, device).variant
    if variant is FUSED and not _fuses_v41(batch):
        return _plan_torch(config, batch, widths)
    return variant.entry(config, batch, widths)


def _fuses_v41(batch: BatchView) -> bool:
    """Whether the fused planner takes ``batch``'s DeepSeek-V4.1 parts: a late-layer tail's
    window floors only where ``LOW_RATIO_PLAN``'s ``fused`` variant runs (else the torch
    planner plans the tail)."""
    if batch.window_floors is None:
        return True
    return resolve(LOW_RATIO_PLAN, batch.req_to_token.device).variant is LOW_RATIO_FUSED


def _extend_lens(batch: BatchView) -> tuple[Sequence[int], Sequence[int]]:
    """An extend kind's host prefix and new-token lengths (``BatchView`` requires them)."""
    return cast(Sequence[int], batch.extend_prefix_lens), cast(Sequence[int], batch.extend_seq_lens)


def _host_lens(batch: BatchView) -> list[int] | None:
    """Each request's length after this forward, when the host knows it without a sync."""
    if batch.kind in (ForwardKind.EXTEND, ForwardKind.DRAFT_EXTEND):
        return [p + e for p, e in zip(*_extend_lens(batch), strict=True)]
    host = batch.host_seq_lens
    if host is None:
        return None
    if batch.ragged is not None:
        lens = batch.ragged.lens_cpu
        return None if lens is None else [s + n for s, n in zip(host, lens, strict=True)]
    if batch.kind is ForwardKind.TARGET_VERIFY:
        return [s + cast(int, batch.num_draft_tokens) for s in host]
    return [s + batch.draft.step_id + 1 for s in host] if batch.draft is not None else host


def _row_layout(batch: BatchView) -> RowLayout:
    """How ``batch``'s requests expand into rows (the expansions above, as kernel scalars)."""
    if batch.kind in (ForwardKind.EXTEND, ForwardKind.DRAFT_EXTEND):
        prefix, extend = _extend_lens(batch)
        starts = [0, *itertools.accumulate(extend)][: len(extend)]
        floors = list(batch.window_floors or [0] * len(extend))
        keep = [p + e for p, e in zip(prefix, extend, strict=True)]
        host = [starts, list(prefix), list(extend), floors, keep]
        with launch("copy: extend lengths to the device"):
            table = torch.tensor(host, dtype=torch.int64, device=batch.seq_lens.device)
        return RowLayout(host=table, floors=batch.window_floors is not None)
    if batch.ragged is not None:  # the extend layout's table, from the device lengths
        lens, seq = batch.ragged.lens.long(), batch.seq_lens.long()
        first_rows = torch.cumsum(lens, 0) - lens
        # Drafts may be rejected: the write plans keep seq_lens + 1, as a verify's. The
        # floors row is read only with window floors (none here): it repeats seq_lens.
        return RowLayout(host=torch.stack([first_rows, seq, lens, seq, seq + 1]))
    if batch.kind is ForwardKind.TARGET_VERIFY:
        n = cast(int, batch.num_draft_tokens)
        return RowLayout(rows_per_request=n, loc_stride=n)
    if batch.draft is not None:
        step = batch.draft
        return RowLayout(
            pos_shift=step.step_id, loc_stride=step.topk * step.num_steps, loc_offset=step.step_id
        )
    return RowLayout(pos_shift=-1)


def fuses(batch: BatchView) -> bool:
    """Whether ``batch`` is planned by the fused kernels (``planning/kernels/plan_fields.py``):
    on the Triton paths, every kind, its batch checks included (read at once or deferred)."""
    return (
        batch.kind in _KINDS
        and resolve(PLAN, batch.req_to_token.device).variant is FUSED
        and _fuses_v41(batch)
    )


class _KernelInputs(TypedDict):
    """The batch tensors the fused planner's two kernels read (``check_rows``,
    ``plan_fields``)."""

    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token: torch.Tensor
    full_to_swa: torch.Tensor | None


def _kernel_inputs(batch: BatchView) -> _KernelInputs:
    return _KernelInputs(
        seq_lens=batch.seq_lens,
        req_pool_indices=batch.req_pool_indices,
        out_cache_loc=batch.out_cache_loc,
        req_to_token=batch.req_to_token,
        full_to_swa=batch.full_to_swa,
    )


def fused_checks(
    config: DSV4AttentionConfig, batch: BatchView, layout: RowLayout, page_width: int
) -> tuple[torch.Tensor, PendingChecks | None]:
    """The batch checks in one launch (``check_rows``), their verdict read at once (raises
    ``BatchError``) or pending (``planning/checks.py``); returns the ``[B]`` int8 mask of the
    requests that failed, for ``plan_fields``."""
    record, failed = check_rows(
        **_kernel_inputs(batch),
        layout=layout,
        num_rows=batch.num_rows,
        slot_limit=_slot_limit(batch),
        swa_limit=batch.num_swa_slots,
        window=config.window_size,
        page_size=config.page_size,
        page_width=page_width,
    )
    return failed, checks.settle(check_messages(batch), record, f"a {batch.kind.name} batch")


def empty_metadata(
    batch: BatchView,
    rows: int,
    widths: dict[str, int],
    ratios: frozenset[int],
    low_ratios: frozenset[int],
) -> AttentionMetadata:
    """Uninitialised metadata of ``rows`` rows for ``batch`` (its kind and size, no tag) to
    plan into, with the fields of ``ratios`` and ``low_ratios``; ``widths`` maps
    ``page_table``, ``swa_page_indices``, ``c4``, ``c128``, ``low_ratio`` (the low ratios'
    ``K``) and ``candidates`` (a ratio's candidate blocks, absent for none) to their column
    counts, and ``candidate_ratio`` to the low ratio that has them."""
    device = batch.req_to_token.device

    def empty(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    def ratio(r: int) -> CompressedMetadata | None:
        if r not in ratios:
            return None
        return CompressedMetadata(
            ratio=r,
            out_loc=empty(rows, dtype=torch.int64),
            topk_lengths_raw=empty(rows),
            sparse_topk_lengths=empty(rows),
            page_indices=empty(rows, widths[f"c{r}"]),
            compress_plan=empty(rows, 4),
            write_plan=empty(rows, 4),
        )

    def low_ratio(r: int) -> LowRatioMetadata | None:
        if r not in low_ratios:
            return None
        candidates = widths.get("candidate_ratio") == r
        return LowRatioMetadata(
            ratio=r,
            out_loc=empty(rows, dtype=torch.int64),
            topk_lengths_raw=empty(rows),
            sparse_topk_lengths=empty(rows),
            page_indices=empty(rows, widths["low_ratio"]),
            candidate_blocks=empty(rows, widths["candidates"]) if candidates else None,
        )

    return AttentionMetadata(
        kind=batch.kind,
        batch_size=batch.batch_size,
        num_rows=rows,
        max_request_rows=max_request_rows(batch),
        row_batch_ids=empty(rows),
        page_table=empty(rows, widths["page_table"]),
        swa_out_loc=empty(rows, dtype=torch.int64),
        positions_causal=empty(rows, dtype=torch.int64),
        swa_page_indices=empty(rows, widths["swa_page_indices"]),
        swa_topk_lengths=empty(rows),
        c4=ratio(4),
        c128=ratio(128),
        c1=low_ratio(1),
        c2=low_ratio(2),
    )


def plan_into(
    config: DSV4AttentionConfig,
    batch: BatchView,
    widths: PlanWidths | None,
    out: AttentionMetadata | None,
) -> AttentionMetadata:
    """The fused planner: ``plan``'s result from two launches, the batch checks and the fields
    (three for extend kinds: their host lengths are uploaded first), for a batch that ``fuses``.

    ``out`` (``None``: allocated here, :func:`empty_metadata`) is the metadata planned into,
    of ``batch``'s kind and size: its tensors receive the fields (its ratios, those planned);
    rows past ``batch.num_rows`` get the sentinels (``metadata.sentinel``), and its
    widths must be ``widths``'. Returns ``out`` with the batch's tag and pending checks.
    """
    spec = _KINDS[batch.kind]
    widths = resolve_widths(config, batch, _host_lens(batch), widths)
    layout = _row_layout(batch)
    failed, pending = fused_checks(config, batch, layout, widths.page_table)
    low_present = config.low_ratios_present if spec.compressed else frozenset()
    device = batch.req_to_token.device
    in_kernel = bool(low_present) and resolve(LOW_RATIO_PLAN, device).variant is LOW_RATIO_FUSED
    if out is None:
        present = config.ratios_present if spec.compressed else frozenset()
        columns = {
            "page_table": widths.page_table,
            "swa_page_indices": config.swa_index_width,
            "c4": config.index_topk,
            "c128": widths.c128,
            "low_ratio": config.index_topk,
        }
        if config.v41 is not None and config.candidate_ratio is not None:
            columns["candidates"] = config.v41.candidate_topk_blocks
            columns["candidate_ratio"] = config.candidate_ratio
        written = low_present if in_kernel else frozenset()
        out = empty_metadata(batch, batch.num_rows, columns, present, written)
    plan_fields(
        **_kernel_inputs(batch),
        failed=failed,
        layout=layout,
        num_rows=batch.num_rows,
        out=out if in_kernel else dataclasses.replace(out, c1=None, c2=None),
        window=config.window_size,
        index_topk=config.index_topk,
        page_size=config.page_size,
    )
    if not in_kernel and low_present:
        low = _low_ratio_after_kernel(config, batch, out, low_present)
        out = dataclasses.replace(out, c1=low.get(1), c2=low.get(2))
    return dataclasses.replace(out, tag=batch_tag(batch), pending_checks=pending)


def _low_ratio_after_kernel(
    config: DSV4AttentionConfig, batch: BatchView, out: AttentionMetadata, present: frozenset[int]
) -> dict[int, LowRatioMetadata]:
    """``LOW_RATIO_PLAN``'s torch variant after the fused planner's launch: the twin over the
    plan's rows (a row writes its slot unless the plan gave it no window write: a bucket's
    padded row, a request that failed a deferred check), written into ``out``'s low-ratio
    views when it has them (the graph buffers)."""
    loc = _KINDS[batch.kind].expand(batch).out_loc
    slots = torch.full_like(out.swa_out_loc, -1)
    slots[: loc.numel()] = loc
    slots = torch.where(out.swa_out_loc >= 0, slots, -1)
    low = {r: low_ratio_fields(config, out.positions_causal, slots, r) for r in present}
    for views in (out.c1, out.c2):
        if views is None:
            continue
        for field in dataclasses.fields(views):
            view = getattr(views, field.name)
            if isinstance(view, torch.Tensor):
                view.copy_(getattr(low[views.ratio], field.name))
        low[views.ratio] = views
    return low


def batch_tag(batch: BatchView) -> BatchTag:
    """The plan's tag: the batch tensors it was made from (``check_batch``)."""
    return BatchTag(
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens,
        out_cache_loc=batch.out_cache_loc,
    )


def resolve_widths(
    config: DSV4AttentionConfig,
    batch: BatchView,
    host_lens: list[int] | None,
    widths: PlanWidths | None,
) -> PlanWidths:
    """Check the lengths the host knows; derive the widths when none are given (a ragged
    verify without host lengths: the widths of ``req_to_token``'s whole context)."""
    if host_lens is None and widths is None and batch.ragged is not None:
        return PlanWidths.for_max_len(batch.req_to_token.shape[1], config.page_size)
    if host_lens is None:
        if widths is None:
            raise BatchError(
                f"cannot size the plan of a batch whose seq_lens are on {batch.seq_lens.device} "
                "without host lengths; pass seq_lens_cpu (eager) or fixed widths (CUDA graphs)"
            )
        return widths
    max_len = max(host_lens, default=0)
    context = batch.req_to_token.shape[1]
    if max_len > context:
        raise BatchError(
            f"seq_len {max_len} exceeds req_to_token width {context}; the request pool holds "
            f"at most {context} tokens per request"
        )
    needed = PlanWidths.for_max_len(max_len, config.page_size)
    if widths is None:
        return needed
    if not widths.covers(needed):
        raise BatchError(
            f"{widths} is too small for this batch: its longest request ({max_len} tokens) needs "
            f"page_table >= {needed.page_table} and c128 >= {needed.c128}; size the widths for "
            "the longest context (PlanWidths.for_max_len(max_context_len))"
        )
    return widths


def _slot_limit(batch: BatchView) -> int | None:
    """Full slots must lie below this (the cache's slots and ``full_to_swa``'s length)."""
    limits = [n for n in (batch.num_cache_slots, _len(batch.full_to_swa)) if n is not None]
    return min(limits) if limits else None


def check_messages(batch: BatchView) -> tuple[str, ...]:
    """The messages of the batch checks, in the order of their record (``checked_rows``,
    ``planning/kernels/plan_fields.py``'s ``check_rows``)."""
    pool_rows, context = batch.req_to_token.shape
    limit = _slot_limit(batch)
    full = f"[0, {'num_cache_slots' if limit is None else limit})"
    window = f"[0, {'num_swa_slots' if batch.num_swa_slots is None else batch.num_swa_slots})"
    slots = "out_cache_loc"
    if batch.draft is not None:
        slots = f"out_cache_loc (draft step {batch.draft.step_id}'s slots, [batch, topk, steps])"
    return (
        f"req_pool_indices[{{index}}]={{value}}; expected a row of req_to_token in "
        f"[0, {pool_rows})",
        f"row {{index}} is at position {{value}}, outside req_to_token's {context} columns; "
        "seq_lens must fit the request pool",
        f"{slots}[{{index}}]={{value}}; expected a full-cache slot in {full}",
        f"{slots}[{{index}}]={{value}} but req_to_token holds slot {{expected}} for that row's "
        "request and position: the write slots are not laid out as the rows (attention would "
        "read another slot back)",
        f"{slots}[{{index}}]={{expected}} is window slot {{value}} (full_to_swa); expected a "
        f"window-cache slot in {window}",
        f"request {{index}}: req_to_token holds slot {{value}} at position {{expected}}, which "
        f"the plan reads (window keys, page table); expected a full-cache slot in {full}",
        f"request {{index}}: the window key at position {{expected}} is window slot {{value}} "
        f"(full_to_swa); expected a window-cache slot in {window}",
    )


def _window_slots(batch: BatchView, full: torch.Tensor) -> torch.Tensor:
    """Window slots (int64) of in-range full slots ``full`` (int64): ``full_to_swa`` or the
    identity."""
    if batch.full_to_swa is None:
        return full
    return batch.full_to_swa[full.clamp(0, batch.full_to_swa.numel() - 1)].long()


def _out_of(values: torch.Tensor, limit: int | None) -> torch.Tensor:
    """``values < 0`` or ``>= limit`` (no upper bound when ``limit`` is None)."""
    return values < 0 if limit is None else (values < 0) | (values >= limit)


def _checked_reads(
    batch: BatchView,
    req: torch.Tensor,
    first_new: torch.Tensor,
    lens: torch.Tensor,
    *,
    keys: int,
    page_size: int,
    page_width: int,
) -> tuple[Check, Check, torch.Tensor]:
    """The checks of what the plan reads from ``req_to_token`` besides the rows' own slots.

    Per request (pool row ``req`` ``[B]``, in range; first new position ``first_new`` ``[B]``;
    length ``lens`` ``[B]``): the ``keys`` window keys before its first new position (full
    slot and window slot) and the first slot of each of the ``page_width`` pages of the page
    table inside its length (full slot). Entries are laid out ``[entry, request]``, the order
    ``check_rows`` visits them. Returns the full-slot check, the window-slot check and ``[B]``
    bool, the requests with a bad entry.
    """
    context = batch.req_to_token.shape[1]
    key_pos = first_new[None, :] - torch.arange(1, keys + 1, device=req.device)[:, None]
    page_pos = torch.arange(page_width, device=req.device)[:, None] * page_size
    positions = torch.cat([key_pos, page_pos.expand(-1, req.numel())])
    valid = torch.cat([key_pos >= 0, page_pos < lens[None, :]]) & (positions < context)
    full = batch.req_to_token[req[None, :], positions.clamp(0, context - 1)].long()
    bad_full = valid & _out_of(full, _slot_limit(batch))
    swa = _window_slots(batch, full[:keys])
    bad_swa = valid[:keys] & ~bad_full[:keys] & _out_of(swa, batch.num_swa_slots)
    requests = torch.arange(req.numel(), device=req.device).expand_as(positions)
    messages = check_messages(batch)
    full_check = Check(messages[5], bad_full, full, positions, indices=requests)
    swa_check = Check(messages[6], bad_swa, swa, positions[:keys], indices=requests[:keys])
    return full_check, swa_check, bad_full.any(0) | bad_swa.any(0)


def checked_rows(
    config: DSV4AttentionConfig,
    batch: BatchView,
    rows: _Rows,
    page_width: int,
    context_keys: int | None = None,
) -> tuple[torch.Tensor, _Rows, PendingChecks | None]:
    """Check every index before anything is gathered or written (``planning/checks.py``).

    * ``req_pool_indices`` in ``[0, pool_rows)`` (``-1`` included: it would wrap to the last
      request's row);
    * each row's position inside ``req_to_token``'s columns;
    * each write slot in ``[0, num_cache_slots)`` (and inside ``full_to_swa``);
    * each write slot equal to ``req_to_token[pool_row, position]``, the slot attention reads
      the row's key back from; a padding row (pool row 0, slot 0: sglang's data-parallel
      padding) is exempt;
    * each write's window slot (``full_to_swa``) in ``[0, num_swa_slots)``;
    * what the plan reads besides (``_checked_reads``): the full and window slots of the
      ``context_keys`` keys before each request's first new position (default ``window - 1``,
      the keys a causal row reads there; a DSpark block reads ``window``), every page-table
      slot.

    Returns the rows' pool rows ``[T]`` int64, the rows, and the pending checks (deferred
    mode). When deferred, the requests with a failing row write nothing (no cache slot, no
    compressor ring row) and read only in-range indices (pool row 0). The torch twin of
    ``planning/kernels/plan_fields.py``'s ``check_rows``.
    """
    pool_rows, context = batch.req_to_token.shape
    requests = batch.req_pool_indices.long()
    ids = rows.batch_ids.long()
    bad_request = (requests < 0) | (requests >= pool_rows)
    request_rows = torch.where(bad_request, 0, requests)
    req = request_rows[ids]
    positions, out = rows.positions, rows.out_loc
    live = torch.ones_like(positions, dtype=torch.bool) if rows.live is None else rows.live
    bad_position = live & ((positions < 0) | (positions >= context))
    held = batch.req_to_token[req, positions.clamp(0, context - 1)].long()
    bad_slot = live & _out_of(out, _slot_limit(batch))
    foreign = live & (out != held) & ~((req == 0) & (out == 0))
    swa = _window_slots(batch, out)
    bad_window = live & ~bad_slot & _out_of(swa, batch.num_swa_slots)
    # Every request has rows (extend lengths >= 1; a ragged verify's request without rows
    # reads nothing: length 0), so these scatters set every entry.
    first_new = requests.new_zeros(requests.shape).scatter_(0, ids, rows.first_new)
    lens = requests.new_zeros(requests.shape).scatter_(0, ids, rows.request_lens.long())
    read_full, read_swa, bad_reads = _checked_reads(
        batch,
        request_rows,
        first_new,
        lens,
        keys=config.window_size - 1 if context_keys is None else context_keys,
        page_size=config.page_size,
        page_width=page_width,
    )
    messages = check_messages(batch)
    row_checks = [
        Check(messages[0], bad_request, requests),
        Check(messages[1], bad_position, positions),
        Check(messages[2], bad_slot, out),
        Check(messages[3], foreign, out, held),
        Check(messages[4], bad_window, swa, out),
    ]
    pending = run_checks(
        [*row_checks, read_full, read_swa], batch.req_to_token.device, f"a {batch.kind.name} batch"
    )
    if pending is not None:
        # Requests with a failing row: pool row 0 (sglang's padding row), no cache write, and
        # position 1 (no page end) with an unreachable keep length, so no compress or write
        # plan record.
        row_failed = (bad_position | bad_slot | foreign | bad_window).int()
        failed_requests = (bad_request | bad_reads).int().index_add(0, ids, row_failed) > 0
        failed = failed_requests[ids]
        req = torch.where(failed, 0, req)
        rows = rows._replace(
            positions=torch.where(failed, 1, positions),
            first_new=torch.where(failed, 1, rows.first_new),
            keep_lens=torch.where(failed, _NEVER, rows.keep_lens),
            out_loc=torch.where(failed, -1, out),
        )
    return req, rows, pending


def _len(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.numel()


def plan_page_table(
    req_to_token: torch.Tensor,
    req: torch.Tensor,
    request_lens: torch.Tensor,
    width: int,
    page_size: int,
) -> torch.Tensor:
    """``[T, width]`` int32: page ``k`` = ``req_to_token[req, k * page_size] // page_size``."""
    first_token = torch.arange(width, device=req.device) * page_size
    slots = req_to_token[req[:, None], first_token.clamp(max=req_to_token.shape[1] - 1)]
    return torch.where(first_token < request_lens[:, None], slots // page_size, -1).int()


def _row_floors(batch: BatchView, rows: _Rows) -> torch.Tensor | None:
    """``[T]`` int64: the first position each row's window reads (``batch.window_floors`` of
    its request, at most the row's position, which a failed request's rows moved); None
    without floors (the plain window)."""
    if batch.window_floors is None:
        return None
    floors = torch.tensor(batch.window_floors, dtype=torch.int64, device=rows.positions.device)
    return torch.minimum(floors[rows.batch_ids.long()], rows.positions)


def _swa_page_indices(
    config: DSV4AttentionConfig,
    batch: BatchView,
    req: torch.Tensor,
    positions: torch.Tensor,
    floors: torch.Tensor | None,
) -> torch.Tensor:
    """``[T, Ws]`` int32: window-cache slots of positions ``p, p - 1, ...`` inside the window,
    at or after the row's window floor (``floors`` ``[T]``; None: from position 0)."""
    back = torch.arange(config.swa_index_width, device=positions.device)
    key_pos = positions[:, None] - back
    valid = (back < config.window_size) & (key_pos >= (0 if floors is None else floors[:, None]))
    slots = batch.req_to_token[req[:, None], key_pos.clamp(min=0)].long()
    if batch.full_to_swa is not None:
        slots = batch.full_to_swa[slots]
    return torch.where(valid, slots, -1).int()


def swa_write_slots(batch: BatchView, out_loc: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64 window slot each row writes; -1 stays -1 (no write)."""
    if batch.full_to_swa is None:
        return out_loc
    slots = batch.full_to_swa[out_loc.clamp(min=0)].long()
    return torch.where(out_loc >= 0, slots, -1)


def _compressed(
    config: DSV4AttentionConfig, ratio: int, rows: _Rows, page_table: torch.Tensor, c128: int
) -> CompressedMetadata:
    fields = row_fields(
        rows.positions,
        rows.out_loc,
        page_table,
        ratio=ratio,
        index_topk=config.index_topk,
        c128_width=c128,
    )
    page_indices = fields.page_indices
    if page_indices is None:  # c4: filled later by the indexer's top-k
        page_indices = torch.full(
            (rows.positions.shape[0], config.index_topk),
            -1,
            dtype=torch.int32,
            device=rows.positions.device,
        )
    compress_plan, write_plan = build_compress_plans(
        rows.batch_ids, rows.positions, rows.first_new, rows.keep_lens, ratio, config.page_size
    )
    return CompressedMetadata(
        ratio=ratio,
        out_loc=fields.out_loc,
        topk_lengths_raw=fields.topk_lengths_raw,
        sparse_topk_lengths=fields.sparse_topk_lengths,
        page_indices=page_indices,
        compress_plan=compress_plan,
        write_plan=write_plan,
    )


def _plan_rows(
    config: DSV4AttentionConfig,
    batch: BatchView,
    rows: _Rows,
    widths: PlanWidths | None,
    *,
    compressed: bool,
) -> AttentionMetadata:
    """Every metadata field from the expanded rows; shared by all kinds."""
    widths = resolve_widths(config, batch, _host_lens(batch), widths)
    req, rows, pending = checked_rows(config, batch, rows, widths.page_table)
    positions = rows.positions
    floors = _row_floors(batch, rows)
    page_table = plan_page_table(
        batch.req_to_token, req, rows.request_lens, widths.page_table, config.page_size
    )
    present = config.ratios_present if compressed else frozenset()
    comp = {r: _compressed(config, r, rows, page_table, widths.c128) for r in present}
    low_present = config.low_ratios_present if compressed else frozenset()
    low = {r: low_ratio_fields(config, positions, rows.out_loc, r) for r in low_present}
    metadata = AttentionMetadata(
        kind=batch.kind,
        batch_size=batch.batch_size,
        num_rows=batch.num_rows,
        max_request_rows=max_request_rows(batch),
        row_batch_ids=rows.batch_ids,
        page_table=page_table,
        swa_out_loc=swa_write_slots(batch, rows.out_loc),
        positions_causal=positions,
        swa_page_indices=_swa_page_indices(config, batch, req, positions, floors),
        swa_topk_lengths=(positions + 1 - (0 if floors is None else floors))
        .clamp(max=config.window_size)
        .int(),
        c4=comp.get(4),
        c128=comp.get(128),
        c1=low.get(1),
        c2=low.get(2),
        tag=batch_tag(batch),
        pending_checks=pending,
    )
    return metadata if rows.live is None else _padding_rows(metadata, rows.live)


def _padding_rows(metadata: AttentionMetadata, live: torch.Tensor) -> AttentionMetadata:
    """``metadata`` with every per-row field of the rows where ``live`` (``[T]`` bool) is
    False set to its sentinel (``metadata.sentinel``): they write nothing, attend to nothing
    and output 0, like a graph bucket's padded rows. Their rows leave no plan record
    (``ragged_verify_rows``), so the record lists are kept as planned."""

    def masked(part: Any) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if isinstance(value, torch.Tensor) and f.name not in RECORD_FIELDS:
                keep = live.view(-1, *([1] * (value.dim() - 1)))
                out[f.name] = torch.where(keep, value, sentinel(f.name))
        return out

    parts: dict[str, Any] = {}
    for name in ("c4", "c128", "c1", "c2"):
        part = getattr(metadata, name)
        parts[name] = None if part is None else dataclasses.replace(part, **masked(part))
    return dataclasses.replace(metadata, **masked(metadata), **parts)


def _plan_torch(
    config: DSV4AttentionConfig, batch: BatchView, widths: PlanWidths | None
) -> AttentionMetadata:
    """The torch planner: ``plan``'s result from torch ops and ``planning/kernels/table.py``."""
    spec = _KINDS[batch.kind]
    return _plan_rows(config, batch, spec.expand(batch), widths, compressed=spec.compressed)


def _plan_fused(
    config: DSV4AttentionConfig, batch: BatchView, widths: PlanWidths | None
) -> AttentionMetadata:
    return plan_into(config, batch, widths, None)


#: A plan variant's entry: the batch's metadata (``plan``'s arguments).
PlanEntry = Callable[[DSV4AttentionConfig, BatchView, PlanWidths | None], AttentionMetadata]

FUSED: Variant[PlanEntry] = Variant(
    "triton",
    _plan_fused,
    (TRITON_PATHS,),
    "every kind: the batch checks, then every field in one launch",
    baseline=True,
)
#: DeepSeek-V4.1's parts of a fused plan: its c1 / c2 fields and a late-layer tail's window
#: floors inside the planner kernel's launch (the interpreter's default; opt-in on CUDA until
#: ``scripts/gpu_check.sh`` passes it), or the fields by the torch twin after the launch and a
#: tail by the torch planner (the CUDA baseline). The torch planner always uses the twin.
#: Its entries are the functions that do the work, read by identity (``_fuses_v41``), not called.
LOW_RATIO_FUSED: Variant[Callable[..., object]] = Variant(
    "fused",
    plan_fields,
    (TRITON_PATHS,),
    "every kind, and a tail's window floors, in the fused planner kernel's launch",
)
LOW_RATIO_PLAN: OpTable[Callable[..., object]] = OpTable(
    "low_ratio_plan",
    "DeepSeek-V4.1's parts of a fused plan: its c1 / c2 fields, a late-layer tail's floors",
    (
        LOW_RATIO_FUSED,
        Variant(
            "torch",
            low_ratio_fields,
            (),
            "every kind: torch ops after the launch; a tail by the torch planner",
            baseline=True,
        ),
    ),
)
#: The planner's variants: the fused Triton kernels, then the torch planner.
PLAN: OpTable[PlanEntry] = OpTable(
    "plan",
    "the attention metadata of a batch (batch checks, rows, page tables, compression fields)",
    (FUSED, Variant("torch", _plan_torch, (), "every kind", baseline=True)),
)
