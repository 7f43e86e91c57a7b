"""``indexer_selection="fp4"`` (sglang's ``--enable-deepseek-v4-fp4-indexer``) against sglang's
own code on the CPU: its fp4 quantiser ``quantize_fp4_indexer_tensor`` (Triton, in the
interpreter), its ``DeepSeekV4IndexerPool`` fp4 pages (their readbacks of the keys the backend
stores: ``cache/test_pool_alias.py``), its torch top-k; the cache store's fp4 kernel against the
torch store; the indexer variants' fp4 selections; the adapter under the flag."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from dsv4_backend.cache.fp4_format import (
    C4_ROUNDING,
    E2M1_MAGNITUDES,
    V41_ROUNDING,
    Fp4IndexKeyCache,
    e2m1_codes,
    fp4_round_ue8m0,
    pack_ue8m0,
    ue8m0_exponents,
    unpack_ue8m0,
)
from dsv4_backend.kernels.cache_store.table import CACHE_STORE, store_rows
from dsv4_backend.kernels.indexer.deep_gemm import deep_gemm_unsupported_reason
from dsv4_backend.kernels.indexer.fp4 import fp4_key_rows, fp4_query_view
from dsv4_backend.kernels.indexer.table import INDEXER, index_scores, run_indexer
from dsv4_backend.kernels.variants import force_variant

pytestmark = pytest.mark.sglang

DIM = 128


def _rows(generator: torch.Generator, smallest_amax: float = 1e-3) -> torch.Tensor:
    """``[N, 128]`` float32 index keys of every kind a 32-value block can be: random
    magnitudes from ``2^-10`` to ``2^20`` (amax at least ``smallest_amax``), blocks holding every
    e2m1 magnitude and every midpoint (a tie) times a power of two with random signs, and
    blocks whose amax / 6 is a power of two or one float32 step either side of one."""
    rows = [torch.randn(3, DIM, generator=generator) * 2.0**e for e in range(-10, 21, 2)]
    midpoints = [(a + b) / 2 for a, b in itertools.pairwise(E2M1_MAGNITUDES)]
    grid = torch.tensor([*E2M1_MAGNITUDES, *midpoints, 6.5]).repeat(DIM // 16 + 1)[:DIM]
    for e in range(-8, 9):
        sign = torch.where(torch.rand(DIM, generator=generator) < 0.5, -1.0, 1.0)
        rows.append((grid * 2.0**e * sign)[None])
        top = torch.tensor(6.0 * 2.0**e)
        for amax in (top, torch.nextafter(top, top * 2), torch.nextafter(top, top * 0)):
            row = torch.rand(DIM, generator=generator) * amax
            row[::32] = amax  # every block's amax
            rows.append(row[None])
    x = torch.cat(rows).float()
    blocks = x.unflatten(1, (-1, 32)).abs().amax(-1)
    return x[(blocks >= smallest_amax).all(1)]


def _sglang_quantised(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sglang's fp4 indexer quantiser (threshold rounding) as ``(payload uint8 [N, 64],
    exponents uint8 [N, 4])``."""
    from sglang.kernels.ops.quantization.fp4_indexer_quant import quantize_fp4_indexer_tensor

    payload, packed = quantize_fp4_indexer_tensor(x, rne=False)
    return payload.view(torch.uint8), packed.contiguous().view(torch.uint8).view(-1, 4)


def test_c4_rounding_is_sglangs_fp4_indexer_quantiser() -> None:
    """Payload nibbles and ue8m0 exponent bytes equal sglang's quantiser's on every block kind
    (ties round down, no negative zero code); the rounded values are the packed ones."""
    x = _rows(torch.Generator().manual_seed(0))
    assert x.shape[0] > 90
    payload, exponents = pack_ue8m0(x, C4_ROUNDING)
    want_payload, want_exponents = _sglang_quantised(x)
    assert torch.equal(payload, want_payload)
    assert torch.equal(exponents, want_exponents)
    assert torch.equal(fp4_round_ue8m0(x, C4_ROUNDING), unpack_ue8m0(payload, exponents))
    # The roundings differ where they should: ties (down vs even) and exponents.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_codes(ties, ties_even=False).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert e2m1_codes(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert not torch.equal(pack_ue8m0(x, V41_ROUNDING)[0], payload)


