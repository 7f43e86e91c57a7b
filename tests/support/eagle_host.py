"""sglang 0.5.23's EAGLE v2 host on the CPU around this backend, shared by the host tests
(``adapter/test_host_eager_eagle.py``, ``test_host_draft_graphs.py``,
``test_host_dspark_proposer.py``).

sglang's own code does the work wherever it runs on the CPU: a real ``ModelRunner`` (``__new__``)
with its ``EagerRunner``, the ``EagleDraftWorker`` functions called unbound on a namespace
``self`` (``worker``), ``ForwardBatch.init_mlp_sync_metadata``, sglang's cache-location kernels
in the Triton interpreter.

Stand-ins, where sglang's code needs what the CPU has not: ``init_new`` (sglang's
``ForwardBatch.init_new`` reads a whole ``ScheduleBatch``: requests, sampling, the KV
translator), ``schedule_batch`` (the ``ScheduleBatch`` fields the worker functions read),
``build_eagle_verify_input`` (the tree build of ``build_eagle_verify_input``), and the model
(``HostModel``: sglang's ``DeepseekV4ForCausalLM.forward`` cannot be built on the CPU; it reads the
backend from the forward context as sglang's model does and runs ``SimulatedModel.layer``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_uniform
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    clamp_position,
    compute_position_torch,
)
from sglang.srt.model_executor.forward_context import (
    ForwardContext,
    forward_context,
    get_attn_backend,
    get_forward_context,
    has_forward_context,
    set_forward_context,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.runner.eager_runner import EagerRunner
from sglang.srt.runtime_context import get_context
from sglang.srt.speculative import eagle_worker_v2
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.eagle_utils import (
    eagle_prepare_for_verify,
    per_step_draft_out_cache_loc,
)
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.planning import AttentionMetadata
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.sglang_adapter.draft import DSV4MultiStepDraftBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
ATOL = 2e-5
TOPK, NUM_STEPS, NUM_DRAFT = 1, 3, 4
VOCAB, HIDDEN = 16, 8
PAGE = CONFIG.page_size
#: Requests and room: 124 crosses the window and a c128 block at 128, 250 the page at 256,
#: 7 starts inside the first c4 block.
LENS, MAX_LENS = [124, 250, 7], [150, 280, 40]
#: Requests another data-parallel rank has more than this one (``prepare_mlp_sync_batch`` pads
#: this rank's batch up to them).
DP_EXTRA_REQUESTS = 2
#: Tokens the other rank's prefill has more than this one's.
DP_EXTRA_TOKENS = 3


# ----------------------------------------------------------------------------- the server
class PinlessTorch:
    """``torch`` for sglang's forward_batch_info module, with ``tensor(..., pin_memory=...)``
    unpinned: ``prepare_mlp_sync_batch`` pins its count tensor unless sglang runs as its CPU
    build (``use_pin_memory = not _is_cpu``), and this machine has neither CUDA nor that build
    (no pinned-memory allocator). Everything else is torch's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, **kwargs)


@contextlib.contextmanager
def eagle_server(monkeypatch: pytest.MonkeyPatch, **server_args: Any) -> Iterator[None]:
    """sglang's runtime context as a one-rank CPU EAGLE server publishes it (``get_spec()``,
    ``get_parallel()``, ``get_exec()`` read by the runners, the worker functions and
    ``prepare_mlp_sync_batch``): without CUDA graphs unless ``server_args`` say otherwise
    (``cuda_graph_config``, data-parallel attention). The kernels run their torch path and
    sglang's forward_batch_info module gets ``PinlessTorch``."""
    monkeypatch.setattr(forward_batch_info, "torch", PinlessTorch())
    disabled = PhaseConfig(backend=Backend.DISABLED)
    fields: dict[str, Any] = dict(
        device="cpu",
        page_size=PAGE,
        cuda_graph_config=CudaGraphConfig(decode=disabled, prefill=dataclasses.replace(disabled)),
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=TOPK,
        speculative_num_steps=NUM_STEPS,
        speculative_num_draft_tokens=NUM_DRAFT,
    )
    fields.update(server_args)
    override = get_context().override_server_args(**fields)
    override.install()
    try:
        with force_path("torch"):
            yield
    finally:
        override.restore()


