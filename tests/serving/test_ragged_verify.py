"""DSpark's compact ragged verify (``SGLANG_RAGGED_VERIFY_MODE=compact``, docs/planning.md,
"Ragged verify"): each request verifies its own number of tokens, packed into sglang's token
bucket.

sglang code that runs here, called, not re-implemented (``sglang/srt/speculative/
ragged_verify.py``): ``RaggedVerifyLayout.from_verify_lens`` (the bucket ``graph_num_tokens``
from a grid of token tiers), ``padded_to_bucket`` (a graph's padding requests share the
bucket's leftover rows; ``kernels/ops/speculative/ragged_verify_kernels.py``),
``build_capture_verify_lens`` (the capture layout of a tier), and the adapter's read of a batch
carrying the layout (``batch_read.ragged_verify``, as sglang's own backend reads it in
``_resolve_verify_layout``). Stand-ins: the batches (``PagedRequestPool.ragged_verify``, laid
out as sglang's ``build_ragged_verify_window`` lays out the verify window: real slots, then
slot 0) and the model (``RandomModel``).

Verdicts: a ragged verify row is planned as the extend row at the same position (every per-row
field); rows past the requests' are padding rows that write nothing; served through the
caches, every committed row of random ragged rounds with rejected drafts equals the reference's
full causal pass, eager and from the graph buffers."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ragged_layouts import ragged_batch, ragged_step, token_tiers
from sglang.srt.environ import envs
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.ragged_verify import build_capture_verify_lens
from stress import sized

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ContractError
from dsv4_backend.kernels.dispatch import TRITON_INTERPRETER, force_path
from dsv4_backend.planning import AttentionMetadata, GraphMetadataBuffers, PlanWidths, plan
from dsv4_backend.planning.metadata import RECORD_FIELDS, sentinel
from dsv4_backend.planning.planner import fuses
from dsv4_backend.sglang_adapter import batch_read
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel
from dsv4_backend.testing.simulation.v41 import tiny_v41

pytestmark = pytest.mark.usefixtures("torch_path")

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
#: speculative_num_draft_tokens: the anchor and 4 drafts.
N = 5
#: Randomized rounds: CI runs this seeded subset; DSV4_STRESS_TRACES=N runs N seeds.
STRESS_SEEDS = range(int(os.environ.get("DSV4_STRESS_TRACES", "1")))


def per_row(metadata: AttentionMetadata) -> dict[str, torch.Tensor]:
    """``metadata``'s fields of one entry a row (not the record lists), by name."""
    return {
        name: value
        for name, value in metadata.named_tensors().items()
        if name.split(".")[-1] not in RECORD_FIELDS
    }