def test_c4_rounding_floors_a_blocks_amax_at_1e_4() -> None:
    """Blocks below sglang's floor (``max(1e-4, amax) / 6`` in its CUDA kernels) take the
    exponent of 1e-4: ``ceil(log2(fp32(1e-4) / 6))``; above it the exponent follows the amax."""
    floor = math.ceil(math.log2(np.float32(1e-4) / np.float32(6.0)))
    tiny = torch.tensor([0.0, 1e-9, 5e-5, 9.9e-5]).repeat_interleave(32)[None]
    assert ue8m0_exponents(tiny, C4_ROUNDING).tolist() == [[floor] * 4]
    assert ue8m0_exponents(torch.full((1, 32), 6.0), C4_ROUNDING).tolist() == [[0]]
    assert ue8m0_exponents(torch.full((1, 32), 6.5), C4_ROUNDING).tolist() == [[1]]
    assert ue8m0_exponents(tiny, V41_ROUNDING).min() < floor  # V4.1's floor is 6 * 2^-126


@pytest.mark.parametrize("rounding", [C4_ROUNDING, V41_ROUNDING], ids=lambda r: r.name)
def test_fp4_store_kernel_writes_the_torch_stores_bytes(rounding) -> None:
    """The cache store's Triton kernel (interpreter) packs every row as the torch store does,
    tiny blocks included, skipping slot -1."""
    g = torch.Generator().manual_seed(1)
    rows = torch.cat([_rows(g, smallest_amax=0.0)[:60], torch.rand(4, DIM, generator=g) * 1e-6])
    slots = torch.randperm(512, generator=g)[: rows.shape[0]]
    slots[::9] = -1
    caches = {}
    for variant in ("triton", "torch"):
        cache = Fp4IndexKeyCache(512, DIM, "fp8", rounding=rounding)
        with force_variant(CACHE_STORE, variant):
            store_rows(cache, rows, slots)
        caches[variant] = cache.storage
    assert torch.equal(caches["triton"], caches["torch"])
    assert caches["torch"].any()


def _sglang_pool(num_slots: int):
    """sglang's c4 fp4 indexer pool of one layer, on the CPU."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool

    return DeepSeekV4IndexerPool(
        size=num_slots, page_size=64, dtype=torch.bfloat16, index_head_dim=DIM, layer_num=1,
        device="cpu", enable_memory_saver=False, use_fp4_indexer=True,
    )  # fmt: skip


def _butterfly(x: torch.Tensor) -> torch.Tensor:
    """sglang's in-warp Hadamard of 128-wide rows (``main_norm_rope.cuh``)."""
    from test_indexer_fp8 import butterfly_128_rows

    return butterfly_128_rows(x)


