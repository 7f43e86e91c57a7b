"""The backend under sglang 0.5.23's own decode CUDA-graph replay preparation, on the CPU.

sglang code that runs here, called, not re-implemented
(``sglang/srt/model_executor/runner/decode_cuda_graph_runner.py`` unless named otherwise):

* ``DecodeCudaGraphRunner.__init__`` with two things patched out: ``capture`` (no graph is
  captured on the CPU) and ``resolve_decode_backend`` (the capture / replay mechanics, which
  need CUDA and a tensor-parallel group). It picks the capture mode (TARGET_VERIFY under EAGLE,
  DECODE without speculation) and width (``ModelRunner.decode_num_tokens_per_req``), the
  capture sizes (``get_batch_sizes_to_capture`` from the published ``cuda_graph_config``),
  calls the backend's ``init_cuda_graph_state(max_bs, max_bs * width)`` and
  ``get_cuda_graph_seq_len_fill_value``, and allocates its static buffers on the CPU
  (``DecodeInputBuffers.create``, ``build_decode_registry`` of
  ``cuda_graph_buffer_registry.py`` adopting them).
* ``DecodeCudaGraphRunner.can_run_graph`` (sglang's gate before a replay) and ``load_batch``
  (the replay preparation): the bucket (``_pad_to_bucket``; under DP attention of the largest
  rank's request count, ``_max_dp_batch_size``), ``CudaGraphBufferRegistry.fill_from`` (static
  buffers padded with pool row 0, seq len 1, slot 0), ``_init_replay_attn_metadata`` ->
  ``_init_replay_attn_metadata_from_view`` -> ``build_replay_fb_view`` -> the backend's
  ``init_forward_metadata_out_graph(view)``. The view hands over ``batch_size`` = the bucket,
  the padded ``req_pool_indices`` / ``seq_lens`` / ``seq_lens_cpu`` (None without a CPU
  mirror), ``num_padding``, ``forward_mode`` = the capture mode, ``actual_forward_mode`` = the
  live mode, and the live batch's own ``out_cache_loc`` (``raw_bs * width`` slots).
* ``ForwardBatch.init_mlp_sync_metadata`` (``forward_batch_info.py``): the DP fields of a live
  batch (``original_global_num_tokens_cpu``, ``can_run_decode_cuda_graph``) from the per-rank
  request counts, as the scheduler's batch carries them.

Stand-ins: the model runner (``harness.mock_runner`` plus what the runner's constructor reads),
the live ``ForwardBatch``es (``harness.BatchBuilder``; an idle rank's laid out as
``ScheduleBatch.prepare_for_idle`` leaves it, sglang/srt/managers/schedule_batch.py) and the
model (``harness.SimulatedModel``). No graph replays on the CPU: the layers run with the replay
view the backend planned, reading the backend's graph buffers as the captured kernels would.

Verdicts: the replay plan's live rows equal the eager plan of the live batch (a second
backend's ``init_forward_metadata``), padding rows write only sglang's padding slot (in the
plan, and in the caches after the layers ran), every live output equals the reference's full
causal pass, and views whose live rows do not fit the bucket are refused with the backend's
typed errors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from ragged_layouts import ragged_step
from sglang.srt.environ import envs
from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardMode,
)
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.runner import decode_cuda_graph_runner
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.runtime_context import get_context
from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from v41_host import SglangV41Model, v41_hf_config

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ContractError
from dsv4_backend.planning import AttentionMetadata
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel
from dsv4_backend.testing.simulation.v41 import tiny_v41

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

#: sglang's speculative default capture list, cut at 12 requests.
CAPTURE_BS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]
NUM_DRAFT, NUM_STEPS = 4, 3
DP_RANKS = 2
ATOL = 2e-5
#: Committed lengths of the requests: around the window (128), the c4 blocks, the c128 entry
#: (128) and the page (256); a decode writes position ``L``, a verify ``L ... L + 3``. The
#: last request only makes a batch past the largest capture size (never run).
LENS = [3, 29, 126, 128, 131, 255, 256, 262, 5, 14, 47, 66, 7]
MAX_LENS = [n + NUM_DRAFT + 1 for n in LENS]
SERVED = range(max(CAPTURE_BS))  # the requests that run


def sglang_server(*, dp: bool) -> Any:
    """sglang's published config of a CPU server with ``CAPTURE_BS`` decode graphs (with DP
    attention: ``DP_RANKS`` ranks of attention TP 1, so ``require_mlp_tp_gather``)."""
    fields: dict[str, Any] = dict(
        device="cpu",
        cuda_graph_config=CudaGraphConfig.from_dict({"decode": {"bs": CAPTURE_BS}}),
    )
    if dp:
        fields.update(attn_dp_size=DP_RANKS, tp_size=DP_RANKS)
    return get_context().override_server_args(**fields)


class RecordingBackend(DSV4AttentionBackend):
    """The backend, keeping every view sglang's replay preparation hands it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.views: list[Any] = []

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        self.views.append(forward_batch)
        super().init_forward_metadata_out_graph(forward_batch, in_capture)


