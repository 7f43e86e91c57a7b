"""The backend's fp8 caches as views of a real sglang ``DeepSeekV4TokenToKVPool`` (on the CPU).

sglang's pool hard-codes the Flash geometry (448 nope + 64 rope, indexer dim 128), so the
config here is Flash-width with four layers and a few hundred slots.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.test.kernels.deepseek_v4.k_cache_reference import dequantize_k_cache_paged_ref
from sglang_pool import CONFIG, REQUEST_SLOTS, inside, make_pool

from dsv4_backend.cache import DSV4CachePools, IndexerKeyCache, TokenCache
from dsv4_backend.cache.fp4_format import C4_ROUNDING, Fp4IndexKeyCache
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.sglang_adapter.pool_alias import (
    shared_state,
    unaliasable_reason,
    unmovable_reason,
)


def make_runner(pool: DeepSeekV4TokenToKVPool) -> SimpleNamespace:
    return SimpleNamespace(
        token_to_kv_pool=pool,
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(REQUEST_SLOTS, 2048)),
        device="cpu",
    )


@pytest.fixture(scope="module")
def pool() -> DeepSeekV4TokenToKVPool:
    return make_pool()


@pytest.fixture(scope="module")
def state(pool):
    return shared_state(make_runner(pool), CONFIG, "fp8")


@pytest.mark.sglang
def test_caches_are_views_of_the_pool_buffers(pool, state) -> None:
    pools = state.pools
    for layer, ratio in enumerate(CONFIG.compress_ratios):
        assert inside(pools.window(layer).storage, pool.get_swa_raw_buffer(layer))
        if ratio:
            assert inside(pools.compressed(layer).storage, pool.get_extra_key_buffer(layer))
        if ratio == 4:
            assert inside(pools.indexer(layer).storage, pool.get_index_k_with_scale_buffer(layer))
    ring128 = state.compressor_states[2].ring
    c128_states = pool.get_attention_compress_states(2).kv_score_buffer.kv_score
    assert inside(ring128, c128_states)
    assert ring128.shape == (REQUEST_SLOTS, CONFIG.ring_rows(128), 2 * CONFIG.head_dim)
    assert torch.all(ring128[..., : CONFIG.head_dim] == 0)
    assert torch.all(ring128[..., CONFIG.head_dim :] == float("-inf"))
    # c4 rings: page-scoped like sglang's (row swa_page * R + pos % R), one per window page.
    pages = -(-pool.swa_size // 256) + 1  # window slots swa_size + 1, rounded up, in pages
    for layer in (1, 3):
        for ring_state, states, dim in (
            (state.compressor_states[layer], pool.get_attention_compress_states(layer), 512),
            (state.indexer_states[layer], pool.get_indexer_compress_states(layer), 128),
        ):
            buf = states.kv_score_buffer.kv_score
            assert ring_state.ring.data_ptr() == buf.data_ptr()
            assert ring_state.ring.shape == (pages, CONFIG.ring_rows(4), 4 * dim)
            assert ring_state.window_page == states.swa_page_size == 256
            assert torch.all(ring_state.ring[..., : 2 * dim] == 0)


@pytest.mark.sglang
@pytest.mark.parametrize("stage", [range(0, 2), range(2, 4), range(1, 4)])
def test_a_pipeline_stage_aliases_its_stage_pool(stage: range) -> None:
    """sglang's pool of a pipeline stage holds that stage's layers (its getters take the
    model's layer ids): the stage's caches and rings are views of it; a pool of another stage
    is not aliased, and the reason names both ranges."""
    stage_pool = make_pool(stage=stage)
    state = shared_state(make_runner(stage_pool), CONFIG, "fp8", layers=stage)
    assert state.pools.layers == stage and sorted(state.pools.windows) == list(stage)
    assert unmovable_reason(state, stage_pool, None) is None  # every ring a view too
    for layer in stage:
        assert inside(state.pools.window(layer).storage, stage_pool.get_swa_raw_buffer(layer))
        if CONFIG.compress_ratios[layer]:
            buf = stage_pool.get_extra_key_buffer(layer)
            assert inside(state.pools.compressed(layer).storage, buf)
    other = range(0, stage.start) if stage.start else range(stage.stop, 4)
    reason = unaliasable_reason(stage_pool, CONFIG, "fp8", other)
    assert f"stage [{stage.start}, {stage.stop})" in (reason or "")
    assert f"at [{other.start}, {other.stop})" in (reason or "")


@pytest.mark.sglang
def test_c4_state_rows_are_sglangs(pool, state) -> None:
    """Our ring row of (window slot s, position p) is the row sglang's translation gives."""
    states = pool.get_attention_compress_states(1)
    ring = state.compressor_states[1].ring
    swa_loc = torch.tensor([256 + 5, 512 + 250, 255])  # positions p with p % 256 = swa_loc % 256
    state_loc = states.translate_from_swa_loc_to_state_loc(swa_loc.clone())
    positions = torch.tensor([5, 1018, 511])
    values = torch.randn(3, ring.shape[-1])
    ring[swa_loc // 256, positions % ring.shape[1]] = values
    torch.testing.assert_close(states.kv_score_buffer.kv_score[state_loc], values)
    state.compressor_states[1].reset()


@pytest.mark.sglang
def test_store_gather_round_trip_through_the_pool(pool, state) -> None:
    gen = torch.Generator().manual_seed(0)
    cases = [
        (state.pools.window(1), pool.get_swa_raw_buffer(1), CONFIG.head_dim),
        (
            state.pools.compressed(1),
            pool.get_extra_key_buffer(1).view(torch.uint8),
            CONFIG.head_dim,
        ),
        (
            state.pools.compressed(2),
            pool.get_extra_key_buffer(2).view(torch.uint8),
            CONFIG.head_dim,
        ),
        (state.pools.indexer(3), pool.get_index_k_with_scale_buffer(3), CONFIG.index_head_dim),
    ]
    for cache, buf, dim in cases:
        cache_slots = torch.randperm(cache.num_slots, generator=gen)[:5]
        rows = torch.randn(len(cache_slots), dim, generator=gen)
        before = buf.clone()
        store_rows(cache, rows, cache_slots)
        assert not torch.equal(before, buf), f"{cache} did not write sglang's buffer"
        # Same bytes as a freshly allocated cache of the same layout.
        if isinstance(cache, IndexerKeyCache):
            fresh = IndexerKeyCache(cache.num_slots, dim, "fp8")
        else:
            fresh = TokenCache(cache.num_slots, dim, CONFIG.rope_dim, cache.page_tokens, "fp8")
        store_rows(fresh, rows, cache_slots)
        torch.testing.assert_close(
            cache.gather(cache_slots), fresh.gather(cache_slots), rtol=0, atol=0
        )
        torch.testing.assert_close(cache.gather(cache_slots), rows, rtol=0.07, atol=0.01)


@pytest.mark.sglang
def test_window_bytes_are_sglangs_swa_page(pool, state) -> None:
    """Our window writer and sglang's (``set_swa_key_buffer_radix``, a 256-token SWA page: the
    576 data bytes of all tokens, then their scales) leave the same bytes, and sglang's paged
    dequantisation reference reads back what our gather reads (slots around the page edges)."""
    window, buf = state.pools.window(0), pool.get_swa_raw_buffer(0)
    assert buf.shape[1] == window.layout.page_bytes == 149_760
    slots = torch.tensor([0, 3, 127, 128, 255, 256, 300, 511, 512])
    keys = torch.randn(len(slots), CONFIG.head_dim, generator=torch.Generator().manual_seed(3))
    data, scales = window.layout.pack_tokens(keys)
    nope = CONFIG.nope_dim
    pack = NopeFp8RopeBf16Pack(
        k_nope_fp8=data[:, :nope].contiguous().view(torch.float8_e4m3fn),
        k_rope_bf16=data[:, nope:].contiguous().view(torch.bfloat16),
        scale_k_nope_ue8m0=scales[:, : nope // 64].contiguous(),
    )
    buf.zero_()
    pool.set_swa_key_buffer_radix(0, slots, pack)
    theirs = buf.clone()
    buf.zero_()
    store_rows(window, keys, slots)
    assert torch.equal(buf, theirs)
    read = dequantize_k_cache_paged_ref(buf, slots, pool.swa_page_size).reshape(len(slots), -1)
    torch.testing.assert_close(read.float(), window.gather(slots), rtol=0, atol=0)
    buf.zero_()


@pytest.mark.sglang
def test_too_small_pool_buffer_is_refused(caplog) -> None:
    pool = make_pool()
    pool.swa_size = 4096  # sizes our window caches past sglang's 3 pages of 256 tokens
    # swa_size plus one 256-token page, as sglang sizes its own buffers.
    with pytest.raises(ConfigError, match=r"window\[0\] holds 449280 bytes; 4352 slots need"):
        shared_state(make_runner(pool), CONFIG, "fp8")


@pytest.mark.sglang
def test_logs_aliased_or_allocated(caplog) -> None:
    pool = make_pool()
    with caplog.at_level(logging.INFO, logger="dsv4_backend.sglang_adapter.pool_alias"):
        fp8 = shared_state(make_runner(pool), CONFIG, "fp8")
    assert "aliased" in caplog.text and "DeepSeekV4TokenToKVPool" in caplog.text
    rings = [*fp8.compressor_states.values(), *fp8.indexer_states.values()]
    expected = fp8.pools.nbytes + sum(r.ring.nbytes for r in rings)
    assert f"aliased {expected} bytes" in caplog.text
    assert f"{len(rings)} of {len(rings)} compressor rings" in caplog.text
    caplog.clear()
    dense_pool = make_pool()
    with caplog.at_level(logging.INFO, logger="dsv4_backend.sglang_adapter.pool_alias"):
        dense = shared_state(make_runner(dense_pool), CONFIG, "dense")
    assert "allocated" in caplog.text and "cache format 'dense'" in caplog.text
    assert not inside(dense.pools.window(0).storage, dense_pool.get_swa_raw_buffer(0))


@pytest.mark.parametrize(
    ("storage", "match"),
    [
        (torch.zeros(10**6, dtype=torch.int8), "expected a uint8 tensor"),
        (torch.zeros(2000, 1000, dtype=torch.uint8)[:, :500], "not contiguous"),
        (torch.zeros(1000, dtype=torch.uint8), "test buf holds 1000 bytes; 300 slots need 224640"),
    ],
)
def test_over_validates_storage(storage: torch.Tensor, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TokenCache.over(storage, 300, 512, 64, 128, name="test buf")


def test_pools_over_needs_every_layer() -> None:
    big = torch.zeros(1 << 20, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="no compressed storage for layer 2"):
        DSV4CachePools.over(
            CONFIG,
            num_full_slots=512,
            num_swa_slots=256,
            windows=dict.fromkeys(range(4), big),
            compressed={1: big, 3: big},
            indexers={1: big, 3: big},
        )


@pytest.mark.sglang
def test_fp4_indexer_pool_is_aliased_and_read_by_sglang() -> None:
    """``--enable-deepseek-v4-fp4-indexer``: sglang's c4 indexer pool in fp4 pages (68 B a
    key) is aliased under ``indexer_selection="fp4"`` (and only then); keys the backend stores
    read back through sglang's own readers as sglang's quantiser packs them."""
    from sglang.kernels.ops.quantization.fp4_indexer_quant import quantize_fp4_indexer_tensor

    pool = make_pool(enable_deepseek_v4_fp4_indexer=True)
    assert pool.index_pools[4].use_fp4_indexer
    fp4 = dataclasses.replace(CONFIG, indexer_selection="fp4")
    layers = range(len(CONFIG.compress_ratios))
    assert "c4 indexer pool is not fp8" in unaliasable_reason(pool, CONFIG, "fp8", layers)
    assert "c4 indexer pool is not fp4" in unaliasable_reason(make_pool(), fp4, "fp8", layers)
    state = shared_state(make_runner(pool), fp4, "fp8")
    assert unmovable_reason(state, pool, None) is None
    g = torch.Generator().manual_seed(5)
    for layer in (1, 3):
        cache = state.pools.indexer(layer)
        assert isinstance(cache, Fp4IndexKeyCache) and cache.rounding is C4_ROUNDING
        buffer = pool.get_index_k_with_scale_buffer(layer)
        assert cache.storage.data_ptr() == buffer.data_ptr()
        assert buffer.shape[1] == cache.layout.page_bytes == 64 * 68
        assert pool.index_pools[4].get_bytes_per_token() == cache.layout.bytes_per_token
        rows = torch.randn(50, 128, generator=g) * 3
        slots = torch.randperm(cache.num_slots - 64, generator=g)[:50] + 64
        store_rows(cache, rows, slots)
        payload, scales = pool.get_low_ratio_index_k_fp4(layer, slots)
        want_payload, want_scales = quantize_fp4_indexer_tensor(rows, rne=False)
        assert torch.equal(payload, want_payload) and torch.equal(scales, want_scales)
        dequant = pool.get_low_ratio_index_k_dequant(layer, slots)
        assert torch.equal(dequant, cache.gather(slots).bfloat16())