# ---------------------------------------------------------------------------- the host
#: The batch tensors a ``Forward`` keeps the values of (the eager runner's copy is a view of
#: buffers that the next ``load_batch`` refills).
KEPT = ("req_pool_indices", "seq_lens", "out_cache_loc", "positions")


@dataclass
class Forward:
    """One call of the model: the batch it was handed (and the ``KEPT`` values it held then),
    the backend it found in the forward context, its rows and each layer's attention output."""

    batch: ForwardBatch
    backend: Any
    rows: list[harness.Row]
    values: dict[str, torch.Tensor]
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)


class HostModel:
    """Stand-in for sglang's ``DeepseekV4ForCausalLM`` (models/deepseek_v4.py), which the CPU
    cannot build: ``forward(input_ids, positions, forward_batch)`` takes the attention backend
    from the forward context (``get_attn_backend()``, as the model's attention does) and runs
    each layer's backend calls (``SimulatedModel.layer``) on the batch it was handed.

    ``requests``: the request of each real row of the next forwards, set by the test; the rows'
    positions are read from the handed batch, and rows past them are padding (at position 0,
    or, in a draft graph's padding requests, at the step's own position)."""

    shared_experts_config = None

    def __init__(self, sim: harness.SimulatedModel, *, draft: bool) -> None:
        self.sim = sim
        self.draft = draft
        self.requests: list[int] = []
        self.forwards: list[Forward] = []

    def layers(self, fb: ForwardBatch) -> Sequence[int]:
        """The draft (MTP) model's extend runs the window layer only, as in test_eagle_loop."""
        if self.draft and fb.forward_mode == ForwardMode.DRAFT_EXTEND_V2:
            return [0]
        return range(len(CONFIG.compress_ratios))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        **_: Any,
    ) -> LogitsProcessorOutput:
        backend = get_attn_backend()
        num_rows = input_ids.shape[0]
        real = [] if forward_batch.forward_mode.is_idle() else self.requests
        assert len(real) <= num_rows, (len(real), num_rows)
        at = positions.tolist()
        rows: list[harness.Row] = [(r, p) for r, p in zip(real, at, strict=False)]
        rows += [None] * (num_rows - len(real))
        values = {name: getattr(forward_batch, name).clone() for name in KEPT}
        record = Forward(forward_batch, backend, rows, values)
        self.forwards.append(record)
        for layer in self.layers(forward_batch):
            record.outputs[layer] = self.sim.layer(
                backend, harness.Step(forward_batch, rows), layer
            )
        return LogitsProcessorOutput(
            next_token_logits=torch.zeros(num_rows, VOCAB),
            hidden_states=torch.zeros(num_rows, HIDDEN),
        )


def check_forward(sim: harness.SimulatedModel, record: Forward) -> None:
    """Every real row equals the full causal pass; every padding row outputs 0."""
    padding = [i for i, row in enumerate(record.rows) if row is None]
    for layer, out in record.outputs.items():
        assert out.shape[0] == len(record.rows)
        error = sim.max_error(record.rows, layer, out)
        assert error <= ATOL, (record.batch.forward_mode.name, layer, error)
        if padding:
            assert out[padding].abs().max() == 0, (record.batch.forward_mode.name, layer)


def model_runner(
    ns: SimpleNamespace, backend: Any, model: Any, *, is_draft_worker: bool
) -> ModelRunner:
    """A real ``ModelRunner`` (``__new__``) with the attributes ``forward`` / ``_forward_raw`` /
    ``_prepare_eager_forward_batch`` and the ``EagerRunner`` constructor read, and its own
    ``EagerRunner`` (sglang's constructor: the eager input registry)."""
    mr = ModelRunner.__new__(ModelRunner)
    vars(mr).update(vars(ns))
    hf_config = _CONFIG_REGISTRY["deepseek_v4"](**harness.tiny_hf_config(CONFIG))
    if is_draft_worker:
        hf_config.architectures = ["DeepseekV4ForCausalLMNextN"]
    vars(mr).update(
        attn_backend=backend,
        model=model,
        is_draft_worker=is_draft_worker,
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        model_config=SimpleNamespace(
            hf_config=hf_config,
            is_draft_model=is_draft_worker,
            linear_attn_registry_result=None,
            context_len=ns.model_config.context_len,
            is_encoder_decoder=False,
            model_is_mrope=False,
            vocab_size=VOCAB,
            spec_hidden_size=HIDDEN,
            dtype=torch.float32,
        ),
        max_running_requests=8,
        max_total_num_tokens=ns.token_to_kv_pool.full_size,
        forward_pass_id=0,
        msprobe_debugger=None,
        canary_manager=None,
        enable_elastic_ep=False,
        eplb_manager=None,
        decode_cuda_graph_runner=None,
        prefill_cuda_graph_runner=None,
        hisparse_coordinator=None,
        lora_manager=None,
        support_pp=False,
        device_timer=None,
        is_generation=True,
        kv_index_translator=None,
        pp_group=SimpleNamespace(is_last_rank=True),
    )
    mr.eager_runner = EagerRunner(mr, run_warmup=False)
    return mr


