"""The sglang adapter with real sglang 0.5.23 objects (ForwardBatch, ForwardMode, ReqToTokenPool,
the registry and the draft factory): construction and its refusals, the batch mapping, the
lazy-init contract and the two seed failures (docs/design.md §5)."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.speculative import eagle_utils

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ConfigError, ContractError
from dsv4_backend.planning import BatchView, ForwardKind, per_step_draft_out_cache_loc, plan
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.sglang_adapter.batch_read import batch_view
from dsv4_backend.sglang_adapter.draft import DSV4MultiStepDraftBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
HF = harness.tiny_hf_config(CONFIG)


@pytest.fixture
def pool() -> PagedRequestPool:
    return PagedRequestPool(CONFIG, [140, 270], generator=torch.Generator().manual_seed(0))


def make_backend(pool: PagedRequestPool, **runner_kwargs) -> DSV4AttentionBackend:
    runner = harness.mock_runner(pool, HF, **runner_kwargs)
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    runner.attn_backend = backend
    return backend


def idle_batch() -> ForwardBatch:
    """An sglang IDLE batch: no requests, no rows."""
    empty = torch.zeros(0, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=None, req_pool_indices=empty,
        seq_lens=empty, out_cache_loc=empty, seq_lens_sum=0,
    )  # fmt: skip


def test_backend_is_an_sglang_backend_exposing_its_pools(pool: PagedRequestPool) -> None:
    backend = make_backend(pool)
    assert isinstance(backend, AttentionBackend)
    assert backend.req_to_token_pool.req_to_token.shape == pool.req_to_token.shape
    assert backend.token_to_kv_pool.full_to_swa_index_mapping is pool.full_to_swa
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    assert backend.config.compress_ratios == CONFIG.compress_ratios
    # The model writes window keys through store_cache only with this flag set.
    assert os.environ["SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE"] == "True"


def test_backends_of_one_runner_share_one_state(pool: PagedRequestPool) -> None:
    runner = harness.mock_runner(pool, HF)
    target = DSV4AttentionBackend(runner, cache_format="dense")
    draft = DSV4MultiStepDraftBackend(runner, 1, 3, cache_format="dense")
    assert all(b.state is target.state for b in draft.attn_backends)
    assert [b.speculative_step_id for b in draft.attn_backends] == [0, 1, 2]


def test_draft_worker_serves_the_window_only_mtp_layer(pool: PagedRequestPool) -> None:
    backend = make_backend(pool, is_draft_worker=True)
    assert backend.config.compress_ratios == (0,)


@pytest.mark.parametrize(
    ("runner_kwargs", "hf_overrides", "message"),
    [
        ({"page_size": 128}, {}, "page_size=128"),
        ({"topk": 2}, {}, "speculative_eagle_topk=2"),
        ({"attn_cp_size": 2}, {}, "attn_cp_size=2"),
        ({"enable_flexkv": True}, {}, "does not serve --enable-flexkv"),
        ({"radix_cache_backend": "mine"}, {}, "radix_cache_backend='mine'"),
        ({"enable_streaming_session": True}, {}, "--enable-streaming-session"),
        ({}, {"compress_ratios": [0, 4, 2, 128, 0]}, "compress_ratios contains [2]"),
    ],
)
def test_unservable_configurations_are_refused_naming_the_option(
    pool: PagedRequestPool, runner_kwargs: dict, hf_overrides: dict, message: str
) -> None:
    runner = harness.mock_runner(pool, {**HF, **hf_overrides}, **runner_kwargs)
    with pytest.raises(ConfigError) as refused:
        DSV4AttentionBackend(runner)
    assert message in str(refused.value)


def test_sglang_default_radix_cache_is_accepted(pool: PagedRequestPool) -> None:
    """The plain launch: radix cache on (sglang's default), no cache flags."""
    runner = harness.mock_runner(pool, HF, disable_radix_cache=False)
    assert not runner.server_args.disable_radix_cache
    DSV4AttentionBackend(runner, cache_format="dense")


def test_draft_topk_argument_is_checked_too(pool: PagedRequestPool) -> None:
    runner = harness.mock_runner(pool, HF, topk=1)
    with pytest.raises(ConfigError, match="speculative_eagle_topk=2"):
        DSV4MultiStepDraftBackend(runner, 2, 3)


def test_sglang_registry_and_draft_factory_build_these_backends(pool: PagedRequestPool) -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    from dsv4_backend.registration import register

    register()
    runner = harness.mock_runner(pool, HF)
    runner.draft_attention_backend = None
    assert type(ATTENTION_BACKENDS["dsv4"](runner)) is DSV4AttentionBackend
    factory = DraftBackendFactory(runner, topk=1, speculative_num_steps=3)
    stamp, draft = factory._create_dsv4_decode_backend()
    assert stamp == "dsv4" and isinstance(draft, DSV4MultiStepDraftBackend)
    assert len(draft.attn_backends) == 3
    stamp, extend = factory._create_dsv4_prefill_backend()
    assert stamp == "dsv4" and type(extend) is DSV4AttentionBackend


# ------------------------------------------------------------------------------ batch views
def test_every_supported_mode_maps_to_its_kind(pool: PagedRequestPool) -> None:
    builder = harness.BatchBuilder(pool)
    r2t = pool.req_to_token
    view = lambda step, **kw: batch_view(  # noqa: E731
        step.batch, req_to_token=r2t, full_to_swa=pool.full_to_swa, num_draft_tokens=4, **kw
    )
    steps = {
        ForwardMode.EXTEND: (builder.extend([0, 1], [0, 3], [5, 2]), ForwardKind.EXTEND),
        ForwardMode.DECODE: (builder.decode([0, 1], [6, 6]), ForwardKind.DECODE),
        ForwardMode.TARGET_VERIFY: (builder.verify([0, 1], [6, 6], 4), ForwardKind.TARGET_VERIFY),
        ForwardMode.DRAFT_EXTEND_V2: (
            builder.draft_extend([0, 1], [6, 9], 4),
            ForwardKind.DRAFT_EXTEND,
        ),
    }
    for mode, (step, kind) in steps.items():
        assert step.batch.forward_mode is mode  # the harness builds sglang's own modes
        assert view(step).kind is kind
    verify = view(steps[ForwardMode.TARGET_VERIFY][0])
    assert verify.num_rows == 8
    # DRAFT_EXTEND_V2: sglang passes seq_lens = L + n; the prefix is L.
    extend = view(steps[ForwardMode.DRAFT_EXTEND_V2][0])
    assert extend.extend_prefix_lens == [6, 9]
    idle = idle_batch()
    assert view(harness.Step(idle, [])).num_rows == 0


def test_mixed_chunks_are_planned_as_the_extend_they_are() -> None:
    """``--enable-mixed-chunk``: MIXED batches (a new request's chunks, then the running
    decodes as 1-token extends, ``mix_with_running``'s layout) plan exactly as the same batch in
    EXTEND mode; every layer's output equals the full causal pass, before and after, and the
    caches and rings equal the EXTEND-mode backend's."""
    pool = PagedRequestPool(CONFIG, [140, 270, 90], generator=torch.Generator().manual_seed(4))
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(5))
    mixed, extend = make_backend(pool), make_backend(pool)
    sim, builder = harness.SimulatedModel(model), harness.BatchBuilder(pool)
    steps = [
        builder.extend([0, 1], [0, 0], [120, 250]),
        builder.decode([0, 1], [121, 251]),
        builder.mixed([2], [0], [40], [0, 1], [122, 252]),
        builder.mixed([2], [40], [45], [0, 1], [123, 253]),
        builder.decode([0, 1, 2], [124, 254, 86]),
    ]
    assert [s.batch.forward_mode for s in steps].count(ForwardMode.MIXED) == 2
    for step in steps:
        as_extend = dataclasses.replace(step.batch)
        if step.batch.forward_mode is ForwardMode.MIXED:
            as_extend.forward_mode = ForwardMode.EXTEND
        mixed.init_forward_metadata(step.batch)
        extend.init_forward_metadata(as_extend)
        got, want = mixed.forward_metadata.named_tensors(), extend.forward_metadata.named_tensors()
        assert got.keys() == want.keys()
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
        for layer in range(len(CONFIG.compress_ratios)):
            out = sim.layer(mixed, step, layer)
            sim.layer(extend, harness.Step(as_extend, step.rows), layer)
            assert sim.max_error(step.rows, layer, out) < 1e-4, (step.batch.forward_mode, layer)
    want_state = extend.state.named_tensors()
    for name, got_state in mixed.state.named_tensors().items():
        torch.testing.assert_close(got_state, want_state[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("mode", [ForwardMode.SPLIT_PREFILL, ForwardMode.DLLM_EXTEND])
def test_unsupported_modes_are_refused_by_name(pool: PagedRequestPool, mode: ForwardMode) -> None:
    step = harness.BatchBuilder(pool).decode([0], [5])
    step.batch.forward_mode = mode
    backend = make_backend(pool)
    with pytest.raises(BatchError, match=mode.name):
        backend.init_forward_metadata(step.batch)


@pytest.mark.parametrize(("bs", "topk", "steps"), [(1, 1, 1), (2, 1, 3), (3, 2, 4), (4, 1, 2)])
def test_per_step_slots_equal_sglangs(bs: int, topk: int, steps: int) -> None:
    loc = torch.randperm(1000)[: bs * topk * steps]
    ours = per_step_draft_out_cache_loc(loc, bs, topk, steps)
    theirs = eagle_utils.per_step_draft_out_cache_loc(loc, bs, topk, steps)
    assert torch.equal(ours, theirs)
    assert ours.is_contiguous() and ours.stride() == (bs * topk, 1)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_draft_step_plans_its_own_slot_and_causal_length(
    pool: PagedRequestPool, graph: bool
) -> None:
    runner = harness.mock_runner(pool, HF)
    draft = DSV4MultiStepDraftBackend(runner, 1, 3, cache_format="dense")
    step = harness.BatchBuilder(pool).draft([0, 1], [130, 257], 3)
    if graph:
        draft.init_cuda_graph_state(max_bs=4, max_num_tokens=16)
        # The last step only samples: it gets no graph buffers.
        assert draft.attn_backends[2].graph_buffers is None
        draft.init_forward_metadata_out_graph(step.batch)
    else:
        draft.init_forward_metadata(step.batch)
    assert draft.attn_backends[2].forward_metadata is None  # the last step only samples
    per_step = per_step_draft_out_cache_loc(step.batch.out_cache_loc, 2, 1, 3)
    for i, backend in enumerate(draft.attending_backends):
        metadata = backend.forward_metadata
        assert torch.equal(metadata.swa_out_loc, pool.full_to_swa[per_step[i]])
        # Causal length L + i + 1 (like sglang's HIP backend; its CUDA backend uses L).
        assert (metadata.positions_causal + 1).tolist() == [131 + i, 258 + i]


# ------------------------------------------------------------------------ lazy-init contract
def test_a_fresh_batch_needs_init_and_the_forward_never_plans(pool: PagedRequestPool) -> None:
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(1))
    backend = make_backend(pool)
    step = harness.BatchBuilder(pool).decode([0, 1], [5, 9])
    assert step.batch.needs_forward_metadata_init()
    with pytest.raises(ContractError, match="no attention metadata was planned"):
        harness.SimulatedModel(model).layer(backend, step, 0)
    backend.init_forward_metadata(step.batch)
    step.batch.mark_forward_metadata_ready()
    assert not step.batch.needs_forward_metadata_init()


def test_a_plan_for_another_batch_is_refused(pool: PagedRequestPool) -> None:
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(1))
    backend = make_backend(pool)
    builder = harness.BatchBuilder(pool)
    backend.init_forward_metadata(builder.decode([0, 1], [5, 9]).batch)
    # Same shape, other mode: a decode plan must not serve a verify forward.
    verify = builder.verify([0, 1], [4, 8], 1)
    with pytest.raises(ContractError, match="planned for DECODE"):
        harness.SimulatedModel(model).layer(backend, verify, 0)