@settings(max_examples=sized(6, 100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seq_lens=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    data=st.data(),
    extra_slots=st.integers(0, 3),
)
def test_ragged_rows_are_the_extend_rows(seq_lens: list[int], data, extra_slots: int) -> None:
    """Every real row equals the EXTEND row at its position (page table, window, c4 / c128
    fields, write slot); the rows past them (the bucket's leftover on the last request, or
    none when padding requests take it) are padding rows: every per-row field a sentinel, no
    plan record. Padding requests (pool row 0) write only sglang's padding slot 0."""
    lens = data.draw(st.lists(st.integers(1, N), min_size=len(seq_lens), max_size=len(seq_lens)))
    requests = list(range(len(seq_lens)))
    pool = PagedRequestPool(CONFIG, [s + N for s in seq_lens], generator=torch.Generator())
    bucket = len(requests) + extra_slots if extra_slots else None
    view, _ = ragged_batch(pool, requests, seq_lens, lens, width=N, slots=bucket)
    widths = PlanWidths.for_max_len(pool.max_context)
    metadata = plan(CONFIG, view, widths=widths)
    extend = plan(CONFIG, pool.extend(requests, seq_lens, lens), widths=widths)
    real = sum(lens)
    ragged_rows, extend_rows = per_row(metadata), per_row(extend)
    for name, value in extend_rows.items():
        assert torch.equal(ragged_rows[name][:real], value), name
    padding_request = metadata.row_batch_ids[real:] >= len(requests)
    for name, value in ragged_rows.items():
        if name.endswith("out_loc"):  # padding requests write slot 0 (window slot 0) or nothing
            assert ((value[real:] == -1) | ((value[real:] == 0) & padding_request)).all(), name
            continue
        tail = value[real:][~padding_request]
        assert (tail == sentinel(name.split(".")[-1])).all(), name
    for ratio in (4, 128):
        part = metadata.compressed(ratio)
        records = part.compress_plan[part.compress_plan[:, 0] >= 0]
        mine = records[records[:, 1] < len(requests)]
        want = extend.compressed(ratio).compress_plan
        assert torch.equal(mine, want[want[:, 0] >= 0]), ratio
        writes = part.write_plan[part.write_plan[:, 0] >= 0]
        # A verify keeps the ring rows that all drafts rejected needs, from seq_len + 1 on.
        kept = writes[writes[:, 1] < len(requests)]
        assert (kept[:, 0] < real).all()
        rows_kept = set(kept[:, 0].tolist())
        for b, (s, n) in enumerate(zip(seq_lens, lens, strict=True)):
            start = sum(lens[:b])
            back = ratio if ratio == 4 else 0
            tail_from = max(s, (s + 1) // ratio * ratio - back)
            for i in range(n):
                if s + i >= tail_from:
                    assert start + i in rows_kept, (ratio, b, i)


@pytest.mark.parametrize("model", ["v4", "v41"])
@pytest.mark.parametrize("slots", [None, 7], ids=["eager", "graph"])
def test_the_fused_planner_plans_as_the_torch_planner(model: str, slots: int | None) -> None:
    """The fused planner (Triton, in the interpreter; the GPU's path) plans a ragged verify as
    the torch planner does, every field (DeepSeek-V4.1's c1 / c2 too), into the graph buffers
    with padding requests, and eagerly with the tier's leftover rows as padding rows."""
    config = CONFIG if model == "v4" else tiny_v41(speculative=True, num_draft_tokens=N)
    seq_lens, lens = [300, 200, 100, 5, 255], [5, 3, 1, 2, 2]  # 13 rows in a tier of 15
    pool = PagedRequestPool(config, [s + N for s in seq_lens], generator=torch.Generator())
    view, layout = ragged_batch(pool, range(5), seq_lens, lens, width=N, slots=slots)
    assert layout.graph_num_tokens == 15
    widths = PlanWidths.for_max_len(pool.max_context)
    want = plan(config, view, widths=widths).named_tensors()
    with force_path(TRITON_INTERPRETER):
        assert fuses(view)
        buffers = GraphMetadataBuffers(
            config, max_batch_size=8, max_rows=8 * N, widths=widths, device="cpu"
        )
        got = plan(config, view, widths=widths) if slots is None else buffers.plan(view)
    for name, value in want.items():
        assert torch.equal(got.named_tensors()[name], value), name


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [None, 7], ids=["eager", "graph"])
def test_the_fused_planner_on_cuda_plans_as_the_torch_planner(slots: int | None) -> None:
    """On a GPU (``scripts/gpu_check.sh``'s ``ragged-verify`` step): the fused planner compiled
    for the GPU plans a ragged verify as the torch planner does, eagerly (the tier's leftover
    rows as padding rows) and into the graph buffers (padding requests)."""
    from dsv4_backend.kernels.dispatch import TORCH, TRITON

    seq_lens, lens = [300, 200, 100, 5, 255], [5, 3, 1, 2, 2]
    pool = PagedRequestPool(CONFIG, [s + N for s in seq_lens], generator=torch.Generator())
    cpu, _ = ragged_batch(pool, range(5), seq_lens, lens, width=N, slots=slots)
    moved = {
        f.name: value.cuda()
        for f in dataclasses.fields(cpu)
        if isinstance(value := getattr(cpu, f.name), torch.Tensor)
    }
    ragged = dataclasses.replace(cpu.ragged, lens=cpu.ragged.lens.cuda())
    view = dataclasses.replace(cpu, **moved, ragged=ragged)
    widths = PlanWidths.for_max_len(pool.max_context)

    def planned(path: str) -> dict[str, torch.Tensor]:
        with force_path(path):
            if slots is None:
                metadata = plan(CONFIG, view, widths=widths)
            else:
                buffers = GraphMetadataBuffers(
                    CONFIG, max_batch_size=8, max_rows=8 * N, widths=widths, device="cuda"
                )
                metadata = buffers.plan(view)
            return {k: v.cpu() for k, v in metadata.named_tensors().items()}

    want, got = planned(TORCH), planned(TRITON)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_the_compressor_is_bounded_by_the_verify_width() -> None:
    """A ragged verify's requests' row counts are device values: the plan bounds them by the
    verify width, not the rows' average (one request of 5 rows beside four of 1, a tier of 10
    rows: 2 a request on average), so the compressor defers its ring writes as for the
    uniform verify whenever 5 rows could replace a ring row an entry still reads."""
    from dsv4_backend.kernels.compressor.common import ring_write_is_safe

    seq_lens, lens = [300, 200, 100, 5, 255], [5, 1, 1, 1, 1]
    pool = PagedRequestPool(CONFIG, [s + N for s in seq_lens], generator=torch.Generator())
    view, layout = ragged_batch(pool, range(5), seq_lens, lens, width=N, slots=None)
    assert layout.graph_num_tokens == 10
    metadata = plan(CONFIG, view)
    assert metadata.max_request_rows == N
    ring = SimpleNamespace(ratio=4, ring_rows=10)  # c4's span 8: safe for 3 rows a request
    assert ring_write_is_safe(ring, 2) and not ring_write_is_safe(ring, metadata.max_request_rows)
    uniform = pool.verify(range(5), seq_lens, N)
    assert plan(CONFIG, uniform).max_request_rows == N


def test_capture_layouts_plan_into_the_graph_buffers() -> None:
    """Every capture tier's layout (``build_capture_verify_lens`` over ``min(tokens,
    max_bs)`` slots, the static buffers: pool row 0, seq len 1, slot 0) plans into the graph
    buffers: its rows write only the padding slot."""
    pool = PagedRequestPool(CONFIG, [64], generator=torch.Generator())
    max_bs = 4
    buffers = GraphMetadataBuffers(
        CONFIG, max_batch_size=max_bs, max_rows=max_bs * N,
        widths=PlanWidths.for_max_len(pool.max_context), device="cpu",
    )  # fmt: skip
    for tokens in token_tiers(max_bs, N):
        slots = min(tokens, max_bs)
        lens = build_capture_verify_lens(num_tokens=tokens, num_slots=slots, num_draft_tokens=N)
        view = pool.ragged_verify([], [], [], tokens, padding=lens)
        metadata = buffers.plan(view)
        assert metadata.num_rows == tokens
        assert set(metadata.swa_out_loc.tolist()) <= {0}


def test_the_adapter_reads_sglangs_layout() -> None:
    """``batch_read``: a live batch carrying the layout (eager) and a replay view of more
    request slots (``num_padding``), padded by sglang's ``padded_to_bucket``; refused: a
    layout of more requests than the batch, write slots other than the bucket's."""
    pool = PagedRequestPool(CONFIG, [200, 200], generator=torch.Generator())
    seq_lens, lens = [100, 30], [3, 1]
    view, layout = ragged_batch(pool, [0, 1], seq_lens, lens, width=N, slots=None)
    live = view.ragged.lens[:2]
    fb = SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=2, seq_lens_cpu=None,
        req_pool_indices=view.req_pool_indices, seq_lens=view.seq_lens,
        out_cache_loc=view.out_cache_loc,
        spec_info=SimpleNamespace(ragged_verify_layout=layout),
    )  # fmt: skip
    options = dict(req_to_token=pool.req_to_token, full_to_swa=pool.full_to_swa, num_draft_tokens=N)
    read = batch_read.read_batch(fb, **options, ragged_verify_mode=True)
    assert torch.equal(read.view.ragged.lens, live)
    assert read.view.num_rows == layout.graph_num_tokens
    with pytest.raises(BatchError, match="needs 10 write slots"):  # read as a static verify
        batch_read.read_batch(fb, **options)
    # A replay view of 4 capture slots: padding requests take the leftover rows.
    padded = SimpleNamespace(**{**vars(fb), "batch_size": 4, "num_padding": 2})
    padded.req_pool_indices = torch.cat([fb.req_pool_indices, torch.zeros(2, dtype=torch.int64)])
    padded.seq_lens = torch.cat([fb.seq_lens, torch.ones(2, dtype=torch.int64)])
    ragged = batch_read.ragged_verify(padded, padded.out_cache_loc)
    want = layout.padded_to_bucket(padded_bs=4).verify_lens
    assert torch.equal(ragged.lens, want) and int(ragged.lens.sum()) == layout.graph_num_tokens
    batch_read.read_batch(padded, **options, ragged_verify_mode=True)
    # Data-parallel padding tokens past the bucket (slot 0): padding rows, writing nothing.
    grown = torch.nn.functional.pad(fb.out_cache_loc, (0, 3))
    view = batch_read.read_batch(
        SimpleNamespace(**{**vars(fb), "out_cache_loc": grown}), **options, ragged_verify_mode=True
    ).view
    assert view.num_rows == layout.graph_num_tokens + 3
    assert plan(CONFIG, view).swa_out_loc[sum(lens) :].eq(-1).all()
    one = SimpleNamespace(**{**vars(fb), "batch_size": 1})
    with pytest.raises(BatchError, match="layout of 2 requests on a batch of batch_size=1"):
        batch_read.ragged_verify(one, one.out_cache_loc)
    short = SimpleNamespace(**{**vars(fb), "out_cache_loc": fb.out_cache_loc[:-1]})
    with pytest.raises(BatchError, match="graph_num_tokens"):
        batch_read.read_batch(short, **options, ragged_verify_mode=True)


