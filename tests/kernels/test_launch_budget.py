"""Launch budgets: device launches per call, counted on the CPU (``LaunchCounter``).

Launch counts do not depend on the machine: Triton kernels count one each (in the interpreter
as compiled), torch ops that run a kernel count one each, CPU-only checks not at all. The budgets
are those of the fused kernels: a compressor call (pool + norm + RoPE, cache store, ring update)
in 1 in every mode, the lightning indexer (scores, top-k, slots) in 3, a plan (batch checks,
fields, an extend kind's host lengths, the deferred verdict's copy to the host) in 4 (a ragged
verify in 8: its requests' row table is built on the device, five torch ops), sparse
attention in 1 plus the merge of its key splits, plus the union key list where a program takes
several rows. The indexer's work (bytes read, programs that write) follows the rows' lengths,
not the maximum context.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from planning_spec import BatchSpec, make_batch

from dsv4_backend.compute import AttentionState, compress_and_store, select_c4_entries
from dsv4_backend.compute.layer import attend
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels.attention.common import force_num_splits
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.kernels.dispatch import TRITON_INTERPRETER, force_path
from dsv4_backend.kernels.variants import force_unverified
from dsv4_backend.planning import ForwardKind, GraphMetadataBuffers, PlanWidths, checks, plan
from dsv4_backend.testing.simulation import PagedRequestPool
from dsv4_backend.tools.op_counter import LaunchCounter

CONFIG = DSV4AttentionConfig.tiny(compress_ratios=(4, 128))
LENGTHS = [130, 7]
COMPRESSOR_BUDGET = 1
INDEXER_BUDGET = 3
PLAN_BUDGET = 4
#: A ragged verify (sglang's compact verify): the fused plan's 2 launches, its requests' row
#: table built from the device lengths (the lengths in int64, their exclusive cumulative sum,
#: the kept lengths, the stack: 5 torch ops), the deferred verdict's copy.
RAGGED_PLAN_BUDGET = 8


def _batches(pool: PagedRequestPool) -> dict:
    requests = list(range(len(LENGTHS)))
    return {
        # A chunk of 6 tokens crossing a c128 block (and a c4 block), a fresh 3-token prefill.
        "prefill": pool.extend(requests, [124, 0], [6, 3]),
        "decode": pool.decode(requests, LENGTHS),
        "verify": pool.verify(requests, LENGTHS, 3),
    }


def _fp8_state(config: DSV4AttentionConfig, pool: PagedRequestPool) -> AttentionState:
    """FP8 caches (the GPU format) for ``pool``'s requests."""
    slots = pool.num_full_slots
    return AttentionState.allocate(
        config,
        num_full_slots=slots,
        num_swa_slots=slots,
        num_request_slots=pool.num_requests + 1,
        fmt="fp8",
    )


@pytest.fixture(scope="module")
def setup() -> tuple:
    """FP8 caches (the GPU format) and the batches of each mode."""
    g = torch.Generator().manual_seed(0)
    pool = PagedRequestPool(CONFIG, [n + 4 for n in LENGTHS], generator=g)
    state = _fp8_state(CONFIG, pool)
    return state, _batches(pool)


def _count(fn) -> LaunchCounter:
    with force_path(TRITON_INTERPRETER):
        fn()  # first call: compile caches, frequency tables
        with LaunchCounter() as launches:
            fn()
    return launches


@pytest.mark.parametrize("mode", ["prefill", "decode", "verify"])
@pytest.mark.parametrize(("layer", "indexer"), [(0, False), (1, False), (0, True)])
def test_compressor_call_within_budget(setup: tuple, mode: str, layer: int, indexer: bool):
    state, batches = setup
    view = batches[mode]
    metadata = plan(CONFIG, view)
    ratio = 4 if indexer else CONFIG.compress_ratios[layer]
    d = CONFIG.index_head_dim if indexer else CONFIG.head_dim
    cd = (2 if ratio == 4 else 1) * d
    rows = metadata.num_rows
    kv, score, ape = torch.randn(rows, cd), torch.randn(rows, cd), torch.randn(ratio, cd)
    norm = torch.ones(d)
    launches = _count(
        lambda: compress_and_store(
            state,
            layer,
            metadata,
            view.req_pool_indices,
            kv,
            score,
            ape,
            norm,
            indexer=indexer,
        )
    )
    # Extend and verify without the speculative rings too: the writes that replace ring rows
    # an entry reads wait for it in the same launch (compressor.common.ring_write_is_safe).
    assert launches.kernels == {"triton:_compress_fused_kernel": 1}, launches.summary()
    assert launches.total <= COMPRESSOR_BUDGET, (launches.summary(), launches.torch_ops)
    assert not launches.syncs


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_verify_with_speculative_rings_is_one_launch(ratio: int):
    """With the doubled rings of speculative decoding, a verify's ring rows cannot replace
    one its entries read: pooling, cache store and ring write in one launch."""
    config = DSV4AttentionConfig.tiny(compress_ratios=(ratio,), speculative=True)
    pool = PagedRequestPool(config, [n + 4 for n in LENGTHS], generator=torch.Generator())
    state = _fp8_state(config, pool)
    view = pool.verify(list(range(len(LENGTHS))), LENGTHS, 3)
    metadata = plan(config, view)
    cd = (2 if ratio == 4 else 1) * config.head_dim
    kv, score, ape = (
        torch.randn(metadata.num_rows, cd),
        torch.randn(metadata.num_rows, cd),
        torch.randn(ratio, cd),
    )
    norm = torch.ones(config.head_dim)
    launches = _count(
        lambda: compress_and_store(state, 0, metadata, view.req_pool_indices, kv, score, ape, norm)
    )
    assert launches.kernels == {"triton:_compress_fused_kernel": 1}, launches.summary()
    assert launches.total == 1


