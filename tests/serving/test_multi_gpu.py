"""Multi-GPU serving on the CPU: one backend per rank, fed what sglang 0.5.23 hands each rank.

* Attention TP: sglang's DeepSeek-V4 layer gives rank ``r`` of ``n`` query heads
  ``[r * H/n, (r + 1) * H/n)`` and their sink entries (padded to 64 heads for FlashMLA), while the
  indexer (``ReplicatedLinear`` queries and weights) and the compressors are replicated. Each
  rank's outputs, concatenated over ranks, equal the single-rank result; the indexer's top-k and
  every cache and ring are identical on every rank.
* DP attention: batches padded by sglang's own ``ForwardBatch._pad_inputs_to_size`` (requests at
  pool row 0, ``seq_lens`` 1, slot 0) plan and run on the eager and the graph path; real rows
  keep the reference's values.
* Pipeline parallelism: a backend per stage, on a runner whose ``layer_info`` (sglang's
  ``ModelLayerInfo``) owns layers ``[start_layer, end_layer)``, holds only those layers'
  caches and rings; the model calls it with the model's layer ids. The stages together equal
  one backend, output for output and byte for byte.
* Two-batch overlap: sglang's own ``TboAttnBackend`` over this backend's factory and its own
  ``TboForwardBatchPreparer`` splitting each prefill into two children (a request cut in two
  when the halves would be unbalanced; hidden states padded to a multiple of the attention TP
  size); the children, run layer by layer in the overlap's order, equal the unsplit batch.
* Start-up refusals with sglang's real ``ServerArgs``: options that move KV state outside this
  backend (PD disaggregation, HiCache, ...), context parallelism, heads the attention TP group
  does not divide.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import ServerArgs

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ConfigError, ContractError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention.common import AttentionCall
from dsv4_backend.kernels.attention.table import sparse_attention_with_sink
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.planning import ForwardKind, plan
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel
from dsv4_backend.tools.ab.backends import DSV4Backend, ReferenceBackend
from dsv4_backend.tools.ab.cli import main
from dsv4_backend.tools.ab.runner import run_trace
from dsv4_backend.tools.ab.trace import build_trace

pytestmark = pytest.mark.usefixtures("torch_path")

#: The 64-head configuration with tiny head dims (attention, RoPE, indexer).
CONFIG = DSV4AttentionConfig.tiny(
    num_heads=64, head_dim=32, rope_dim=16, index_head_dim=32, speculative=True
)
HF = harness.tiny_hf_config(CONFIG)
ATOL = 2e-5
NUM_DRAFT = 4
#: sglang's FlashMLA query width for a rank with at most 64 heads (``_kernel_num_heads``).
FLASHMLA_HEADS = 64


def make_model(max_lens: list[int], seed: int = 0) -> tuple[PagedRequestPool, RandomModel]:
    generator = torch.Generator().manual_seed(seed)
    pool = PagedRequestPool(CONFIG, max_lens, generator=generator)
    model = RandomModel(CONFIG, pool, generator=generator)
    return pool, model


def make_backend(pool: PagedRequestPool, **runner_kwargs) -> DSV4AttentionBackend:
    runner = harness.mock_runner(pool, HF, num_draft_tokens=NUM_DRAFT, **runner_kwargs)
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    runner.attn_backend = backend
    return backend


# ------------------------------------------------------------------------------ attention TP
@pytest.mark.sglang
@pytest.mark.parametrize("pad_to", [None, FLASHMLA_HEADS], ids=["exact", "flashmla-padded"])
@pytest.mark.parametrize(
    "tp_size",
    [1, 2, pytest.param(4, marks=pytest.mark.stress), 8],
)  # 4 lies between 2 and 8 heads a rank: long only
def test_attention_tp_ranks_concatenate_to_the_single_rank_result(
    tp_size: int, pad_to: int | None
) -> None:
    """Chunked prefill, verify and decode over window / c4 / c128 / page boundaries (the ranks
    plan verify and decode on the CUDA-graph path, the single rank eagerly)."""
    pool, model = make_model([140, 270])
    sim = harness.SimulatedModel(model)
    batches = harness.BatchBuilder(pool)
    single = make_backend(pool)
    ranks = [make_backend(pool, tp_size=tp_size) for _ in range(tp_size)]
    for backend in ranks:  # the ranks plan verify and decode on the graph path
        backend.init_cuda_graph_state(2, 2 * NUM_DRAFT)
    local = CONFIG.num_heads // tp_size
    assert single.local_heads == CONFIG.num_heads
    assert all(b.local_heads == local for b in ranks)
    requests = [0, 1]
    steps = [
        batches.extend(requests, [0, 0], [100, 200]),
        batches.extend(requests, [100, 200], [30, 60]),
        batches.verify(requests, [130, 260], NUM_DRAFT),
        batches.decode(requests, [135, 265]),
    ]
    for step in steps:
        single.init_forward_metadata(step.batch)
        for backend in ranks:
            if step.batch.forward_mode is ForwardMode.EXTEND:
                backend.init_forward_metadata(step.batch)
            else:
                backend.init_forward_metadata_out_graph(step.batch)
        for layer, ratio in enumerate(CONFIG.compress_ratios):
            feed = sim.feed(step.rows, layer)
            want = sim.run_feed(single, step.batch, layer, feed)
            assert sim.max_error(step.rows, layer, want) <= ATOL
            got = []
            for rank, backend in enumerate(ranks):
                tp = harness.AttentionTPRank(rank, tp_size, pad_to)
                out = sim.run_feed(backend, step.batch, layer, feed, tp)
                assert out.shape == (len(step.rows), pad_to or local, CONFIG.head_dim)
                assert not out[:, local:].any()  # padded heads: 0
                got.append(out[:, :local])
                if ratio == 4:  # the indexer's top-k of this layer, identical on every rank
                    assert torch.equal(
                        backend.forward_metadata.c4.page_indices,
                        single.forward_metadata.c4.page_indices,
                    )
            torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-6, rtol=1e-6)
    reference = single.state.named_tensors()
    for backend in ranks:
        for name, tensor in backend.state.named_tensors().items():
            assert torch.equal(tensor, reference[name]), name


@pytest.mark.sglang
def test_a_rank_given_other_heads_than_it_serves_is_stopped() -> None:
    pool, model = make_model([40])
    sim = harness.SimulatedModel(model)
    backend = make_backend(pool, tp_size=4)
    step = harness.BatchBuilder(pool).extend([0], [0], [8])
    backend.init_forward_metadata(step.batch)
    feed = sim.feed(step.rows, 0)
    with pytest.raises(ContractError, match="serves 16 query heads"):
        sim.run_feed(backend, step.batch, 0, feed)  # all 64 heads, as one rank


def test_kernels_read_a_rank_s_heads_from_the_padded_query() -> None:
    """The strided view ``q[:, :Hl]`` of sglang's padded query (NaN past ``Hl``), on every
    kernel path, equals the contiguous query."""
    generator = torch.Generator().manual_seed(3)
    rows, local, dim = 5, 8, CONFIG.head_dim
    window = TokenCache(256, dim, CONFIG.rope_dim, 128, "dense", torch.float32, "cpu")
    store_rows(window, torch.randn(256, dim, generator=generator), torch.arange(256))
    indices = torch.randint(0, 256, (rows, 64), generator=generator, dtype=torch.int32)
    lengths = torch.tensor([64, 17, 1, 40, 0], dtype=torch.int32)
    sink = torch.randn(local, generator=generator)
    padded = torch.full((rows, FLASHMLA_HEADS, dim), float("nan"))
    padded[:, :local] = torch.randn(rows, local, dim, generator=generator)
    for path in (dispatch.TORCH, dispatch.TRITON_INTERPRETER):
        with force_path(path):
            args = (window, indices, lengths, None, None, None, sink, CONFIG.softmax_scale)
            got = sparse_attention_with_sink(AttentionCall.of(padded[:, :local], *args))
            want = sparse_attention_with_sink(
                AttentionCall.of(padded[:, :local].contiguous(), *args)
            )
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------ DP attention
@pytest.mark.sglang
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_dp_padded_requests_plan_and_leave_real_rows_exact(graph: bool) -> None:
    """DECODE and TARGET_VERIFY padded by sglang's ``_pad_inputs_to_size`` (the modes whose
    request count DP attention pads), planned after the padding; an IDLE rank padded to rows."""
    pool, model = make_model([150, 260])
    sim = harness.SimulatedModel(model)
    batches = harness.BatchBuilder(pool)
    runner = harness.mock_runner(pool, HF, num_draft_tokens=NUM_DRAFT)
    backend = runner.attn_backend = DSV4AttentionBackend(runner, cache_format="dense")
    if graph:
        backend.init_cuda_graph_state(8, 8 * NUM_DRAFT)
    requests = [0, 1]
    prefill = batches.extend(requests, [0, 0], [126, 250])
    backend.init_forward_metadata(prefill.batch)
    for layer in range(len(CONFIG.compress_ratios)):
        sim.layer(backend, prefill, layer)

    def run(step: harness.Step, extra: int, rows_per_request: int) -> None:
        step = batches.pad(step, runner, extra, rows_per_request)
        assert step.batch.seq_lens[-extra:].tolist() == [1] * extra
        assert step.batch.req_pool_indices[-extra:].tolist() == [0] * extra
        if graph:
            backend.init_forward_metadata_out_graph(step.batch)
        else:
            backend.init_forward_metadata(step.batch)
        assert backend.forward_metadata.batch_size == len(requests) + extra
        for layer in range(len(CONFIG.compress_ratios)):
            out = sim.layer(backend, step, layer)
            assert out.shape[0] == len(step.rows) and torch.isfinite(out).all()
            assert sim.max_error(step.rows, layer, out) <= ATOL

    run(batches.verify(requests, [126, 250], NUM_DRAFT), 3, NUM_DRAFT)  # all accepted
    for seq_lens in ([131, 255], [132, 256], [133, 257]):
        run(batches.decode(requests, seq_lens), 2, 1)

    idle = batches.pad(batches.idle(), runner, 3, 1)
    backend.init_forward_metadata(idle.batch)
    assert backend.forward_metadata.num_rows == 0
    out = sim.layer(backend, idle, 0)
    assert out.shape == (3, CONFIG.num_heads, CONFIG.head_dim) and out.abs().max() == 0

    # MAX_LEN padding with an extend elsewhere (prepare_mlp_sync_batch): an idle rank runs a
    # fabricated EXTEND request of all its padded tokens, at pool row 0, writing slot 0.
    dummy = batches.dp_dummy_extend(300)
    backend.init_forward_metadata(dummy.batch)
    for layer in range(len(CONFIG.compress_ratios)):
        assert torch.isfinite(sim.layer(backend, dummy, layer)).all()
    run(batches.decode(requests, [134, 258]), 1, 1)  # the real requests' caches are intact


# ---------------------------------------------------------------------- pipeline parallelism
def stage_backend(pool: PagedRequestPool, start: int, end: int) -> DSV4AttentionBackend:
    """The backend of the pipeline stage that owns layers ``[start, end)``."""
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo

    runner = harness.mock_runner(pool, HF, num_draft_tokens=NUM_DRAFT)
    runner.layer_info = ModelLayerInfo(
        start_layer=start, end_layer=end, num_effective_layers=end - start
    )
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    runner.attn_backend = backend
    return backend


@pytest.mark.sglang
@pytest.mark.parametrize("split", [1, 2, 3])
def test_pipeline_stages_together_equal_one_backend(split: int) -> None:
    """Two stages, layers ``[0, split)`` and ``[split, 4)``, each planning the batch (every
    stage's runner plans its own): chunked prefill, verify, decode; each layer run on its
    stage equals the one backend exactly; each stage holds its own layers' caches and rings
    only, equal to the one backend's; a layer of the other stage is refused."""
    pool, model = make_model([140, 270])
    sim = harness.SimulatedModel(model)
    batches = harness.BatchBuilder(pool)
    single = make_backend(pool)
    stages = [stage_backend(pool, 0, split), stage_backend(pool, split, 4)]
    steps = [
        batches.extend([0, 1], [0, 0], [100, 200]),
        batches.extend([0, 1], [100, 200], [30, 60]),
        batches.verify([0, 1], [130, 260], NUM_DRAFT),
        batches.decode([0, 1], [135, 265]),
    ]
    for step in steps:
        for backend in (single, *stages):
            backend.init_forward_metadata(step.batch)
        for layer in range(len(CONFIG.compress_ratios)):
            feed = sim.feed(step.rows, layer)
            want = sim.run_feed(single, step.batch, layer, feed)
            got = sim.run_feed(stages[layer >= split], step.batch, layer, feed)
            assert torch.equal(got, want), (step.batch.forward_mode, layer)
    reference = single.state.named_tensors()
    for stage, layers in zip(stages, (range(split), range(split, 4)), strict=True):
        assert stage.state.pools.layers == layers
        held = stage.state.named_tensors()
        assert {int(name.lstrip("_cdeinrgowx")) for name in held} == set(layers)
        for name, tensor in held.items():
            assert torch.equal(tensor, reference[name]), name
    with pytest.raises(ContractError, match=rf"layer=0; these caches hold layers \[{split}, 4\)"):
        sim.run_feed(stages[1], steps[-1].batch, 0, sim.feed(steps[-1].rows, 0))


@pytest.mark.sglang
def test_a_stage_outside_the_model_is_refused() -> None:
    pool, _ = make_model([40])
    with pytest.raises(ConfigError, match=r"layers=range\(2, 6\).*within the model's 4 layers"):
        stage_backend(pool, 2, 6)


# ------------------------------------------------------------------------ two-batch overlap
def tbo_children(tbo: Any, step: harness.Step, attn_tp_size: int) -> list[harness.Step]:
    """The two children sglang's ``TboForwardBatchPreparer.prepare`` splits ``step`` into
    (``two_batch_overlap.py``, run here as the scheduler's batch preparation runs it), with
    their rows: the parent's token range, then padding up to ``tbo_padded_len``."""
    from sglang.srt.batch_overlap.two_batch_overlap import (
        TboForwardBatchPreparer,
        compute_split_seq_index,
    )
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.runtime_context import get_context, get_parallel

    batch = step.batch
    batch.tbo_split_seq_index = compute_split_seq_index(
        batch.forward_mode, batch.input_ids.shape[0], batch.extend_seq_lens_cpu, None
    )
    with (
        get_parallel().override(attn_tp_size=attn_tp_size),
        get_context().override_server_args(device="cpu"),
        forward_context(ForwardContext(attn_backend=tbo)),
    ):
        TboForwardBatchPreparer.prepare(batch)
    children = []
    for child in batch.tbo_children:
        lo, hi = child.tbo_parent_token_range
        children.append(
            harness.Step(child, step.rows[lo:hi] + [None] * (child.tbo_padded_len - hi + lo))
        )
    return children


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("extend", "attn_tp_size", "cut"),
    [([10, 250, 30], 1, True), ([140, 20, 120], 1, False), ([10, 251, 30], 4, True)],
    ids=["two-chunk", "at-a-request", "two-chunk-padded"],
)
def test_two_batch_overlap_children_equal_the_unsplit_batch(
    extend: list[int], attn_tp_size: int, cut: bool
) -> None:
    """``--enable-two-batch-overlap``: sglang's ``TboAttnBackend.init_new`` builds the primary
    and two children from this backend's factory (one shared state) and plans them
    (``init_forward_metadata``); the children run layer by layer, the first child first (the
    second runs ``tbo_delta_stages`` behind it), over two prefill chunks, then a decode on the
    primary. Every real row equals the unsplit batch on one backend and the full causal pass;
    padding rows output 0 and write nothing; the caches equal the unsplit run's. The children
    stay off the graph paths."""
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend

    pool, model = make_model([300, 300, 300])
    sim = harness.SimulatedModel(model)
    batches = harness.BatchBuilder(pool)
    runner = harness.mock_runner(pool, HF, num_draft_tokens=NUM_DRAFT)
    tbo = TboAttnBackend.init_new(lambda: DSV4AttentionBackend(runner, cache_format="dense"))
    assert all(child.state is tbo.primary.state for child in tbo.children)
    assert not tbo._children_use_cuda_graph()
    single = make_backend(pool)
    requests = [0, 1, 2]
    for step in (
        batches.extend(requests, [0, 0, 0], extend),
        batches.extend(requests, extend, [5, 10, 20]),
    ):
        single.init_forward_metadata(step.batch)
        children = tbo_children(tbo, step, attn_tp_size)
        if step.batch.extend_prefix_lens_cpu == [0, 0, 0]:  # the first chunk: the split's kind
            second = children[1].batch
            assert (second.extend_prefix_lens_cpu[0] > 0) == cut
        tbo.init_forward_metadata(step.batch)
        for layer in range(len(CONFIG.compress_ratios)):
            want = sim.layer(single, step, layer)
            for backend, child in zip(tbo.children, children, strict=True):
                lo, hi = child.batch.tbo_parent_token_range
                out = sim.layer(backend, child, layer)
                assert out.shape[0] == child.batch.tbo_padded_len
                torch.testing.assert_close(out[: hi - lo], want[lo:hi], atol=ATOL, rtol=0)
                assert not out[hi - lo :].any()  # padding rows
                assert sim.max_error(child.rows, layer, out) <= ATOL
    # Decode runs unsplit on the primary (DeepSeek-V4 overlaps prefill only): it reads every
    # ring row the children left for it. (Other ring rows may differ: a cut request keeps the
    # first child's last rows, the unsplit run does not, and nothing reads them.)
    decode = batches.decode(requests, [n + m + 1 for n, m in zip(extend, [5, 10, 20], strict=True)])
    for backend in (single, tbo):
        backend.init_forward_metadata(decode.batch)
    for layer in range(len(CONFIG.compress_ratios)):
        want = sim.layer(single, decode, layer)
        torch.testing.assert_close(sim.layer(tbo.primary, decode, layer), want, atol=ATOL, rtol=0)
        assert sim.max_error(decode.rows, layer, want) <= ATOL
    reference = single.state.named_tensors()
    for name, tensor in tbo.primary.state.named_tensors().items():
        if "ring" not in name:  # the caches: every entry the same
            torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0, msg=name)