def model_runner_stand_in(
    pool: PagedRequestPool,
    *,
    verify: bool,
    dp: bool,
    config: DSV4AttentionConfig,
    dspark: bool = False,
) -> SimpleNamespace:
    """``harness.mock_runner`` plus what ``DecodeCudaGraphRunner.__init__`` reads of a model
    runner; its ``decode_num_tokens_per_req`` is sglang's own ``ModelRunner`` method. Verifies
    come from EAGLE, or DSpark (DeepSeek-V4.1's speculative algorithm; ``dspark`` for V4)."""
    dspark = dspark or config.v41 is not None
    hf = v41_hf_config(config) if config.v41 is not None else harness.tiny_hf_config(config)
    runner = harness.mock_runner(
        pool, hf, topk=1 if verify and not dspark else 0,
        num_steps=NUM_STEPS, num_draft_tokens=NUM_DRAFT, tp_size=DP_RANKS if dp else 1,
        speculative_algorithm="DSPARK" if verify and dspark else None,
    )  # fmt: skip
    runner.server_args.attn_dp_size = DP_RANKS if dp else 1
    runner.server_args.dllm_algorithm = None
    algorithm = SpeculativeAlgorithm.DSPARK if dspark else SpeculativeAlgorithm.EAGLE
    runner.spec_algorithm = algorithm if verify else SpeculativeAlgorithm.NONE
    runner.decode_num_tokens_per_req = functools.partial(
        ModelRunner.decode_num_tokens_per_req, runner
    )
    runner.model_config.is_encoder_decoder = False
    runner.model_config.hf_text_config = SimpleNamespace()
    runner.model_config.hidden_size = 8
    runner.model_config.vocab_size = 16
    runner.model_config.dtype = torch.float32
    runner.ngram_embedding_manager = SimpleNamespace(enabled=False)
    runner.graph_shared_output = SimpleNamespace(
        get_logits_buffer=lambda vocab_size, rows: torch.zeros(rows, vocab_size)
    )
    runner.get_pp_proxy_topk_size = lambda: None
    runner.get_pp_proxy_residual_num_blocks = lambda: None
    runner.get_pp_proxy_dspark_hidden_size = lambda: 0
    runner.get_aux_hidden_states_width = lambda: 0
    runner.attn_tp_sequence_sharded = lambda num_tokens: False
    runner.lora_manager = None
    runner.hisparse_coordinator = None
    return runner


