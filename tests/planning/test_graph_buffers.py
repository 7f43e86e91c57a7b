"""CUDA-graph metadata buffers: the graph path equals the eager plan, padded with sentinels."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_spec import BatchSpec, assert_same, make_batch
from stress import sized

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ContractError
from dsv4_backend.kernels.dispatch import TORCH, TRITON_INTERPRETER, force_path
from dsv4_backend.kernels.variants import force_variant
from dsv4_backend.planning import (
    AttentionMetadata,
    BatchView,
    ForwardKind,
    GraphMetadataBuffers,
    PlanWidths,
    checks,
    pad_plan,
    plan,
)
from dsv4_backend.planning.planner import LOW_RATIO_PLAN
from dsv4_backend.testing.simulation.v41 import tiny_v41
from dsv4_backend.tools.op_counter import LaunchCounter, OpCounter

CONFIG = DSV4AttentionConfig.tiny()
WIDTHS = PlanWidths(page_table=20, c128=40)  # covers 5120 tokens
D, V = ForwardKind.DECODE, ForwardKind.TARGET_VERIFY

#: Padding the buffers promise (module table of graph_buffers.py), written out independently.
SENTINELS = {
    "positions_causal": 0,
    "row_batch_ids": 0,
    "swa_topk_lengths": 1,
    "c4.topk_lengths_raw": 0,
    "c128.topk_lengths_raw": 0,
    "c4.sparse_topk_lengths": 1,
    "c128.sparse_topk_lengths": 1,
    "c1.topk_lengths_raw": 0,
    "c2.topk_lengths_raw": 0,
    "c1.sparse_topk_lengths": 1,
    "c2.sparse_topk_lengths": 1,
}
#: DeepSeek-V4.1 (c1 / c2 fields, a c1 candidate source), planned by the same kernels.
V41 = tiny_v41()


def padded(eager: AttentionMetadata, num_rows: int, widths: PlanWidths) -> dict:
    """The eager plan's fields widened to the buffer widths and padded to ``num_rows``."""
    col_widths = {"page_table": widths.page_table, "c128.page_indices": widths.c128}
    out = {}
    for name, value in eager.named_tensors().items():
        if value.dim() == 2:
            value = F.pad(
                value, (0, col_widths.get(name, value.shape[1]) - value.shape[1]), value=-1
            )
        pad_rows = num_rows - value.shape[0]
        fill = SENTINELS.get(name, -1)
        out[name] = torch.cat([value, value.new_full((pad_rows, *value.shape[1:]), fill)])
    return out


def buffers(config: DSV4AttentionConfig = CONFIG, **overrides: object) -> GraphMetadataBuffers:
    kwargs = dict(max_batch_size=64, max_rows=300, widths=WIDTHS, device="cpu")
    kwargs.update(overrides)
    return GraphMetadataBuffers(config, **kwargs)