@pytest.mark.parametrize("mode", ["prefill", "decode", "verify"])
def test_indexer_within_budget(setup: tuple, mode: str):
    state, batches = setup
    metadata = plan(CONFIG, batches[mode])
    rows, heads, dim = metadata.num_rows, CONFIG.index_n_heads, CONFIG.index_head_dim
    q, w = torch.randn(rows, heads, dim), torch.rand(rows, heads)
    launches = _count(lambda: select_c4_entries(state, 0, metadata, q, w))
    assert launches.total <= INDEXER_BUDGET, launches.summary()
    assert not launches.syncs


@functools.cache
def _decode_batch() -> tuple:
    """FP8 state, the eager plan of a decode batch and its indexer inputs."""
    lengths = [300, 70, 7]  # 75, 17 and 1 candidates (top-k 16): two blocks, a short row
    g = torch.Generator().manual_seed(1)
    pool = PagedRequestPool(CONFIG, lengths, generator=g)
    state = _fp8_state(CONFIG, pool)
    metadata = plan(CONFIG, pool.decode(list(range(len(lengths))), lengths))
    q = torch.randn(len(lengths), CONFIG.index_n_heads, CONFIG.index_head_dim, generator=g)
    w = torch.rand(len(lengths), CONFIG.index_n_heads, generator=g)
    return state, metadata, q, w


def _indexer_work(max_context: int, bounded: bool) -> LaunchCounter:
    """The indexer of one decode batch planned with graph widths for ``max_context``."""
    state, eager, q, w = _decode_batch()
    widths = PlanWidths.for_max_len(max_context)  # page table: max_context / 256 columns
    buffers = GraphMetadataBuffers(
        CONFIG, max_batch_size=4, max_rows=4, widths=widths, device="cpu"
    )
    metadata = buffers.load(eager)  # as the graph path: columns past the plan's are -1
    # One counted call: the interpreter needs no warm-up (flashinfer's top-k is CUDA only).
    with force_unverified(bounded), force_path(TRITON_INTERPRETER), LaunchCounter() as launches:
        select_c4_entries(state, 0, metadata, q, w)
    return launches


def test_indexer_work_follows_the_rows_not_the_maximum_context():
    """The same decode batch planned for an 8K and a 1M maximum context: the same launches,
    bytes read and programs that write, within 10 %. The kernels it replaces (negative
    control) read every column of the page table's width (here 1K against 2K)."""
    short, long = _indexer_work(8192, True), _indexer_work(1 << 20, True)
    assert short.kernels == long.kernels and short.total == long.total <= INDEXER_BUDGET
    for name in short.kernels:
        assert long.bytes_loaded[name] <= 1.1 * short.bytes_loaded[name], name
        assert long.working_programs[name] <= 1.1 * short.working_programs[name], name
    assert sum(long.bytes_loaded.values()) <= 1.1 * sum(short.bytes_loaded.values())
    replaced_short, replaced_long = _indexer_work(1024, False), _indexer_work(2048, False)
    replaced = sum(replaced_long.bytes_loaded.values()) / sum(replaced_short.bytes_loaded.values())
    assert replaced > 1.1, replaced