@dataclass
class Host:
    """One (DP rank's) server: its pool, model, graph backend, eager backend and sglang's
    decode graph runner."""

    pool: PagedRequestPool
    model: RandomModel | SglangV41Model
    sim: harness.SimulatedModel | SglangV41Model
    batches: harness.BatchBuilder
    backend: RecordingBackend
    eager: DSV4AttentionBackend
    graph_runner: DecodeCudaGraphRunner
    verify: bool
    #: Output tolerance: the simulated model's fp32 rows, or bf16 rows of sglang's V4.1 modules.
    atol: float = ATOL
    checked: list[str] = field(default_factory=list)

    @property
    def width(self) -> int:
        return NUM_DRAFT if self.verify else 1

    def live(self, requests: Sequence[int], *, host_mirror: bool = True) -> harness.Step:
        """The live batch of ``requests``: a DECODE of position ``L`` or a TARGET_VERIFY of
        ``L ... L + 3``, as the scheduler hands it to the runner."""
        lens = [LENS[r] for r in requests]
        if self.verify:
            step = self.batches.verify(requests, lens, NUM_DRAFT)
        else:
            step = self.batches.decode(requests, [n + 1 for n in lens])
        step.batch.capture_hidden_mode = CaptureHiddenMode.NULL  # ForwardBatch.init_new's
        if not host_mirror:
            step.batch.seq_lens_cpu = None
        return step

    def prefill(self, requests: Sequence[int]) -> None:
        """Eager EXTEND of every token before ``L``; checked against the reference."""
        step = self.batches.extend(requests, [0] * len(requests), [LENS[r] for r in requests])
        self.eager.init_forward_metadata(step.batch)
        for layer in range(len(self.model.config.compress_ratios)):
            out = self.sim.layer(self.eager, step, layer)
            assert self.sim.max_error(step.rows, layer, out) <= self.atol, ("prefill", layer)


def make_host(
    monkeypatch: pytest.MonkeyPatch,
    *,
    verify: bool,
    dp: bool = False,
    seed: int = 0,
    v41: bool = False,
    dspark: bool = False,
) -> Host:
    """A server in sglang's published config (the caller holds ``sglang_server``): sglang's
    ``DecodeCudaGraphRunner`` built by its own constructor, capture patched out. ``v41``: a
    DeepSeek-V4.1 model driven through sglang's own V4.1 modules (``testing.v41_host``)."""
    config = (
        tiny_v41(speculative=verify, num_draft_tokens=NUM_DRAFT if verify else 0)
        if v41
        else DSV4AttentionConfig.tiny(speculative=verify)
    )
    generator = torch.Generator().manual_seed(seed)
    pool = PagedRequestPool(config, MAX_LENS, generator=generator)
    model: RandomModel | SglangV41Model
    if v41:
        model = SglangV41Model(config, MAX_LENS, seed)
    else:
        model = RandomModel(config, pool, generator=generator)
    runner = model_runner_stand_in(pool, verify=verify, dp=dp, config=config, dspark=dspark)
    backend = RecordingBackend(runner, cache_format="dense")
    runner.attn_backend = backend
    eager = DSV4AttentionBackend(runner, cache_format="dense")
    monkeypatch.setattr(DecodeCudaGraphRunner, "capture", lambda self: None)
    monkeypatch.setattr(decode_cuda_graph_runner, "resolve_decode_backend", lambda runner: None)
    graph_runner = DecodeCudaGraphRunner(
        runner, speculative_num_steps=NUM_STEPS, speculative_num_draft_tokens=NUM_DRAFT
    )
    mode = ForwardMode.TARGET_VERIFY if verify else ForwardMode.DECODE
    assert graph_runner.capture_forward_mode == mode
    assert graph_runner.capture_bs == CAPTURE_BS
    assert graph_runner.captured_req_width == (NUM_DRAFT if verify else 1)
    assert graph_runner.require_mlp_tp_gather is dp
    assert backend.graph_buffers is not None  # the constructor's init_cuda_graph_state
    return Host(
        pool=pool, model=model,
        sim=model if isinstance(model, SglangV41Model) else harness.SimulatedModel(model),
        batches=harness.BatchBuilder(pool), backend=backend, eager=eager,
        graph_runner=graph_runner, verify=verify, atol=2e-2 if v41 else ATOL,
    )  # fmt: skip