# --------------------------------------------------------------------------- start-up checks
def server_args(**overrides) -> ServerArgs:
    """sglang's ``ServerArgs`` as the dsv4 backend serves it, with ``overrides``."""
    values = dict(
        model_path="unused", page_size=256, disable_radix_cache=True,
        speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_steps=3,
        speculative_num_draft_tokens=NUM_DRAFT,
    )  # fmt: skip
    return ServerArgs(**{**values, **overrides})


def backend_with(args: ServerArgs, pool: PagedRequestPool) -> DSV4AttentionBackend:
    runner = harness.mock_runner(pool, HF)
    runner.server_args = args
    return DSV4AttentionBackend(runner, cache_format="dense")


@pytest.fixture(scope="module")
def small_pool() -> PagedRequestPool:
    return PagedRequestPool(CONFIG, [40], generator=torch.Generator().manual_seed(0))


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"disaggregation_mode": "prefill"}, "disaggregation_mode='prefill'"),
        ({"disaggregation_mode": "decode"}, "--disaggregation-mode"),
        ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
        ({"enable_hisparse": True}, "--enable-hisparse"),
        ({"enable_lmcache": True}, "--enable-lmcache"),
        ({"attn_cp_size": 2, "tp_size": 2}, "--attention-context-parallel-size"),
        ({"dcp_size": 2, "tp_size": 2}, "--decode-context-parallel-size"),
        ({"tp_size": 3}, "num_attention_heads=64 cannot be split"),
        ({"tp_size": 256, "attn_dp_size": 2}, "group of 128 ranks"),
    ],
)
def test_state_losing_or_unsplittable_configurations_are_refused_at_start_up(
    small_pool: PagedRequestPool, overrides: dict, message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        backend_with(server_args(**overrides), small_pool)
    assert message in str(refused.value)


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("overrides", "local_heads"),
    [
        ({}, 64),
        ({"tp_size": 8}, 8),  # attention TP 8
        ({"tp_size": 8, "attn_dp_size": 8}, 64),  # DP attention: every rank all heads
        ({"tp_size": 8, "attn_dp_size": 2}, 16),  # 2 DP groups of attention TP 4
        ({"tp_size": 8, "dp_size": 8, "enable_dp_attention": True}, 64),  # deprecated spelling
        ({"tp_size": 8, "ep_size": 8}, 8),  # expert parallelism: attention unaffected
    ],
)
def test_parallel_layouts_serve_the_rank_s_heads(
    small_pool: PagedRequestPool, overrides: dict, local_heads: int
) -> None:
    assert backend_with(server_args(**overrides), small_pool).local_heads == local_heads


