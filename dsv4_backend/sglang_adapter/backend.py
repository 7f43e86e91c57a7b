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

import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from sglang.srt.environ import envs
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.dp_attention import get_local_dp_buffer_len, set_local_dp_buffer_len
from sglang.srt.runtime_context import derive_attn_tp_size, get_parallel

from dsv4_backend.cache import CacheFormat, stage_layers
from dsv4_backend.compute import (
    AttentionState,
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
from dsv4_backend.config import (
    INDEXER_SELECTIONS,
    REQUIRED_PAGE_SIZE,
    DSV4AttentionConfig,
)
from dsv4_backend.errors import BatchError, ConfigError, ContractError
from dsv4_backend.kernels.indexer.topk import warm_up_topk
from dsv4_backend.ops.rope import apply_rope
from dsv4_backend.planning import (
    SUPPORTED_DRAFT_TOPK,
    AttentionMetadata,
    BatchView,
    DraftStep,
    ForwardKind,
    GraphMetadataBuffers,
    PlanInputs,
    PlanWidths,
    pad_plan,
    plan,
    read_plan,
    seq_len_fill_value,
)
from dsv4_backend.planning.checks import PendingChecks, run_checks, strict_checks_enabled
from dsv4_backend.planning.draft_slots import draft_step_slots
from dsv4_backend.planning.tag import BatchTag
from dsv4_backend.self_check.check import at_startup
from dsv4_backend.sglang_adapter.batch_view import (
    GraphCall,
    batch_view,
    cp_all_rows,
    cp_rank_rows,
    forward_kind,
    padding_rows,
    readable_ints,
)
from dsv4_backend.sglang_adapter.late_layer_tail import TailForward, bounded_replay, plan_tail
from dsv4_backend.sglang_adapter.pool_alias import (
    aliased_state,
    log_state_memory,
    unaliasable_reason,
    unmovable_reason,
)
from dsv4_backend.sglang_adapter.refusals import check_served

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


#: Attribute of the runner's ``token_to_kv_pool`` holding the shared ``AttentionState``.
_STATE_ATTR = "_dsv4_backend_attention_state"
#: Server options that copy the pool's regions (``get_contiguous_buf_infos``,
#: ``get_state_buf_infos``, ``get_request_state_buf_infos``) between pools or to host memory:
#: ``(ServerArgs field, value that is off, CLI flag)``. Served only where every cache and ring
#: of the backend is a view of those regions (``pool_alias.unmovable_reason``), refused otherwise.
REGION_COPYING_OPTIONS = (
    ("disaggregation_mode", "null", "--disaggregation-mode"),
    ("enable_hierarchical_cache", False, "--enable-hierarchical-cache"),
)
#: DeepSeek-V4.1 under prefill CP: sglang's model all-gathers the window keys and writes them
#: into its pool (``set_swa_key_buffer_radix_fused_norm_rope``), not through ``store_cache``,
#: so the backend's window cache must be a view of that pool, like the region-copying options.
V41_CP_WINDOW_WRITES = (
    "--attention-context-parallel-size with DeepSeek-V4.1 (its model writes the window keys "
    "into the pool itself)"
)
#: Environment variable choosing ``DSV4AttentionConfig.indexer_selection`` (default "exact";
#: "fp8" reproduces sglang's built-in quantised top-k, for A/B runs against it).
INDEXER_SELECTION_ENV = "DSV4_BACKEND_INDEXER_SELECTION"


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """What the backend reads from an sglang model runner, validated."""

    config: DSV4AttentionConfig
    draft_topk: int
    num_draft_tokens: int
    device: torch.device
    #: Attention tensor-parallel ranks: each serves ``config.num_heads // attn_tp_size`` heads.
    attn_tp_size: int = 1
    #: The ``REGION_COPYING_OPTIONS`` set, as ``"option=value (flag)"``.
    region_copying: tuple[str, ...] = ()
    #: The model layer ids this runner serves: its pipeline stage's ``[start_layer,
    #: end_layer)`` (every layer without pipeline parallelism, and on a draft worker).
    layers: range | None = None
    #: ``--enable-cp-decode-attn-tp``: the prefill-CP ranks split the query heads of every
    #: batch that is not a CP prefill over themselves (sglang's ``CpDecodeAttnTpContext``).
    decode_attn_tp_size: int = 1
    #: DeepSeek-V4.1's decoder SWA bounded replay: extends plan their late-layer tail
    #: (``sglang_adapter/late_layer_tail.py``).
    bounded_replay: bool = False
    #: The server's speculative algorithm is DSpark.
    dspark: bool = False

    @property
    def local_heads(self) -> int:
        """Query heads of this rank (sglang's ``n_local_heads``)."""
        return self.config.num_heads // self.attn_tp_size

    @property
    def split_heads(self) -> int:
        """Query heads of this rank in a batch that is not a CP prefill: ``local_heads``, or
        a ``decode_attn_tp_size``-th of them under ``--enable-cp-decode-attn-tp``."""
        return self.local_heads // self.decode_attn_tp_size

    @classmethod
    def from_runner(cls, runner: ModelRunner, topk: int = 0) -> RunnerSettings:
        """Read and validate ``runner``; ``ConfigError`` names the option that cannot be served.

        Reads ``page_size``, ``device``, ``is_draft_worker``, ``layer_info`` (the pipeline
        stage's ``start_layer`` / ``end_layer``), ``model_config.hf_config`` and
        ``server_args`` (``speculative_algorithm``, ``speculative_eagle_topk``,
        ``speculative_num_draft_tokens``, ``tp_size``, ``attn_dp_size`` (or
        ``enable_dp_attention`` with ``dp_size``), every option of the refusal table
        (``refusals.REFUSED``) and the ``REGION_COPYING_OPTIONS``), and the environment
        variables ``INDEXER_SELECTION_ENV`` and the kernel tables' ``DSV4_<OP>_KERNEL``
        (``compute/kernel_choice.py``).
        """
        if runner.page_size != REQUIRED_PAGE_SIZE:
            raise ConfigError(
                f"page_size={runner.page_size}; the dsv4 backend needs page_size "
                f"{REQUIRED_PAGE_SIZE} (--page-size {REQUIRED_PAGE_SIZE})"
            )
        args = runner.server_args
        draft_topk = max(int(topk or 0), int(getattr(args, "speculative_eagle_topk", 0) or 0))
        if draft_topk and draft_topk not in SUPPORTED_DRAFT_TOPK:
            raise ConfigError(
                f"speculative_eagle_topk={draft_topk}; the dsv4 backend serves EAGLE with "
                f"--speculative-eagle-topk {max(SUPPORTED_DRAFT_TOPK)} only (no draft trees)"
            )
        hf = runner.model_config.hf_config
        check_served(args, hf)
        region_copying = tuple(
            f"{option}={getattr(args, option)!r} ({flag})"
            for option, off, flag in REGION_COPYING_OPTIONS
            if getattr(args, option, off) not in (off, None)
        )
        selection = os.environ.get(INDEXER_SELECTION_ENV, "exact")
        if selection not in INDEXER_SELECTIONS:
            raise ConfigError(
                f"{INDEXER_SELECTION_ENV}={selection!r}; expected one of {INDEXER_SELECTIONS}"
            )
        speculative = getattr(args, "speculative_algorithm", None) is not None
        # The config object itself (not to_dict()): its attributes are what sglang's model reads.
        # sglang's own reading of the window (its model config resolves the same keys).
        window = getattr(runner.model_config, "sliding_window_size", None)
        num_draft_tokens = int(getattr(args, "speculative_num_draft_tokens", 0) or 0)
        config = DSV4AttentionConfig.from_hf_config(
            hf,
            {"window_size": window},
            speculative=speculative,
            num_draft_tokens=num_draft_tokens if speculative else 0,
            indexer_selection=selection,
        )
        layers = None
        if config.v41 is not None:
            check_served(args, hf, v41=True)
            # sglang's V4.1 model writes a CP prefill's window keys into its pool itself
            # (--enable-prefill-cp before attn_cp_size resolves, as its V4.1 hook reads it).
            if getattr(args, "enable_prefill_cp", False) or (
                int(getattr(args, "attn_cp_size", 1) or 1) > 1
            ):
                region_copying += (V41_CP_WINDOW_WRITES,)
        if getattr(runner, "is_draft_worker", False):
            # The draft (MTP) model has one window-only layer, layer_id 0.
            config = dataclasses.replace(config, compress_ratios=(0,), v41=None)
        elif getattr(runner, "layer_info", None) is not None:  # sglang's ModelLayerInfo
            info = runner.layer_info
            layers = stage_layers(config, range(info.start_layer, info.end_layer))
        attn_dp_size = int(getattr(args, "attn_dp_size", 1) or 1)
        if attn_dp_size == 1 and getattr(args, "enable_dp_attention", False):
            # The deprecated spelling, before sglang resolves it to attn_dp_size.
            attn_dp_size = int(getattr(args, "dp_size", 1) or 1)
        attn_cp_size = int(getattr(args, "attn_cp_size", 1) or 1)
        if attn_cp_size > 1 and not getattr(args, "enable_prefill_cp", False):
            raise ConfigError(
                f"attn_cp_size={attn_cp_size} without --enable-prefill-cp: the dsv4 backend "
                "serves context parallelism as sglang's DeepSeek-V4 prefill CP (--enable-prefill-"
                "cp --cp-strategy interleave, --attention-context-parallel-size)"
            )
        attn_tp_size = derive_attn_tp_size(
            tp_size=int(getattr(args, "tp_size", 1) or 1),
            attn_cp_size=attn_cp_size,
            attn_dp_size=attn_dp_size,
        )
        decode_attn_tp_size = (
            attn_cp_size if getattr(args, "enable_cp_decode_attn_tp", False) else 1
        )
        if attn_tp_size < 1 or config.num_heads % (attn_tp_size * decode_attn_tp_size):
            raise ConfigError(
                f"num_attention_heads={config.num_heads} cannot be split over an attention "
                f"tensor-parallel group of {attn_tp_size} ranks (tp_size / attn_dp_size)"
                + (
                    f" and then over {decode_attn_tp_size} CP ranks (--enable-cp-decode-attn-tp)"
                    if decode_attn_tp_size > 1
                    else ""
                )
                + "; choose --tp-size / --attention-data-parallel-size so that it divides the "
                "heads"
            )
        algorithm = getattr(args, "speculative_algorithm", None)
        return cls(
            config=config,
            draft_topk=draft_topk,
            num_draft_tokens=num_draft_tokens,
            device=torch.device(runner.device),
            attn_tp_size=attn_tp_size,
            region_copying=region_copying,
            layers=layers,
            decode_attn_tp_size=decode_attn_tp_size,
            bounded_replay=not getattr(runner, "is_draft_worker", False)
            and bounded_replay(args, config),
            dspark=str(getattr(algorithm, "name", algorithm)).upper() == "DSPARK",
        )


class CudaStreams:
    """The two stream calls of sglang's multi-stream indexer path (``torch.cuda``): the
    current stream, and a context making another stream current. A backend's ``streams``
    attribute; tests swap in a recorder."""

    @staticmethod
    def current() -> Any:
        return torch.cuda.current_stream()

    @staticmethod
    def use(stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)


def shared_state(
    runner: ModelRunner,
    config: DSV4AttentionConfig,
    fmt: CacheFormat,
    region_copying: Sequence[str] = (),
    layers: range | None = None,
) -> AttentionState:
    """The runner's ``AttentionState`` of ``layers`` (a pipeline stage's; None: every layer),
    built on first use and kept on its KV pool.

    Sizes (``state_sizes``): full and window slots as sglang sizes its own buffers, c4 rings
    one per window page of 256 slots, c128 rings one per ``req_to_token`` row. Slot 0 is
    sglang's padding slot and stays addressable. With an fp8 format and an sglang
    ``DeepSeekV4TokenToKVPool`` the caches are views of that pool's buffers (``pool_alias``;
    ``ConfigError`` when one is too small), otherwise allocated; one INFO line says which.
    ``region_copying`` (the ``REGION_COPYING_OPTIONS`` set): ``ConfigError`` unless every
    cache and ring is such a view, naming what sglang's regions would not carry.
    """
    pool = runner.token_to_kv_pool
    state = getattr(pool, _STATE_ATTR, None)
    layers = stage_layers(config, layers)
    if state is not None:
        if state.config != config or state.pools.layers != layers:
            raise ConfigError(
                "backends of one runner disagree on the attention configuration: "
                f"{state.config} of layers {state.pools.layers} vs {config} of {layers}"
            )
        return state
    sizes = state_sizes(runner, config)
    reason = unaliasable_reason(pool, config, fmt, layers)
    if reason is None:
        state = aliased_state(pool, config, **sizes, layers=layers)
    else:
        state = AttentionState.allocate(
            config, **sizes, fmt=fmt, device=runner.device, layers=layers
        )
    log_state_memory(state, pool, reason)
    unmovable = unmovable_reason(state, pool, reason)
    if region_copying and unmovable:
        raise ConfigError(
            f"{', '.join(region_copying)}: sglang copies its DeepSeekV4TokenToKVPool's regions "
            f"between pools (or to host memory) or writes into them, and they would not hold the "
            f"dsv4 backend's state: {unmovable}. Serve these with fp8 caches over sglang's pool "
            "(V4 layout, paged window, offline fp32 c128 state), or leave the options unset"
        )
    setattr(pool, _STATE_ATTR, state)
    return state


class StateSizes(TypedDict):
    """The sizes ``AttentionState.allocate`` and ``aliased_state`` take."""

    num_full_slots: int
    num_swa_slots: int
    num_request_slots: int
    max_positions: int


def state_sizes(runner: ModelRunner, config: DSV4AttentionConfig) -> StateSizes:
    """``AttentionState`` sizes of ``runner``, as sglang sizes its pool's buffers.

    sglang's paged allocators hand out pages ``1 ... size / 256`` (page 0 is the padding page,
    ``PagedTokenToKVPoolAllocator.clear``), so slots reach ``size + 255`` on both sides (full
    ``full_size``, window ``swa_size``; ``size`` where a pool has no split) and sglang's buffers
    hold ``size + 256`` slots (``deepseek_v4_memory_pool._num_dsv4_physical_kv_pages``). Both
    are sized that way here, rounded up to whole pages; the c4 rings follow the window slots
    (``ring_slots``).
    """
    pool = runner.token_to_kv_pool
    page = config.page_size
    full = getattr(pool, "full_size", None) or pool.size
    swa = getattr(pool, "swa_size", None) or pool.size
    return StateSizes(
        num_full_slots=math.ceil((full + page) / page) * page,
        num_swa_slots=math.ceil((swa + page) / page) * page,
        num_request_slots=runner.req_to_token_pool.req_to_token.shape[0],
        max_positions=runner.req_to_token_pool.req_to_token.shape[1],
    )


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    """What the backend remembers of the batch its current plan was made for.

    ``inputs``: the planning inputs, matched by value against a batch object the consumers get
    that is not ``accepted`` (``PlanInputs``: sglang's eager runner forwards a copy of the
    planned batch, a draft step rebinds ``out_cache_loc``, data-parallel padding grows it).
    ``accepted``: the last ``ForwardBatch`` object matched (the planned one at first) and its
    ``req_pool_indices`` / ``seq_lens`` / ``out_cache_loc`` with their in-place versions: the
    same objects, unchanged, pass without a value check.
    """

    inputs: PlanInputs
    accepted: BatchTag


def _batch_objects(fb: Any) -> dict[str, Any]:
    """``fb`` and its three planning tensors, by the names ``BatchTag`` messages use."""
    return dict(
        forward_batch=fb,
        req_pool_indices=fb.req_pool_indices,
        seq_lens=fb.seq_lens,
        out_cache_loc=fb.out_cache_loc,
    )


def _kept(planned: torch.Tensor) -> torch.Tensor:
    """``planned`` itself, or a copy for an inference tensor: its in-place writes bump no
    version, so the values planned from must be kept apart (sglang's registry buffers are
    refilled by the next batch)."""
    return planned.clone() if planned.is_inference() else planned


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (no value check may run:
    it would be recorded into the graph)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _host_values(name: str, values: Any) -> list[int] | None:
    """``values`` as host ints when readable without a device sync, or in strict mode."""
    return readable_ints(name, values, sync_ok=strict_checks_enabled())


def _is_idle(fb: Any, rows: torch.Tensor, where: str) -> bool:
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


def _check_padding_slots(out_cache_loc: torch.Tensor, first: int, where: str) -> None:
    """Padding tokens (``out_cache_loc[first:]``) write slot 0, where readable without a sync:
    a real token taken for padding would write no key (``BatchError`` naming it)."""
    tail = _host_values("out_cache_loc", out_cache_loc[first:])
    bad = [(first + i, v) for i, v in enumerate(tail or ()) if v != 0]
    if bad:
        index, value = bad[0]
        raise BatchError(
            f"{where}: out_cache_loc[{index}]={value} is past the requests' rows, where only "
            "data-parallel padding tokens (slot 0) may be; check extend_seq_lens_cpu"
        )


def original_ape(compressor: Compressor) -> torch.Tensor:
    """``[r, c*D]`` float32 ape in checkpoint layout.

    sglang's ``Compressor._apply_ape_hotfix`` (``ape_converted``) stores a ratio-4 ape
    ``[4, 2D]`` as its two halves stacked, ``[2, 4, D]``; undo that.
    """
    ape = compressor.ape.float()
    if compressor.ratio == 4 and getattr(compressor, "ape_converted", False):
        ape = ape.reshape(2, 4, -1).permute(1, 0, 2).reshape(4, -1)
    return ape


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

    Raises ``ConfigError`` for page size != 256, EAGLE topk > 1, compress ratios other than
    0 / 4 / 128, a configuration of the refusal table (``refusals.REFUSED``: other attention
    kernels' pool layouts, DeepSeek-V4.1, state moved outside the backend, decode context
    parallelism, ...), attention CP without prefill CP, PD disaggregation or HiCache
    (``REGION_COPYING_OPTIONS``) over caches that are not views of sglang's pool, or heads
    that the attention TP group does not divide.

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
        self.forward_metadata: AttentionMetadata | None = None
        #: A prefill context-parallel rank's own rows of ``forward_metadata``, which its
        #: indexer and attention read (``planning.read_plan``); None for any other batch.
        self.cp_read_metadata: AttentionMetadata | None = None
        self.planned: PlannedBatch | None = None
        #: Device-side planning checks not read yet (CUDA without strict mode).
        self.pending_checks: list[PendingChecks] = []
        self.graph_buffers: GraphMetadataBuffers | None = None
        #: Columns of the graph buffers' ``swa_page_indices`` (None: the config's window).
        self.graph_swa_width: int | None = None
        self.streams = CudaStreams()
        self.bounded_replay, self.dspark = settings.bounded_replay, settings.dspark
        #: DeepSeek-V4.1's decoder SWA bounded replay: the late-layer tail of the extend planned
        #: last (None for other batches); the model reads its ``late_layer_tail``.
        self.tail_forward_metadata: TailForward | None = None
        #: The kv source whose compressor ``write_tail_source_kv`` ran over every row, until
        #: ``exit_late_layer_tail``: its pass inside the tail skips the compressor.
        self.tail_source_kv_layer_id: int | None = None
        self.in_late_layer_tail = False
        # The model writes window keys through store_cache only with this set (class docstring).
        envs.SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE.set(True)

    @classmethod
    def runner_settings(cls, model_runner: ModelRunner, topk: int = 0) -> RunnerSettings:
        """What this backend serves of ``model_runner`` (``RunnerSettings.from_runner``)."""
        return RunnerSettings.from_runner(model_runner, topk)

    # ------------------------------------------------------------------------- planning
    def _plan(
        self,
        forward_batch: ForwardBatch,
        buffers: GraphMetadataBuffers | None,
        graph: GraphCall | None = None,
    ) -> AttentionMetadata:
        """Plan ``forward_batch``: eager (``buffers`` None) or into the graph buffers (the
        same planning body), as the graph runner hands it (``graph``).

        A radix-cache hit is an EXTEND whose ``extend_prefix_lens`` is the cached, page-aligned
        prefix (sglang matches whole 256-token pages), in a fresh pool row whose
        ``req_to_token`` row points at the prefix's pages: it is planned like any extend. Its
        compressors read the prefix's last c4 block from the prefix's own window page (page-
        scoped rings) and nothing of the c128 ring (no c128 entry spans a page boundary), so
        nothing is reset: no forward reads a ring row it did not write.

        First raises the verdict of earlier batches' device-side checks that has reached the
        host (the next safe point after them, ``planning/checks.py``).
        """
        self.raise_pending_checks(wait=False)
        self.forward_metadata = self.planned = self.cp_read_metadata = None
        self.tail_forward_metadata, self.tail_source_kv_layer_id = None, None
        self.in_late_layer_tail = False
        view = batch_view(
            forward_batch,
            req_to_token=self.req_to_token_pool.req_to_token,
            full_to_swa=getattr(self.token_to_kv_pool, "full_to_swa_index_mapping", None),
            num_draft_tokens=self.num_draft_tokens,
            draft=self.draft_step,
            num_cache_slots=self.num_cache_slots,
            num_swa_slots=self.num_swa_slots,
            graph=graph,
        )
        metadata = self._plan_view(view, buffers)
        padding = padding_rows(forward_batch, view)
        if padding > 0:
            _check_padding_slots(forward_batch.out_cache_loc, view.num_rows, "plan")
            # Data-parallel padding tokens (EXTEND / DRAFT_EXTEND_V2, eager only): sentinel rows
            # that write nothing and output 0, as sglang's own backend plans them.
            metadata = pad_plan(
                self.config,
                metadata,
                batch_size=metadata.batch_size,
                num_rows=metadata.num_rows + padding,
            )
        if metadata.pending_checks is not None:
            self.pending_checks.append(metadata.pending_checks)
        cp_rows = cp_rank_rows(forward_batch, metadata.num_rows)
        if cp_rows is not None:  # the batch's plan writes; the rank's rows of it read
            rows, physical = cp_rows
            self.cp_read_metadata = read_plan(self.config, metadata, rows, num_rows=physical)
        self.planned = self._planned_batch(forward_batch, view)
        if (
            self.bounded_replay
            and buffers is None
            and view.kind is ForwardKind.EXTEND
            and forward_batch.forward_mode.is_extend_without_speculative()
        ):
            cp = None
            if cp_rows is not None:
                parallel = get_parallel()
                cp = (int(parallel.attn_cp_rank), int(parallel.attn_cp_size))
            tail = plan_tail(self.config, view, forward_batch, dspark=self.dspark, cp=cp)
            if tail.metadata.pending_checks is not None:
                self.pending_checks.append(tail.metadata.pending_checks)
            self.tail_forward_metadata = tail
        return metadata

    def _plan_view(
        self, view: BatchView, buffers: GraphMetadataBuffers | None
    ) -> AttentionMetadata:
        """The plan of ``view``: eager, or into the graph buffers."""
        return plan(self.config, view) if buffers is None else buffers.plan(view)

    def _forward_kind(self, forward_batch: ForwardBatch) -> ForwardKind:
        """The planner kind this backend plans ``forward_batch``'s mode as."""
        return forward_kind(forward_batch.forward_mode)

    def _planned_batch(self, fb: Any, view: BatchView) -> PlannedBatch:
        """What a consumer's batch is matched against (``PlannedBatch``): ``view``'s requests,
        and the rows' write slots as the forward's batch holds them (a draft step's own row
        of the ``[bs, topk, num_steps]`` layout; an extend kind's padding tokens included)."""
        loc, seq_lens = view.out_cache_loc, view.seq_lens
        seq_lens_cpu = view.host_seq_lens if view.seq_lens_cpu is not None else None
        if view.kind in (ForwardKind.EXTEND, ForwardKind.DRAFT_EXTEND):
            loc = fb.out_cache_loc
        elif view.draft is not None:
            loc = draft_step_slots(loc, view.batch_size, view.draft)
        if view.kind is ForwardKind.DRAFT_EXTEND:
            # A draft-extend graph's padding requests are planned longer than handed.
            seq_lens = fb.seq_lens[: view.batch_size]
            host = self._host_seq_lens(fb)
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

    def raise_pending_checks(self, wait: bool = True) -> None:
        """Raise ``BatchError`` for a failed device-side planning check of an earlier batch.

        ``wait=False`` reads only the verdicts already on the host (no sync); the sglang path
        calls it at every plan. A host may call it with ``wait=True`` at any safe point.
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

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Eager: plan ``forward_batch`` as it is now (after data-parallel padding)."""
        self.forward_metadata = self._plan(forward_batch, None)

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> None:
        """CUDA graphs: plan with fixed widths and load the plan into the graph buffers.

        The same planning body as eager. It runs outside the graph (before capture and before
        each replay), so every kind is accepted, not only ``GRAPH_KINDS`` (DECODE, draft steps,
        TARGET_VERIFY, IDLE: planned without a host sync): sglang 0.5.23 also graphs
        DRAFT_EXTEND_V2 batches (``eagle_draft_extend_cuda_graph_runner``), whose rows come
        from host lengths (``batch_view.draft_extend_graph_view``). Needs
        ``init_cuda_graph_state`` first.
        """
        if self.graph_buffers is None:
            raise ContractError(
                "init_forward_metadata_out_graph before init_cuda_graph_state: the graph "
                "buffers do not exist yet"
            )
        graph = GraphCall.CAPTURE if in_capture else GraphCall.REPLAY
        self.forward_metadata = self._plan(forward_batch, self.graph_buffers, graph)

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
        """The current plan, checked against this batch (``ContractError`` when stale).

        ``num_rows``: the rows the caller got (None when it has none to compare: then the
        batch's size, kind and values are checked). The planned object, or the last one
        matched, with its tensors unchanged passes at once; another object is matched by value
        (``_match``). Inside the late-layer tail the rows are the tail plan's: sglang's tail
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
        kind = self._forward_kind(forward_batch)
        if kind is not metadata.kind:
            raise ContractError(
                f"{where}: attention metadata was planned for {metadata.kind.name} but the batch "
                f"is {forward_batch.forward_mode.name}; plan each batch before its forward"
            )
        rows = metadata.num_rows if num_rows is None else num_rows
        if planned.accepted.mismatch(**_batch_objects(forward_batch)) is not None:
            metadata = self._match(forward_batch, planned, metadata, rows, where)
        metadata.check_matches(batch_size=forward_batch.batch_size, num_rows=rows, where=where)
        return metadata

    def _read_metadata(
        self, forward_batch: ForwardBatch, num_rows: int, where: str
    ) -> AttentionMetadata:
        """The plan the query side reads (indexer queries and top-k, attention), checked as
        ``_metadata`` checks it: the batch's plan, or on a prefill context-parallel rank its
        own rows of it (``cp_read_metadata``: ``num_rows`` local query rows)."""
        local = self.cp_read_metadata
        metadata = self._metadata(forward_batch, None if local is not None else num_rows, where)
        if local is None:
            return metadata
        local.check_matches(batch_size=forward_batch.batch_size, num_rows=num_rows, where=where)
        return local

    def _match(
        self,
        fb: ForwardBatch,
        planned: PlannedBatch,
        metadata: AttentionMetadata,
        num_rows: int,
        where: str,
    ) -> AttentionMetadata:
        """Accept ``fb`` (not the object last matched) for the plan when its planning inputs
        equal the planned ones (``PlanInputs``), and return the plan for it: grown by padding
        rows (they write nothing, output 0) when ``fb`` is the planned batch padded for
        data-parallel sync after planning, as sglang pads draft and draft-extend batches.

        ``ContractError`` for a plan of another batch: host lengths at once; device values at
        once on the CPU or in strict mode, else read at the next plan (``planning/checks.py``).
        During CUDA-graph capture only the shapes are checked.
        """
        stale = planned.inputs.stale() or planned.inputs.host_mismatch(self._host_seq_lens(fb))
        if stale is not None:
            raise self._stale(metadata, stale, where)
        capturing = _capturing()
        grown = fb.batch_size > metadata.batch_size or num_rows > metadata.num_rows
        may_grow = self._grows_after_planning(metadata) and not capturing
        shrunk = fb.batch_size < metadata.batch_size or num_rows < metadata.num_rows
        if shrunk or (grown and not may_grow):
            metadata.check_matches(batch_size=fb.batch_size, num_rows=num_rows, where=where)
        if not capturing:
            checks = planned.inputs.checks(
                req_pool_indices=fb.req_pool_indices,
                seq_lens=fb.seq_lens,
                out_cache_loc=None if self.in_late_layer_tail else fb.out_cache_loc[:num_rows],
            )
            try:
                pending = run_checks(
                    checks,
                    fb.seq_lens.device,
                    f"{where}'s batch against its plan",
                    error=ContractError,
                    consequence="the forward ran on that plan",
                )
            except ContractError as mismatch:
                raise self._stale(metadata, str(mismatch), where) from None
            if pending is not None:
                self.pending_checks.append(pending)
        if grown:
            metadata = pad_plan(self.config, metadata, batch_size=fb.batch_size, num_rows=num_rows)
            self.forward_metadata = metadata
        self.planned = dataclasses.replace(planned, accepted=BatchTag(**_batch_objects(fb)))
        return metadata

    def _grows_after_planning(self, metadata: AttentionMetadata) -> bool:
        """Whether sglang pads batches of this plan's kind after planning them: the EAGLE v2
        worker plans and marks its draft batch (``eagle_worker_v2.py`` ``draft``) and its draft
        extend (``_draft_extend_for_decode``) before ``ModelRunner.forward``, whose
        ``_prepare_eager_forward_batch`` pads for data-parallel sync. Every other kind is
        planned after padding (the lazy-init contract), so a grown batch is a stale plan."""
        return metadata.kind is ForwardKind.DRAFT_EXTEND or self.draft_step is not None

    @staticmethod
    def _stale(metadata: AttentionMetadata, mismatch: str, where: str) -> ContractError:
        return ContractError(
            f"{where}: the attention metadata ({metadata.kind.name}, batch_size="
            f"{metadata.batch_size}, num_rows={metadata.num_rows}) was made for another batch: "
            f"{mismatch}. Plan every batch before its forward (init_forward_metadata after "
            "padding, or init_forward_metadata_out_graph)."
        )

    @staticmethod
    def _host_seq_lens(fb: Any) -> list[int] | None:
        """``fb``'s ``seq_lens_cpu`` as host ints (None when absent)."""
        return readable_ints("seq_lens_cpu", getattr(fb, "seq_lens_cpu", None))

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
            loc = forward_batch.out_cache_loc
            if loc is None:
                return torch.zeros(0, dtype=torch.int32, device=self.device)
            mapping = getattr(self.token_to_kv_pool, "full_to_swa_index_mapping", None)
            return (loc if mapping is None else mapping[loc.long()]).to(torch.int32)
        rows = forward_batch.out_cache_loc.shape[0]
        if self.draft_step is not None or self.in_late_layer_tail:  # not out_cache_loc's rows
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
        if _is_idle(forward_batch, swa_k, where):
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
        if _is_idle(forward_batch, x, where):
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
        metadata = self._metadata(forward_batch, kv_score.shape[0], where)
        half = kv_score.shape[-1] // 2
        compress_and_store(
            self.state,
            layer_id,
            metadata,
            forward_batch.req_pool_indices,
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

        Streams, as sglang's ``C4IndexerBackendMixin``: with ``enable_multi_stream`` the model
        calls this on its indexer stream *before* ``q_lora`` is computed, handing the event
        ``q_lora_ready``; the compressor runs on the current stream, the head weights on
        ``alt_streams[1]``, the queries on ``alt_streams[0]`` after waiting for
        ``q_lora_ready`` (and the weights), and the current stream joins ``alt_streams[0]``
        before the top-k. ``q_lora_ready`` without ``enable_multi_stream`` is a
        ``ContractError`` (sglang asserts it is None).
        """
        if _is_idle(forward_batch, x, "c4 indexer"):
            return
        layer_id = c4_indexer.layer_id
        where = f"c4 indexer (layer {layer_id})"
        if self._enter_layer(layer_id, where) != 4:
            raise ContractError(
                f"{where}: layer {layer_id} has compress ratio "
                f"{self.config.compress_ratios[layer_id]}; the indexer runs on ratio-4 layers"
            )
        metadata = self._read_metadata(forward_batch, x.shape[0], where)
        if not enable_multi_stream and q_lora_ready is not None:
            raise ContractError(
                f"{where}: q_lora_ready given without enable_multi_stream; the event belongs to "
                "the multi-stream path (sglang asserts it is None otherwise)"
            )
        if enable_multi_stream:
            if alt_streams is None or len(alt_streams) < 2:
                raise ContractError(
                    f"{where}: enable_multi_stream needs two alt_streams (queries, weights), "
                    f"got {alt_streams!r}"
                )
            streams = self.streams
            current = streams.current()
            stream_q, stream_weights = alt_streams[0], alt_streams[1]
            stream_q.wait_stream(current)
            stream_weights.wait_stream(current)
            if not skip_compressor:
                self._compress(x, forward_batch, layer_id, c4_indexer.compressor, where)
            with streams.use(stream_weights):
                weights = self._index_weights(c4_indexer, x)
                weights_ready = stream_weights.record_event()
            with streams.use(stream_q):
                if q_lora_ready is not None:
                    stream_q.wait_event(q_lora_ready)
                stream_q.wait_event(weights_ready)
                q = self._index_queries(c4_indexer, q_lora, metadata)
            current.wait_stream(stream_q)
        else:
            if not skip_compressor:
                self._compress(x, forward_batch, layer_id, c4_indexer.compressor, where)
            weights = self._index_weights(c4_indexer, x)
            q = self._index_queries(c4_indexer, q_lora, metadata)
        select_c4_entries(self.state, layer_id, metadata, q, weights)

    @staticmethod
    def _index_weights(c4_indexer: C4Indexer, x: torch.Tensor) -> torch.Tensor:
        """``[T, HI]`` float32 head weights: the projection times ``weight_scale`` in fp32."""
        return c4_indexer.compute_weights(x, skip_scale=True).float() * c4_indexer.weight_scale

    def _index_queries(
        self, c4_indexer: C4Indexer, q_lora: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """``[T, HI, DI]`` float32 indexer queries, roped at each row's position."""
        q, _ = c4_indexer.wq_b(q_lora)
        q = q.view(q.shape[0], c4_indexer.n_heads, c4_indexer.head_dim)
        cos, sin = self.state.rope.cos_sin(metadata.positions_causal)
        return apply_rope(q, cos, sin)

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
        if _is_idle(forward_batch, x, where):
            return
        metadata = self._read_metadata(forward_batch, x.shape[0], where)
        if positions.shape[0] != x.shape[0]:
            raise ContractError(
                f"{where}: positions has {positions.shape[0]} rows but x has {x.shape[0]}"
            )
        compressor, indexer = layer.compressor, layer.indexer
        if layer_id == self.tail_source_kv_layer_id:  # write_tail_source_kv compressed it
            run_compressor = False
        if run_compressor and compressor is not None:
            written, write_plan = x, metadata
            if self.cp_read_metadata is not None:  # a CP rank: every rank writes every entry
                write_plan = self._metadata(forward_batch, None, where)
                written = cp_all_rows(x, forward_batch, write_plan.num_rows)
            kv, score = compressor.project(written)
            keys = None
            if indexer is not None and indexer.owns_k:
                k_norm = indexer.k_norm
                keys = (indexer.wk.weight, k_norm.weight.float(), float(k_norm.eps))
            compress_low_ratio(
                self.state, layer_id, write_plan, forward_batch.req_pool_indices,
                kv.float(), None if score is None else score.float(),
                compressor.norm.weight.float(), float(compressor.norm.eps),
                index_key_params=keys,
            )  # fmt: skip
        if run_indexer and indexer is not None:
            if q_lora is None:
                raise ContractError(f"{where}: the indexer needs q_lora, got None")
            q, _ = indexer.wq_b(q_lora)
            q = q.view(q.shape[0], indexer.n_local_heads, indexer.index_head_dim)
            weights = indexer.head_weights_raw(x).float() * indexer.head_weight_scale
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
                layer=layer, x=x, q_lora=None, positions=positions, forward_batch=forward_batch,
                run_indexer=False,
            )  # fmt: skip
        self.tail_source_kv_layer_id = layer.layer_id

    def enter_late_layer_tail(self, forward_batch: ForwardBatch) -> tuple[Any, ...]:
        """Make the tail's plan current: the late layers run over the tail rows
        (``tail_forward_metadata.late_layer_tail``); returns what ``exit_late_layer_tail``
        restores."""
        tail = self.tail_forward_metadata
        if tail is None or self.in_late_layer_tail:
            raise ContractError(
                "enter_late_layer_tail: no late-layer tail was planned for this batch (an extend "
                "under --enable-decoder-swa-bounded-replay, planned by init_forward_metadata), "
                "or the tail is entered already"
            )
        cp_metadata = tail.late_layer_tail.cp_metadata
        cp_saved = None
        if cp_metadata is not None:  # the collectives gather the tail rows (as sglang swaps)
            cp_saved = (forward_batch.attn_cp_metadata, get_local_dp_buffer_len())
            forward_batch.attn_cp_metadata = cp_metadata
            set_local_dp_buffer_len(sum(cp_metadata.per_rank_actual_token))
        saved = (self.forward_metadata, self.cp_read_metadata, cp_saved)
        self.forward_metadata, self.cp_read_metadata = tail.metadata, tail.cp_read
        self.in_late_layer_tail = True
        return saved

    def exit_late_layer_tail(self, saved: tuple[Any, ...], forward_batch: ForwardBatch) -> None:
        """Restore the extend's plan (and a CP rank's layout) ``enter_late_layer_tail`` saved."""
        self.forward_metadata, self.cp_read_metadata, cp_saved = saved
        if cp_saved is not None:
            forward_batch.attn_cp_metadata, dp_buffer_len = cp_saved
            set_local_dp_buffer_len(dp_buffer_len)
        self.in_late_layer_tail = False
        self.tail_source_kv_layer_id = None

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
        if _is_idle(forward_batch, q, "forward"):
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
        if attn_sink is None:
            raise ContractError(f"{where}: attn_sink is required (the per-head sink logits)")
        head_dim = self.config.head_dim
        if q.dim() == 2 and q.shape[1] % head_dim == 0:
            q = q.view(q.shape[0], -1, head_dim)
        if q.dim() != 3 or q.shape[2] != head_dim:
            raise ContractError(
                f"{where}: q has shape {tuple(q.shape)}; expected [T, H, {head_dim}] or "
                f"[T, H * {head_dim}] (head_dim={head_dim})"
            )
        if attn_sink.shape != (q.shape[1],):
            raise ContractError(
                f"{where}: attn_sink has shape {tuple(attn_sink.shape)}; expected one logit per "
                f"query head, ({q.shape[1]},)"
            )
        metadata = self._read_metadata(forward_batch, q.shape[0], where)
        # A CP prefill keeps every head of the rank; other batches may split them further.
        heads = self.local_heads if self.cp_read_metadata is not None else self.split_heads
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