# ------------------------------------------------------------------------------ verdicts
def bucket(n: int) -> int:
    return min(bs for bs in CAPTURE_BS if bs >= n)


def dp_sync(step: harness.Step, counts: Sequence[int]) -> None:
    """sglang's ``ForwardBatch.init_mlp_sync_metadata`` with the scheduler's per-rank request
    counts (the batch carries them as ``global_num_tokens``)."""
    batch = SimpleNamespace(
        dp_spec_prefill_coordination_applied=False,
        global_num_tokens=list(counts), global_num_tokens_for_logprob=list(counts),
        draft_global_num_tokens=None, can_run_decode_cuda_graph=True,
        can_run_dp_draft_cuda_graph=True,
    )  # fmt: skip
    step.batch.init_mlp_sync_metadata(batch, "cpu")


def replay_prep(host: Host, step: harness.Step) -> Any:
    """sglang's gate and replay preparation (``can_run_graph``, ``load_batch``); the view the
    backend was handed, checked to be what ``build_replay_fb_view`` promises."""
    runner, batch = host.graph_runner, step.batch
    raw_bs = batch.batch_size
    counts = batch.original_global_num_tokens_cpu
    bs = bucket(max(counts) if counts is not None else raw_bs)
    assert runner.can_run_graph(batch), "sglang would not replay this batch"
    seen = len(host.backend.views)
    runner.load_batch(batch)
    (view,) = host.backend.views[seen:]
    assert (view.batch_size, view.num_padding) == (bs, bs - raw_bs)
    assert view.forward_mode == runner.capture_forward_mode
    assert view.actual_forward_mode == batch.forward_mode
    assert view.out_cache_loc is batch.out_cache_loc
    assert runner.seq_len_fill_value == 1  # the backend's get_cuda_graph_seq_len_fill_value
    assert view.req_pool_indices[raw_bs:].eq(0).all() and view.seq_lens[raw_bs:].eq(1).all()
    assert torch.equal(view.req_pool_indices[:raw_bs], batch.req_pool_indices)
    assert (view.seq_lens_cpu is None) is (batch.seq_lens_cpu is None)
    return view


def assert_live_rows_equal(graph: AttentionMetadata, eager: AttentionMetadata, label: str) -> None:
    """Every field of the eager plan equals the replay plan's over the live rows: 2-D fields on
    the eager columns (the replay's further columns -1); plan records: the replay's records of
    live rows are the eager plan's valid records, in order."""
    live = eager.num_rows
    got, want = graph.named_tensors(), eager.named_tensors()
    assert sorted(got) == sorted(want), f"{label}: fields {sorted(got)} != {sorted(want)}"
    for name, expected in want.items():
        value = got[name]
        assert value.dtype == expected.dtype, f"{label}: {name} dtype {value.dtype}"
        if name.endswith(("compress_plan", "write_plan")):
            ragged = value[:, 0]
            value = value[(ragged >= 0) & (ragged < live)]
            expected = expected[expected[:, 0] >= 0]
        else:
            value = value[:live]
            if expected.dim() == 2:
                assert value[:, expected.shape[1] :].eq(-1).all(), f"{label}: {name} columns"
                value = value[:, : expected.shape[1]]
        assert torch.equal(value, expected), (
            f"{label}: {name} differs on the live rows\n got {value.tolist()}\n"
            f"want {expected.tolist()}"
        )