def test_a_ragged_plan_serves_only_its_batch() -> None:
    """The lazy-init contract under compact ragged verify (the target backend built with
    ``SGLANG_RAGGED_VERIFY_MODE=compact``): the eager runner's copy of the planned batch is
    served; another ragged batch of the same shapes (the same requests verifying other
    counts) is refused with a ``ContractError`` naming the mismatch."""
    pool = PagedRequestPool(CONFIG, [200, 200], generator=torch.Generator().manual_seed(0))
    runner = harness.mock_runner(
        pool, harness.tiny_hf_config(CONFIG), topk=0, num_draft_tokens=N,
        speculative_algorithm="DSPARK",
    )  # fmt: skip
    with envs.SGLANG_RAGGED_VERIFY_MODE.override("compact"):
        backend = DSV4AttentionBackend(runner, cache_format="dense")
    steps = []
    for lens in ([3, 1], [1, 3]):
        view, layout = ragged_batch(pool, [0, 1], [100, 30], lens, width=N, slots=None)
        spans = zip([0, 1], [100, 30], lens, strict=True)
        steps.append(
            ragged_step(view, layout, [(r, s + i) for r, s, n in spans for i in range(n)], N)
        )
    backend.init_forward_metadata(steps[0].batch)
    planned = backend.forward_metadata
    assert planned is not None and planned.num_rows == len(steps[0].rows)
    copy = dataclasses.replace(steps[0].batch)  # sglang's EagerRunner.load_batch
    assert torch.equal(backend.get_swa_out_cache_loc(copy), planned.swa_out_loc.int())
    with pytest.raises(ContractError, match="made for another batch"):
        backend.get_swa_out_cache_loc(steps[1].batch)