@pytest.mark.sglang
def test_refusals_name_a_real_server_option() -> None:
    """Every option the backend refuses is a field of sglang 0.5.23's ``ServerArgs``, and
    sglang's default value of each is served."""
    from dsv4_backend.sglang_adapter.refusals import REFUSED
    from dsv4_backend.sglang_adapter.settings import REGION_COPYING_OPTIONS

    args = server_args()
    for row in REFUSED:
        if row.source == "server_args":
            assert hasattr(args, row.option), row.option
            assert not row.matches(getattr(args, row.option)), row.option
    for option, off, _ in REGION_COPYING_OPTIONS:
        assert getattr(args, option) == off, option  # sglang's default is off
    for option in ("tp_size", "attn_dp_size", "disable_radix_cache"):
        assert hasattr(args, option), option


# ---------------------------------------------------------------------- the A/B --dp-pad run
def test_ab_dp_pad_scenario_plans_padded_batches_and_matches_the_reference(
    tmp_path: Path, capsys
) -> None:
    """``dsv4-backend ab --dp-pad 3``: draft, verify and decode batches carry 3 padding
    requests into planning on both paths; every mode still equals the reference."""
    sizes: dict[ForwardKind, set[int]] = {}

    def recording_plan(config, batch, widths=None):
        sizes.setdefault(batch.kind, set()).add(batch.batch_size)
        return plan(config, batch, widths=widths)

    tiny = DSV4AttentionConfig.tiny(speculative=True)
    trace = build_trace(tiny, num_requests=2, max_len=150, cycles=2, decode_steps=2, dp_pad=3)
    assert trace.dp_pad == 3
    backend = DSV4Backend("dsv4-torch", path="torch", planner=recording_plan)
    result = run_trace(trace, backend, ReferenceBackend())
    assert result.passed, result.failed
    assert sizes[ForwardKind.TARGET_VERIFY] == {5} and sizes[ForwardKind.DECODE] == {5}
    assert sizes[ForwardKind.EXTEND] == {2} and sizes[ForwardKind.DRAFT_EXTEND] == {2}

    status = main(
        ["--a", "dsv4-torch", "--requests", "2", "--max-len", "150", "--cycles", "1",
         "--decode-steps", "2", "--dp-pad", "2", "--out", str(tmp_path), "--json", "--quiet"]
    )  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["trace"]["dp_pad"] == 2


def test_padding_requests_write_only_the_reserved_page() -> None:
    """``pad_requests`` lays padding out as sglang does, and no request owns page 0."""
    pool = PagedRequestPool(CONFIG, [300, 40, 600], generator=torch.Generator().manual_seed(1))
    owned = {int(s) // CONFIG.page_size for r, n in enumerate(pool.max_lens)
             for s in pool.slots(r, range(n))}  # fmt: skip
    assert 0 not in owned
    view = pool.pad_requests(pool.verify([0, 2], [10, 20], NUM_DRAFT), 2)
    assert view.req_pool_indices.tolist() == [1, 3, 0, 0]
    assert view.host_seq_lens == [10, 20, 1, 1]
    assert view.out_cache_loc[2 * NUM_DRAFT :].tolist() == [0] * 2 * NUM_DRAFT
    draft = pool.pad_requests(pool.draft_step([1], [5], 3, 1), 1)
    assert draft.out_cache_loc.numel() == 2 * 3
    with pytest.raises(BatchError, match="request padding"):
        pool.pad_requests(pool.extend([0], [0], [4]), 1)