def assert_padding_plans_slot_zero(host: Host, graph: AttentionMetadata, live: int) -> None:
    """Padding rows belong to the padding requests (after the live ones) and write the window
    slot of full slot 0 and no compressed entry but 0."""
    pad = slice(live, graph.num_rows)
    swa_zero = int(host.pool.full_to_swa[0])
    assert graph.swa_out_loc[pad].eq(swa_zero).all(), (
        f"padding rows' swa_out_loc {graph.swa_out_loc[pad].tolist()}; expected the window slot "
        f"{swa_zero} of sglang's padding slot 0"
    )
    for part in (graph.c4, graph.c128, graph.c1, graph.c2):
        if part is not None:
            out = part.out_loc[pad]
            assert (out.eq(-1) | out.eq(0)).all(), (
                f"padding rows' c{part.ratio}.out_loc {out.tolist()}; expected -1 or 0"
            )
    padding_requests = torch.arange(live, graph.num_rows) // host.width
    assert torch.equal(graph.row_batch_ids[pad].long(), padding_requests), "padding requests"


def cache_storages(backend: DSV4AttentionBackend) -> dict[str, torch.Tensor]:
    pools = backend.state.pools
    out = {f"window{i}": cache.storage for i, cache in pools.windows.items()}
    out.update({f"c{i}": cache.storage for i, cache in pools.compressed_caches.items()})
    out.update({f"index{i}": cache.storage for i, cache in pools.indexer_caches.items()})
    out.update({f"index{i}": cache.storage for i, cache in pools.index_key_caches.items()})
    return out


def allowed_slots(host: Host, eager: AttentionMetadata | None, step: harness.Step) -> dict:
    """Slots the replay may write: the live rows' (from the eager plan) and slot 0's."""
    swa_zero = int(host.pool.full_to_swa[0])
    config = host.model.config
    live = {swa_zero}
    if step.batch.out_cache_loc.numel():
        live |= set(host.pool.full_to_swa[step.batch.out_cache_loc.long()].tolist())
    allowed = {f"window{i}": live for i in range(len(config.compress_ratios))}
    for layer in backend_caches(host):
        ratio = config.compress_ratios[layer]
        entries = {0}
        if eager is None:
            part = None
        elif ratio in (1, 2):  # DeepSeek-V4.1: a kv source's entries and index keys
            part = eager.low_ratio(ratio)
        else:
            part = eager.compressed(ratio)
        if part is not None:
            entries |= {v for v in part.out_loc.tolist() if v >= 0}
        allowed[f"c{layer}"] = entries
        if ratio in (1, 2, 4):
            allowed[f"index{layer}"] = entries
    return allowed


def backend_caches(host: Host) -> list[int]:
    """The layers holding a compressed cache (V4's compressed layers, V4.1's kv sources)."""
    return sorted(host.backend.state.pools.compressed_caches)


def run_layers(
    host: Host, view: Any, step: harness.Step, allowed: dict, num_rows: int | None = None
) -> None:
    """Every layer through the backend's sglang-facing methods on the replay view (of
    ``num_rows`` rows: its requests' widths by default): live rows equal the reference; the
    caches change only at ``allowed`` slots."""
    padding = (num_rows or view.batch_size * host.width) - len(step.rows)
    rows: list[harness.Row] = [*step.rows, *[None] * padding]
    before = {name: t.clone() for name, t in cache_storages(host.backend).items()}
    for layer in range(len(host.model.config.compress_ratios)):
        feed = host.sim.feed(rows, layer)
        out = host.sim.run_feed(host.backend, view, layer, feed)
        assert out.shape[0] == len(rows)
        error = host.sim.max_error(rows, layer, out)
        assert error <= host.atol, (view.actual_forward_mode.name, view.batch_size, layer, error)
        host.checked.append(f"{view.actual_forward_mode.name}/{view.batch_size}/{layer}")
    for name, now in cache_storages(host.backend).items():
        changed = (now != before[name]).flatten(1).any(dim=1).nonzero().flatten().tolist()
        stray = sorted(set(changed) - allowed[name])
        assert not stray, f"{name}: slots {stray[:8]} written, none of the batch's nor slot 0"


