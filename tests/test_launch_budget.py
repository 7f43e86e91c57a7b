"""Launch budgets: device launches per call, counted on the CPU (``LaunchCounter``).

Launch counts do not depend on the machine: Triton kernels count one each (in the interpreter
as compiled), torch ops that run a kernel count one each, CPU-only checks not at all. The budgets
are those of the fused kernels: a compressor call (pool + norm + RoPE, ring update, cache store)
in 3, the lightning indexer (scores, top-k, slots) in 3.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.compute import AttentionState, compress_and_store, select_c4_entries
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels.cache_store import store_rows
from dsv4_backend.kernels.dispatch import TRITON_INTERPRETER, force_path
from dsv4_backend.planning import plan
from dsv4_backend.testing.op_counter import LaunchCounter
from dsv4_backend.testing.simulation import PagedRequestPool

CONFIG = DSV4AttentionConfig.tiny(compress_ratios=(4, 128))
LENGTHS = [130, 7]
COMPRESSOR_BUDGET = 3
INDEXER_BUDGET = 3


def _batches(pool: PagedRequestPool) -> dict:
    requests = list(range(len(LENGTHS)))
    return {
        # A chunk of 10 tokens crossing a c128 block (and c4 blocks), a fresh 7-token prefill.
        "prefill": pool.extend(requests, [120, 0], [10, 7]),
        "decode": pool.decode(requests, LENGTHS),
        "verify": pool.verify(requests, LENGTHS, 3),
    }


@pytest.fixture(scope="module")
def setup() -> tuple:
    """FP8 caches (the GPU format) and the batches of each mode."""
    g = torch.Generator().manual_seed(0)
    pool = PagedRequestPool(CONFIG, [n + 4 for n in LENGTHS], generator=g)
    state = AttentionState.allocate(
        CONFIG,
        num_full_slots=pool.num_full_slots,
        num_swa_slots=pool.num_full_slots,
        num_request_slots=len(LENGTHS) + 1,
        fmt="fp8",
    )
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
    assert launches.total <= COMPRESSOR_BUDGET, (launches.summary(), launches.torch_ops)
    assert not launches.syncs


@pytest.mark.parametrize("mode", ["prefill", "decode", "verify"])
def test_indexer_within_budget(setup: tuple, mode: str):
    state, batches = setup
    metadata = plan(CONFIG, batches[mode])
    rows, heads, dim = metadata.num_rows, CONFIG.index_n_heads, CONFIG.index_head_dim
    q, w = torch.randn(rows, heads, dim), torch.rand(rows, heads)
    launches = _count(lambda: select_c4_entries(state, 0, metadata, q, w))
    assert launches.total <= INDEXER_BUDGET, launches.summary()
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
