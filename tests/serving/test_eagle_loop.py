"""An EAGLE v2 serving loop on the CPU with real sglang objects, through the backend's
sglang-facing methods (store_cache, forward_c4_indexer, forward_core_compressor, forward):

prefill (EXTEND) -> multi-step draft (topk 1, 3 steps: steps 0 and 1 run) -> TARGET_VERIFY
(4 draft tokens) -> DRAFT_EXTEND_V2 -> DECODE, repeated, for requests whose lengths cross the
window (128), block (4 / 128) and page (256) boundaries. Every attention output of every real
row equals the reference's full causal pass.

Two hosts: ``graph`` plans the uniform batches with ``init_forward_metadata_out_graph`` into
graph buffers and marks them ready (the verify batch padded to the graph bucket first: sglang's
graph runner pads its static buffers instead and hands a replay view, whose plan
``test_host_graph_replay.py`` checks equals this one on the live rows); ``eager`` leaves them
unmarked, pads the verify batch for data-parallel sync after its preparation (one extra request,
as ``_pad_inputs_to_size`` does) and only then plans, as sglang's eager runner does when
``needs_forward_metadata_init()``.

Both hosts are simulations of sglang's call order on the planned objects themselves. sglang's
own runner code (the eager runner's copy, the EAGLE v2 worker, the decode and draft graph
runners' replay views of live batches, the DSpark proposer) drives the backend in
``test_host_eager_eagle.py``, ``test_host_graph_replay.py``, ``test_host_draft_graphs.py`` and
``test_host_dspark_proposer.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from stress import sized

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels.attention.common import force_num_splits
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.planning import per_step_draft_out_cache_loc
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.sglang_adapter.draft import DSV4MultiStepDraftBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
ATOL = 2e-5
NUM_STEPS, NUM_DRAFT = 3, 4
GRAPH_BUCKET = 4  # requests per verify graph


class Loop:
    """One model, one runner, its target backend and its multi-step draft backend."""

    def __init__(
        self,
        lens: list[int],
        max_lens: list[int],
        graph: bool,
        seed: int = 0,
        cache_format: str = "dense",
        layout: Callable[[PagedRequestPool], None] | None = None,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        pool = PagedRequestPool(CONFIG, max_lens, generator=generator)
        if layout is not None:  # another host's slots and sizes
            layout(pool)
        self.model = RandomModel(CONFIG, pool, generator=generator)
        self.runner = harness.mock_runner(
            pool, harness.tiny_hf_config(CONFIG), num_steps=NUM_STEPS,
            num_draft_tokens=NUM_DRAFT,
        )  # fmt: skip
        self.target = DSV4AttentionBackend(self.runner, cache_format=cache_format)
        self.runner.attn_backend = self.target
        self.draft = DSV4MultiStepDraftBackend(self.runner, 1, NUM_STEPS, cache_format=cache_format)
        self.fp8 = cache_format == "fp8"
        self.sim = harness.SimulatedModel(self.model)
        self.batches = harness.BatchBuilder(pool)
        self.graph = graph
        if graph:
            max_tokens = GRAPH_BUCKET * NUM_DRAFT
            self.target.init_cuda_graph_state(GRAPH_BUCKET, max_tokens)
            self.draft.init_cuda_graph_state(GRAPH_BUCKET, max_tokens)
        self.requests = list(range(len(lens)))
        self.lens = list(lens)
        self.checked = 0

    def plan(self, backend: Any, step: harness.Step, graphable: bool = True) -> None:
        """The host: graph runners plan and mark; the eager runner plans unmarked batches."""
        if self.graph and graphable:
            backend.init_forward_metadata_out_graph(step.batch)
            step.batch.mark_forward_metadata_ready()
        if step.batch.needs_forward_metadata_init():
            backend.init_forward_metadata(step.batch)

    def run(self, backend: Any, step: harness.Step, layers: list[int] | None = None) -> None:
        for layer in layers if layers is not None else range(len(CONFIG.compress_ratios)):
            out = self.sim.layer(backend, step, layer)
            assert out.shape[0] == len(step.rows)
            error = self.sim.max_error(step.rows, layer, out)
            if self.fp8:  # e4m3 keys: bounded as in test_serving_modes' FP8 test
                assert error < (0.15 if CONFIG.compress_ratios[layer] == 0 else 1.0), error
            else:
                assert error <= ATOL, (step.batch.forward_mode.name, layer, error)
            self.checked += 1

    def prefill(self) -> None:
        step = self.batches.extend(self.requests, [0] * len(self.lens), self.lens)
        self.plan(self.target, step, graphable=False)
        self.run(self.target, step)

    def round(self, accepted: list[int] | None = None) -> None:
        """Draft, verify, draft extend, one decode. ``accepted[b]`` drafts of request ``b``
        are accepted (default: all); the decode continues from there."""
        step = self.batches.draft(self.requests, self.lens, NUM_STEPS)
        self.plan(self.draft, step)
        # Planned from the whole buffer; then, as sglang's draft_forward does, each step's
        # forward sees only its own slots in out_cache_loc (the plan must not re-read it).
        per_step = per_step_draft_out_cache_loc(
            step.batch.out_cache_loc, len(self.requests), 1, NUM_STEPS
        )
        for i in range(NUM_STEPS - 1):  # the last step only samples
            step.batch.out_cache_loc = per_step[i]
            self.run(self.draft.attn_backends[i], step)
            step = self.batches.advance(step)

        step = self.batches.verify(self.requests, self.lens, NUM_DRAFT)
        extra = GRAPH_BUCKET - len(self.requests) if self.graph else 1
        if self.graph:  # the graph runner pads to its bucket, then plans
            step = self.batches.pad(step, self.runner, extra, NUM_DRAFT)
            self.plan(self.target, step)
        else:  # prepared unmarked; data-parallel padding; the eager runner plans after it
            assert step.batch.needs_forward_metadata_init()
            step = self.batches.pad(step, self.runner, extra, NUM_DRAFT)
            self.plan(self.target, step)
        assert self.target.forward_metadata.batch_size == len(self.requests) + extra
        self.run(self.target, step)

        # The draft model's extend over the verify window: window only (the MTP layer).
        step = self.batches.draft_extend(self.requests, self.lens, NUM_DRAFT)
        self.plan(self.target, step, graphable=False)
        assert self.target.forward_metadata.c4 is None
        if not self.graph:
            # As sglang does: the draft extend is planned and marked ready, then padded for
            # data-parallel sync; the padded rows must attend to nothing and write nothing.
            step.batch.mark_forward_metadata_ready()
            step = self.batches.pad(step, self.runner, 1, NUM_DRAFT)
            assert not step.batch.needs_forward_metadata_init()
        self.run(self.target, step, layers=[0])
        if not self.graph:
            padded = [i for i, row in enumerate(step.rows) if row is None]
            assert padded and self.sim.layer(self.target, step, 0)[padded].abs().max() == 0

        accepted = accepted or [NUM_DRAFT] * len(self.lens)
        self.lens = [n + a + 1 for n, a in zip(self.lens, accepted, strict=True)]
        step = self.batches.decode(self.requests, self.lens)
        self.plan(self.target, step)
        self.run(self.target, step)


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_eagle_v2_loop_matches_the_full_causal_pass(graph: bool) -> None:
    # 124 -> 144 crosses the window and c128 boundary at 128; 250 -> 270 the page and c128
    # boundary at 256; 7 -> 27 starts inside the first c4 block; every round ends on another
    # position mod 4.
    loop = Loop([124, 250, 7], [150, 280, 40], graph)
    loop.prefill()
    for _ in range(4):
        loop.round()
    assert loop.lens == [144, 270, 27]
    # prefill 4 layers + per round: 2 draft steps x 4, verify 4, draft extend 1, decode 4.
    assert loop.checked == 4 + 4 * (8 + 4 + 1 + 4)


# The split-merge path also runs in the interpreter in test_serving_modes (every serving mode);
# this full EAGLE round through it is one of the long variants.
SPLIT_MERGE = pytest.param(2, id="split-merge", marks=pytest.mark.stress)


@pytest.mark.parametrize("splits", [pytest.param(1, id="one-split"), SPLIT_MERGE])
def test_one_round_through_the_triton_kernels(splits: int) -> None:
    """A short segment (draft steps, verify, draft extend, decode) with every Triton kernel
    (interpreter on the CPU), the attention with one key split and with two."""
    loop = Loop([126, 9], [140, 24], graph=True, seed=3)
    loop.prefill()
    with force_path("triton-interpreter"), force_num_splits(splits):
        loop.round()


def sglang_allocator_layout(pool: PagedRequestPool) -> None:
    """Every slot of ``pool``'s requests from sglang's own ``SWATokenToKVPoolAllocator``
    (each request's ``max_len`` tokens, as prefills allocate them), with a window pool of
    exactly the pages they need: the last request gets the top window page, whose slots reach
    ``swa_size + 255``. The pool then reports the allocator's sizes and map."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.runtime_context import get_context
    from sglang_pool import make_pool

    page = CONFIG.page_size
    swa = sum(-(-n // page) for n in pool.max_lens) * page
    full = swa + 2 * page  # a larger full pool, as swa_full_tokens_ratio < 1 gives
    with get_context().override_server_args(device="cpu"):
        kv_pool = make_pool(swa_size=swa, full_size=full)  # only its sizes and SWA pool matter
        alloc = SWATokenToKVPoolAllocator(
            full, swa, page, torch.float8_e4m3fn, "cpu", kv_pool, need_sort=False
        )
        pool.req_to_token.zero_()
        for request, n in enumerate(pool.max_lens):
            lens = [torch.tensor([v]) for v in (0, 0, n, n, -1)]
            loc = alloc.alloc_extend(*lens, n)
            pool.req_to_token[pool.pool_index(request), :n] = loc.int()
    pool.full_to_swa = alloc.full_to_swa_index_mapping
    pool.num_full_slots, pool.full_size, pool.swa_size = full + page, full, swa
    assert alloc.swa_available_size() == 0


def test_the_top_window_page_of_sglangs_allocator_through_prefill_eagle_and_decode() -> None:
    """sglang's SWA allocator hands out window pages 1 ... swa_size / 256, so slots reach
    ``swa_size + 255``: the caches, rings and plans are sized as sglang sizes its pool, and the
    request on the top page is served (prefill, EAGLE rounds with rejected drafts, decode)."""
    loop = Loop([500, 250], [530, 280], graph=False, layout=sglang_allocator_layout)
    pool = loop.model.pool
    top = int(pool.full_to_swa[pool.req_to_token[pool.pool_index(1)].long()].max())
    assert top >= pool.swa_size, "the last request should hold the top window page"
    assert loop.target.state.pools.window(0).num_slots == pool.swa_size + CONFIG.page_size
    loop.prefill()
    loop.round([1, 0])
    loop.round()
    assert loop.checked == 4 + 2 * (8 + 4 + 1 + 4)


#: Randomized serving traces: the default suite runs one seed, DSV4_STRESS=1 ten,
#: DSV4_STRESS_TRACES=N runs N.
STRESS_SEEDS = range(int(os.environ.get("DSV4_STRESS_TRACES", sized(1, 10))))


@pytest.mark.parametrize("cache_format", ["dense", "fp8"])
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("seed", STRESS_SEEDS)
def test_randomized_serving_trace(seed: int, graph: bool, cache_format: str) -> None:
    """Random requests, lengths and accepted drafts (rejections included), DP padding on the
    eager path: every real row matches the full causal pass (FP8: within its error), and no
    valid batch is refused by the checks."""
    rng = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=rng))

    rounds = 2
    lens = [draw(1, 300) for _ in range(draw(1, 3))]
    max_lens = [n + rounds * (NUM_DRAFT + 1) + 1 for n in lens]
    loop = Loop(lens, max_lens, graph, seed=seed, cache_format=cache_format)
    loop.prefill()
    for _ in range(rounds):
        loop.round([draw(0, NUM_DRAFT) for _ in lens])
    assert loop.checked > 4