def _sglang_selection(q, w, pool, page_table, lengths, topk):
    """sglang's fp4 indexer on the CPU: queries rotated, rounded to bf16 and quantised by its
    quantiser, de-quantised by its table; keys by its pool's readback; logits ``sum_h w *
    relu(q . k)`` (DeepGEMM's ``fp8_fp4_paged_mqa_logits``); its torch top-k transform."""
    from sglang.srt.layers.attention.dsv4.indexer import topk_transform_pytorch_vectorized
    from sglang.srt.layers.quantization.fp8 import DSV4_DEQUANT_FP4_TABLE

    rows, heads, _ = q.shape
    payload, exponents = _sglang_quantised(_butterfly(q).bfloat16().float().reshape(-1, DIM))
    codes = torch.stack([payload & 15, payload >> 4], -1).flatten(1).long()
    scales = torch.exp2(exponents.float() - 127).repeat_interleave(32, -1)
    q_deq = (DSV4_DEQUANT_FP4_TABLE[codes] * scales).reshape(rows, heads, DIM)
    width = page_table.shape[1] * 64
    cols = torch.arange(width)
    slots = page_table.long()[:, cols // 64] * 64 + cols % 64  # [T, N]
    keys = pool.get_index_k_dequant(0, slots.reshape(-1)).float().reshape(rows, width, DIM)
    logits = torch.einsum("th,thn->tn", w, torch.einsum("thd,tnd->thn", q_deq, keys).relu())
    out = torch.empty(rows, topk, dtype=torch.int32)
    topk_transform_pytorch_vectorized(logits, lengths, page_table, out, 64)
    return logits.masked_fill(cols >= lengths[:, None], -math.inf), out


@pytest.mark.parametrize("variant", ["torch", "full_width", "bounded"])
def test_fp4_selection_is_sglangs(variant: str) -> None:
    """Keys written as the backend writes them (``fp4_key_rows``, the cache's c4 rounding)
    into sglang's pool, queries as ``fp4_query_view``: every indexer variant's scores equal
    sglang's fp4 logits and its top-k selects sglang's slots."""
    g = torch.Generator().manual_seed(3)
    rows, heads, topk, pages = 5, 8, 24, 6
    pool = _sglang_pool(pages * 64)
    cache = Fp4IndexKeyCache.over(pool.index_k_with_scale_buffer[0], pages * 64, DIM,
                                  rounding=C4_ROUNDING)  # fmt: skip
    entries = torch.randn(pages * 64, DIM, generator=g) * torch.rand(pages * 64, 1, generator=g)
    with force_variant(CACHE_STORE, "torch"):  # its kernel: test_fp4_store_kernel_...
        store_rows(cache, fp4_key_rows(entries), torch.arange(pages * 64))
    page_table = torch.stack([torch.randperm(pages - 1, generator=g)[:3] + 1 for _ in range(rows)])
    page_table = page_table.int()
    lengths = torch.tensor([1, 20, 100, 150, 192], dtype=torch.int32)
    q = torch.randn(rows, heads, DIM, generator=g)
    w = torch.rand(rows, heads, generator=g)
    want_scores, want_slots = _sglang_selection(q, w, pool, page_table, lengths, topk)
    queries = fp4_query_view(q)
    out = torch.empty(rows, topk, dtype=torch.int32)
    with force_variant(INDEXER, variant):
        scores = index_scores(queries, w, cache, page_table, lengths, 192)
        run_indexer(queries, w, cache, page_table, lengths, topk, out)
    finite = torch.isfinite(want_scores)
    assert torch.equal(torch.isfinite(scores), finite)
    torch.testing.assert_close(scores[finite], want_scores[finite], rtol=1e-5, atol=1e-5)
    for got, want, n in zip(out, want_slots, lengths.tolist(), strict=True):
        kept = min(n, topk)
        assert sorted(got[:kept].tolist()) == sorted(want[:kept].tolist())
        assert (got[kept:] == -1).all()


#: The CUDA checks' shape: Flash's 64 indexer heads of 128, top-512, rows over 12 pages.
CUDA_ROWS, CUDA_HEADS, CUDA_TOPK, CUDA_PAGES = 9, 64, 512, 12


def _cuda_keys(g: torch.Generator) -> dict[str, Fp4IndexKeyCache]:
    """Flash's fp4 c4 keys stored on the GPU by the cache store's ``triton`` and ``torch``
    variants."""
    from dsv4_backend.kernels.dispatch import TRITON, force_path

    num = CUDA_PAGES * 64
    entries = torch.randn(num, DIM, generator=g) * torch.rand(num, 1, generator=g)
    key_rows = fp4_key_rows(entries.cuda())
    caches = {}
    for variant in ("triton", "torch"):
        caches[variant] = Fp4IndexKeyCache(num, DIM, "fp8", "cuda", rounding=C4_ROUNDING)
        with force_path(TRITON), force_variant(CACHE_STORE, variant):
            store_rows(caches[variant], key_rows, torch.arange(num, device="cuda"))
    return caches


def _check_on_cuda(variants: tuple[str, ...], cache: Fp4IndexKeyCache, g: torch.Generator):
    """Each indexer variant's fp4 scores and selection compiled for the GPU against the torch
    variant's on the same bytes: the scores to fp32 summation order, the selections tie-aware
    (the scores of the slots chosen)."""
    from dsv4_backend.kernels.dispatch import TRITON, force_path

    rows, topk, width = CUDA_ROWS, CUDA_TOPK, CUDA_PAGES * 64
    page_table = torch.stack([torch.randperm(CUDA_PAGES, generator=g) for _ in range(rows)])
    page_table = page_table.int().cuda()
    lengths = torch.randint(1, width + 1, (rows,), generator=g).int().cuda()
    queries = fp4_query_view(torch.randn(rows, CUDA_HEADS, DIM, generator=g).cuda())
    w = torch.rand(rows, CUDA_HEADS, generator=g).cuda()
    with force_variant(INDEXER, "torch"):
        want = index_scores(queries, w, cache, page_table, lengths, width)
    finite = torch.isfinite(want)
    for variant in variants:
        out = torch.empty(rows, topk, dtype=torch.int32, device="cuda")
        with force_path(TRITON), force_variant(INDEXER, variant):
            got = index_scores(queries, w, cache, page_table, lengths, width)
            run_indexer(queries, w, cache, page_table, lengths, topk, out)
        assert torch.equal(torch.isfinite(got), finite), variant
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-3)
        for row, n in enumerate(lengths.tolist()):
            kept = min(n, topk)
            chosen = out[row, :kept].long()
            assert (chosen >= 0).all() and (out[row, kept:] == -1).all(), (variant, row)
            pos = page_table[row].long()[:, None] * 64 + torch.arange(64, device="cuda")
            index = {int(s): i for i, s in enumerate(pos.flatten().tolist())}
            picked = want[row, [index[int(s)] for s in chosen.tolist()]]
            # tie-aware: the chosen slots' scores are the top-``kept`` scores
            best = want[row, :n].topk(kept).values
            torch.testing.assert_close(picked.sort().values, best.sort().values, atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_fp4_kernels_on_cuda() -> None:
    """The fp4 cache store and the ``full_width`` / ``bounded`` scores and selections compiled
    for the GPU against the torch twins on the same bytes: the stores byte for byte, the rest
    as ``_check_on_cuda`` says."""
    g = torch.Generator().manual_seed(7)
    caches = _cuda_keys(g)
    assert torch.equal(caches["triton"].storage, caches["torch"].storage)
    _check_on_cuda(("full_width", "bounded"), caches["torch"], g)


@pytest.mark.gpu
def test_fp4_deep_gemm_on_cuda() -> None:
    """DeepGEMM's ``fp8_fp4_paged_mqa_logits`` (the ``deep_gemm`` variant) on the same fp4
    pages, where it runs (sm_100 / sm_120 with ``deep_gemm``; skipped with the variant's
    reason elsewhere): as ``_check_on_cuda`` says."""
    g = torch.Generator().manual_seed(7)
    cache = _cuda_keys(g)["torch"]
    reason = deep_gemm_unsupported_reason(cache.device, cache, CUDA_HEADS, DIM, "fp4")
    if reason is not None:
        pytest.skip(f"the deep_gemm indexer does not run here: {reason}")
    _check_on_cuda(("deep_gemm",), cache, g)


def _fp4_backend(pool, fmt: str, **flags):
    from dsv4_backend.config import DSV4AttentionConfig
    from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
    from dsv4_backend.testing import harness

    hf = harness.tiny_hf_config(DSV4AttentionConfig.tiny(speculative=True))
    runner = harness.mock_runner(pool, hf, **flags)
    backend = DSV4AttentionBackend(runner, cache_format=fmt)
    runner.attn_backend = backend
    return backend


def test_the_flag_switches_the_adapter_to_fp4_keys(monkeypatch) -> None:
    """``--enable-deepseek-v4-fp4-indexer`` on SM100 (the platform probe replaced): the
    backend's c4 indexer keys (dense, and fp4 pages) are the rotated compressor entries in the
    c4 fp4 rounding and both select the same entries; refused off SM100 / SM120 and against
    another ``DSV4_BACKEND_INDEXER_SELECTION``."""
    from dsv4_backend.config import DSV4AttentionConfig
    from dsv4_backend.errors import ConfigError
    from dsv4_backend.kernels.dispatch import force_path
    from dsv4_backend.sglang_adapter import settings
    from dsv4_backend.testing import harness
    from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel

    config = DSV4AttentionConfig.tiny(speculative=True)
    pool = PagedRequestPool(config, [140, 270], generator=torch.Generator().manual_seed(0))
    model = RandomModel(config, pool, generator=torch.Generator().manual_seed(1))
    sim = harness.SimulatedModel(model)
    exact = _fp4_backend(pool, "dense")
    with pytest.raises(ConfigError, match="on a device without CUDA: --enable-deepseek"):
        _fp4_backend(pool, "dense", enable_deepseek_v4_fp4_indexer=True)
    monkeypatch.setattr(settings, "device_capability", lambda device: (10, 0))
    fp4 = [_fp4_backend(pool, fmt, enable_deepseek_v4_fp4_indexer=True) for fmt in ("dense", "fp8")]
    assert fp4[0].config.indexer_selection == "fp4"
    step = harness.BatchBuilder(pool).extend([0, 1], [0, 0], [120, 250])
    with force_path("torch"):
        for backend in (exact, *fp4):
            backend.init_forward_metadata(step.batch)
            sim.layer(backend, step, 1)
    slots = exact.forward_metadata.c4.out_loc
    slots = slots[slots >= 0]
    want = fp4_round_ue8m0(fp4_key_rows(exact.state.pools.indexer(1).gather(slots)), C4_ROUNDING)
    for backend in fp4:
        assert torch.equal(backend.state.pools.indexer(1).gather(slots), want)
    picked = [b.forward_metadata.c4.page_indices for b in (exact, *fp4)]
    assert torch.equal(picked[1], picked[2])
    assert not torch.equal(picked[0], picked[1])  # fp4 scores reorder some near entries
    monkeypatch.setenv("DSV4_BACKEND_INDEXER_SELECTION", "fp8")
    with pytest.raises(ConfigError, match="DSV4_BACKEND_INDEXER_SELECTION='fp8' with --enable"):
        _fp4_backend(pool, "dense", enable_deepseek_v4_fp4_indexer=True)