def check_replay(host: Host, step: harness.Step, label: str) -> None:
    """Replay ``step`` through sglang's preparation; every verdict of the module docstring."""
    view = replay_prep(host, step)
    graph = host.backend.forward_metadata
    assert graph is not None
    assert (graph.batch_size, graph.num_rows) == (view.batch_size, view.batch_size * host.width)
    live = len(step.rows)
    eager = None
    if step.batch.batch_size:
        host.eager.init_forward_metadata(step.batch)
        eager = host.eager.forward_metadata
        assert eager is not None and eager.num_rows == live
        assert_live_rows_equal(graph, eager, label)
    assert_padding_plans_slot_zero(host, graph, live)
    run_layers(host, view, step, allowed_slots(host, eager, step))


# --------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("verify", [False, True], ids=["decode", "target-verify"])
def test_every_live_batch_size_replays_as_its_eager_plan(
    verify: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Live batches of 1 ... 12 requests in the buckets of ``CAPTURE_BS`` (DECODE graphs, and
    TARGET_VERIFY graphs of 4 draft tokens a request); 13 is past every graph (sglang's gate
    sends it to the eager runner). Then batches without a host mirror (``seq_lens_cpu=None``,
    as the overlap scheduler may hand them): the view carries None, the verdicts are the same.
    (One test, so the requests are prefilled once.)"""
    with sglang_server(dp=False):
        host = make_host(monkeypatch, verify=verify)
        host.prefill(SERVED)
        for n in range(1, max(CAPTURE_BS) + 1):
            check_replay(host, host.live(range(n)), f"{n} requests in bucket {bucket(n)}")
        too_many = host.live(range(len(LENS)))
        assert not host.graph_runner.can_run_graph(too_many.batch)
        assert len(host.checked) == max(CAPTURE_BS) * len(host.model.config.compress_ratios)

        requests = [0, 2, 4, 7, 9]  # bucket 5; with the four below, 9 requests in bucket 10
        for chosen in (requests, [*requests, 1, 3, 5, 11]):
            step = host.live(chosen, host_mirror=False)
            check_replay(host, step, f"no host mirror, {len(chosen)} requests")
            assert host.backend.views[-1].seq_lens_cpu is None


@pytest.mark.parametrize("verify", [False, True], ids=["decode", "dspark-verify"])
def test_deepseek_v41_replays_as_its_eager_plan(
    verify: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V4.1 (``tiny_v41``: c2 and c1 kv sources, a candidate source and consumer)
    driven through sglang's own V4.1 modules: live batches of 1 ... 12 requests in the DECODE
    buckets, and in DSpark's TARGET_VERIFY buckets (4 tokens a request); the replay plan's live
    rows (the c1 / c2 fields too) equal the eager plan, padding rows write only the padding
    slot 0, every live output equals the reference."""
    with sglang_server(dp=False):
        host = make_host(monkeypatch, verify=verify, v41=True)
        host.prefill(SERVED)
        for n in range(1, max(CAPTURE_BS) + 1):
            check_replay(host, host.live(range(n)), f"V4.1: {n} requests in bucket {bucket(n)}")
        assert len(host.checked) == max(CAPTURE_BS) * len(host.model.config.compress_ratios)


#: Request counts of the two DP ranks, replay after replay: an idle rank (0) beside ranks of
#: several buckets, then live again; ranks of different sizes in either order.
DP_COUNTS = ((0, 1), (0, 9), (3, 7), (9, 2), (1, 12), (12, 0), (5, 5))


@pytest.mark.parametrize("v41", [False, True], ids=["v4", "v41"])
@pytest.mark.parametrize("verify", [False, True], ids=["decode", "target-verify"])
def test_dp_ranks_replay_in_the_largest_ranks_bucket(
    verify: bool, v41: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DP_RANKS`` ranks (each its own runner, state and backends) of different sizes each
    replay in the bucket of the largest rank's count (``_max_dp_batch_size``). An idle rank
    (raw_bs 0, live mode IDLE, ``ScheduleBatch.prepare_for_idle``'s batch) replays the graph's
    mode (DECODE; TARGET_VERIFY under EAGLE) of that bucket as ``batch_size`` padding
    requests: it writes only slot 0, and its next live batches still match the reference.
    ``v41``: DeepSeek-V4.1 through sglang's V4.1 modules (verified by DSpark)."""
    with sglang_server(dp=True):
        hosts = [
            make_host(monkeypatch, verify=verify, dp=True, seed=rank, v41=v41) for rank in (0, 1)
        ]
        for host in hosts:
            host.prefill(SERVED)
        mode = ForwardMode.TARGET_VERIFY if verify else ForwardMode.DECODE
        for counts in DP_COUNTS:
            for host, n in zip(hosts, counts, strict=True):
                step = host.live(range(n)) if n else harness.BatchBuilder.idle()
                dp_sync(step, counts)
                check_replay(host, step, f"rank of {n} requests, ranks {counts}")
                view, graph = host.backend.views[-1], host.backend.forward_metadata
                assert view.batch_size == bucket(max(counts)) == graph.batch_size
                assert view.forward_mode == mode
                assert view.actual_forward_mode == (mode if n else ForwardMode.IDLE)
        layers = len(hosts[0].model.config.compress_ratios)
        assert all(len(host.checked) == layers * len(DP_COUNTS) for host in hosts)


# -------------------------------------------------------------------------------- refusals
def test_live_rows_past_the_bucket_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DP rank handed counts smaller than its own batch (5 requests, counts (3, 2)): sglang's
    preparation pads to bucket 3 and hands a view of 3 requests with 5 requests' write slots;
    the backend refuses it (it cannot plan them in 3 rows each) instead of dropping rows."""
    with sglang_server(dp=True):
        host = make_host(monkeypatch, verify=True, dp=True)
        step = host.live(range(5))
        dp_sync(step, (3, 2))
        with pytest.raises((BatchError, ContractError)):
            host.graph_runner.load_batch(step.batch)
        view = host.backend.views[-1]
        assert view.batch_size == 3 and view.out_cache_loc.numel() == 5 * NUM_DRAFT
        assert host.backend.forward_metadata is None


def test_a_view_of_more_requests_than_its_bucket_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same through the smallest sglang functions, in a DECODE graph: the registry filled
    for the live batch of 4 (``fill_from``), the view built by ``build_replay_fb_view`` for a
    bucket of 3. Refused with a typed error, nothing planned."""
    with sglang_server(dp=False):
        host = make_host(monkeypatch, verify=False)
        step = host.live(range(4))
        runner = host.graph_runner
        runner.buffer_registry.fill_from(
            step.batch, raw_bs=4, padded_bs=4, raw_num_tokens=4, padded_num_tokens=4
        )
        view = decode_cuda_graph_runner.build_replay_fb_view(
            forward_batch=step.batch, buffers=runner.buffers, bs=3, raw_bs=4, num_tokens=3,
            global_num_tokens_cpu=None, seq_len_fill_value=runner.seq_len_fill_value,
            capture_forward_mode=runner.capture_forward_mode, is_encoder_decoder=False,
        )  # fmt: skip
        assert view.batch_size == 3 and view.out_cache_loc.numel() == 4
        with pytest.raises((BatchError, ContractError)):
            host.backend.init_forward_metadata_out_graph(view)
        assert host.backend.forward_metadata is None


def compact_step(host: Host, requests: Sequence[int], verify_lens: Sequence[int]) -> tuple:
    """A live TARGET_VERIFY of sglang's compact ragged verify over the runner's token tiers
    (``ragged_layouts``), and its layout."""
    lens = [LENS[r] for r in requests]
    tiers = host.graph_runner.capture_num_tokens
    layout = RaggedVerifyLayout.from_verify_lens(
        verify_lens_cpu=list(verify_lens), device=torch.device("cpu"), grid=tiers
    )
    view = host.pool.ragged_verify(requests, lens, verify_lens, layout.graph_num_tokens)
    spans = zip(requests, lens, verify_lens, strict=True)
    rows = [(r, s + i) for r, s, n in spans for i in range(n)]
    return ragged_step(view, layout, rows, NUM_DRAFT), layout


def test_compact_ragged_verify_replays_as_its_eager_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSpark's compact ragged verify (``SGLANG_RAGGED_VERIFY_MODE=compact``) through sglang's
    token-keyed TARGET_VERIFY graphs: sglang's own runner picks the token tier and the capture
    slots (``capture_num_tokens``, ``_ragged_capture_slots``), admits the batch only because
    the backend says it serves them (``_can_run_ragged_verify_graph`` reads
    ``supports_ragged_verify_graph``) and hands the backend the replay view; the backend pads
    the live layout to the view's slots with sglang's ``padded_to_bucket``. The requests' rows
    equal the eager plan's (whose rows past them are padding rows, writing nothing); the
    padding requests' rows write only slot 0; every live row equals the reference."""
    rng = torch.Generator().manual_seed(3)
    with sglang_server(dp=False), envs.SGLANG_RAGGED_VERIFY_MODE.override("compact"):
        host = make_host(monkeypatch, verify=True, dspark=True)
        runner = host.graph_runner
        assert runner.ragged_verify_mode and host.backend.ragged_verify and host.eager.ragged_verify
        assert runner.capture_num_tokens == [bs * NUM_DRAFT for bs in CAPTURE_BS]
        host.prefill(SERVED)
        for requests in ([0], [1, 2, 3], list(SERVED)):
            verify_lens = torch.randint(1, NUM_DRAFT + 1, (len(requests),), generator=rng).tolist()
            step, layout = compact_step(host, requests, verify_lens)
            assert runner.can_run_graph(step.batch), "sglang would not replay this batch"
            seen = len(host.backend.views)
            runner.load_batch(step.batch)
            (view,) = host.backend.views[seen:]
            tokens = layout.graph_num_tokens
            slots = min(tokens, max(CAPTURE_BS))
            assert (view.batch_size, view.num_padding) == (slots, slots - len(requests))
            graph = host.backend.forward_metadata
            assert graph is not None and (graph.batch_size, graph.num_rows) == (slots, tokens)
            host.eager.init_forward_metadata(step.batch)
            eager = host.eager.forward_metadata
            assert eager is not None and eager.num_rows == tokens
            real = sum(verify_lens)
            for name, want in eager.named_tensors().items():
                got = graph.named_tensors()[name]
                if name.endswith(("compress_plan", "write_plan")):
                    got, want = got[(got[:, 0] >= 0) & (got[:, 0] < real)], want[want[:, 0] >= 0]
                else:
                    got, want = got[:real], want[:real]
                    if want.dim() == 2:
                        got = got[:, : want.shape[1]]
                assert torch.equal(got, want), (requests, name)
            assert eager.swa_out_loc[real:].eq(-1).all()  # the tier's leftover writes nothing
            if view.num_padding:  # the padding requests take it, writing slot 0 only
                assert graph.row_batch_ids[real:].ge(len(requests)).all()
                assert graph.swa_out_loc[real:].eq(int(host.pool.full_to_swa[0])).all()
            else:  # as eager: the last request's, which are not its drafts
                assert graph.swa_out_loc[real:].eq(-1).all()
            run_layers(host, view, step, allowed_slots(host, eager, step), num_rows=tokens)
        # The batch read without the backend's ragged graphs: sglang replays eagerly instead.
        monkeypatch.setattr(RecordingBackend, "supports_ragged_verify_graph", False)
        assert not runner.can_run_graph(compact_step(host, [0, 1], [2, 3])[0].batch)