@pytest.mark.parametrize("mode", ["prefill", "decode", "verify"])
@pytest.mark.parametrize("heads", [8, 64])
@pytest.mark.parametrize("splits", [1, 3])
def test_attention_within_budget(setup: tuple, mode: str, heads: int, splits: int):
    """Attention of a c4 layer: the kernel, the merge when the keys are split, and the union
    key list when a program takes the rows of a request together (8 heads, verify and
    prefill) -- never at 64 heads or for decode."""
    state, batches = setup
    metadata = plan(CONFIG, batches[mode])
    q, sink = torch.randn(metadata.num_rows, heads, CONFIG.head_dim), torch.zeros(heads)
    grouped = heads < 64 and mode != "decode"
    with force_num_splits(splits):
        launches = _count(lambda: attend(state, 0, metadata, q, sink))
    kernels = {"triton:_sparse_attention_kernel": 1}
    if splits > 1:
        kernels["triton:_merge_splits_kernel"] = 1
    if grouped:
        kernels["triton:_key_union_kernel"] = 1
    assert launches.kernels == kernels, launches.summary()
    assert launches.total == len(kernels), (launches.summary(), launches.torch_ops)
    assert not launches.syncs


def test_counter_sees_torch_and_triton_launches(setup: tuple):
    """The counter itself: torch kernels count, views and CPU-only checks do not."""
    state, _ = setup
    x, key, skip = torch.randn(4, 8), torch.zeros(1, CONFIG.head_dim), torch.tensor([-1])
    with LaunchCounter() as launches:
        y = x.view(8, 4)[1:]  # views: no launch
        y = y + 1  # one kernel
        store_rows(state.pools.window(0), key, skip)  # one Triton kernel; CPU-only slot check
    assert launches.torch_ops == {"aten.add": 1}
    assert launches.kernels == {"triton:_store_fp8_token_kernel": 1}
    assert launches.total == 2


D, V = ForwardKind.DECODE, ForwardKind.TARGET_VERIFY
PLAN_MODES = [
    BatchSpec("decode", D, (1, 128, 257, 513)),
    BatchSpec("draft step", D, (126, 253), draft_steps=3, step_id=1),
    BatchSpec("extend", ForwardKind.EXTEND, (4, 330), extend_lens=(1, 200)),
    BatchSpec("verify", V, (126, 253), num_draft_tokens=4),
    BatchSpec("draft extend", ForwardKind.DRAFT_EXTEND, (4, 130), extend_lens=(1, 4)),
    BatchSpec("idle", ForwardKind.IDLE, ()),
]


@pytest.mark.parametrize("spec", PLAN_MODES, ids=lambda s: s.name)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("deferred", [False, True], ids=["strict", "deferred"])
def test_plan_within_budget(
    spec: BatchSpec, graph: bool, deferred: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every plan mode, eager and into graph buffers, with the batch checks read at once or
    deferred (as on a GPU without strict mode), in at most ``PLAN_BUDGET`` launches."""
    monkeypatch.setattr(checks, "defer_checks", lambda device: deferred)
    batch = make_batch(spec)
    widths = PlanWidths(page_table=20, c128=40)
    buffers = GraphMetadataBuffers(
        CONFIG, max_batch_size=8, max_rows=300, widths=widths, device="cpu"
    )
    launches = _count(lambda: buffers.plan(batch) if graph else plan(CONFIG, batch))
    # Deferred, the verdict's copy to pinned host memory is one more launch on CUDA.
    total = launches.total + (1 if deferred else 0)
    assert total <= PLAN_BUDGET, launches.summary()
    assert not launches.syncs


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("deferred", [False, True], ids=["strict", "deferred"])
def test_ragged_verify_plan_within_budget(
    graph: bool, deferred: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DSpark's compact ragged verify (each request its own row count, a token tier's padding
    rows after them), eager and into graph buffers, in ``RAGGED_PLAN_BUDGET`` launches and no
    host sync: its lengths stay on the device."""
    monkeypatch.setattr(checks, "defer_checks", lambda device: deferred)
    pool = PagedRequestPool(CONFIG, [n + 4 for n in LENGTHS], generator=torch.Generator())
    batch = pool.ragged_verify(list(range(len(LENGTHS))), LENGTHS, [3, 1], 8)
    batch = dataclasses.replace(batch, ragged=dataclasses.replace(batch.ragged, lens_cpu=None))
    widths = PlanWidths(page_table=20, c128=40)
    buffers = GraphMetadataBuffers(
        CONFIG, max_batch_size=8, max_rows=300, widths=widths, device="cpu"
    )
    launches = _count(lambda: buffers.plan(batch) if graph else plan(CONFIG, batch, widths=widths))
    total = launches.total + (1 if deferred else 0)
    assert total <= RAGGED_PLAN_BUDGET, launches.summary()
    assert not launches.syncs