def test_idle_forward_is_empty_and_plans_no_rows(pool: PagedRequestPool) -> None:
    backend = make_backend(pool)
    idle = idle_batch()
    backend.init_forward_metadata(idle)
    assert backend.forward_metadata.num_rows == 0
    q = torch.zeros(0, CONFIG.num_heads, CONFIG.head_dim, dtype=torch.bfloat16)
    layer = SimpleNamespace(layer_id=1, tp_q_head_num=8, v_head_dim=128)
    out = backend.forward(q, q, q, layer, idle, compress_ratio=4, attn_sink=torch.zeros(8))
    assert out.shape == (0, 8, 128) and out.dtype == torch.bfloat16
    assert backend.forward_c4_indexer(x=q, q_lora=q, forward_batch=idle, c4_indexer=None) is None


def test_graph_planning_needs_the_graph_state(pool: PagedRequestPool) -> None:
    backend = make_backend(pool)
    step = harness.BatchBuilder(pool).decode([0, 1], [5, 9])
    with pytest.raises(ContractError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_out_graph(step.batch)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=16)
    backend.init_forward_metadata_out_graph(step.batch)
    assert backend.forward_metadata.page_table.shape == (2, backend.graph_buffers.widths.page_table)
    # The compressors' arrival counters exist before any capture (a capture cannot allocate).
    c128 = backend.state.compressor_states[CONFIG.compress_ratios.index(128)]
    assert c128.arrivals.at_least(0).numel() >= 16


