"""The metadata planner against the brute-force spec (tests/support/planning_spec.py), field by
field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_spec import BatchSpec, assert_same, expected_metadata, make_batch
from stress import sized

from dsv4_backend.config import DSV4AttentionConfig, entries_per_page
from dsv4_backend.errors import BatchError, ConfigError, ContractError
from dsv4_backend.planning import (
    GRAPH_KINDS,
    BatchView,
    CompressPlanCall,
    DraftStep,
    ForwardKind,
    PlanWidths,
    checks,
    compute_compress_plans,
    per_step_draft_out_cache_loc,
    plan,
    row_fields,
)
from dsv4_backend.testing.simulation.v41 import tiny_v41
from dsv4_backend.tools.op_counter import OpCounter

CONFIG = DSV4AttentionConfig.tiny()
D, E, V = ForwardKind.DECODE, ForwardKind.EXTEND, ForwardKind.TARGET_VERIFY

SPECS = [
    BatchSpec("decode_short", D, (1, 3, 4, 5, 6, 7, 8, 9)),
    BatchSpec("decode_c128_boundary", D, (127, 128, 129), swa_map=True, seed=1),
    BatchSpec("decode_page_boundary", D, (255, 256, 257), seed=2),
    BatchSpec("decode_511_513", D, (511, 512, 513), swa_map=True, seed=3),
    BatchSpec("decode_crossing", D, (124, 128, 132, 252, 256, 260, 508, 512, 516), seed=4),
    BatchSpec("extend_mixed", E, (4, 130, 260, 330, 9), extend_lens=(1, 4, 10, 200, 9), seed=5),
    BatchSpec(
        "extend_fresh", E, (1, 129, 257, 513), extend_lens=(1, 129, 257, 513), seed=6, swa_map=True
    ),
    BatchSpec("draft_extend", ForwardKind.DRAFT_EXTEND, (4, 130), extend_lens=(1, 4), seed=7),
    BatchSpec("verify", V, (126, 253), num_draft_tokens=4, seed=8),
    BatchSpec("verify_swa_map", V, (126, 253), num_draft_tokens=4, swa_map=True, seed=9),
    *[
        BatchSpec(f"draft_step{i}", D, (126, 253), draft_steps=3, step_id=i, seed=10)
        for i in range(3)
    ],
    BatchSpec("idle", ForwardKind.IDLE, ()),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_plan_matches_brute_force(spec: BatchSpec) -> None:
    batch = make_batch(spec)
    meta = plan(CONFIG, batch)
    assert (meta.kind, meta.batch_size, meta.num_rows) == (
        spec.kind,
        len(spec.seq_lens),
        batch.num_rows,
    )
    assert_same(meta.named_tensors(), expected_metadata(CONFIG, batch), spec.name)
    # Fixed (graph) widths give the same rows, padded with -1 columns.
    widths = PlanWidths(page_table=4, c128=7)
    fixed = plan(CONFIG, batch, widths=widths)
    assert_same(fixed.named_tensors(), expected_metadata(CONFIG, batch, (4, 7)), spec.name)


def test_ratios_absent_from_config_have_no_fields() -> None:
    batch = make_batch(SPECS[0])
    window_only = plan(DSV4AttentionConfig.tiny(compress_ratios=(0, 0)), batch)
    assert window_only.c4 is None and window_only.c128 is None
    c4_only = plan(DSV4AttentionConfig.tiny(compress_ratios=(0, 4)), batch)
    assert c4_only.c4 is not None and c4_only.c128 is None
    assert torch.equal(c4_only.c4.out_loc, plan(CONFIG, batch).c4.out_loc)


def test_draft_steps_write_their_own_slice() -> None:
    """Section 5 bug 1: step i plans from row i of the [bs, topk, steps] slot layout."""
    steps = [make_batch(spec) for spec in SPECS if spec.name.startswith("draft_step")]
    per_step = per_step_draft_out_cache_loc(steps[0].out_cache_loc, 2, 1, 3)
    to_swa = steps[0].full_to_swa

    def window_slots(full_slots: torch.Tensor) -> torch.Tensor:
        return full_slots if to_swa is None else to_swa[full_slots]

    seen = []
    for i, batch in enumerate(steps):
        meta = plan(CONFIG, batch)
        assert torch.equal(meta.swa_out_loc, window_slots(per_step[i]))
        assert torch.equal(meta.positions_causal, batch.seq_lens.long() + i)
        for ratio in (4, 128):
            comp = meta.compressed(ratio)
            completes = (meta.positions_causal + 1) % ratio == 0
            assert torch.equal(comp.out_loc, torch.where(completes, per_step[i] // ratio, -1))
        seen += meta.swa_out_loc.tolist()
    # The three steps together write every slot of the draft batch exactly once.
    assert sorted(seen) == sorted(window_slots(steps[0].out_cache_loc).tolist())
    # The slots are the next tokens of each request: 126 + 0..2 and 253 + 0..2 complete c4
    # entries at positions 127 (step 1) and 255 (step 2).
    step1 = plan(CONFIG, steps[1])
    assert step1.c4.out_loc[0] == per_step[1][0] // 4 and step1.c4.out_loc[1] == -1


def test_compress_plans_by_hand() -> None:
    """One request extending positions 2..9 of a 10-token sequence (first new position 2)."""
    positions = torch.arange(2, 10)
    ids = torch.zeros(8, dtype=torch.int32)
    first = torch.full((8,), 2)
    lens = torch.full((8,), 10, dtype=torch.int32)
    compress, write = compute_compress_plans(CompressPlanCall(ids, positions, first, lens, 4))
    invalid = [[-1] * 4]
    # entries end at positions 3 and 7; window_len = min(8, p - 2 + 1)
    assert compress.tolist() == [[1, 0, 3, 2], [5, 0, 7, 6]] + invalid * 6
    # keep positions >= (10 // 4) * 4 - 4 = 4
    assert write.tolist() == [[r, 0, r + 2, min(8, r + 1)] for r in range(2, 8)] + invalid * 2
    compress, write = compute_compress_plans(CompressPlanCall(ids, positions, first, lens, 128))
    assert compress.tolist() == invalid * 8
    assert write.tolist() == [[r, 0, r + 2, r + 1] for r in range(8)]  # keep >= 0
    assert compress.dtype == write.dtype == torch.int32 and compress.shape == (8, 4)


def test_c4_write_plan_keeps_the_last_block_of_every_page() -> None:
    """Positions 200..600 of a 601-token request: the c4 ring keeps 252-255 and 508-511 (the
    block a request starting from the cached 256- or 512-token prefix pools first) besides the
    tail 596-600; the c128 ring only its tail (no c128 entry spans a page boundary)."""
    positions = torch.arange(200, 601)
    n = positions.numel()
    args = (torch.zeros(n, dtype=torch.int32), positions, torch.full((n,), 200),
            torch.full((n,), 601, dtype=torch.int32))  # fmt: skip
    kept = lambda plan: [p for p in plan[:, 2].tolist() if p >= 0]  # noqa: E731
    _, write = compute_compress_plans(CompressPlanCall(*args, 4))
    assert kept(write) == [252, 253, 254, 255, 508, 509, 510, 511, 596, 597, 598, 599, 600]
    _, write = compute_compress_plans(CompressPlanCall(*args, 4, page_size=512))
    assert kept(write) == [508, 509, 510, 511, 596, 597, 598, 599, 600]
    _, write = compute_compress_plans(CompressPlanCall(*args, 128))
    assert kept(write) == list(range(512, 601))


@pytest.mark.parametrize("tile", ["interpreter", "gpu"])
def test_fused_planner_keeps_the_page_ends_too(tile: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused kernel's closed-form record indices agree with the torch plans when the c4
    write plan holds page ends before each request's tail (long extends, verify, decode); with
    the interpreter's row tile and with the GPU's (its last two batches)."""
    from dsv4_backend.kernels.dispatch import TORCH, TRITON_INTERPRETER, force_path
    from dsv4_backend.planning.kernels import plan_fields
    from dsv4_backend.planning.planner import fuses
    from dsv4_backend.testing.simulation import PagedRequestPool

    config = DSV4AttentionConfig.tiny(speculative=True)
    generator = torch.Generator().manual_seed(0)
    pool = PagedRequestPool(config, [400, 600, 1300, 40], generator=generator)
    # Each extend crosses one or two 256-token pages before its tail (the last at 1024).
    batches = [
        pool.extend([0, 1, 2, 3], [0, 250, 509, 3], [300, 280, 270, 30]),
        pool.extend([2, 0], [1000, 240], [40, 30]),
        pool.verify([0, 1, 2], [251, 509, 254], 4),
    ]
    if tile == "gpu":
        monkeypatch.setattr(plan_fields, "INTERPRETER_TILES", plan_fields.GPU_TILES)
        batches = batches[1:]
    for batch in batches:
        with force_path(TRITON_INTERPRETER):
            assert fuses(batch)
            fused = plan(config, batch)
        with force_path(TORCH):
            torch_plan = plan(config, batch)
        for ratio in (4, 128):
            for name in ("compress_plan", "write_plan"):
                got = getattr(fused.compressed(ratio), name)
                assert torch.equal(got, getattr(torch_plan.compressed(ratio), name)), name
    assert int((fused.c4.write_plan[:, 0] >= 0).sum()) == 12  # verify: every row kept