def run_rounds(seed: int, *, graph: bool, rounds: int = 3) -> None:
    """A prefill, then rounds of ragged verifies: per request a random count of the anchor and
    drafts, a random number of them accepted (the rows after are rejected drafts, fed other
    inputs); every accepted row of every layer equals the reference."""
    rng = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=rng))

    lens = [draw(2, 40), draw(120, 140), draw(250, 260)]
    requests = list(range(len(lens)))
    pool = PagedRequestPool(CONFIG, [n + rounds * N for n in lens], generator=rng)
    model = RandomModel(CONFIG, pool, generator=rng)
    slots = len(requests) + 2
    buffers = GraphMetadataBuffers(
        CONFIG, max_batch_size=slots, max_rows=slots * N,
        widths=PlanWidths.for_max_len(pool.max_context), device="cpu",
    )  # fmt: skip
    check(model, model.forward(pool.extend(requests, [0] * len(lens), lens)), {})
    for _ in range(rounds):
        verify = [draw(1, N) for _ in requests]
        accepted = [draw(0, v - 1) for v in verify]
        bucket = slots if graph else None
        view, _ = ragged_batch(pool, requests, lens, verify, width=N, slots=bucket)
        rejected = {r: s + 1 + a for r, s, a in zip(requests, lens, accepted, strict=True)}
        planner = (lambda config, batch: buffers.plan(batch)) if graph else plan
        result = model.forward(view, planner=planner, rejected=rejected)
        real = sum(verify)
        assert (result.metadata.swa_out_loc[real:] <= 0).all()
        check(model, result, rejected, real_rows=real)
        if not graph:  # the bucket's leftover rows: padding rows, nothing attended
            assert all((out[real:] == 0).all() for out in result.outputs)
        lens = [n + a + 1 for n, a in zip(lens, accepted, strict=True)]
    check(model, model.forward(pool.decode(requests, [n + 1 for n in lens])), {})


def check(
    model: RandomModel, result, rejected: dict[int, int], real_rows: int | None = None
) -> None:
    """Every row of ``result`` (its first ``real_rows``) before its request's first rejected
    position equals the reference's."""
    rows = result.rows[:real_rows]
    keep = [i for i, (r, p) in enumerate(rows) if p < rejected.get(r, p + 1)]
    assert keep
    for layer, out in zip(result.layers, result.outputs, strict=True):
        error = (out[keep] - model.expected(layer, [rows[i] for i in keep])).abs().max()
        assert error <= 2e-5, (layer, error)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("seed", STRESS_SEEDS)
def test_ragged_rounds_match_the_reference(seed: int, graph: bool) -> None:
    run_rounds(seed, graph=graph)