# ---------------------------------------------------------------------------- seed failures
def test_seed_a_verify_planned_before_dp_padding_is_stopped(pool: PagedRequestPool) -> None:
    """Bug 2: the host plans verify, then pads for data-parallel sync, then runs the forward."""
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(1))
    backend = make_backend(pool)
    builder = harness.BatchBuilder(pool)
    step = builder.verify([0, 1], [126, 253], 4)
    backend.init_forward_metadata(step.batch)  # too early
    # sglang's _pad_inputs_to_size reads only the backend's fill value from the runner.
    padded = builder.pad(step, SimpleNamespace(attn_backend=backend), 1, 4)
    with pytest.raises(ContractError) as stopped:
        harness.SimulatedModel(model).layer(backend, padded, 1)
    message = str(stopped.value)
    assert "planned before the batch reached its final (padded) shape" in message
    assert "batch_size=2, num_rows=8" in message and "batch_size=3, num_rows=12" in message


def test_seed_b_a_draft_step_without_per_step_slicing_is_refused(pool: PagedRequestPool) -> None:
    """Bug 1: the draft batch's slots are [bs, topk, steps]; each step must take its own row."""
    runner = harness.mock_runner(pool, HF)
    draft = DSV4MultiStepDraftBackend(runner, 1, 3, cache_format="dense")
    step = harness.BatchBuilder(pool).draft([0, 1], [130, 257], 3)
    whole = step.batch.out_cache_loc
    # A host that slices before the backend (the backend slices again): refused.
    step.batch.out_cache_loc = per_step_draft_out_cache_loc(whole, 2, 1, 3)[0]
    with pytest.raises(BatchError) as refused:
        draft.init_forward_metadata(step.batch)
    assert "(2,)" in str(refused.value) and "2 * 1 * 3 = 6" in str(refused.value)
    # A planner handed the whole buffer as if it were one decode step: refused.
    with pytest.raises(BatchError, match=r"shape \(6,\); a DECODE batch of 2 requests needs 2"):
        plan(CONFIG, BatchView(
            kind=ForwardKind.DECODE, req_pool_indices=step.batch.req_pool_indices,
            seq_lens=step.batch.seq_lens, out_cache_loc=whole, req_to_token=pool.req_to_token,
        ))  # fmt: skip
