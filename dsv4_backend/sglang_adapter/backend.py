"""``DSV4AttentionBackend``: sglang 0.5.23's ``AttentionBackend`` for DeepSeek-V4, thin over the
planner (``planning``) and the kernels (``kernels``).

What sglang's ``DeepseekV4ForCausalLM`` calls on its default path (V4, CUDA, no context
parallelism), per layer, and what each call does here:

* ``store_cache(layer_id=, swa_k=, forward_batch=)`` — writes the window key. The model only
  routes the key here when ``SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE`` is true (it reads the variable
  on every layer call); otherwise it writes sglang's own pool. The constructor therefore sets it.
* ``forward_c4_indexer(x=, q_lora=, forward_batch=, c4_indexer=, ...)`` (ratio-4 layers) — runs
  the indexer compressor (``forward_indexer_compressor``), projects and ropes the indexer queries
  with the module's ``wq_b`` / ``compute_weights``, and writes each row's top-k c4 slots into
  ``forward_metadata.c4.page_indices``; returns None. With ``enable_multi_stream`` it keeps
  sglang's stream handshake (``alt_streams``, waits for ``q_lora_ready`` before reading
  ``q_lora``).
* ``forward_core_compressor(x, forward_batch, layer_id, compressor)`` (ratio 4 / 128) — the
  module's ``compute_kv_score`` projections through
  ``kernels.compressor.table.compress_forward``, the finished entries stored at ``c{r}.out_loc``.
* ``forward(q, k, v, layer, forward_batch, compress_ratio=, attn_sink=, save_kv_cache=)`` —
  sparse attention with sink; returns ``[T, H, D]`` in ``q``'s dtype (``k``/``v`` are the
  model's sentinel and ``save_kv_cache`` is moot: keys were written by ``store_cache``).
* ``get_swa_out_cache_loc(forward_batch)``, ``token_to_kv_pool``, ``req_to_token_pool``.

DeepSeek-V4.1 adds ``forward_low_ratio_sources`` (its ratio-1 / ratio-2 compressors and
indexers) and, under the decoder SWA bounded replay, ``tail_forward_metadata``,
``write_tail_source_kv``, ``enter_late_layer_tail`` / ``exit_late_layer_tail``
(``sglang_adapter/late_layer_tail.py``).

Lazy-init contract: nothing here plans from a forward. ``init_forward_metadata`` (eager) plans
the batch as it is when called — the host calls it after data-parallel padding — and
``init_forward_metadata_out_graph`` plans into fixed ``GraphMetadataBuffers`` (CUDA graphs).
Every call that consumes the plan first checks it was made for this batch: the same
``ForwardBatch`` object and tensors, unchanged since planning (``BatchTag``), of the planned
shapes (``AttentionMetadata.check_matches``) and mode, and raises ``ContractError`` otherwise.
Planning checks the batch's indices and write slots (``planning/checks.py``); on CUDA without
strict mode their verdict is read at the next plan.

Memory: the caches and compressor rings (``compute.AttentionState``) are sized from the runner's
pools. With fp8 caches and an sglang ``DeepSeekV4TokenToKVPool`` the caches (and fitting rings)
are views of that pool's buffers, which sglang leaves unwritten on this path (``pool_alias``);
otherwise they are allocated. One state is shared by every backend of a runner (the target
backend; the draft runner's draft-extend backend and its per-step backends).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.environ import envs
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.runtime_context import get_parallel

from dsv4_backend.cache import CacheFormat
from dsv4_backend.compute import (
    attend,
    compress_and_store,
    compress_low_ratio,
    layer_ratio,
    select_c4_entries,
    select_low_ratio_entries,
    store_window_keys,
)
from dsv4_backend.compute.kernel_choice import (
    KernelChoice,
    explicit_choice_refusal,
    kernel_choice,
)
from dsv4_backend.errors import ConfigError, ContractError
from dsv4_backend.kernels.indexer.topk import warm_up_topk
from dsv4_backend.planning import (
    AttentionMetadata,
    BatchView,
    DraftStep,
    GraphMetadataBuffers,
    PlanWidths,
    plan,
    seq_len_fill_value,
)
from dsv4_backend.self_check.check import at_startup
from dsv4_backend.sglang_adapter.batch_read import (
    GraphCall,
    KindOf,
    cp_all_rows,
    forward_kind,
    idle_window_slots,
    is_idle,
    read_batch,
    read_consumer,
    written_rows,
)
from dsv4_backend.sglang_adapter.late_layer_tail import (
    TailForward,
    plan_tail,
    restore_cp_layout,
    swap_cp_layout,
)
from dsv4_backend.sglang_adapter.module_inputs import (
    CudaStreams,
    attention_queries,
    c4_indexer_inputs,
    low_ratio_indexer_inputs,
    original_ape,
)
from dsv4_backend.sglang_adapter.plan_session import PlanSession
from dsv4_backend.sglang_adapter.pool_alias import shared_state, state_sizes
from dsv4_backend.sglang_adapter.settings import RunnerSettings

if TYPE_CHECKING:
    from sglang.srt.layers.attention.dsv4.compressor import Compressor
    from sglang.srt.layers.attention.dsv4.indexer import C4Indexer
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)
_logged_choices: set[KernelChoice] = set()


def _log_kernels(kernels: KernelChoice) -> None:
    """Log the kernel variants once per distinct choice (every draft step builds a backend)."""
    if kernels not in _logged_choices:
        _logged_choices.add(kernels)
        logger.info("dsv4 kernels on %s: %s", kernels.target.describe(), "; ".join(kernels.lines()))


class DSV4AttentionBackend(AttentionBackend):
    """sglang attention backend for DeepSeek-V4 served by this package.

    Parameters
    ----------
    model_runner : sglang ``ModelRunner`` (or a runner exposing the same attributes).
    skip_prefill : accepted for sglang's signature; unused.
    speculative_step_id, topk, speculative_num_steps : a multi-step draft's step backend
        (``speculative_num_steps > 1``); its DECODE batches are planned as step
        ``speculative_step_id``.
    cache_format : ``"fp8"`` (sglang's FP8 layout) or ``"dense"`` (tests).

    Raises ``ConfigError`` for what cannot be served (``settings.RunnerSettings``: page
    size, EAGLE topk, the refusal table, region copying over caches that are not views of
    sglang's pool, heads the attention TP group does not divide) and for a kernel that cannot
    run or fails the start-up self-check.

    Side effect: sets the process environment variable ``SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE``
    to ``True`` (sglang's ``MQALayer`` reads it on every layer call and, only when it is true,
    hands the window keys to ``store_cache`` instead of writing its own pool). It is
    process-wide: a DeepSeek-V4 model served by sglang's own backend in the same process (or
    a child inheriting the environment) takes sglang's bf16-quant-source path too.
    """

    #: sglang's overlap scheduler publishes ``seq_lens_cpu`` only for backends that ask: eager
    #: plans size their fields from the host lengths (``planning.plan``).
    needs_cpu_seq_lens = True
    #: Two-batch overlap: sglang's ``TboAttnBackend`` builds a primary and two child backends
    #: of this class (one shared state) and plans each child on its own ``ForwardBatch``.
    #: DeepSeek-V4 overlaps prefill only (``DeepseekV4Model._can_run_tbo``), so the children
    #: are kept off the CUDA-graph paths, where the model never calls them
    #: (``TboAttnBackend._children_use_cuda_graph``).
    tbo_supports_cuda_graph = False
    #: sglang's compact ragged verify (``SGLANG_RAGGED_VERIFY_MODE=compact``): its token-keyed
    #: TARGET_VERIFY graphs replay only for a backend that says so (``DecodeCudaGraphRunner.
    #: _can_run_ragged_verify_graph``); the backend plans them into its graph buffers like
    #: its eager plans (``batch_read.ragged_verify``, docs/planning.md).
    supports_ragged_verify_graph = True

    def __init__(
        self,
        model_runner: ModelRunner,
        skip_prefill: bool = False,
        speculative_step_id: int = 0,
        topk: int = 0,
        speculative_num_steps: int = 0,
        *,
        cache_format: CacheFormat = "fp8",
    ) -> None:
        super().__init__()
        settings = self.runner_settings(model_runner, topk)
        self.config = settings.config
        self.device = settings.device
        self.num_draft_tokens = settings.num_draft_tokens
        self.local_heads = settings.local_heads
        #: The heads of a batch that is not a CP prefill (``RunnerSettings.split_heads``).
        self.split_heads = settings.split_heads
        self.topk = settings.draft_topk
        self.speculative_step_id = speculative_step_id
        self.speculative_num_steps = speculative_num_steps
        self.draft_step = (
            DraftStep(topk=self.topk, num_steps=speculative_num_steps, step_id=speculative_step_id)
            if self.topk > 0 and speculative_num_steps > 1
            else None
        )
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.state = shared_state(
            model_runner, self.config, cache_format, settings.region_copying, settings.layers
        )
        #: What every op runs here (``compute/kernel_choice.py``), logged once per process;
        #: on CUDA the start-up self-check decides the defaults first (``self_check/``); a
        #: variant named in the environment that cannot run, take these caches or pass the
        #: self-check is refused when built, not at the first forward.
        window_format = self.state.pools.window(self.state.pools.layers.start).fmt
        self.self_check = at_startup(self.config, window_format, self.local_heads, self.device)
        self.kernels = kernel_choice(self.device)
        for heads in sorted({self.local_heads, self.split_heads}):
            reason = explicit_choice_refusal(self.device, self.state.pools, self.config, heads)
            if reason is not None:
                raise ConfigError(reason)
        _log_kernels(self.kernels)
        sizes = state_sizes(model_runner, self.config)
        self.num_cache_slots = sizes["num_full_slots"]
        self.num_swa_slots = sizes["num_swa_slots"]
        #: The plan's life (``plan_session.py``); DSpark's draft backend gives its own planner
        #: and the kind it plans each sglang mode as (``kind_of``).
        self.session = PlanSession(
            self.config, self.plan_view, draft_step=self.draft_step is not None
        )
        self.kind_of: KindOf = forward_kind
        self.graph_buffers: GraphMetadataBuffers | None = None
        #: Columns of the graph buffers' ``swa_page_indices`` (None: the config's window).
        self.graph_swa_width: int | None = None
        self.streams = CudaStreams()
        self.bounded_replay, self.dspark = settings.bounded_replay, settings.dspark
        #: The target runner under DSpark's compact ragged verify: its TARGET_VERIFY batches
        #: carry per-request verify lengths (``batch_read.ragged_verify``).
        self.ragged_verify = settings.ragged_verify
        # The model writes window keys through store_cache only with this set (class docstring).
        envs.SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE.set(True)

    @classmethod
    def runner_settings(cls, model_runner: ModelRunner, topk: int = 0) -> RunnerSettings:
        """What this backend serves of ``model_runner`` (``RunnerSettings.from_runner``)."""
        return RunnerSettings.from_runner(model_runner, topk)

    @property
    def forward_metadata(self) -> AttentionMetadata | None:
        """The current plan (sglang's model reads it; ``PlanSession.forward_metadata``)."""
        return self.session.forward_metadata

    @forward_metadata.setter
    def forward_metadata(self, metadata: AttentionMetadata | None) -> None:
        # sglang's eager runner drops the plan of an unpadded idle batch (sets None).
        self.session.forward_metadata = metadata

    @property
    def tail_forward_metadata(self) -> TailForward | None:
        """DeepSeek-V4.1's late-layer tail of the extend planned last (None for other
        batches); sglang's model reads its ``late_layer_tail``."""
        return self.session.tail

    # ------------------------------------------------------------------------- planning
    def _plan(
        self,
        forward_batch: ForwardBatch,
        buffers: GraphMetadataBuffers | None,
        graph: GraphCall | None = None,
    ) -> None:
        """Plan ``forward_batch``: eager (``buffers`` None) or into the graph buffers (the
        same planning body), as the graph runner hands it (``graph``); then, under
        DeepSeek-V4.1's bounded replay, an eager whole extend's late-layer tail.

        A radix-cache hit is an EXTEND whose ``extend_prefix_lens`` is the cached, page-aligned
        prefix (sglang matches whole 256-token pages), in a fresh pool row whose
        ``req_to_token`` row points at the prefix's pages: it is planned like any extend. Its
        compressors read the prefix's last c4 block from the prefix's own window page (page-
        scoped rings) and nothing of the c128 ring (no c128 entry spans a page boundary), so
        nothing is reset: no forward reads a ring row it did not write.
        """
        read = functools.partial(
            read_batch,
            forward_batch,
            req_to_token=self.req_to_token_pool.req_to_token,
            full_to_swa=getattr(self.token_to_kv_pool, "full_to_swa_index_mapping", None),
            num_draft_tokens=self.num_draft_tokens,
            draft=self.draft_step,
            num_cache_slots=self.num_cache_slots,
            num_swa_slots=self.num_swa_slots,
            graph=graph,
            ragged_verify_mode=self.ragged_verify,
        )
        _, batch = self.session.plan(read, buffers)
        if self.bounded_replay and buffers is None and batch.whole_extend:
            cp = None
            if batch.cp_rows is not None:
                parallel = get_parallel()
                cp = (int(parallel.attn_cp_rank), int(parallel.attn_cp_size))
            tail = plan_tail(self.config, batch.view, forward_batch, dspark=self.dspark, cp=cp)
            self.session.add_tail(tail)

    def plan_view(self, view: BatchView, buffers: GraphMetadataBuffers | None) -> AttentionMetadata:
        """The session's planner: ``view`` eagerly, or into the graph buffers."""
        return plan(self.config, view) if buffers is None else buffers.plan(view)

    def raise_pending_checks(self, wait: bool = True) -> None:
        """Raise ``BatchError`` for a failed device-side planning check of an earlier batch
        (``PlanSession.raise_pending_checks``)."""
        self.session.raise_pending_checks(wait)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Eager: plan ``forward_batch`` as it is now (after data-parallel padding)."""
        self._plan(forward_batch, None)

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> None:
        """CUDA graphs: plan with fixed widths and load the plan into the graph buffers.

        The same planning body as eager. It runs outside the graph (before capture and before
        each replay), so every kind is accepted, not only ``GRAPH_KINDS`` (DECODE, draft steps,
        TARGET_VERIFY, IDLE: planned without a host sync): sglang 0.5.23 also graphs
        DRAFT_EXTEND_V2 batches (``eagle_draft_extend_cuda_graph_runner``), whose rows come
        from host lengths (``batch_read.draft_extend_graph_view``). Needs
        ``init_cuda_graph_state`` first.
        """
        if self.graph_buffers is None:
            raise ContractError(
                "init_forward_metadata_out_graph before init_cuda_graph_state: the graph "
                "buffers do not exist yet"
            )
        graph = GraphCall.CAPTURE if in_capture else GraphCall.REPLAY
        self._plan(forward_batch, self.graph_buffers, graph)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """Nothing to record: the whole plan is built (and copied into buffers) outside."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the fixed metadata buffers (and the state's per-row scratch) for graphs of
        up to ``max_num_tokens`` rows, and build flashinfer's top-k before any capture (of the
        index top-k and, for DeepSeek-V4.1, of the candidate blocks)."""
        warm_up_topk(self.device, self.config.index_topk)
        v41 = self.config.v41
        if v41 is not None and v41.candidate_source_layer >= 0:  # its block top-k
            warm_up_topk(self.device, v41.candidate_topk_blocks)
        self.state.reserve_rows(max_num_tokens)
        self.graph_buffers = GraphMetadataBuffers(
            self.config,
            max_batch_size=max_bs,
            max_rows=max_num_tokens,
            widths=PlanWidths.for_max_len(
                self.req_to_token_pool.req_to_token.shape[1], self.config.page_size
            ),
            device=self.device,
            swa_width=self.graph_swa_width,
        )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return seq_len_fill_value

    def on_after_cuda_graph_warmup(self) -> None:
        """Nothing to reset: planning keeps no per-capture state."""

    # ------------------------------------------------------------------ plan consumers
    def _metadata(
        self, forward_batch: ForwardBatch, num_rows: int | None, where: str
    ) -> AttentionMetadata:
        """The current plan, checked against this batch (``PlanSession.metadata``)."""
        return self.session.metadata(read_consumer(forward_batch, self.kind_of), num_rows, where)

    def _read_metadata(
        self, forward_batch: ForwardBatch, num_rows: int, where: str
    ) -> AttentionMetadata:
        """The plan the query side reads (``PlanSession.read_metadata``)."""
        batch = read_consumer(forward_batch, self.kind_of)
        return self.session.read_metadata(batch, num_rows, where)

    def get_swa_out_cache_loc(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """``[T]`` int32 window slot each row writes (its own step's slots for a draft step),
        as sglang's own backend returns it.

        IDLE: never the plan (stale or unset there): ``out_cache_loc`` (data-parallel padding,
        slot 0) translated through the pool's ``full_to_swa_index_mapping``, so padding slots
        give window slot 0. Otherwise the plan's ``swa_out_loc``, the plan checked against the
        batch like every consumer's: with ``T`` taken from ``out_cache_loc``, except for a
        draft step (whose ``out_cache_loc`` holds every step's slots: batch size, kind and
        identity are checked).
        """
        if forward_batch.forward_mode.is_idle():
            mapping = getattr(self.token_to_kv_pool, "full_to_swa_index_mapping", None)
            return idle_window_slots(forward_batch, mapping).to(self.device)
        rows: int | None = written_rows(forward_batch)
        if self.draft_step is not None or self.session.in_tail:  # not out_cache_loc's rows
            rows = None
        metadata = self._metadata(forward_batch, rows, "get_swa_out_cache_loc")
        return metadata.swa_out_loc.to(torch.int32)

    def _enter_layer(self, layer_id: int, where: str) -> int:
        """``layer_id``'s compress ratio (checked), once HiCache's load of that layer is done:
        the caches are views of the pool, so the backend waits as sglang's pool getters do
        (``wait_layer_transfer``; no wait without HiCache)."""
        ratio = layer_ratio(self.config, layer_id, where)
        wait = getattr(self.token_to_kv_pool, "wait_layer_transfer", None)
        if wait is not None:
            wait(layer_id)
        return ratio

    def store_cache(self, layer_id: int, swa_k: torch.Tensor, forward_batch: ForwardBatch) -> None:
        """Write the window keys ``swa_k`` ``[T, D]`` (normed, roped) of layer ``layer_id``."""
        where = f"store_cache (layer {layer_id})"
        self._enter_layer(layer_id, where)
        if is_idle(forward_batch, swa_k, where):
            return
        metadata = self._metadata(forward_batch, swa_k.shape[0], where)
        store_window_keys(self.state, layer_id, metadata, swa_k.float())

    def forward_core_compressor(
        self, x: torch.Tensor, forward_batch: ForwardBatch, layer_id: int, compressor: Compressor
    ) -> None:
        """Run sglang ``Compressor`` ``compressor``'s projections through ``compress_forward``.

        ``compressor.compute_kv_score(x, forward_batch)`` is ``[T, 2*c*D]`` float32: kv, then
        scores without ape (sglang fuses ``wkv`` and ``wgate`` in that order). Entries completed
        by this forward go to the layer's compressed cache (or its indexer key cache when
        ``compressor.is_in_indexer``). The indexer's Hadamard rotation is skipped on both
        sides (keys here, queries in ``forward_c4_indexer``): it leaves ``q . k`` unchanged.
        """
        where = f"compressor (layer {layer_id}, ratio {compressor.ratio})"
        self._enter_layer(layer_id, where)
        if is_idle(forward_batch, x, where):
            return
        self._compress(x, forward_batch, layer_id, compressor, where)

    forward_indexer_compressor = forward_core_compressor

    def _compress(
        self,
        x: torch.Tensor,
        forward_batch: ForwardBatch,
        layer_id: int,
        compressor: Compressor,
        where: str,
    ) -> None:
        """``forward_core_compressor``'s body. The projections are the batch's rows: on a
        prefill context-parallel rank ``x`` is the rank's rows and sglang's
        ``compute_kv_score`` all-gathers the projections of every rank's, so the plan is
        checked against ``kv_score``, which every rank writes whole."""
        kv_score = compressor.compute_kv_score(x, forward_batch).float()
        batch = read_consumer(forward_batch, self.kind_of)
        metadata = self.session.metadata(batch, kv_score.shape[0], where)
        half = kv_score.shape[-1] // 2
        compress_and_store(
            self.state,
            layer_id,
            metadata,
            batch.req_pool_indices,
            kv_score[:, :half],
            kv_score[:, half:],
            original_ape(compressor),
            compressor.norm.weight.float(),
            indexer=bool(compressor.is_in_indexer),
            norm_eps=float(compressor.norm.variance_epsilon),
        )

    def forward_c4_indexer(
        self,
        x: torch.Tensor,
        q_lora: torch.Tensor,
        forward_batch: ForwardBatch,
        c4_indexer: C4Indexer,
        alt_streams: Sequence[Any] | None = None,
        enable_multi_stream: bool = False,
        q_lora_ready: Any = None,
        skip_compressor: bool = False,
        q_lora_quant: Any = None,
    ) -> None:
        """The lightning indexer of sglang ``C4Indexer`` ``c4_indexer``; returns None.

        Queries: ``c4_indexer.wq_b(q_lora)`` as ``[T, HI, DI]``, roped (compressed-layer RoPE,
        trailing dims) at each row's position; head weights ``compute_weights(x, skip_scale=
        True)`` scaled by ``c4_indexer.weight_scale`` in float32 (as sglang's fused query kernel
        does). Writes each row's top-k c4 slots into ``forward_metadata.c4.page_indices``. The
        indexer compressor runs first unless ``skip_compressor``. ``q_lora_quant`` (sglang's fp8
        copy of ``q_lora``) is unused: queries are projected from ``q_lora``.

        Streams: with ``enable_multi_stream`` sglang's multi-stream order, ``q_lora_ready``
        and ``alt_streams`` (``module_inputs.c4_indexer_inputs``).
        """
        if is_idle(forward_batch, x, "c4 indexer"):
            return
        layer_id = c4_indexer.layer_id
        where = f"c4 indexer (layer {layer_id})"
        if self._enter_layer(layer_id, where) != 4:
            raise ContractError(
                f"{where}: layer {layer_id} has compress ratio "
                f"{self.config.compress_ratios[layer_id]}; the indexer runs on ratio-4 layers"
            )
        metadata = self._read_metadata(forward_batch, x.shape[0], where)
        compress = None
        if not skip_compressor:
            compress = functools.partial(
                self._compress, x, forward_batch, layer_id, c4_indexer.compressor, where
            )
        q, weights = c4_indexer_inputs(
            c4_indexer,
            x,
            q_lora,
            self.state.rope,
            metadata,
            compress=compress,
            streams=self.streams if enable_multi_stream else None,
            alt_streams=alt_streams,
            q_lora_ready=q_lora_ready,
            where=where,
        )
        select_c4_entries(self.state, layer_id, metadata, q, weights)

    def forward_low_ratio_sources(
        self,
        *,
        layer: Any,
        x: torch.Tensor,
        q_lora: torch.Tensor | None,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        run_compressor: bool = True,
        run_indexer: bool = True,
    ) -> None:
        """DeepSeek-V4.1: the low-ratio sources of ``layer`` (sglang's ``MQALayer`` of ratio 1
        or 2) before its attention, as sglang's ``DeepseekV4AttnBackend`` runs them
        (``compute/low_ratio.py``); returns None.

        A kv source (``layer.compressor``, sglang's ``DeepseekV41Compressor``): its projections
        ``compressor.project(x)`` (``kv``, and ``score`` for ratio 2) into the c1 / c2 entries,
        normed by ``compressor.norm``; when the layer's indexer owns the keys, the index keys
        from ``indexer.wk`` and ``indexer.k_norm``. An index source (``layer.indexer``,
        ``DeepseekV41Indexer``): queries ``indexer.wq_b(q_lora)`` ``[T, HI, DI]`` and head
        weights ``indexer.head_weights_raw(x)`` times ``indexer.head_weight_scale`` (float32)
        select the ratio's entries. ``positions``: the rows' positions, which the plan holds
        (checked against its row count).
        """
        layer_id = layer.layer_id
        where = f"low-ratio sources (layer {layer_id})"
        ratio = self._enter_layer(layer_id, where)
        if ratio not in (1, 2):
            raise ContractError(
                f"{where}: layer {layer_id} has compress ratio {ratio}; the low-ratio sources "
                "run on DeepSeek-V4.1's ratio-1 / ratio-2 layers"
            )
        if is_idle(forward_batch, x, where):
            return
        metadata = self._read_metadata(forward_batch, x.shape[0], where)
        if positions.shape[0] != x.shape[0]:
            raise ContractError(
                f"{where}: positions has {positions.shape[0]} rows but x has {x.shape[0]}"
            )
        compressor, indexer = layer.compressor, layer.indexer
        if layer_id == self.session.tail_source_kv_layer_id:  # write_tail_source_kv ran it
            run_compressor = False
        if run_compressor and compressor is not None:
            batch = read_consumer(forward_batch, self.kind_of)
            written, write_plan = x, metadata
            if self.session.cp_read_metadata is not None:  # a CP rank writes every entry
                write_plan = self.session.metadata(batch, None, where)
                written = cp_all_rows(x, forward_batch, write_plan.num_rows)
            kv, score = compressor.project(written)
            keys = None
            if indexer is not None and indexer.owns_k:
                k_norm = indexer.k_norm
                keys = (indexer.wk.weight, k_norm.weight.float(), float(k_norm.eps))
            compress_low_ratio(
                self.state,
                layer_id,
                write_plan,
                batch.req_pool_indices,
                kv.float(),
                None if score is None else score.float(),
                compressor.norm.weight.float(),
                float(compressor.norm.eps),
                index_key_params=keys,
            )
        if run_indexer and indexer is not None:
            if q_lora is None:
                raise ContractError(f"{where}: the indexer needs q_lora, got None")
            q, weights = low_ratio_indexer_inputs(indexer, x, q_lora)
            select_low_ratio_entries(self.state, layer_id, metadata, q, weights)

    # ------------------------------------------------------ DeepSeek-V4.1's late-layer tail
    def write_tail_source_kv(
        self, *, layer: Any, x: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> None:
        """The decoder SWA bounded replay's first tail layer (the last kv source, ``layer``):
        its compressor over every row of the extend (``x`` ``[T, hidden]``) before
        ``enter_late_layer_tail``; its own pass inside the tail then runs the indexer only."""
        if x.shape[0] > 0:
            self.forward_low_ratio_sources(
                layer=layer,
                x=x,
                q_lora=None,
                positions=positions,
                forward_batch=forward_batch,
                run_indexer=False,
            )
        self.session.tail_source_kv_layer_id = layer.layer_id

    def enter_late_layer_tail(self, forward_batch: ForwardBatch) -> tuple[Any, ...]:
        """Make the tail's plan current: the late layers run over the tail rows
        (``tail_forward_metadata.late_layer_tail``), a CP rank's collectives over the tail's
        layout; returns what ``exit_late_layer_tail`` restores."""
        saved = self.session.enter_tail()
        assert self.session.tail is not None  # enter_tail raised otherwise
        return saved, swap_cp_layout(forward_batch, self.session.tail)

    def exit_late_layer_tail(self, saved: tuple[Any, ...], forward_batch: ForwardBatch) -> None:
        """Restore the extend's plan (and a CP rank's layout) ``enter_late_layer_tail`` saved."""
        plans, cp_saved = saved
        restore_cp_layout(forward_batch, cp_saved)
        self.session.exit_tail(plans)

    # -------------------------------------------------------------------------- forward
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """IDLE: zeros of ``q``'s shape (rows that data-parallel padding gave an idle rank);
        otherwise sglang's dispatch to decode / extend."""
        if is_idle(forward_batch, q, "forward"):
            return q.new_zeros(q.shape)
        return super().forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, layer, forward_batch, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, layer, forward_batch, **kwargs)

    def _attend(
        self,
        q: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        compress_ratio: int | None = None,
        attn_sink: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """``q`` ``[T, Hq, D]`` (normed, roped) -> ``[T, Hq, D]`` in ``q``'s dtype.

        Attention TP: the rank's ``Hl = num_heads / attn_tp_size`` heads are the first ``Hl``
        of ``q`` and ``attn_sink`` (``Hq >= Hl``: sglang pads a rank's queries and sink to 64
        heads for FlashMLA and reads back only the first ``Hl``). Only those are attended;
        padded heads of the output are 0.
        """
        layer_id = layer.layer_id
        where = f"forward (layer {layer_id})"
        ratio = self._enter_layer(layer_id, where)
        if compress_ratio is not None and compress_ratio != ratio:
            raise ContractError(
                f"{where}: compress_ratio={compress_ratio} but the model config gives layer "
                f"{layer_id} ratio {ratio}"
            )
        q, attn_sink = attention_queries(q, attn_sink, self.config.head_dim, where)
        metadata = self._read_metadata(forward_batch, q.shape[0], where)
        # A CP prefill keeps every head of the rank; other batches may split them further.
        heads = self.local_heads if self.session.cp_read_metadata is not None else self.split_heads
        layer_heads = getattr(layer, "tp_q_head_num", heads)
        if layer_heads != heads or q.shape[1] < heads:
            raise ContractError(
                f"{where}: this rank serves {heads} query heads in this batch "
                f"(num_attention_heads {self.config.num_heads} / {self.config.num_heads // heads}"
                " ranks of attention TP, and of CP under --enable-cp-decode-attn-tp) but got a "
                f"layer of {layer_heads} heads and q {tuple(q.shape)}"
            )
        out = attend(self.state, layer_id, metadata, q[:, :heads], attn_sink[:heads].float())
        if q.shape[1] == heads:
            return out.to(q.dtype)
        padded = q.new_zeros(q.shape)
        padded[:, :heads] = out
        return padded