def test_row_fields_by_hand() -> None:
    positions = torch.tensor([0, 3, 127, 255, 300])
    raw_out_loc = torch.tensor([1000, 1003, 2047, 4095, 5000])
    page_table = torch.tensor([[7, 2, -1]] * 5, dtype=torch.int32)
    c4 = row_fields(positions, raw_out_loc, page_table, ratio=4, index_topk=16, c128_width=3)
    assert c4.out_loc.tolist() == [-1, 1003 // 4, 2047 // 4, 4095 // 4, -1]
    assert c4.topk_lengths_raw.tolist() == [0, 1, 32, 64, 75]
    assert c4.topk_lengths_clamp1.tolist() == [1, 1, 32, 64, 75]
    assert c4.sparse_topk_lengths.tolist() == [1, 1, 16, 16, 16]
    assert c4.page_indices is None
    c128 = row_fields(positions, raw_out_loc, page_table, ratio=128, index_topk=16, c128_width=3)
    assert c128.out_loc.tolist() == [-1, -1, 2047 // 128, 4095 // 128, -1]
    assert c128.topk_lengths_raw.tolist() == [0, 0, 1, 2, 2]
    assert c128.sparse_topk_lengths.tolist() == [1, 1, 1, 2, 2]
    assert c128.page_indices.tolist() == [[-1, -1, -1]] * 2 + [[14, -1, -1]] + [[14, 15, -1]] * 2
    assert c128.page_indices.dtype == torch.int32 and c128.out_loc.dtype == torch.int64
    # Entries whose page lies beyond the table's columns have no known slot.
    beyond = row_fields(
        torch.tensor([600]),
        torch.tensor([0]),
        page_table[:1, :1],
        ratio=128,
        index_topk=16,
        c128_width=3,
    )
    assert beyond.topk_lengths_raw.tolist() == [4]
    assert beyond.page_indices.tolist() == [[14, 15, -1]]


# ---------------------------------------------------------------------------- hypothesis
@st.composite
def batch_specs(draw: st.DrawFn) -> BatchSpec:
    kind = draw(st.sampled_from([D, E, V, ForwardKind.DRAFT_EXTEND, "draft"]))
    # Quick: up to 8 requests of 4 pages (window, c128 block and page boundaries crossed);
    # DSV4_STRESS=1: up to 64 requests of 16 pages.
    bs = draw(st.integers(1, sized(8, 64)))
    max_len = sized(1024, 4096)
    lens = st.integers(1, max_len)
    common = dict(swa_map=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))
    if kind in (E, ForwardKind.DRAFT_EXTEND):
        # Brute force walks every row: keep extends short, prefixes long.
        prefix = draw(st.lists(st.integers(0, max_len), min_size=bs, max_size=bs))
        extend = draw(st.lists(st.integers(1, 16), min_size=bs, max_size=bs))
        seq = tuple(p + e for p, e in zip(prefix, extend, strict=True))
        return BatchSpec("hyp", kind, seq, extend_lens=tuple(extend), **common)
    seq = tuple(draw(st.lists(lens, min_size=bs, max_size=bs)))
    if kind is V:
        return BatchSpec("hyp", V, seq, num_draft_tokens=draw(st.integers(1, 8)), **common)
    if kind == "draft":
        steps = draw(st.integers(1, 4))
        return BatchSpec(
            "hyp", D, seq, draft_steps=steps, step_id=draw(st.integers(0, steps - 1)), **common
        )
    return BatchSpec("hyp", D, seq, **common)


@settings(max_examples=sized(15, 100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batch_specs(), fixed=st.booleans())
def test_plan_matches_brute_force_random(spec: BatchSpec, fixed: bool) -> None:
    batch = make_batch(spec)
    widths = None
    if fixed:  # graph widths: the whole request pool's context
        widths = PlanWidths.for_max_len(batch.req_to_token.shape[1])
    meta = plan(CONFIG, batch, widths=widths)
    want_widths = None if widths is None else (widths.page_table, widths.c128)
    assert_same(meta.named_tensors(), expected_metadata(CONFIG, batch, want_widths), str(spec))


@pytest.mark.parametrize("path", ["fused", "fused-torch-fields", "torch"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_v41_plan_matches_brute_force(spec: BatchSpec, path: str) -> None:
    """DeepSeek-V4.1's c1 / c2 fields (the entry each row completes, the entries it sees, the
    selections to fill) beside every other field: in the fused planner's launch, by the torch
    twin after it (``LOW_RATIO_PLAN``'s CUDA baseline), and on the torch planner."""
    from dsv4_backend.kernels.dispatch import TORCH, TRITON_INTERPRETER, force_path
    from dsv4_backend.kernels.variants import force_variant
    from dsv4_backend.planning.planner import LOW_RATIO_PLAN

    config = tiny_v41()
    batch = make_batch(spec)
    low = "torch" if path == "fused-torch-fields" else "fused"
    with (
        force_path(TORCH if path == "torch" else TRITON_INTERPRETER),
        force_variant(LOW_RATIO_PLAN, low),
    ):
        meta = plan(config, batch)
    assert_same(meta.named_tensors(), expected_metadata(config, batch), spec.name)
    if spec.kind is not ForwardKind.DRAFT_EXTEND and batch.num_rows:
        assert meta.c1 is not None and meta.c2 is not None and meta.c1.candidate_blocks is not None


@pytest.mark.parametrize("path", ["fused", "torch"])
def test_window_floors_cut_each_request_s_window(path: str) -> None:
    """``window_floors`` (DeepSeek-V4.1's late-layer tail): a request's rows read no window key
    before its floor (a floor at the prefix: the first row sees only itself), on both
    planners; floors above the prefix or on another kind are refused."""
    from dsv4_backend.kernels.dispatch import TORCH, TRITON_INTERPRETER, force_path

    spec = next(s for s in SPECS if s.name == "extend_mixed")
    base = make_batch(spec)
    prefix = base.extend_prefix_lens
    assert prefix is not None
    batch = dataclasses.replace(
        base, window_floors=[p - min(p, 40 * i) for i, p in enumerate(prefix)]
    )
    with force_path(TORCH if path == "torch" else TRITON_INTERPRETER):
        meta = plan(CONFIG, batch)
    assert_same(meta.named_tensors(), expected_metadata(CONFIG, batch), spec.name)
    first = [sum(spec.extend_lens[:b]) for b in range(len(prefix))]  # type: ignore[arg-type]
    assert meta.swa_topk_lengths[first[0]] == 1  # request 0's floor is its prefix
    from dsv4_backend.kernels.variants import force_variant
    from dsv4_backend.planning import planner

    with force_path(TRITON_INTERPRETER):  # the CUDA baseline: a tail by the torch planner
        assert planner.fuses(batch) and planner.fuses(base)
        with force_variant(planner.LOW_RATIO_PLAN, "torch"):
            assert not planner.fuses(batch) and planner.fuses(base)
            assert_same(plan(CONFIG, batch).named_tensors(), meta.named_tensors(), spec.name)
    with pytest.raises(BatchError, match="window_floors"):
        dataclasses.replace(base, window_floors=[p + 1 for p in prefix])
    with pytest.raises(BatchError, match="window_floors are for EXTEND"):
        dataclasses.replace(make_batch(SPECS[0]), window_floors=[0] * 8)


# ----------------------------------------------------------------------------- graph safety
def test_graph_kinds_declared_once() -> None:
    expected = {ForwardKind.IDLE, ForwardKind.DECODE, ForwardKind.TARGET_VERIFY}
    assert expected == GRAPH_KINDS


UNIFORM = [s for s in SPECS if s.kind in GRAPH_KINDS]


@pytest.mark.parametrize("spec", UNIFORM, ids=lambda s: s.name)
def test_uniform_plans_do_not_sync(spec: BatchSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a GPU without strict mode: the value checks stay on the device, pending.
    monkeypatch.setattr(checks, "defer_checks", lambda device: True)
    batch = make_batch(spec, host_lens=False)
    with OpCounter() as ops:
        metadata = plan(CONFIG, batch, widths=PlanWidths(page_table=8, c128=16))
    assert metadata.pending_checks is not None
    metadata.pending_checks.raise_if_failed()  # the batch is valid
    assert ops.total > 0
    assert not ops.syncs, f"host syncs while planning {spec.name}: {dict(ops.syncs)}"


def _to_meta(batch: BatchView) -> BatchView:
    """The batch with every tensor on the meta device: any read of device data raises."""
    moved = {
        name: getattr(batch, name).to("meta")
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "req_to_token")
    }
    return BatchView(
        kind=batch.kind,
        num_draft_tokens=batch.num_draft_tokens,
        draft=batch.draft,
        **moved,
        full_to_swa=None if batch.full_to_swa is None else batch.full_to_swa.to("meta"),
    )


@pytest.mark.parametrize("spec", UNIFORM, ids=lambda s: s.name)
def test_uniform_plans_run_on_meta_tensors(spec: BatchSpec) -> None:
    """No ``.tolist()`` / ``.cpu()`` either (they never reach the dispatcher on CPU)."""
    batch = _to_meta(make_batch(spec))
    meta = plan(CONFIG, batch, widths=PlanWidths(page_table=8, c128=16))
    assert meta.page_table.shape == (batch.num_rows, 8)
    assert meta.c128.page_indices.shape == (batch.num_rows, 16)
    assert meta.c4.compress_plan.shape == (batch.num_rows, 4)
    assert meta.row_batch_ids.device.type == "meta"


# ------------------------------------------------------------------------------ bad input
def _decode(**overrides: object) -> BatchView:
    batch = make_batch(BatchSpec("d", D, (5, 300)))
    fields = dict(
        kind=D,
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens,
        out_cache_loc=batch.out_cache_loc,
        req_to_token=batch.req_to_token,
    )
    fields.update(overrides)
    return BatchView(**fields)


def test_out_cache_loc_wrong_length() -> None:
    with pytest.raises(BatchError, match=r"shape \(3,\); a DECODE batch of 2 requests needs 2"):
        _decode(out_cache_loc=torch.zeros(3, dtype=torch.int64))


def test_draft_out_cache_loc_of_one_step() -> None:
    """The section-5 crash: a 3-step draft batch handed only one slot per request."""
    with pytest.raises(BatchError, match=r"topk \* num_steps = 2 \* 1 \* 3 = 6 write slots"):
        _decode(draft=DraftStep(topk=1, num_steps=3, step_id=0))


def test_seq_lens_and_req_pool_indices_disagree() -> None:
    with pytest.raises(BatchError, match="seq_lens has 3 entries but req_pool_indices has 2"):
        _decode(seq_lens=torch.tensor([5, 300, 7]))


@pytest.mark.parametrize("bad", [0, -4])
def test_non_positive_seq_lens(bad: int) -> None:
    with pytest.raises(BatchError, match=rf"seq_lens must be >= 1, got \[{bad}, 300\]"):
        _decode(seq_lens=torch.tensor([bad, 300]))


def test_zero_extend_len() -> None:
    batch = make_batch(SPECS[5])
    with pytest.raises(BatchError, match="EXTEND: extend_seq_lens must be >= 1"):
        BatchView(
            kind=E,
            req_pool_indices=batch.req_pool_indices[:2],
            seq_lens=torch.tensor([4, 130]),
            out_cache_loc=torch.zeros(4, dtype=torch.int64),
            req_to_token=batch.req_to_token,
            extend_prefix_lens=[4, 126],
            extend_seq_lens=[0, 4],
        )


def test_page_size_must_be_256() -> None:
    with pytest.raises(ConfigError, match="page_size=128; DeepSeek-V4 caches need page_size 256"):
        DSV4AttentionConfig.tiny(page_size=128)


def test_draft_topk_2_is_refused() -> None:
    with pytest.raises(BatchError, match=r"draft topk=2; .* --speculative-eagle-topk 1"):
        DraftStep(topk=2, num_steps=3, step_id=0)


def test_verify_without_draft_tokens() -> None:
    with pytest.raises(BatchError, match="TARGET_VERIFY needs num_draft_tokens >= 1, got 0"):
        _decode(kind=V, num_draft_tokens=0, out_cache_loc=torch.zeros(0, dtype=torch.int64))


def test_seq_len_beyond_req_to_token() -> None:
    batch = _decode()
    width = batch.req_to_token.shape[1]
    long = torch.tensor([5, width + 1])
    with pytest.raises(BatchError, match=f"seq_len {width + 1} exceeds req_to_token width {width}"):
        plan(CONFIG, _decode(seq_lens=long))


def test_widths_too_small() -> None:
    with pytest.raises(
        BatchError,
        match=r"PlanWidths\(page_table=1, c128=1\) is too small .* \(300 tokens\) needs "
        r"page_table >= 2 and c128 >= 2",
    ):
        plan(CONFIG, _decode(), widths=PlanWidths(page_table=1, c128=1))


def test_no_widths_and_no_host_lengths() -> None:
    with pytest.raises(BatchError, match="on meta without host lengths; pass seq_lens_cpu"):
        plan(CONFIG, _to_meta(_decode()))


def test_unknown_kind() -> None:
    with pytest.raises(BatchError, match="cannot plan forward kind 'mixed'"):
        plan(CONFIG, _decode(kind="mixed", out_cache_loc=torch.zeros(0, dtype=torch.int64)))


def test_row_fields_contract_errors() -> None:
    positions = torch.arange(9) * 40
    raw_out_loc = positions + 1000
    page_table = torch.arange(18, dtype=torch.int32).reshape(9, 2)
    kw = {"ratio": 128, "index_topk": 16, "c128_width": 5}
    with pytest.raises(ContractError, match=r"raw_out_loc has shape \(8,\).*expected \[T\]"):
        row_fields(positions, raw_out_loc[:8], page_table, **kw)
    with pytest.raises(ContractError, match=r"page_table has shape \(9, 2\) and dtype torch.int64"):
        row_fields(positions, raw_out_loc, page_table.long(), **kw)
    with pytest.raises(ContractError, match="width 0"):
        row_fields(positions, raw_out_loc, page_table[:, :0], **kw)
    with pytest.raises(ConfigError, match="index_topk=0"):
        row_fields(positions, raw_out_loc, page_table, ratio=4, index_topk=0, c128_width=5)


def test_bad_widths_and_ratios() -> None:
    with pytest.raises(ConfigError, match=r"PlanWidths\(page_table=0, c128=1\); both must be >= 1"):
        PlanWidths(page_table=0, c128=1)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ConfigError, match=r"compress plan ratio=8; expected one of \(4, 128\)"):
        compute_compress_plans(CompressPlanCall(one.int(), one, one, one.int() + 1, 8))
    with pytest.raises(ConfigError, match=r"row fields ratio=0; expected one of \(4, 128\)"):
        row_fields(one, one, one.int()[None], ratio=0, index_topk=16, c128_width=1)


def test_idle_plans_eagerly_on_any_device() -> None:
    """An IDLE batch (no requests) needs no host lengths: its empty shape sizes the plan.

    (It used to demand ``seq_lens_cpu`` when its tensors were off the CPU, so eager IDLE
    batches on CUDA, which sglang builds without host lengths, failed to plan.)
    """
    empty = torch.zeros(0, dtype=torch.int64, device="meta")
    batch = BatchView(
        kind=ForwardKind.IDLE,
        req_pool_indices=empty,
        seq_lens=empty,
        out_cache_loc=empty,
        req_to_token=torch.zeros(4, 512, dtype=torch.int32, device="meta"),
    )
    assert batch.host_seq_lens == []
    meta = plan(CONFIG, batch)
    assert meta.num_rows == 0 and meta.page_table.shape == (0, 1)
    assert meta.c128.page_indices.shape == (0, 1) and meta.c4.compress_plan.shape == (0, 4)


def test_batch_tensors_on_another_device() -> None:
    with pytest.raises(BatchError, match="out_cache_loc is on meta but req_to_token is on cpu"):
        _decode(out_cache_loc=torch.zeros(2, dtype=torch.int64, device="meta"))
    with pytest.raises(BatchError, match="seq_lens_cpu is on meta; host lengths must be CPU"):
        _decode(seq_lens_cpu=torch.tensor([5, 300], device="meta"))


def test_metadata_refuses_rows_and_ratios_it_does_not_hold() -> None:
    meta = plan(CONFIG, _decode())
    with pytest.raises(ContractError, match=r"field c128.out_loc has 1 rows, expected num_rows=2"):
        dataclasses.replace(meta, c128=dataclasses.replace(meta.c128, out_loc=meta.c4.out_loc[:1]))
    with pytest.raises(ContractError, match="field page_table has 3 rows, expected num_rows=2"):
        dataclasses.replace(meta, page_table=torch.zeros(3, 2, dtype=torch.int32))
    assert meta.compressed(0) is None and meta.compressed(128) is meta.c128
    with pytest.raises(ContractError, match="ratio=2; expected a layer's compress ratio 0, 4"):
        meta.compressed(2)


def test_config_sizes_per_ratio() -> None:
    assert [CONFIG.ring_rows(4), CONFIG.ring_rows(128)] == [8, 128]
    speculative = DSV4AttentionConfig.tiny(speculative=True)
    assert [speculative.ring_rows(4), speculative.ring_rows(128)] == [16, 256]
    assert [entries_per_page(4), entries_per_page(128)] == [64, 2]
    assert [entries_per_page(1), entries_per_page(2)] == [256, 128]  # DeepSeek-V4.1's
    with pytest.raises(ConfigError, match=r"cache ratio=0; expected one of \(4, 128, 1, 2\)"):
        entries_per_page(0)
    assert CONFIG.ring_rows(2) == 2  # DeepSeek-V4.1's pair ring
    with pytest.raises(ConfigError, match="pair rings are sized by the draft tokens"):
        speculative.ring_rows(2)
    # sglang's get_compress_state_ring_size(2, n): a power of two above n + 1.
    assert [
        DSV4AttentionConfig.tiny(speculative=True, num_draft_tokens=n).ring_rows(2)
        for n in (1, 2, 3, 5, 7)
    ] == [4, 4, 8, 8, 16]
    with pytest.raises(ConfigError, match=r"ratio=0; expected one of \(4, 128\)"):
        CONFIG.ring_rows(0)