def untranslating_translator(runner: Any) -> KVIndexTranslator:
    """sglang's ``KVIndexTranslator`` for ``runner`` over a pool without a translating allocator
    (mem_cache/kv_index_translator.py): write ids are the virtual ids as they are (a graph
    runner's capture batch binds its own buffer through it, ``bind_runner_slots``)."""
    return KVIndexTranslator(
        req_to_token=runner.req_to_token_pool.req_to_token,
        token_to_kv_pool_allocator=SimpleNamespace(),
        token_to_kv_pool=runner.token_to_kv_pool,
        page_size=PAGE,
        device="cpu",
        is_draft_worker=True,
    )


class Host:
    """One model's target and draft runners over one pool, as an EAGLE v2 server holds them:
    the target backend, the multi-step draft backend and the draft runner's (draft-extend)
    backend share one state (as in test_eagle_loop). ``dp``: this rank is padded by
    data-parallel sync to ``DP_EXTRA_REQUESTS`` more requests (``DP_EXTRA_TOKENS`` more prefill
    tokens) than it has."""

    def __init__(self, *, dp: bool = False, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.pool = PagedRequestPool(CONFIG, MAX_LENS, generator=generator)
        # sglang's padding page: full page 0 is window page 0 (its SWA allocator hands out
        # neither), and no request holds it.
        assert torch.equal(self.pool.full_to_swa[:PAGE], torch.arange(PAGE))
        for request, n in enumerate(MAX_LENS):
            assert (self.pool.slots(request, range(n)) >= PAGE).all()
        self.model = RandomModel(CONFIG, self.pool, generator=generator)
        self.sim = harness.SimulatedModel(self.model)
        self.batches = harness.BatchBuilder(self.pool)
        ns = harness.mock_runner(
            self.pool, harness.tiny_hf_config(CONFIG), num_steps=NUM_STEPS,
            num_draft_tokens=NUM_DRAFT,
        )  # fmt: skip
        self.target = DSV4AttentionBackend(ns, cache_format="dense")
        ns.attn_backend = self.target
        self.draft = DSV4MultiStepDraftBackend(ns, TOPK, NUM_STEPS, cache_format="dense")
        self.draft_extend = DSV4AttentionBackend(ns, cache_format="dense")
        #: Every ``init_forward_metadata`` call, in order.
        self.plans: list[Plan] = []
        for backend in (self.target, self.draft_extend, *self.draft.attn_backends):
            spy_on_plans(backend, self.plans)
        self.target_model = HostModel(self.sim, draft=False)
        self.draft_model = HostModel(self.sim, draft=True)
        self.target_runner = model_runner(ns, self.target, self.target_model, is_draft_worker=False)
        self.draft_runner = model_runner(
            ns, self.draft_extend, self.draft_model, is_draft_worker=True
        )
        self.req_to_token_pool = ns.req_to_token_pool
        self.dp = dp
        self.requests = list(range(len(LENS)))
        self.lens = list(LENS)
        self.worker = draft_worker(self)
        self.target_worker = SimpleNamespace(
            model_runner=self.target_runner,
            pp_group=SimpleNamespace(is_last_rank=True),
            is_dllm=lambda: False,
        )

    def planned(self, since: int) -> list[tuple[Any, ForwardBatch]]:
        """``(backend, batch)`` of the plans made since there were ``since``."""
        return [(plan.backend, plan.batch) for plan in self.plans[since:]]

    @property
    def forwards(self) -> list[Forward]:
        return self.target_model.forwards + self.draft_model.forwards

    def check(self) -> int:
        """Check every forward so far (``check_forward``); returns how many there were."""
        for record in self.forwards:
            check_forward(self.sim, record)
        return len(self.forwards)

    def dp_requests(self) -> list[int] | None:
        """``ScheduleBatch.global_num_tokens`` of a decode-family round (request counts)."""
        return [len(self.requests) + DP_EXTRA_REQUESTS] if self.dp else None

    # ------------------------------------------------------------------------- flows
    def prefill(self) -> None:
        """EXTEND through ``ModelRunner.forward`` (unmarked: the eager runner plans the copy
        it made; DP: padded with whole tokens first)."""
        step = self.batches.extend(self.requests, [0] * len(self.lens), self.lens)
        fb = step.batch
        tokens = fb.out_cache_loc.numel()
        if self.dp:
            sync_metadata(fb, [tokens + DP_EXTRA_TOKENS], extend=True)
        self.target_model.requests = [row[0] for row in step.rows]
        plans = len(self.plans)
        self.target_runner.forward(fb)
        record = self.target_model.forwards[-1]
        assert self.planned(plans) == [(self.target, record.batch)]
        assert len(record.rows) == tokens + (DP_EXTRA_TOKENS if self.dp else 0)

    def round(self, accept_lens: Sequence[int]) -> None:
        """Draft (``EagleDraftWorker.draft``), verify (``eagle_prepare_for_verify`` then
        ``TpModelWorker.forward_batch_generation``), draft extend (``_draft_extend_for_decode``),
        then one target decode (``ModelRunner.forward``) of the next token. ``accept_lens[b]``:
        verify tokens request ``b`` commits (1 ... ``NUM_DRAFT``, the bonus token included).

        Checks where each batch was planned and what reached the model: the draft batch and the
        draft extend planned (and marked) before ``ModelRunner.forward``, the model handed the
        eager runner's copy (grown by data-parallel padding on a ``dp`` host); verify and decode
        unmarked, planned by the eager runner on its copy after the padding."""
        bs, pad = len(self.requests), DP_EXTRA_REQUESTS if self.dp else 0
        batch = schedule_batch(self, ForwardMode.DECODE)
        batch.spec_info = draft_input(bs)
        graphs = self.worker.cuda_graph_runner_for_draft_extend
        # Under DP attention every rank must agree to replay (prepare_mlp_sync_batch).
        batch.can_run_decode_cuda_graph = graphs is not None
        self.draft_model.requests = list(self.requests)
        plans, forwards = len(self.plans), len(self.draft_model.forwards)
        verify_input = EagleDraftWorker.draft(self.worker, batch)
        attending = self.draft.attending_backends
        assert [backend for backend, _ in self.planned(plans)] == attending
        draft_fb = self.plans[plans].batch
        assert all(fb is draft_fb for _, fb in self.planned(plans))
        per_step = per_step_draft_out_cache_loc(batch.out_cache_loc, bs, TOPK, NUM_STEPS)
        steps = self.draft_model.forwards[forwards:]
        assert [r.backend for r in steps] == attending
        for i, record in enumerate(steps):
            assert record.batch is not draft_fb and len(record.rows) == bs + pad
            loc = record.values["out_cache_loc"]
            assert torch.equal(loc[:bs], per_step[i]) and not loc[bs:].any()

        self.target_model.requests = [r for r in self.requests for _ in range(NUM_DRAFT)]
        batch.spec_info = verify_input  # as EAGLEWorkerV2.forward_batch_generation installs it
        verify_fb, can_run_cuda_graph = eagle_prepare_for_verify(
            verify_input, self.req_to_token_pool, batch, self.target_worker
        )
        assert not can_run_cuda_graph and verify_fb.needs_forward_metadata_init()
        plans = len(self.plans)
        result = TpModelWorker.forward_batch_generation(
            self.target_worker, batch=None, forward_batch=verify_fb, is_verify=True
        )
        record = self.target_model.forwards[-1]
        assert self.planned(plans) == [(self.target, record.batch)]  # the copy, after padding
        assert len(record.rows) == (bs + pad) * NUM_DRAFT

        result.accept_lens = torch.tensor(list(accept_lens))
        result.next_token_ids = torch.zeros(bs * NUM_DRAFT, dtype=torch.int64)
        result.next_draft_input = SimpleNamespace()
        self.draft_model.requests = list(self.target_model.requests)
        plans = len(self.plans)
        EagleDraftWorker._draft_extend_for_decode(self.worker, batch, result)
        assert result.next_draft_input.topk_index.shape == (bs, TOPK)
        record = self.draft_model.forwards[-1]
        if graphs is None:
            assert [backend for backend, _ in self.planned(plans)] == [self.draft_extend]
            assert self.plans[plans].batch is not record.batch  # planned, marked, then copied
            assert len(record.rows) == (bs + pad) * NUM_DRAFT
        else:  # replayed: planned by the runner's execute (init_forward_metadata_out_graph)
            assert not self.planned(plans)
            assert len(record.rows) == graphs.bs * NUM_DRAFT

        self.lens = [n + a + 1 for n, a in zip(self.lens, accept_lens, strict=True)]
        step = self.batches.decode(self.requests, self.lens)
        sync_metadata(step.batch, self.dp_requests())
        self.target_model.requests = list(self.requests)
        plans = len(self.plans)
        self.target_runner.forward(step.batch)
        record = self.target_model.forwards[-1]
        assert self.planned(plans) == [(self.target, record.batch)]
        assert len(record.rows) == bs + pad


class Plan(NamedTuple):
    """One ``init_forward_metadata`` call: the backend, the batch, and the ``PLANNED`` values
    the batch held then."""

    backend: Any
    batch: ForwardBatch
    values: dict[str, torch.Tensor]


PLANNED = ("req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc", "positions")


def spy_on_plans(backend: DSV4AttentionBackend, log: list[Plan]) -> None:
    """Log a ``Plan`` for each ``backend.init_forward_metadata`` call (then plan)."""
    plan = backend.init_forward_metadata

    def logged(forward_batch: ForwardBatch) -> None:
        values = {name: getattr(forward_batch, name).clone() for name in PLANNED}
        log.append(Plan(backend, forward_batch, values))
        plan(forward_batch)

    backend.init_forward_metadata = logged  # type: ignore[method-assign]


def draft_worker(host: Host) -> SimpleNamespace:
    """The ``EagleDraftWorker`` attributes ``draft``, ``draft_forward`` and
    ``_draft_extend_for_decode`` read (speculative/eagle_worker_v2.py), its methods bound."""
    max_bs = 8
    worker = SimpleNamespace(
        req_to_token_pool=host.req_to_token_pool,
        cuda_graph_runner=None,
        cuda_graph_runner_for_draft_extend=None,
        draft_runner=host.draft_runner,
        draft_attn_backend=host.draft,
        target_worker=SimpleNamespace(model_runner=SimpleNamespace(kv_index_translator=None)),
        topk=TOPK,
        speculative_num_steps=NUM_STEPS,
        speculative_num_draft_tokens=NUM_DRAFT,
        seed_dsa_topk_from_draft_extend=False,
        index_share_for_mtp_iteration=False,
        hot_token_id=None,
        tree_mask_mode=None,
        device="cpu",
        plan_stream=None,
        plan_stream_ctx=contextlib.nullcontext(),
        _topk1_parents_prealloc=torch.zeros(max_bs, NUM_STEPS, dtype=torch.int64),
        _topk1_score_indices_prealloc=torch.zeros(max_bs, NUM_STEPS, dtype=torch.int64),
    )
    worker.draft_forward = types.MethodType(EagleDraftWorker.draft_forward, worker)
    worker._draft_forward_idle = types.MethodType(EagleDraftWorker._draft_forward_idle, worker)
    return worker


def schedule_batch(host: Host, mode: ForwardMode) -> SimpleNamespace:
    """Stand-in for the ``ScheduleBatch`` (managers/schedule_batch.py) of the running requests:
    the fields ``prepare_for_draft``, ``eagle_prepare_for_verify``, ``prepare_for_draft_extend``
    and ``init_new`` read. ``global_num_tokens``: the data-parallel request counts."""
    pool = host.pool
    seq_lens = torch.tensor(host.lens, dtype=torch.int64)
    global_num_tokens = host.dp_requests()
    return SimpleNamespace(
        forward_mode=mode,
        reqs=[None] * len(host.requests),
        req_pool_indices=torch.tensor([pool.pool_index(r) for r in host.requests]),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        seq_lens_sum=None,
        input_ids=None,
        out_cache_loc=None,
        out_cache_loc_dsv4=None,
        spec_info=None,
        device="cpu",
        multimodal_inputs=[None] * len(host.requests),
        token_to_kv_pool_allocator=SimpleNamespace(page_size=PAGE),
        req_to_token_pool=host.req_to_token_pool,
        model_config=SimpleNamespace(vocab_size=VOCAB),
        hisparse_coordinator=None,
        mamba_track_indices=None,
        sampling_info=SimpleNamespace(is_all_greedy=True),
        has_grammar=False,
        is_extend_in_batch=False,
        global_num_tokens=global_num_tokens,
        global_num_tokens_for_logprob=global_num_tokens,
        draft_global_num_tokens=None,
        dp_spec_prefill_coordination_applied=False,
        can_run_decode_cuda_graph=False,
        can_run_dp_draft_cuda_graph=False,
    )


def draft_input(bs: int) -> EagleDraftInput:
    """sglang's ``EagleDraftInput`` of a round (topk 1): what the previous draft extend left
    (``topk_p``, ``topk_index``, ``hidden_states``), one row per request."""
    return EagleDraftInput(
        topk_p=torch.ones(bs, TOPK),
        topk_index=torch.zeros(bs, TOPK, dtype=torch.int64),
        hidden_states=torch.zeros(bs, HIDDEN),
    )


def init_new(
    cls: type[ForwardBatch], batch: SimpleNamespace, model_runner: Any, **_: Any
) -> ForwardBatch:
    """Stand-in for ``ForwardBatch.init_new`` (model_executor/forward_batch_info.py, lines
    958-1304) for the fields the backend and the eager path read: the core tensors aliased
    from the ``ScheduleBatch`` (``cls(...)``, lines 1039-1050), the data-parallel counts by
    sglang's own ``init_mlp_sync_metadata`` (line 1172), ``positions`` from
    ``spec_info.positions`` or sglang's ``clamp_position`` (decode / verify, lines 1219-1228)
    or its ``compute_position_torch`` over the host extend lists (lines 1229-1259)."""
    mode = batch.forward_mode
    ret = cls(
        forward_mode=mode,
        batch_size=len(batch.seq_lens),
        input_ids=batch.input_ids,
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens,
        out_cache_loc=batch.out_cache_loc,
        seq_lens_sum=int(batch.seq_lens_cpu.sum()),
        seq_lens_cpu=batch.seq_lens_cpu,
        is_extend_in_batch=batch.is_extend_in_batch,
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        spec_info=batch.spec_info,
        sampling_info=batch.sampling_info,
    )
    ret.init_mlp_sync_metadata(batch, "cpu", is_draft_worker=model_runner.is_draft_worker)
    if getattr(ret.spec_info, "positions", None) is not None:
        ret.positions = ret.spec_info.positions
    if mode.is_decode() or mode.is_target_verify():
        if ret.positions is None:
            ret.positions = clamp_position(batch.seq_lens)
    elif not mode.is_idle():
        prefix, extend = list(batch.prefix_lens), list(batch.extend_lens)
        ret.extend_seq_lens = torch.tensor(extend, dtype=torch.int32)
        ret.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32)
        ret.extend_seq_lens_cpu, ret.extend_prefix_lens_cpu = extend, prefix
        ret.extend_num_tokens = batch.extend_num_tokens
        positions, ret.extend_start_loc = compute_position_torch(
            ret.extend_prefix_lens, ret.extend_seq_lens
        )
        if ret.positions is None:
            ret.positions = positions
    return ret


