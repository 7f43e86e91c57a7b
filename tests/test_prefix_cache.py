"""Prefix (radix) cache hits: a request that starts from another request's cached prefix
computes exactly what it would have computed from scratch.

sglang hands a hit to the backend as an EXTEND whose ``extend_prefix_lens`` is the matched
prefix, a whole number of 256-token pages (its radix keys are page-aligned and at least one
prompt token is left to extend), in a fresh ``req_to_token`` row whose first entries point at
the cached pages (``simulation.PagedRequestPool``'s ``shared_pages``). The prompts here share
more tokens than the hit covers where sglang would too (the unaligned tail is recomputed).
Every output row is compared with the reference's full causal pass and with the run that
computes the same request without the cache.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.planning import BatchView
from dsv4_backend.sglang_adapter import harness
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.simulation import PagedRequestPool, RandomModel

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
PAGE = CONFIG.page_size
ATOL = 2e-5


def make_model(
    max_lens: list[int],
    *,
    shared_pages: dict[int, tuple[int, int]] | None = None,
    same_tokens: dict[int, tuple[int, int]] | None = None,
) -> RandomModel:
    """Pages from seed 0, token data from seed 1: with and without shared pages the requests'
    data are the same."""
    pool = PagedRequestPool(
        CONFIG, max_lens, generator=torch.Generator().manual_seed(0),
        shared_pages=shared_pages, same_tokens=same_tokens,
    )  # fmt: skip
    return RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(1))


def run(model: RandomModel, batch: BatchView, **kwargs: object) -> list[torch.Tensor]:
    """Forward ``batch``; every accepted row must equal the full causal pass."""
    result = model.forward(batch, **kwargs)
    assert result.outputs, "the forward ran no layer"
    error = model.max_error(result)
    assert error <= ATOL, f"{batch.kind.name}: max error {error:.3g} > {ATOL}"
    return result.outputs


def poison_own_rings(model: RandomModel, request: int) -> None:
    """NaN in the rings ``request`` owns (its pool row's c128 rings, its own pages' c4 rings),
    as an earlier request of that row or of those pages may have left them: read, they would
    turn its outputs into NaN."""
    pool = model.pool
    row = pool.pool_index(request)
    shared = pool.shared_pages.get(request, (request, 0))[1]
    pages = range(shared, math.ceil(pool.max_lens[request] / PAGE))
    full = pool.req_to_token[row, [k * PAGE for k in pages]].long()
    window_pages = pool.full_to_swa[full] // PAGE
    state = model.state
    for rings in (*state.compressor_states.values(), *state.indexer_states.values()):
        rings.ring[window_pages if rings.window_page else row] = float("nan")


def hit_schedule(model: RandomModel, request: int, start: int) -> list[list[torch.Tensor]]:
    """From ``start``: chunked prefill, decode, an EAGLE round with rejected drafts, one with
    all accepted (verify, multi-step draft, draft extend), decode. Outputs of each forward."""
    pool = model.pool
    r = [request]
    outs = [run(model, pool.extend(r, [start], [50]))]
    outs.append(run(model, pool.extend(r, [start + 50], [70])))
    seq = start + 120
    for _ in range(2):
        seq += 1
        outs.append(run(model, pool.decode(r, [seq])))
    outs.append(run(model, pool.verify(r, [seq], 4), rejected={request: seq + 2}))
    seq += 2  # the bonus token and one accepted draft
    outs.append(run(model, pool.verify(r, [seq], 4)))
    seq += 4
    outs += [run(model, pool.draft_step(r, [seq], 3, step)) for step in range(3)]
    result = model.forward(pool.extend(r, [seq], [3], draft_model=True))  # window-only MTP
    assert model.max_error(result) <= ATOL
    outs.append(run(model, pool.decode(r, [seq + 4])))
    return outs


@pytest.fixture(autouse=True)
def torch_path():
    with force_path("torch"):
        yield


@pytest.mark.parametrize(
    ("pages", "prompt"),
    [(1, 256), (1, 300), (2, 512), (4, 1024), (4, 1101)],
    ids=["256", "256-of-300", "512", "1024", "1024-of-1101"],
)
def test_hit_then_chunked_prefill_decode_and_eagle_equals_no_cache(pages: int, prompt: int) -> None:
    """Request 0 prefills the prompt (two chunks); request 1 shares the prompt and hits its
    first ``pages`` pages (in the same batch as request 0's next token), then goes on."""
    hit = pages * PAGE
    lens = [prompt + 10, prompt + 220]
    cached = make_model(lens, shared_pages={1: (0, pages)}, same_tokens={1: (0, prompt)})
    pool = cached.pool
    first = prompt // 2 + 3
    run(cached, pool.extend([0], [0], [first]))
    run(cached, pool.extend([0], [first], [prompt - first]))
    poison_own_rings(cached, 1)
    # The hit extends beside request 0's next token; its own prefix is all in the cache.
    run(cached, pool.extend([0, 1], [prompt, hit], [1, 5]))
    with_cache = hit_schedule(cached, 1, hit + 5)

    fresh = make_model(lens, same_tokens={1: (0, prompt)})
    run(fresh, fresh.pool.extend([1], [0], [hit + 5]))
    without = hit_schedule(fresh, 1, hit + 5)
    for step, (a, b) in enumerate(zip(with_cache, without, strict=True)):
        for layer, (x, y) in enumerate(zip(a, b, strict=True)):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0, msg=f"step {step} layer {layer}")


