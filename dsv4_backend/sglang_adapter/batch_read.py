"""The one read of an sglang 0.5.23 ``ForwardBatch``: the planner's ``BatchView`` (the one place
that knows how sglang lays out each forward mode), with the padding rows, a context-parallel
rank's rows and the planning inputs a plan is matched by (:func:`read_batch`,
:class:`BatchRead`), and what a consumer's batch offers to that match (:func:`read_consumer`,
:class:`ConsumerBatch`). The backend reads no ``ForwardBatch`` field but ``forward_mode``
itself: it calls the functions here.

==================  ==============  =======================================================
sglang mode         ForwardKind     what sglang hands over (``L`` = committed length)
==================  ==============  =======================================================
IDLE                IDLE            no requests
DECODE              DECODE          ``seq_lens`` includes the decoded token
DECODE (draft i)    DECODE + step   ``seq_lens = L`` on every step, ``positions = L + i``,
                                    ``out_cache_loc`` = the whole ``[bs, topk, num_steps]``
                                    buffer; the planner takes row ``i`` (never slice here)
EXTEND              EXTEND          host ``extend_prefix_lens_cpu`` / ``extend_seq_lens_cpu``
MIXED               EXTEND          an extend whose running decode requests follow the new
                                    chunks as 1-token extends after a prefix of ``L - 1``
                                    (``ScheduleBatch.mix_with_running``)
TARGET_VERIFY       TARGET_VERIFY   ``seq_lens = L``; ``num_draft_tokens`` rows per request;
                                    under compact ragged verify ``spec_info.
                                    ragged_verify_layout`` gives each request's rows
                                    (``ragged_verify``)
DRAFT_EXTEND_V2     DRAFT_EXTEND    ``seq_lens = L + n`` with extend lens ``n`` (window only)
==================  ==============  =======================================================

Draft step ``i`` is planned with the causal length ``L + i + 1`` (its own token and the earlier
steps' tokens are attended), as sglang's HIP backend does. This deliberately differs from
sglang's CUDA ``DeepseekV4AttnBackend``, which plans every step with ``seq_lens = L`` and so
attends without the draft tokens.

Rows that data-parallel padding added (``seq_lens`` fill value 1, ``req_pool_indices`` 0,
``out_cache_loc`` 0) plan like ordinary rows; their outputs are discarded by the host.

CUDA-graph replay views (sglang's ``build_replay_fb_view`` for the decode / verify graphs, the
EAGLE draft graph runner's namespace; they carry ``num_padding``): ``batch_size`` is the graph's
bucket and ``req_pool_indices`` / ``seq_lens`` are the padded static buffers, but
``out_cache_loc`` may be the live batch's (``raw_bs`` requests' slots). The view pads it with
sglang's padding slot 0 to the bucket (``replay_slots``), as sglang's own backend does in its
replay branch. The EAGLE draft-extend graph runner's batches (capture and replay) are read by
``draft_extend_graph_view``: its padding requests are shorter than their fixed rows. A view
whose ``actual_forward_mode`` is IDLE (an idle data-parallel rank replaying the largest rank's
graph) is planned as ``batch_size`` padding requests. Padding
requests (pool row 0, length 1, slot 0) write only sglang's padding slot, page and ring row. An
EXTEND / DRAFT_EXTEND_V2 batch can also be padded with whole tokens that belong to no request
(``out_cache_loc`` longer than the sum of the extend lengths, sglang's
``ForwardBatch._pad_inputs_to_size``): the view leaves them out (``padding_rows``) and the
backend appends them to the plan as sentinel rows (``planning.pad_plan``: no write, output 0).
A two-batch-overlap child (``TboForwardBatchPreparer.filter_batch``: a token range of the
batch; a request cut in two continues in the second child as a chunked extend) is planned like
any batch; sglang pads its hidden states to ``tbo_padded_len`` rows, which are sentinel rows
the same way.

A prefill context-parallel batch (``--enable-prefill-cp``, the interleave strategy: sglang's
``is_cp_active``, ``forward_batch.attn_cp_metadata`` from ``prepare_cp_forward``) is the whole
batch (``out_cache_loc`` trimmed to its tokens), planned as usual; token ``i`` is rank
``i % cp``'s, and every rank holds ``per_rank_actual_token[rank]`` rows (its tokens, then
padding). ``cp_rank_rows`` gives a rank its rows of the plan.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from sglang.kernels.ops.speculative.ragged_verify_kernels import PaddedToBucket
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.ragged_verify import resolve_ragged_verify_layout

from dsv4_backend.errors import BatchError, ContractError
from dsv4_backend.planning import (
    BatchView,
    DraftStep,
    ForwardKind,
    PlanInputs,
    seq_len_fill_value,
)
from dsv4_backend.planning.batch import RaggedVerify, readable_ints
from dsv4_backend.planning.checks import strict_checks_enabled
from dsv4_backend.planning.draft_slots import draft_step_slots
from dsv4_backend.planning.tag import BatchTag
from dsv4_backend.sglang_adapter.plan_session import BatchRead, ConsumerBatch, PlannedBatch

#: The planner kind of each supported sglang forward mode.
KIND_OF_MODE = {
    ForwardMode.IDLE: ForwardKind.IDLE,
    ForwardMode.DECODE: ForwardKind.DECODE,
    ForwardMode.EXTEND: ForwardKind.EXTEND,
    ForwardMode.MIXED: ForwardKind.EXTEND,
    ForwardMode.TARGET_VERIFY: ForwardKind.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND_V2: ForwardKind.DRAFT_EXTEND,
}
SUPPORTED_MODES = tuple(mode.name for mode in KIND_OF_MODE)


def forward_kind(forward_mode: ForwardMode) -> ForwardKind:
    """The planner kind of an sglang forward mode; ``BatchError`` naming unsupported ones."""
    kind = KIND_OF_MODE.get(forward_mode)
    if kind is None:
        raise BatchError(
            f"forward mode {getattr(forward_mode, 'name', forward_mode)} is not supported by the "
            f"dsv4_backend attention backend; supported modes: {', '.join(SUPPORTED_MODES)}"
        )
    return kind


def padding_rows(fb: Any, view: BatchView) -> int:
    """Padding tokens of an extend-kind ``fb`` past its requests' rows (0 for other kinds):
    data-parallel padding (``out_cache_loc`` longer than the rows) or, on a two-batch-overlap
    child, the rows sglang pads its hidden states to (``tbo_padded_len``, a multiple of the
    attention TP size; ``_model_forward_filter_inputs``), whichever is more."""
    if view.kind not in (ForwardKind.EXTEND, ForwardKind.DRAFT_EXTEND):
        return 0
    rows = max(fb.out_cache_loc.numel(), int(getattr(fb, "tbo_padded_len", None) or 0))
    return rows - view.num_rows


def cp_rank_rows(fb: Any, num_rows: int) -> tuple[torch.Tensor, int] | None:
    """``(rows [n] int64, physical rows)`` of this context-parallel rank in a batch of
    ``num_rows`` planned rows: the rank's tokens ``rank, rank + cp, ...`` (sglang's interleave
    shard, ``InterleaveCPStrategy._interleave_shard``) and how many rows its queries have
    (``per_rank_actual_token[rank]``: the tokens, then padding). None when ``fb`` is not a
    context-parallel prefill. ``BatchError`` for a layout this backend does not plan: another
    strategy's metadata, a late-layer tail's layout (``local_index``: DeepSeek-V4.1's tail,
    which ``enter_late_layer_tail`` swaps in), or counts that do not add up."""
    metadata = getattr(fb, "attn_cp_metadata", None)
    if metadata is None:  # every batch outside prefill CP: nothing more on the plan's path
        return None
    # Imported here, not with the module: sglang's CP modules bring its distributed
    # communicators (about 1.7 s of imports), which a server without CP never needs.
    from sglang.srt.layers.cp.interleave import InterleaveContextParallelMetadata
    from sglang.srt.layers.cp.utils import is_cp_active
    from sglang.srt.runtime_context import get_parallel

    if not is_cp_active(fb):
        return None
    if not isinstance(metadata, InterleaveContextParallelMetadata) or (
        metadata.local_index is not None
    ):
        raise BatchError(
            f"attn_cp_metadata {type(metadata).__name__} (local_index "
            f"{'set' if getattr(metadata, 'local_index', None) is not None else 'None'}): the "
            "dsv4 backend plans a batch of the interleave prefill layout (a DeepSeek-V4.1 "
            "tail's layout, local_index set, is the backend's own, inside the tail)"
        )
    parallel = get_parallel()
    rank, size = parallel.attn_cp_rank, parallel.attn_cp_size
    logical = metadata.per_rank_logical_token or metadata.per_rank_actual_token
    rows = torch.arange(rank, num_rows, size, dtype=torch.int64)
    if metadata.total_seq_lens != num_rows or rows.numel() != logical[rank]:
        raise BatchError(
            f"attn_cp_metadata of {metadata.total_seq_lens} tokens, {logical[rank]} on rank "
            f"{rank} of {size}; the batch plans {num_rows} rows, {rows.numel()} of them the "
            "rank's: prepare_cp_forward ran on another batch"
        )
    return rows, int(metadata.per_rank_actual_token[rank])


def write_slots_per_request(
    kind: ForwardKind, draft: DraftStep | None, num_draft_tokens: int
) -> int | None:
    """Write slots a request of a uniform kind has in ``out_cache_loc`` (None: extend kinds)."""
    if kind is ForwardKind.DECODE:
        return 1 if draft is None else draft.topk * draft.num_steps
    if kind is ForwardKind.TARGET_VERIFY:
        return num_draft_tokens
    return None


def replay_slots(fb: Any, per_request: int) -> torch.Tensor:
    """``out_cache_loc`` of a replay view ``fb`` padded with slot 0 to its ``batch_size``
    requests of ``per_request`` slots; a ``ForwardBatch`` (no ``num_padding``) as it is.

    ``BatchError`` when the view's slots are neither the bucket's nor its live requests'
    (``batch_size - num_padding``): the live rows do not fit the graph.
    """
    loc = fb.out_cache_loc
    padding = getattr(fb, "num_padding", None)
    want = fb.batch_size * per_request
    if padding is None or loc is None or loc.numel() == want:
        return loc
    live = (fb.batch_size - int(padding)) * per_request
    if not 0 <= int(padding) <= fb.batch_size or loc.dim() != 1 or loc.numel() != live:
        raise BatchError(
            f"a CUDA-graph replay view of batch_size={fb.batch_size} with num_padding={padding} "
            f"has out_cache_loc of shape {tuple(loc.shape)}; expected {live} live write slots "
            f"({per_request} a live request) or {want} (the bucket's): the live batch does "
            "not fit the graph"
        )
    return torch.nn.functional.pad(loc, (0, want - live), value=0)


def _idle_replay(fb: Any) -> bool:
    """Whether ``fb`` is a replay view of an idle rank (``actual_forward_mode`` IDLE) in a graph
    of another mode."""
    actual = getattr(fb, "actual_forward_mode", None)
    return actual is not None and actual.is_idle() and not fb.forward_mode.is_idle()


def batch_view(
    fb: Any,
    *,
    req_to_token: torch.Tensor,
    full_to_swa: torch.Tensor | None,
    num_draft_tokens: int,
    draft: DraftStep | None = None,
    num_cache_slots: int | None = None,
    num_swa_slots: int | None = None,
    graph: GraphCall | None = None,
    ragged_verify_mode: bool = False,
) -> BatchView:
    """The ``BatchView`` of ``fb`` (a ``ForwardBatch`` or the graph runners' namespace view).

    Parameters
    ----------
    fb : reads ``forward_mode, req_pool_indices, seq_lens, seq_lens_cpu, out_cache_loc,
        extend_prefix_lens_cpu, extend_seq_lens_cpu`` (host lengths: ``host_seq_lens``).
    req_to_token : ``[pool_rows, max_context]`` int32 of the runner's ``ReqToTokenPool``.
    full_to_swa : the KV pool's ``full_to_swa_index_mapping`` (None: identity).
    num_draft_tokens : ``speculative_num_draft_tokens`` (TARGET_VERIFY and DRAFT_EXTEND_V2).
    draft : the step of a multi-step draft backend; used for DECODE batches only.
    num_cache_slots, num_swa_slots : full- and window-cache slots the backend holds (the
        planning checks' ranges).
    graph : how a CUDA-graph runner hands ``fb`` (``init_forward_metadata_out_graph``); None
        for an eager plan. A DRAFT_EXTEND_V2 graph batch is read by ``draft_extend_graph_view``.
    ragged_verify_mode : sglang's compact ragged verify is on (the target runner's backend):
        a TARGET_VERIFY batch carrying a ``RaggedVerifyLayout`` is read by ``ragged_verify``.

    Raises ``BatchError`` for an unsupported mode or inconsistent shapes (e.g. a draft step fed
    a write-slot buffer other than the whole ``[bs, topk, num_steps]`` one).
    """
    kind = forward_kind(fb.forward_mode)
    seq_lens_cpu = host_seq_lens(fb)
    common: dict[str, Any] = dict(
        req_to_token=req_to_token,
        full_to_swa=full_to_swa,
        seq_lens_cpu=seq_lens_cpu,
        num_cache_slots=num_cache_slots,
        num_swa_slots=num_swa_slots,
    )
    if kind is ForwardKind.IDLE:
        empty = torch.zeros(0, dtype=torch.int64, device=req_to_token.device)
        return BatchView(
            kind=kind,
            req_pool_indices=empty,
            seq_lens=empty,
            out_cache_loc=empty,
            req_to_token=req_to_token,
            full_to_swa=full_to_swa,
        )
    if kind is ForwardKind.DRAFT_EXTEND and graph is not None:
        return draft_extend_graph_view(fb, width=num_draft_tokens, graph=graph, **common)
    out_cache_loc = fb.out_cache_loc
    req_pool_indices, seq_lens = fb.req_pool_indices, fb.seq_lens
    ragged = None
    if ragged_verify_mode and kind is ForwardKind.TARGET_VERIFY:
        ragged = ragged_verify(fb, out_cache_loc)
    per_request = write_slots_per_request(kind, draft, num_draft_tokens)
    if ragged is not None:
        common["ragged"] = ragged
    elif per_request is not None and _idle_replay(fb):
        # An idle rank in the largest rank's graph: every request is padding.
        bs, device = fb.batch_size, req_to_token.device
        req_pool_indices = torch.zeros(bs, dtype=torch.int64, device=device)
        seq_lens = torch.full((bs,), seq_len_fill_value, dtype=torch.int64, device=device)
        common["seq_lens_cpu"] = [seq_len_fill_value] * bs
        out_cache_loc = torch.zeros(bs * per_request, dtype=torch.int64, device=device)
    elif per_request is not None:
        out_cache_loc = replay_slots(fb, per_request)
    if kind is ForwardKind.DECODE:
        common["draft"] = draft
    elif kind is ForwardKind.TARGET_VERIFY:
        common["num_draft_tokens"] = num_draft_tokens
    else:
        extend = readable_ints("extend_seq_lens_cpu", getattr(fb, "extend_seq_lens_cpu", None))
        prefix = readable_ints(
            "extend_prefix_lens_cpu", getattr(fb, "extend_prefix_lens_cpu", None)
        )
        if kind is ForwardKind.DRAFT_EXTEND and extend is None:
            extend = [num_draft_tokens] * int(fb.seq_lens.numel())
        if prefix is None and extend is not None and seq_lens_cpu is not None:
            prefix = [s - e for s, e in zip(seq_lens_cpu, extend, strict=True)]
        if prefix is None or extend is None:
            raise BatchError(
                f"{fb.forward_mode.name} batch without host extend lengths: expected "
                "extend_seq_lens_cpu and extend_prefix_lens_cpu (or seq_lens_cpu)"
            )
        common.update(extend_prefix_lens=prefix, extend_seq_lens=extend)
        # Whole padding tokens (data-parallel) trail the requests' rows; see padding_rows.
        out_cache_loc = out_cache_loc[: sum(extend)]
    return BatchView(
        kind=kind,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        out_cache_loc=out_cache_loc,
        **common,
    )


def ragged_verify(fb: Any, out_cache_loc: torch.Tensor | None) -> RaggedVerify | None:
    """The ragged verify of a TARGET_VERIFY ``fb`` (a ``ForwardBatch`` or a replay view) under
    sglang's compact mode, as sglang's own DeepSeek-V4 backend reads it
    (``_resolve_verify_layout``): the layout on ``fb.spec_info`` (None: a static verify),
    padded by sglang's ``padded_to_bucket`` to the batch's ``batch_size`` requests when the
    batch has more (a graph's padding requests, pool row 0, share the bucket's leftover rows).
    With no request to pad, the rows past the requests' are padding rows: sglang hands them to
    the last request, whose drafts they are not, so the plan writes nothing for them. The
    rows: one per write slot (``out_cache_loc``: the bucket's ``graph_num_tokens``, or more
    after data-parallel padding, whose tokens are padding rows too).

    ``BatchError`` for a layout of more requests than the batch, or fewer write slots than its
    bucket."""
    layout = resolve_ragged_verify_layout(fb)
    if layout is None:
        return None
    bs, tokens = int(fb.batch_size), int(layout.graph_num_tokens)
    if layout.bs > bs:
        raise BatchError(
            f"a ragged verify layout of {layout.bs} requests on a batch of batch_size={bs}; "
            "expected at most the batch's requests (the rest are padding)"
        )
    if out_cache_loc is None or out_cache_loc.dim() != 1 or out_cache_loc.numel() < tokens:
        shape = None if out_cache_loc is None else tuple(out_cache_loc.shape)
        raise BatchError(
            f"a ragged verify of graph_num_tokens={tokens} has out_cache_loc of shape {shape}; "
            f"expected at least {tokens} write slots, one a row (sglang's ragged verify window, "
            "padded with slot 0)"
        )
    lens, lens_cpu = layout.verify_lens, layout.verify_lens_cpu
    if layout.bs < bs:  # the lengths of layout.padded_to_bucket, without its indptr launch
        lens = PaddedToBucket.execute(
            verify_lens=lens, graph_num_tokens=tokens, bs=layout.bs, padded_bs=bs
        )
        lens_cpu = None
    return RaggedVerify(lens=lens, num_rows=out_cache_loc.numel(), lens_cpu=lens_cpu)


class GraphCall(enum.Enum):
    """How a CUDA-graph runner hands a batch to ``init_forward_metadata_out_graph``."""

    CAPTURE = "capture"  # the capture batch over the runner's static buffers (in_capture)
    REPLAY = "replay"  # a replay's batch or view


def draft_extend_graph_view(
    fb: Any, *, width: int, graph: GraphCall, seq_lens_cpu: list[int] | None, **common: Any
) -> BatchView:
    """The ``BatchView`` of a DRAFT_EXTEND_V2 batch of sglang's draft-extend graph runner
    (``speculative/eagle_draft_extend_cuda_graph_runner.py``): the capture batch
    (``capture_one_shape``) or the replay view (``execute``'s namespace).

    Both hold ``fb.batch_size`` requests of ``width`` rows (the runner's
    ``captured_req_width``, ``speculative_num_draft_tokens``): the live requests, then padding
    requests (pool row 0, ``seq_lens`` the fill value 1). The replay view holds the runner's
    static buffers whole (``max_bs`` entries, the first ``batch_size`` the bucket's) and the live
    tokens' ``out_cache_loc`` (``raw_bs * width``), padded here with slot 0 to the bucket; the
    capture's ``out_cache_loc`` is the runner's placeholder (a buffer of ones) and is planned
    as slot 0: sglang's own backend plans both so. A padding request is shorter than its
    ``width`` rows; it is planned as ``width`` rows from position 0 of its pool row 0, whose
    slots are all sglang's padding slot 0, with nothing before them to read.

    ``BatchError`` without host lengths (``seq_lens_cpu``), for host extend lengths other than
    ``width``, a padding request before a live one, or write slots that are not whole
    requests' (at least the live ones', at most the bucket's).
    """
    bs = int(fb.batch_size)
    if seq_lens_cpu is None or len(seq_lens_cpu) < bs:
        raise BatchError(
            f"a DRAFT_EXTEND_V2 graph batch of batch_size={bs} has seq_lens_cpu "
            f"{seq_lens_cpu}; expected host lengths of at least {bs} requests"
        )
    handed = readable_ints("extend_seq_lens_cpu", getattr(fb, "extend_seq_lens_cpu", None))
    if handed is not None and handed[:bs] != [width] * bs:
        raise BatchError(
            f"a DRAFT_EXTEND_V2 graph batch has extend_seq_lens_cpu={handed}; the graph "
            f"runs {width} rows a request (speculative_num_draft_tokens)"
        )
    lens = list(seq_lens_cpu[:bs])
    padding = [i for i, n in enumerate(lens) if n < width]
    live = len(lens) - len(padding)
    if padding and padding != list(range(live, bs)):
        raise BatchError(
            f"a DRAFT_EXTEND_V2 graph batch has seq_lens_cpu={lens}: requests shorter than "
            f"its {width} rows are padding, which only follows the live requests"
        )
    loc = fb.out_cache_loc
    device = fb.req_pool_indices.device
    if graph is GraphCall.CAPTURE:
        loc = torch.zeros(bs * width, dtype=torch.int64, device=device)
    elif loc is None or loc.dim() != 1 or loc.numel() % width or loc.numel() > bs * width:
        shape = None if loc is None else tuple(loc.shape)
        raise BatchError(
            f"a DRAFT_EXTEND_V2 graph batch of batch_size={bs} has out_cache_loc of shape "
            f"{shape}; expected whole requests' slots ({width} a request), at most {bs * width}"
        )
    elif loc.numel() < live * width:
        raise BatchError(
            f"a DRAFT_EXTEND_V2 graph batch of {live} live requests has only {loc.numel()} "
            f"write slots; expected {live * width}"
        )
    else:
        loc = torch.nn.functional.pad(loc, (0, bs * width - loc.numel()), value=0)
    prefix = [max(n - width, 0) for n in lens]
    seq_lens = fb.seq_lens[:bs]
    if padding:  # the padding requests' planned length, on the device too
        seq_lens = seq_lens.clamp(min=width)
    return BatchView(
        kind=ForwardKind.DRAFT_EXTEND,
        req_pool_indices=fb.req_pool_indices[:bs],
        seq_lens=seq_lens,
        out_cache_loc=loc,
        seq_lens_cpu=[p + width for p in prefix],
        extend_prefix_lens=prefix,
        extend_seq_lens=[width] * bs,
        **common,
    )


def cp_all_rows(x: torch.Tensor, fb: Any, num_rows: int) -> torch.Tensor:
    """The batch's ``num_rows`` rows of ``x`` (``[n, ...]``: this context-parallel rank's rows,
    then padding), all-gathered over the CP group in token order by sglang's
    ``cp_materialize_global_token_order`` (what its DeepSeek-V4.1 backend gathers before the
    low-ratio compressors, ``_forward_low_ratio_sources_cp``)."""
    from sglang.srt.layers.cp.utils import cp_materialize_global_token_order

    stream = torch.cuda.current_stream() if x.is_cuda else None
    return cp_materialize_global_token_order(x.contiguous(), fb, stream)[:num_rows]


# ------------------------------------------------------------------- the one read of a batch
#: The planner kind a backend plans an sglang forward mode as (``forward_kind``; DSpark's
#: draft backend plans TARGET_VERIFY as DSPARK_BLOCK).
KindOf = Callable[[ForwardMode], ForwardKind]


def _batch_objects(fb: Any) -> dict[str, Any]:
    """``fb`` and its three planning tensors, by the names ``BatchTag`` messages use."""
    return dict(
        forward_batch=fb,
        req_pool_indices=fb.req_pool_indices,
        seq_lens=fb.seq_lens,
        out_cache_loc=fb.out_cache_loc,
    )


def handed_seq_lens_cpu(fb: Any) -> Any:
    """``fb``'s host lengths as handed, matching ``fb.seq_lens``: its ``seq_lens_cpu``, but for
    a verify of DSpark's, whose worker raises ``seq_lens_cpu`` by the verify's tokens for a
    backend without sglang's ``make_forward_metadata_from_raw_verify`` (this one:
    ``dspark_verify.py``, ``_verify_backend_self_adds_seq_lens``) while ``seq_lens`` stays the
    committed lengths, which its verify input keeps as ``live_seq_lens_cpu``. Requests past
    those (data-parallel padding) keep ``seq_lens_cpu``'s entries."""
    handed = getattr(fb, "seq_lens_cpu", None)
    live = getattr(getattr(fb, "spec_info", None), "live_seq_lens_cpu", None)
    if live is None or not fb.forward_mode.is_target_verify():
        return handed
    if handed is None or len(handed) <= len(live):
        return live
    return [int(n) for n in live] + [int(n) for n in handed[len(live) :]]


def host_seq_lens(fb: Any) -> list[int] | None:
    """``fb``'s host lengths (``handed_seq_lens_cpu``) as host ints (None when absent)."""
    return readable_ints("seq_lens_cpu", handed_seq_lens_cpu(fb))


def read_consumer(fb: Any, kind_of: KindOf = forward_kind) -> ConsumerBatch:
    """``fb`` as a consumer hands it over (:class:`ConsumerBatch`). Every layer call reads
    one: its host lengths are read only when a match needs them."""
    return ConsumerBatch(
        kind=kind_of(fb.forward_mode),
        mode=fb.forward_mode.name,
        batch_size=fb.batch_size,
        objects=_batch_objects(fb),
        seq_lens_cpu=handed_seq_lens_cpu(fb),
    )


def _kept(planned: torch.Tensor) -> torch.Tensor:
    """``planned`` itself, or a copy for an inference tensor: its in-place writes bump no
    version, so the values planned from must be kept apart (sglang's registry buffers are
    refilled by the next batch)."""
    return planned.clone() if planned.is_inference() else planned


def _planned_batch(fb: Any, view: BatchView) -> PlannedBatch:
    """What a consumer's batch is matched against (``PlannedBatch``): ``view``'s requests,
    and the rows' write slots as the forward's batch holds them (a draft step's own row of
    the ``[bs, topk, num_steps]`` layout; an extend kind's padding tokens included)."""
    loc, seq_lens = view.out_cache_loc, view.seq_lens
    seq_lens_cpu = view.host_seq_lens if view.seq_lens_cpu is not None else None
    if view.kind in (ForwardKind.EXTEND, ForwardKind.DRAFT_EXTEND):
        loc = fb.out_cache_loc
    elif view.draft is not None:
        loc = draft_step_slots(loc, view.batch_size, view.draft)
    if view.kind is ForwardKind.DRAFT_EXTEND:
        # A draft-extend graph's padding requests are planned longer than handed.
        seq_lens = fb.seq_lens[: view.batch_size]
        host = host_seq_lens(fb)
        seq_lens_cpu = None if host is None else host[: view.batch_size]
    inputs = PlanInputs(
        req_pool_indices=_kept(view.req_pool_indices),
        seq_lens=_kept(seq_lens),
        out_cache_loc=_kept(loc),
        seq_lens_cpu=seq_lens_cpu,
        sources=BatchTag(
            req_pool_indices=fb.req_pool_indices,
            seq_lens=fb.seq_lens,
            out_cache_loc=fb.out_cache_loc,
        ),
    )
    return PlannedBatch(inputs=inputs, accepted=BatchTag(**_batch_objects(fb)))


def _check_padding_slots(out_cache_loc: torch.Tensor, first: int, where: str) -> None:
    """Padding tokens (``out_cache_loc[first:]``) write slot 0, where readable without a sync:
    a real token taken for padding would write no key (``BatchError`` naming it)."""
    tail = readable_ints("out_cache_loc", out_cache_loc[first:], sync_ok=strict_checks_enabled())
    bad = [(first + i, v) for i, v in enumerate(tail or ()) if v != 0]
    if bad:
        index, value = bad[0]
        raise BatchError(
            f"{where}: out_cache_loc[{index}]={value} is past the requests' rows, where only "
            "data-parallel padding tokens (slot 0) may be; check extend_seq_lens_cpu"
        )


def read_batch(fb: Any, **view_options: Any) -> BatchRead:
    """Read ``fb`` for planning (:class:`BatchRead`); ``view_options`` as :func:`batch_view`
    takes them. ``BatchError`` for a batch that cannot be planned, or padding tokens that do
    not write slot 0."""
    view = batch_view(fb, **view_options)
    padding = padding_rows(fb, view)
    if padding > 0:
        _check_padding_slots(fb.out_cache_loc, view.num_rows, "plan")
    return BatchRead(
        view=view,
        padding=padding,
        cp_rows=cp_rank_rows(fb, view.num_rows + max(padding, 0)),
        planned=_planned_batch(fb, view),
        whole_extend=view.kind is ForwardKind.EXTEND
        and fb.forward_mode.is_extend_without_speculative(),
    )


def is_idle(fb: Any, rows: torch.Tensor, where: str) -> bool:
    """Whether ``fb`` is IDLE. An IDLE batch's rows are data-parallel padding (one per
    ``out_cache_loc`` slot): nothing is written for them and ``forward`` outputs zeros.
    ``ContractError`` when an IDLE call is handed another number of rows."""
    if not fb.forward_mode.is_idle():
        return False
    padding = 0 if fb.out_cache_loc is None else fb.out_cache_loc.shape[0]
    if rows.shape[0] != padding:
        raise ContractError(
            f"{where}: an IDLE batch has {padding} rows (data-parallel padding only), but "
            f"{where} got a tensor of shape {tuple(rows.shape)}"
        )
    return True


def written_rows(fb: Any) -> int:
    """The rows ``fb`` writes: its ``out_cache_loc`` slots."""
    return int(fb.out_cache_loc.shape[0])


def idle_window_slots(fb: Any, full_to_swa: torch.Tensor | None) -> torch.Tensor:
    """``[T]`` int32 window slots of an IDLE ``fb``'s padding rows: its ``out_cache_loc``
    (slot 0) through the pool's ``full_to_swa`` (None: identity); empty without one."""
    loc = fb.out_cache_loc
    if loc is None:
        return torch.zeros(0, dtype=torch.int32)
    return (loc if full_to_swa is None else full_to_swa[loc.long()]).to(torch.int32)