def build_eagle_verify_input(batch: SimpleNamespace, draft_input: Any, *args: Any, **kwargs: Any):
    """Stand-in for ``build_eagle_verify_input`` (speculative/eagle_worker_common.py, line 377):
    the chain of ``num_draft_tokens`` tokens per request from its committed length (topk 1), as
    ``eagle_prepare_for_verify`` reads it (``draft_token``, ``draft_token_num``, ``positions``)."""
    bs = len(batch.seq_lens)
    steps = torch.arange(NUM_DRAFT)
    return SimpleNamespace(
        draft_token=torch.zeros(bs * NUM_DRAFT, dtype=torch.int64),
        draft_token_num=NUM_DRAFT,
        num_tokens_per_req=NUM_DRAFT,
        num_tokens_for_logprob_per_req=NUM_DRAFT,
        positions=(batch.seq_lens[:, None] + steps).reshape(-1),
        prepared_out_cache_loc=verify_slots(batch),
        prepared_mrope_positions=None,
        kv_loc_plan=None,
        is_draft_input=lambda: False,
    )


def assign_extend_cache_locs_uniform_on_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
    device: Any,
    *,
    page_size: int = 1,
    **untranslated: Any,
) -> torch.Tensor:
    """``assign_extend_cache_locs_uniform_func`` as its CUDA branch runs (kernels/ops/
    speculative/cache_locs.py, lines 632-657), sglang's Triton kernel in the interpreter: the
    function has no branch for a CPU that is not sglang's CPU build (it returns None here). No
    write translation or fused outputs (the keyword arguments must be None)."""
    unused = sorted(name for name, value in untranslated.items() if value is not None)
    assert not unused, f"not stood in for: {unused}"
    out = torch.empty(batch_size * draft_token_num, dtype=torch.int64, device=device)
    assign_extend_cache_locs_uniform[(batch_size,)](
        req_pool_indices, req_to_token, start_offset, out, req_to_token.shape[1],
        draft_token_num, full_v2p=None, swa_v2p=None, full_out=None, swa_out=None,
        PAGE_SIZE=page_size, num_v_pages=0, num_swa_pages=0, positions_out=None, anchor_src=None,
        anchor_out=None, anchor_stride=0,
    )  # fmt: skip
    return out


