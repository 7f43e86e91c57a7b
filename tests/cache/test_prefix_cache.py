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

from dsv4_backend.compute import AttentionState
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.planning import BatchView, ForwardKind
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel

pytestmark = pytest.mark.usefixtures("torch_path")

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


@pytest.mark.parametrize(
    ("pages", "prompt"),
    [
        (1, 256),
        (1, 300),
        (2, 512),
        # A 4-page hit ending at the prompt's end: 512's case at twice the pages (long only).
        pytest.param(4, 1024, marks=pytest.mark.stress),
        (4, 1101),
    ],
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


@pytest.mark.sglang
def test_hit_through_the_sglang_backend() -> None:
    """The same hit through the sglang adapter: a real ``ReqToTokenPool`` row pointing at the
    cached pages, ``ForwardBatch``es with sglang's extend prefix lengths, radix cache on."""
    model = make_model([530, 640], shared_pages={1: (0, 2)}, same_tokens={1: (0, 520)})
    pool = model.pool
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


class SglangHost:
    """sglang's own objects decide every slot and every hit: its ``UnifiedRadixCache`` (full
    and SWA components) over its ``SWATokenToKVPoolAllocator`` (full and window slots,
    ``full_to_swa``, paged) and a ``ReqToTokenPool``; request ``i`` uses pool row ``i + 1``."""

    def __init__(self, model: RandomModel) -> None:
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang_pool import make_pool

        full, swa = 16 * PAGE, 8 * PAGE
        kv_pool = make_pool(swa_size=swa, full_size=full)  # only its sizes and SWA pool matter
        self.alloc = SWATokenToKVPoolAllocator(
            full, swa, PAGE, torch.float8_e4m3fn, "cpu", kv_pool, need_sort=False
        )
        self.r2t = ReqToTokenPool(
            size=model.pool.num_requests, max_context_len=6 * PAGE, device="cpu",
            enable_memory_saver=False,
        )  # fmt: skip
        self.cache = UnifiedRadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                page_size=PAGE, sliding_window_size=CONFIG.window_size,
                tree_components=(ComponentType.FULL, ComponentType.SWA),
            )
        )  # fmt: skip
        # The model's caches and rings, sized for sglang's slots (page 0 is its padding page).
        model.state = AttentionState.allocate(
            CONFIG, num_full_slots=full + PAGE, num_swa_slots=swa + PAGE,
            num_request_slots=model.pool.num_requests + 1,
        )  # fmt: skip
        self.model = model
        self.lens = [0] * model.pool.num_requests

    @staticmethod
    def key(tokens: list[int]):  # sglang's radix key of token ids
        from array import array

        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", tokens))

    def admit(self, request: int, tokens: list[int]) -> int:
        """Match ``tokens`` in the tree; the hit's cached slots start the request's row.
        Returns the prefix length sglang hands over."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        # At least one token is left to extend (Req._compute_max_prefix_len).
        match = self.cache.match_prefix(MatchPrefixParams(key=self.key(tokens[:-1])))
        hit = match.device_prefix_len
        slots = self.cache.path_device_indices(match.last_device_node)[:hit]
        self.r2t.req_to_token[request + 1, :hit] = slots.int()
        self.lens[request] = hit
        return hit

    def extend(self, request: int, n: int) -> list[torch.Tensor]:
        start = self.lens[request]
        row = self.r2t.req_to_token[request + 1]
        last = int(row[start - 1]) if start else -1
        args = [torch.tensor([v]) for v in (start, start, start + n, start + n, last)]
        loc = self.alloc.alloc_extend(*args, n)
        row[start : start + n] = loc.int()
        self.lens[request] = start + n
        return run(self.model, self.view(request, loc, extend=(start, n)))

    def decode(self, request: int) -> list[torch.Tensor]:
        row = self.r2t.req_to_token[request + 1]
        seq = self.lens[request] + 1
        loc = self.alloc.alloc_decode(
            torch.tensor([seq]), torch.tensor([seq]), row[seq - 2 : seq - 1].long()
        )
        row[seq - 1] = loc.int()
        self.lens[request] = seq
        return run(self.model, self.view(request, loc))

    def view(self, request: int, loc: torch.Tensor, extend: tuple[int, int] | None = None):
        seq = self.lens[request]
        kind = ForwardKind.DECODE if extend is None else ForwardKind.EXTEND
        return BatchView(
            kind=kind, req_pool_indices=torch.tensor([request + 1]),
            seq_lens=torch.tensor([seq]), seq_lens_cpu=[seq], out_cache_loc=loc.long(),
            req_to_token=self.r2t.req_to_token, full_to_swa=self.alloc.full_to_swa_index_mapping,
            extend_prefix_lens=None if extend is None else [extend[0]],
            extend_seq_lens=None if extend is None else [extend[1]],
        )  # fmt: skip

    def cache_prompt(self, request: int, tokens: list[int]) -> None:
        """Insert the request's page-aligned prompt into the tree (``cache_finished_req``)."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        n = len(tokens) // PAGE * PAGE
        slots = self.r2t.req_to_token[request + 1, :n].long()
        self.cache.insert(InsertParams(key=self.key(tokens[:n]), value=slots))

    def evict_all(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.cache.evict(EvictParams(num_tokens=16 * PAGE, swa_num_tokens=8 * PAGE))


@pytest.mark.sglang
def test_hits_decided_by_sglangs_radix_cache_allocator_and_req_to_token_pool() -> None:
    """A 1100-token prompt is cached; requests sharing 1050, 300 of it hit 1024, 256 (sglang's
    page-aligned matches); after eviction a request with the prompt recomputes it in freed
    pages (stale c4 rings) and a later one hits the recomputed prefix (512 of 600)."""
    from sglang.srt.runtime_context import get_context

    lens = [1100, 1160, 400, 700, 710]
    same = {1: (0, 1050), 2: (0, 300), 3: (0, 700), 4: (3, 600)}
    model = make_model(lens, same_tokens=same)
    prompt = list(range(1000, 2100))
    tokens = [prompt, prompt[:1050] + list(range(5000, 5110)), prompt[:300] + [7] * 100,
              prompt[:700], prompt[:600] + [9] * 110]  # fmt: skip
    with get_context().override_server_args(device="cpu"):
        host = SglangHost(model)
        assert host.admit(0, tokens[0]) == 0
        host.extend(0, 600)
        host.extend(0, 500)
        host.cache_prompt(0, tokens[0])
        assert host.admit(1, tokens[1]) == 1024
        host.extend(1, 126)
        host.decode(1)
        assert host.admit(2, tokens[2]) == 256
        host.extend(2, 144)
        host.evict_all()
        assert host.admit(3, tokens[3]) == 0
        host.extend(3, 700)
        host.cache_prompt(3, tokens[3])
        assert host.admit(4, tokens[4]) == 512
        host.extend(4, 188)
        host.decode(4)


#: Prefix-cache modes other than sglang's device radix cache: ``(ServerArgs field, flag)``.
CACHE_MODES = (
    ("enable_flexkv", "--enable-flexkv"),
    ("enable_unified_cache_external_linker", "--enable-unified-cache-external-linker"),
    ("radix_cache_backend", "--radix-cache-backend"),
    ("enable_session_radix_cache", "--enable-session-radix-cache"),
    ("enable_streaming_session", "--enable-streaming-session"),
)


@pytest.mark.sglang
def test_the_plain_launch_is_accepted_and_other_cache_modes_are_refused_by_name() -> None:
    """sglang 0.5.23's own ``ServerArgs`` defaults (radix cache on) build the backend; each
    still unsupported prefix-cache mode is a real ``ServerArgs`` field, off by default, and
    refused naming its flag."""
    from sglang.srt.server_args import ServerArgs

    from dsv4_backend.errors import ConfigError

    pool = PagedRequestPool(CONFIG, [40], generator=torch.Generator().manual_seed(0))
    runner = harness.mock_runner(pool, harness.tiny_hf_config(CONFIG))
    runner.server_args = ServerArgs(model_path="unused", page_size=PAGE)
    assert not runner.server_args.disable_radix_cache
    DSV4AttentionBackend(runner, cache_format="dense")
    for option, flag in CACHE_MODES:
        runner.server_args = ServerArgs(model_path="unused", page_size=PAGE)
        assert not getattr(runner.server_args, option), option
        setattr(runner.server_args, option, "mine" if option == "radix_cache_backend" else True)
        with pytest.raises(ConfigError, match=flag):
            DSV4AttentionBackend(runner, cache_format="dense")