def test_evicted_prefix_is_recomputed_then_hit_again() -> None:
    """Request 0's prompt is evicted; request 2 (same prompt) recomputes it in one prefill, in
    the pages request 1 (another prompt) left behind; request 3 then hits request 2's pages."""
    lens = [600, 600, 560, 700]
    model = make_model(
        lens,
        shared_pages={2: (1, 2), 3: (2, 2)},
        same_tokens={2: (0, 540), 3: (2, 540)},
    )
    pool = model.pool
    run(model, pool.extend([0, 1], [0, 0], [600, 600]))
    run(model, pool.extend([2], [0], [540]))
    poison_own_rings(model, 3)
    run(model, pool.extend([3], [512], [100]))
    run(model, pool.decode([2, 3], [541, 613]))


def test_hit_in_the_triton_interpreter() -> None:
    """A 256-token hit, extend, verify and decode through every Triton kernel."""
    model = make_model([260, 300], shared_pages={1: (0, 1)}, same_tokens={1: (0, 260)})
    pool = model.pool
    run(model, pool.extend([0], [0], [260]))
    poison_own_rings(model, 1)
    with force_path("triton-interpreter"):
        run(model, pool.extend([1], [256], [6]))
        run(model, pool.verify([1], [262], 3))
        run(model, pool.decode([1], [266]))


def test_hit_through_the_sglang_backend() -> None:
    """The same hit through the sglang adapter: a real ``ReqToTokenPool`` row pointing at the
    cached pages, ``ForwardBatch``es with sglang's extend prefix lengths, radix cache on."""
    model = make_model([530, 640], shared_pages={1: (0, 2)}, same_tokens={1: (0, 520)})
    pool = model.pool
    harness.reserve_padding_slot(pool)
    runner = harness.mock_runner(pool, harness.tiny_hf_config(CONFIG))
    assert not runner.server_args.disable_radix_cache
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    model.state = backend.state
    sim = harness.SimulatedModel(model)
    builder = harness.BatchBuilder(pool)
    steps = [
        builder.extend([0], [0], [520]),
        builder.extend([1], [512], [40]),
        builder.decode([0, 1], [521, 553]),
        builder.verify([1], [553], 4),
    ]
    for i, step in enumerate(steps):
        if i == 1:
            poison_own_rings(model, 1)
        backend.init_forward_metadata(step.batch)
        for layer in range(len(CONFIG.compress_ratios)):
            out = sim.layer(backend, step, layer)
            error = sim.max_error(step.rows, layer, out)
            assert error <= ATOL, f"step {i} layer {layer}: {error:.3g}"