def verify_slots(batch: SimpleNamespace) -> torch.Tensor:
    """The verify window's slots by ``assign_extend_cache_locs_uniform_on_cpu``, handed over as
    ``prepared_out_cache_loc``, which ``eagle_prepare_for_verify`` then uses."""
    bs = len(batch.seq_lens)
    return assign_extend_cache_locs_uniform_on_cpu(
        batch.req_pool_indices, batch.req_to_token_pool.req_to_token, batch.seq_lens, bs,
        NUM_DRAFT, "cpu",
    )  # fmt: skip


def sync_metadata(fb: ForwardBatch, global_num_tokens: list[int] | None, *, extend: bool = False):
    """The data-parallel counts ``init_mlp_sync_metadata`` gives a batch of this rank: one
    entry (``dp_slot_in`` is 0; with ``MAX_LEN`` padding every entry is the largest rank's
    count, here more than this rank has). ``None``: no data-parallel sync."""
    if global_num_tokens is None:
        return
    fb.global_num_tokens_cpu = list(global_num_tokens)
    fb.global_num_tokens_for_logprob_cpu = list(global_num_tokens)
    fb.global_num_tokens_gpu = torch.tensor(global_num_tokens)
    fb.global_num_tokens_for_logprob_gpu = torch.tensor(global_num_tokens)
    fb.is_extend_in_batch = extend


