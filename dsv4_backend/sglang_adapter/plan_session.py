"""The plan's life between ``init_forward_metadata`` and the layer calls that consume it:
:class:`PlanSession`, one per backend, given its planner.

A plan is made from a batch read once (``batch_read.read_batch``) and is current until the
next. Every consumer first asks for it with its own batch (``batch_read.read_consumer``): the
planned ``ForwardBatch`` object and tensors, unchanged, pass at once (``BatchTag``); another
object (a copy sglang's runner forwards, a draft step's rebound slots, a batch padded for
data-parallel sync after planning) is matched by value (``PlanInputs``), the plan grown by
padding rows where sglang pads after planning; anything else is a ``ContractError`` naming the
mismatch (docs/lazy-init-contract.md). Device-side checks that cannot be read without a sync
are kept as pending and raised at the next plan (``planning/checks.py``). DeepSeek-V4.1's
late-layer tail is a second plan the session swaps in while the model runs the late layers.

Nothing here knows sglang's classes: the session sees batches through the records
``batch_read`` fills (:class:`BatchRead`, :class:`ConsumerBatch`), so the contract's tests run
against it without a runner.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ContractError
from dsv4_backend.planning import (
    AttentionMetadata,
    BatchView,
    ForwardKind,
    GraphMetadataBuffers,
    pad_plan,
    read_plan,
)
from dsv4_backend.planning.batch import readable_ints
from dsv4_backend.planning.checks import PendingChecks, run_checks
from dsv4_backend.planning.tag import BatchTag, PlanInputs

if TYPE_CHECKING:
    from dsv4_backend.sglang_adapter.late_layer_tail import TailForward


@dataclass(frozen=True)
class PlannedBatch:
    """What a plan remembers of the batch it was made for.

    ``inputs``: the planning inputs, matched by value against a batch object the consumers get
    that is not ``accepted`` (``PlanInputs``: sglang's eager runner forwards a copy of the
    planned batch, a draft step rebinds ``out_cache_loc``, data-parallel padding grows it).
    ``accepted``: the last ``ForwardBatch`` object matched (the planned one at first) and its
    ``req_pool_indices`` / ``seq_lens`` / ``out_cache_loc`` with their in-place versions: the
    same objects, unchanged, pass without a value check.
    """

    inputs: PlanInputs
    accepted: BatchTag


@dataclass(frozen=True)
class BatchRead:
    """A ``ForwardBatch`` read for planning (:func:`read_batch`).

    ``view``: what the planner plans; ``padding``: data-parallel / two-batch-overlap padding
    tokens past the view's rows (sentinel rows the plan appends); ``cp_rows``: a prefill
    context-parallel rank's ``(rows, physical rows)`` of the plan (``cp_rank_rows``; None
    elsewhere); ``planned``: what consumers' batches are matched against; ``whole_extend``: a
    non-speculative EXTEND (DeepSeek-V4.1's bounded replay plans its late-layer tail).
    """

    view: BatchView
    padding: int
    cp_rows: tuple[torch.Tensor, int] | None
    planned: PlannedBatch
    whole_extend: bool


@dataclass(frozen=True)
class ConsumerBatch:
    """What a consumer's ``ForwardBatch`` offers to the match against the plan
    (``batch_read.read_consumer``): its planner ``kind``, its mode's ``mode`` name (for
    messages), ``batch_size``, the objects a ``BatchTag`` keeps (``forward_batch``,
    ``req_pool_indices``, ``seq_lens``, ``out_cache_loc``) and its ``seq_lens_cpu`` as handed
    (read into :attr:`host_seq_lens` only when a match needs it)."""

    kind: ForwardKind
    mode: str
    batch_size: int
    objects: dict[str, Any]
    seq_lens_cpu: Any = None

    @functools.cached_property
    def host_seq_lens(self) -> list[int] | None:
        """``seq_lens_cpu`` as host ints (None when absent or on the device)."""
        return readable_ints("seq_lens_cpu", self.seq_lens_cpu)

    @property
    def req_pool_indices(self) -> torch.Tensor:
        return self.objects["req_pool_indices"]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.objects["seq_lens"]

    @property
    def out_cache_loc(self) -> torch.Tensor:
        return self.objects["out_cache_loc"]


#: Plans a view: eagerly (buffers None) or into the CUDA-graph buffers.
Planner = Callable[[BatchView, GraphMetadataBuffers | None], AttentionMetadata]


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (no value check may run:
    it would be recorded into the graph)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class PlanSession:
    """The current plan of one backend and what it was made for.

    ``planner`` plans a batch's view (``planning.plan``, the graph buffers' ``plan``, or
    DSpark's block planner); ``draft_step``: the backend plans the steps of a multi-step draft,
    whose batches sglang pads after planning (as it pads draft extends).

    Attributes
    ----------
    forward_metadata : the current plan (None before the first plan and after a failed one).
    cp_read_metadata : a prefill context-parallel rank's own rows of it, which its indexer and
        attention read (``planning.read_plan``); None for any other batch.
    planned : what the current plan was made for (``batch_read.PlannedBatch``).
    pending_checks : device-side planning checks not read yet (CUDA without strict mode).
    tail : DeepSeek-V4.1's late-layer tail of the extend planned last (None for other
        batches); ``tail_source_kv_layer_id``: the kv source ``write_tail_source_kv``
        compressed over every row, until the tail is left; ``in_tail``: inside the tail.
    """

    def __init__(
        self, config: DSV4AttentionConfig, planner: Planner, *, draft_step: bool = False
    ) -> None:
        self.config, self.planner, self.draft_step = config, planner, draft_step
        self.forward_metadata: AttentionMetadata | None = None
        self.cp_read_metadata: AttentionMetadata | None = None
        self.planned: PlannedBatch | None = None
        self.pending_checks: list[PendingChecks] = []
        self.tail: TailForward | None = None
        self.tail_source_kv_layer_id: int | None = None
        self.in_tail = False

    # ------------------------------------------------------------------------- planning
    def plan(
        self, read: Callable[[], BatchRead], buffers: GraphMetadataBuffers | None
    ) -> tuple[AttentionMetadata, BatchRead]:
        """Drop the current plan, read the batch (``read``: a batch that cannot be read
        leaves no plan) and plan it: eager (``buffers`` None) or into the graph buffers; a
        read's padding rows are appended as sentinel rows (no write, output 0), and a CP
        rank's rows of the plan kept. First raises the verdict of earlier batches'
        device-side checks that has reached the host."""
        self.raise_pending_checks(wait=False)
        self.forward_metadata = self.planned = self.cp_read_metadata = None
        self.tail, self.tail_source_kv_layer_id, self.in_tail = None, None, False
        batch = read()
        metadata = self.planner(batch.view, buffers)
        if batch.padding > 0:
            metadata = pad_plan(
                self.config,
                metadata,
                batch_size=metadata.batch_size,
                num_rows=metadata.num_rows + batch.padding,
            )
        self._keep_checks(metadata)
        if batch.cp_rows is not None:  # the batch's plan writes; the rank's rows of it read
            rows, physical = batch.cp_rows
            self.cp_read_metadata = read_plan(self.config, metadata, rows, num_rows=physical)
        self.planned, self.forward_metadata = batch.planned, metadata
        return metadata, batch

    def add_tail(self, tail: TailForward) -> None:
        """Keep the late-layer tail planned for the current extend."""
        self._keep_checks(tail.metadata)
        self.tail = tail

    def _keep_checks(self, metadata: AttentionMetadata) -> None:
        if metadata.pending_checks is not None:
            self.pending_checks.append(metadata.pending_checks)

    def raise_pending_checks(self, wait: bool = True) -> None:
        """Raise ``BatchError`` for a failed device-side planning check of an earlier batch.

        ``wait=False`` reads only the verdicts already on the host (no sync); every plan calls
        it so. A host may call it with ``wait=True`` at any safe point.
        """
        pending, self.pending_checks = self.pending_checks, []
        for i, checks in enumerate(pending):
            if wait or checks.ready():
                try:
                    checks.raise_if_failed()
                except BatchError:
                    self.pending_checks = [c for c in pending[i + 1 :] if not c.ready()]
                    raise
            else:
                self.pending_checks.append(checks)

    # ------------------------------------------------------------------------ consumers
    def metadata(self, batch: ConsumerBatch, num_rows: int | None, where: str) -> AttentionMetadata:
        """The current plan, checked against ``batch`` (``ContractError`` when stale).

        ``num_rows``: the rows the caller got (None when it has none to compare: then the
        batch's size, kind and values are checked). The planned object, or the last one
        matched, with its tensors unchanged passes at once; another object is matched by value
        (:meth:`_match`). Inside the late-layer tail the rows are the tail plan's: sglang's tail
        graphs hand each break a copy of the batch whose ``out_cache_loc`` is cut to the tail's
        row count (``deepseek_v4_attention_with_output``), so only its requests are matched.
        """
        metadata, planned = self.forward_metadata, self.planned
        if metadata is None or planned is None:
            raise ContractError(
                f"{where}: no attention metadata was planned; the host must call "
                "init_forward_metadata (eager, after padding) or init_forward_metadata_out_graph "
                "(CUDA graph) before the forward"
            )
        if batch.kind is not metadata.kind:
            raise ContractError(
                f"{where}: attention metadata was planned for {metadata.kind.name} but the batch "
                f"is {batch.mode}; plan each batch before its forward"
            )
        rows = metadata.num_rows if num_rows is None else num_rows
        if planned.accepted.mismatch(**batch.objects) is not None:
            metadata = self._match(batch, planned, metadata, rows, where)
        metadata.check_matches(batch_size=batch.batch_size, num_rows=rows, where=where)
        return metadata

    def read_metadata(self, batch: ConsumerBatch, num_rows: int, where: str) -> AttentionMetadata:
        """The plan the query side reads (indexer queries and top-k, attention), checked as
        :meth:`metadata` checks it: the batch's plan, or on a prefill context-parallel rank its
        own rows of it (``cp_read_metadata``: ``num_rows`` local query rows)."""
        local = self.cp_read_metadata
        metadata = self.metadata(batch, None if local is not None else num_rows, where)
        if local is None:
            return metadata
        local.check_matches(batch_size=batch.batch_size, num_rows=num_rows, where=where)
        return local

    def _match(
        self,
        batch: ConsumerBatch,
        planned: PlannedBatch,
        metadata: AttentionMetadata,
        num_rows: int,
        where: str,
    ) -> AttentionMetadata:
        """Accept ``batch`` (not the object last matched) for the plan when its planning inputs
        equal the planned ones (``PlanInputs``), and return the plan for it: grown by padding
        rows (they write nothing, output 0) when it is the planned batch padded for
        data-parallel sync after planning, as sglang pads draft and draft-extend batches.

        ``ContractError`` for a plan of another batch: host lengths at once; device values at
        once on the CPU or in strict mode, else read at the next plan (``planning/checks.py``).
        During CUDA-graph capture only the shapes are checked.
        """
        stale = planned.inputs.stale() or planned.inputs.host_mismatch(batch.host_seq_lens)
        if stale is not None:
            raise self._stale(metadata, stale, where)
        capturing = _capturing()
        grown = batch.batch_size > metadata.batch_size or num_rows > metadata.num_rows
        may_grow = self._grows_after_planning(metadata) and not capturing
        shrunk = batch.batch_size < metadata.batch_size or num_rows < metadata.num_rows
        if shrunk or (grown and not may_grow):
            metadata.check_matches(batch_size=batch.batch_size, num_rows=num_rows, where=where)
        if not capturing:
            checks = planned.inputs.checks(
                req_pool_indices=batch.req_pool_indices,
                seq_lens=batch.seq_lens,
                out_cache_loc=None if self.in_tail else batch.out_cache_loc[:num_rows],
            )
            try:
                pending = run_checks(
                    checks,
                    batch.seq_lens.device,
                    f"{where}'s batch against its plan",
                    error=ContractError,
                    consequence="the forward ran on that plan",
                )
            except ContractError as mismatch:
                raise self._stale(metadata, str(mismatch), where) from None
            if pending is not None:
                self.pending_checks.append(pending)
        if grown:
            metadata = pad_plan(
                self.config, metadata, batch_size=batch.batch_size, num_rows=num_rows
            )
            self.forward_metadata = metadata
        self.planned = dataclasses.replace(planned, accepted=BatchTag(**batch.objects))
        return metadata

    def _grows_after_planning(self, metadata: AttentionMetadata) -> bool:
        """Whether sglang pads batches of this plan's kind after planning them: the EAGLE v2
        worker plans and marks its draft batch (``eagle_worker_v2.py`` ``draft``) and its draft
        extend (``_draft_extend_for_decode``) before ``ModelRunner.forward``, whose
        ``_prepare_eager_forward_batch`` pads for data-parallel sync. Every other kind is
        planned after padding (the lazy-init contract), so a grown batch is a stale plan."""
        return metadata.kind is ForwardKind.DRAFT_EXTEND or self.draft_step

    @staticmethod
    def _stale(metadata: AttentionMetadata, mismatch: str, where: str) -> ContractError:
        return ContractError(
            f"{where}: the attention metadata ({metadata.kind.name}, batch_size="
            f"{metadata.batch_size}, num_rows={metadata.num_rows}) was made for another batch: "
            f"{mismatch}. Plan every batch before its forward (init_forward_metadata after "
            "padding, or init_forward_metadata_out_graph)."
        )

    # ------------------------------------------------------ DeepSeek-V4.1's late-layer tail
    def enter_tail(self) -> tuple[Any, ...]:
        """Make the tail's plan current; returns what :meth:`exit_tail` restores.
        ``ContractError`` without a tail, or inside it already."""
        tail = self.tail
        if tail is None or self.in_tail:
            raise ContractError(
                "enter_late_layer_tail: no late-layer tail was planned for this batch (an extend "
                "under --enable-decoder-swa-bounded-replay, planned by init_forward_metadata), "
                "or the tail is entered already"
            )
        saved = (self.forward_metadata, self.cp_read_metadata)
        self.forward_metadata, self.cp_read_metadata = tail.metadata, tail.cp_read
        self.in_tail = True
        return saved

    def exit_tail(self, saved: tuple[Any, ...]) -> None:
        """Restore the extend's plan :meth:`enter_tail` saved."""
        self.forward_metadata, self.cp_read_metadata = saved
        self.in_tail = False
        self.tail_source_kv_layer_id = None