SPECS = [
    BatchSpec("decode", D, (1, 128, 257, 513), swa_map=True),
    BatchSpec("verify", V, (126, 253), num_draft_tokens=4, seed=1),
    BatchSpec("draft_step1", D, (126, 253), draft_steps=3, step_id=1, seed=2),
    BatchSpec("extend", ForwardKind.EXTEND, (4, 330), extend_lens=(1, 200), seed=3),
    BatchSpec("idle", ForwardKind.IDLE, ()),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("extra_rows", [0, 5])
def test_load_equals_eager_plan_then_sentinels(spec: BatchSpec, extra_rows: int) -> None:
    batch = make_batch(spec)
    bufs = buffers()
    eager = plan(CONFIG, batch)
    num_rows = batch.num_rows + extra_rows
    for source in (eager, plan(CONFIG, batch, widths=WIDTHS)):  # eager and graph-width plans
        loaded = bufs.load(source, num_rows=num_rows)
        assert (loaded.kind, loaded.batch_size, loaded.num_rows) == (
            spec.kind,
            eager.batch_size,
            num_rows,
        )
        assert_same(loaded.named_tensors(), padded(eager, num_rows, WIDTHS), spec.name)


def test_views_share_storage_across_loads() -> None:
    bufs = buffers()
    big = bufs.load(plan(CONFIG, make_batch(SPECS[0])), num_rows=8)
    small = bufs.load(plan(CONFIG, make_batch(SPECS[1])), num_rows=8)
    for name, value in big.named_tensors().items():
        assert value.data_ptr() == small.named_tensors()[name].data_ptr(), name
    assert small.c4.compress_plan.data_ptr() == bufs.compressed[4]["compress_plan"].data_ptr()
    # Stale rows of the previous, larger plan are overwritten.
    decode = bufs.load(plan(CONFIG, make_batch(SPECS[0])), num_rows=8)
    assert decode.positions_causal.tolist() == [0, 127, 256, 512, 0, 0, 0, 0]


def test_load_allocates_nothing_and_never_syncs() -> None:
    bufs = buffers()
    source = plan(CONFIG, make_batch(SPECS[1]), widths=WIDTHS)
    with OpCounter() as ops:
        bufs.load(source, num_rows=16)
    assert not ops.syncs
    assert set(ops.counts) <= {"aten.slice", "aten.copy_", "aten.fill_"}, dict(ops.counts)


def test_graph_path_on_meta_tensors() -> None:
    """Plan + load with every tensor on the meta device: no read of device data anywhere."""
    batch = make_batch(SPECS[1])
    moved = {
        name: getattr(batch, name).to("meta")
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "req_to_token")
    }
    meta_batch = BatchView(kind=V, num_draft_tokens=4, **moved)
    bufs = buffers(device="meta")
    loaded = bufs.load(plan(CONFIG, meta_batch, widths=WIDTHS), num_rows=12)
    assert loaded.page_table.shape == (12, WIDTHS.page_table)
    assert loaded.c128.page_indices.shape == (12, WIDTHS.c128)


def test_draft_extend_has_no_compressed_fields() -> None:
    batch = make_batch(BatchSpec("de", ForwardKind.DRAFT_EXTEND, (4, 130), extend_lens=(1, 4)))
    loaded = buffers().load(plan(CONFIG, batch))
    assert loaded.c4 is None and loaded.c128 is None and loaded.num_rows == 5


def test_pad_plan_appends_sentinel_rows_and_requests() -> None:
    """A plan padded after planning (sglang's draft extend): real rows kept, sentinels after."""
    batch = make_batch(BatchSpec("de", ForwardKind.DRAFT_EXTEND, (4, 130), extend_lens=(1, 4)))
    source = plan(CONFIG, batch)
    grown = pad_plan(CONFIG, source, batch_size=3, num_rows=9)
    assert (grown.batch_size, grown.num_rows) == (3, 9)
    widths = PlanWidths(page_table=source.page_table.shape[1], c128=1)
    assert_same(grown.named_tensors(), padded(source, 9, widths), "pad_plan")
    with pytest.raises(ContractError, match="padding only appends"):
        pad_plan(CONFIG, source, batch_size=1, num_rows=9)


def test_refuses_plans_larger_than_the_buffers() -> None:
    source = plan(CONFIG, make_batch(SPECS[0]))  # 4 rows, 513 tokens: 3 pages, 4 c128 entries
    with pytest.raises(
        ContractError,
        match=r"num_rows=4 as 4 rows into buffers of "
        r"max_batch_size=64, max_rows=3 .* build GraphMetadataBuffers with",
    ):
        buffers(max_rows=3).load(source)
    with pytest.raises(ContractError, match=r"batch_size=4, .* max_batch_size=2"):
        buffers(max_batch_size=2).load(source)
    with pytest.raises(ContractError, match=r"need plan rows <= num_rows <= max_rows"):
        buffers().load(source, num_rows=3)
    narrow = PlanWidths(page_table=2, c128=8)
    with pytest.raises(
        ContractError,
        match=r"plan widths PlanWidths\(page_table=3, c128=4\) "
        r"exceed the buffers' PlanWidths\(page_table=2, c128=8\)",
    ):
        buffers(widths=narrow).load(source)
    with pytest.raises(ContractError, match="plan tensors are on cpu, the buffers on meta"):
        buffers(device="meta").load(source)
    with pytest.raises(ContractError, match="no ratio-128 layers"):
        GraphMetadataBuffers(
            DSV4AttentionConfig.tiny(compress_ratios=(0, 4)),
            max_batch_size=8,
            max_rows=8,
            widths=WIDTHS,
            device="cpu",
        ).load(source)