def execute(runner: ModelRunner, fb: ForwardBatch) -> Any:
    """``EagerRunner.execute`` of ``runner``'s eager runner under the forward context that
    ``ModelRunner._forward_raw`` publishes around it (model_runner.py, lines 1973-1981)."""
    with forward_context(ForwardContext(attn_backend=runner.attn_backend), forward_batch=fb):
        return runner.eager_runner.execute(fb)


def install_worker_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """``init_new`` and ``build_eagle_verify_input`` replaced where the worker calls them."""
    monkeypatch.setattr(ForwardBatch, "init_new", classmethod(init_new))
    monkeypatch.setattr(eagle_worker_v2, "build_eagle_verify_input", build_eagle_verify_input)


# ----------------------------------------------------------------------- the graphs
def storage(metadata: AttentionMetadata) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each plan field's data pointer and shape."""
    return {name: (t.data_ptr(), tuple(t.shape)) for name, t in metadata.named_tensors().items()}


class EagerGraphs:
    """Stand-in for the graph backend ``resolve_decode_backend`` returns: sglang's breakable
    CUDA-graph backend as its debug-eager mode runs a graph
    (runner_backend/breakable_cuda_graph_backend.py ``capture_one``, lines 113-160; a replay
    runs the captured forward again). ``capture_one`` runs ``forward_fn``
    twice as warm-up (``post_warmup_hook`` after each) and once as the capture, and keeps it;
    ``replay`` runs the kept forward. It notes the storage of every attending step's plan at
    the capture, and ``replay`` checks the replay plans lie there (a GPU graph reads nothing
    else)."""

    def __init__(self, steps: Sequence[Any]) -> None:
        self.steps = steps
        self.graphs: dict[Any, Callable[[], Any]] = {}
        self.captured: dict[Any, list[dict[str, tuple[int, tuple[int, ...]]]]] = {}
        #: The forward context each graph was captured under: a GPU graph replays kernels
        #: recorded with it, while re-running the forward needs it active again.
        self.contexts: dict[Any, ForwardContext | None] = {}

    def capture_one(
        self,
        shape_key: Any,
        forward_fn: Callable[[], Any],
        capture_inputs: Any = None,
        post_warmup_hook: Callable[[], None] | None = None,
    ) -> None:
        for _ in range(2):
            forward_fn()
            if post_warmup_hook is not None:
                post_warmup_hook()
        forward_fn()
        self.graphs[shape_key] = forward_fn
        self.contexts[shape_key] = get_forward_context() if has_forward_context() else None
        self.captured[shape_key] = [storage(step.forward_metadata) for step in self.steps]

    def can_run(self, forward_batch: Any, shape_key: Any) -> bool:
        return shape_key in self.graphs

    def replay(self, shape_key: Any, static_forward_batch: Any, **_: Any) -> Any:
        now = [storage(step.forward_metadata) for step in self.steps]
        assert now == self.captured[shape_key], "the replay plan is not where the graph reads"
        context = self.contexts[shape_key]
        if context is None or has_forward_context():
            return self.graphs[shape_key]()
        previous = set_forward_context(context)
        try:
            return self.graphs[shape_key]()
        finally:
            set_forward_context(previous)


def capture_graphs(runner: Any) -> None:
    """``DecodeCudaGraphRunner._capture`` of an EAGLE graph runner (``runner``: the draft or
    the draft-extend one) without its CUDA set-up (runner/decode_cuda_graph_runner.py lines
    1283-1288 and 1325-1364): the static lengths reset to the fill value, the index buffers
    reset, then ``capture_one_shape`` for each capture size, largest first."""
    runner.buffers.seq_lens.fill_(runner.seq_len_fill_value)
    runner.buffers.seq_lens_cpu.fill_(runner.seq_len_fill_value)
    runner.buffers.reset_index_buffers()
    for bs in reversed(runner.capture_bs):
        runner.capture_one_shape(bs, runner.model_runner.model.forward)


# -------------------------------------------------------------------------- the checks
def state_tensors(backend: DSV4AttentionBackend) -> dict[str, tuple[torch.Tensor, int]]:
    """Every cache and ring of the backend's state, by name, with the rows of sglang's padding
    page (full / window page 0, c4 ring slot 0, c128 ring row of pool row 0) at its start."""
    state, pools = backend.state, backend.state.pools
    out = {f"window{i}": (c.storage, PAGE) for i, c in pools.windows.items()}
    for i, cache in pools.compressed_caches.items():
        out[f"c{i}"] = (cache.storage, PAGE // CONFIG.compress_ratios[i])
    out |= {f"indexer{i}": (c.storage, PAGE // 4) for i, c in pools.indexer_caches.items()}
    out |= {f"ring{i}": (s.ring, 1) for i, s in state.compressor_states.items()}
    out |= {f"indexer_ring{i}": (s.ring, 1) for i, s in state.indexer_states.items()}
    return out


def assert_equal_outside_the_padding_page(padded: Host, plain: Host) -> None:
    """What the padded host's caches and rings hold equals the unpadded host's, except in
    sglang's padding page (and the padded host wrote nothing else there but padding)."""
    want = state_tensors(plain.target)
    for name, (got, skip) in state_tensors(padded.target).items():
        expected = want[name][0]
        torch.testing.assert_close(
            got[skip:], expected[skip:], rtol=0, atol=0, equal_nan=True, msg=name
        )