@st.composite
def graph_specs(draw: st.DrawFn) -> BatchSpec:
    kind = draw(st.sampled_from([D, V, "draft"]))
    # Quick: up to 8 requests of 4 pages; DSV4_STRESS=1: up to 64 requests of 16 pages.
    bs = draw(st.integers(1, sized(8, 64)))
    seq = tuple(draw(st.lists(st.integers(1, sized(1024, 4096)), min_size=bs, max_size=bs)))
    seed = draw(st.integers(0, 2**16))
    if kind is V:
        return BatchSpec("hyp", V, seq, num_draft_tokens=draw(st.integers(1, 4)), seed=seed)
    if kind == "draft":
        steps = draw(st.integers(1, 4))
        return BatchSpec(
            "hyp", D, seq, draft_steps=steps, step_id=draw(st.integers(0, steps - 1)), seed=seed
        )
    return BatchSpec("hyp", D, seq, swa_map=draw(st.booleans()), seed=seed)


@settings(max_examples=sized(10, 100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=graph_specs(), extra_rows=st.integers(0, 8))
def test_graph_path_equals_eager_random(spec: BatchSpec, extra_rows: int) -> None:
    batch = make_batch(spec, extra_context=0)
    bufs = buffers()
    num_rows = batch.num_rows + extra_rows
    loaded = bufs.load(plan(CONFIG, batch, widths=WIDTHS), num_rows=num_rows)
    assert_same(loaded.named_tensors(), padded(plan(CONFIG, batch), num_rows, WIDTHS), str(spec))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("extra_rows", [0, 5])
def test_v41_fields_by_the_twin_after_the_fused_launch_equal_the_fused_ones(
    spec: BatchSpec, extra_rows: int
) -> None:
    """``LOW_RATIO_PLAN``'s CUDA baseline: the fused planner's launch without the c1 / c2
    fields, then the torch twin into the same buffers: equal to the fields of the one launch,
    padded rows included."""
    batch = make_batch(spec)
    num_rows = batch.num_rows + extra_rows
    plans = {}
    for low in ("fused", "torch"):
        with force_path(TRITON_INTERPRETER), force_variant(LOW_RATIO_PLAN, low):
            plans[low] = buffers(V41).plan(batch, num_rows=num_rows).named_tensors()
    assert_same(plans["torch"], plans["fused"], spec.name)


@pytest.mark.parametrize("config", [CONFIG, V41], ids=["v4", "v41"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("extra_rows", [0, 5])
def test_fused_plan_into_buffers_equals_torch_plan_loaded(
    spec: BatchSpec, extra_rows: int, config: DSV4AttentionConfig
) -> None:
    """``buffers.plan`` (the fused planner in the interpreter, writing padded rows itself)
    equals the torch planner's plan loaded with ``load``: the batch checks and the fields in
    one launch each, no torch op (DeepSeek-V4.1's c1 / c2 fields included)."""
    batch = make_batch(spec)
    num_rows = batch.num_rows + extra_rows
    with force_path(TORCH):
        eager = plan(config, batch, widths=WIDTHS)
        want = buffers(config).load(eager, num_rows=num_rows).named_tensors()
    bufs = buffers(config)
    with force_path(TRITON_INTERPRETER), LaunchCounter() as launches:
        got = bufs.plan(batch, num_rows=num_rows).named_tensors()
    assert_same(got, want, spec.name)
    want = {"triton:_check_kernel": 1}
    if num_rows:  # nothing to write for an IDLE batch planned as 0 rows
        want["triton:_plan_kernel"] = 1
    if spec.kind in (ForwardKind.EXTEND, ForwardKind.DRAFT_EXTEND):
        want["copy: extend lengths to the device"] = 1
    assert launches.kernels == want, launches.summary()
    assert not launches.torch_ops, launches.torch_ops


def _corrupt(batch: BatchView, field: str, index: int, value: int) -> BatchView:
    tensor = getattr(batch, field).clone()
    tensor[index] = value
    return dataclasses.replace(batch, **{field: tensor})


@pytest.mark.parametrize(
    ("spec", "field", "index", "value"),
    [
        (SPECS[0], "out_cache_loc", 2, -1),  # a slot out of range
        (SPECS[1], "req_pool_indices", 0, -1),  # would wrap to the last pool row
        (SPECS[3], "out_cache_loc", 100, 0),  # another slot, mid-request
    ],
    ids=["slot", "pool-row", "foreign"],
)
@pytest.mark.parametrize("config", [CONFIG, V41], ids=["v4", "v41"])
def test_deferred_checks_mask_the_same_rows_fused_and_torch(
    spec: BatchSpec,
    field: str,
    index: int,
    value: int,
    config: DSV4AttentionConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deferred (a GPU without strict mode), the fused planner plans a failing request as the
    torch twin does (writes nothing, reads pool row 0; DeepSeek-V4.1: no c1 / c2 entry, no
    visible entry) and defers the same verdict."""
    monkeypatch.setattr(checks, "defer_checks", lambda device: True)
    batch = _corrupt(make_batch(spec), field, index, value)
    plans = {}
    for path in (TORCH, TRITON_INTERPRETER):
        with force_path(path):
            plans[path] = plan(config, batch, widths=WIDTHS)
    failed = plans[TORCH].swa_out_loc == -1
    for part in (plans[TORCH].c1, plans[TORCH].c2):
        if part is not None:
            assert (part.out_loc[failed] == -1).all() and (part.topk_lengths_raw[failed] == 0).all()
    assert_same(plans[TRITON_INTERPRETER].named_tensors(), plans[TORCH].named_tensors(), spec.name)
    assert (plans[TRITON_INTERPRETER].swa_out_loc == -1).any()
    verdicts = []
    for metadata in plans.values():
        assert metadata.pending_checks is not None
        with pytest.raises(BatchError, match=rf"{field}\[{index}\]={value}") as raised:
            metadata.pending_checks.raise_if_failed()
        verdicts.append(str(raised.value))
    assert verdicts[0] == verdicts[1]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_v41_fields_in_the_fused_launch_on_cuda(spec: BatchSpec) -> None:
    """On a GPU (``scripts/gpu_check.sh``'s ``v41-kernels`` step): the fused planner with
    DeepSeek-V4.1's fields in its launch (``LOW_RATIO_PLAN`` ``fused``, opt-in on CUDA) writes
    the buffers the torch planner's plan loads, padded rows included."""
    cpu = make_batch(spec)
    moved = {
        f.name: value.cuda()
        for f in dataclasses.fields(cpu)
        if isinstance(value := getattr(cpu, f.name), torch.Tensor)
    }
    batch = dataclasses.replace(cpu, **moved)
    num_rows = batch.num_rows + 5
    with force_path(TORCH):
        eager = plan(V41, batch, widths=WIDTHS)
        want = buffers(V41, device="cuda").load(eager, num_rows=num_rows).named_tensors()
    with force_variant(LOW_RATIO_PLAN, "fused"):
        got = buffers(V41, device="cuda").plan(batch, num_rows=num_rows).named_tensors()
    assert_same(
        {k: v.cpu() for k, v in got.items()}, {k: v.cpu() for k, v in want.items()}, spec.name
    )


@pytest.mark.gpu
def test_v41_tail_window_floors_in_the_fused_launch_on_cuda() -> None:
    """On a GPU (the ``v41-kernels`` step): a late-layer tail's extend (window floors) planned
    by the fused planner (``LOW_RATIO_PLAN`` ``fused``) equals the torch planner's plan."""
    from dsv4_backend.planning import late_layer_tail

    cpu = make_batch(SPECS[3])  # an extend of 1 and 200 rows
    moved = {
        f.name: value.cuda()
        for f in dataclasses.fields(cpu)
        if isinstance(value := getattr(cpu, f.name), torch.Tensor)
    }
    tail = late_layer_tail(dataclasses.replace(cpu, **moved), 128).batch
    with force_path(TORCH):
        want = plan(V41, tail).named_tensors()
    with force_variant(LOW_RATIO_PLAN, "fused"):
        got = plan(V41, tail).named_tensors()
    assert_same({k: v.cpu() for k, v in got.items()}, {k: v.cpu() for k, v in want.items()}, "tail")
