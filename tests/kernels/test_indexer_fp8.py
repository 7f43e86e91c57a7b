"""``indexer_selection="fp8"``: sglang's quantised top-k (Hadamard rotation + e4m3 q per
(token, head), keys per token), checked against the recipe of sglang's kernels."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.kernels.indexer.fp8 import E4M3_MAX, hadamard, quantised_view
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.sglang_adapter.settings import INDEXER_SELECTION_ENV
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel


def butterfly_128(x: torch.Tensor) -> torch.Tensor:
    """sglang's in-warp Hadamard (``main_norm_rope.cuh``): lane ``l`` holds elements
    ``4l ... 4l+3``; two local stages, five ``shfl_xor`` stages, then ``* rsqrt(128)``."""
    data = x.reshape(32, 4).clone()
    a0, a1, a2, a3 = data.unbind(1)
    data = torch.stack([a0 + a1, a0 - a1, a2 + a3, a2 - a3], dim=1)
    a0, a1, a2, a3 = data.unbind(1)
    data = torch.stack([a0 + a2, a1 + a3, a0 - a2, a1 - a3], dim=1)
    for mask in (1, 2, 4, 8, 16):
        other = data[torch.arange(32) ^ mask]
        upper = (torch.arange(32) & mask).bool()[:, None]
        data = torch.where(upper, other - data, data + other)
    return (data * (1 / math.sqrt(128))).reshape(128)


@pytest.mark.sglang
def test_hadamard_is_sglangs_butterfly() -> None:
    x = torch.randn(128, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(x @ hadamard(128, x.device), butterfly_128(x))
    h = hadamard(64, torch.device("cpu"))
    torch.testing.assert_close(h @ h, torch.eye(64), atol=1e-6, rtol=0)


def sglang_logits(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The built-in's logits from codes and scales (``fused_q_indexer_rope_hadamard_quant``,
    ``fused_norm_rope_indexer``, then ``sum_h relu(q_fp8 . k_fp8) * w_out * k_scale``)."""

    def quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotated = butterfly_128_rows(x)
        scale = rotated.abs().amax(-1, keepdim=True).clamp(min=1e-4) / E4M3_MAX
        codes = (rotated * (1.0 / scale)).to(torch.float8_e4m3fn).float()
        return codes, scale

    q_codes, q_scale = quantise(q)  # [T, H, 128], [T, H, 1]
    k_codes, k_scale = quantise(k)  # [N, 128], [N, 1]
    weights_out = w * q_scale[..., 0]  # w already holds weight_scale
    dots = torch.einsum("thd,nd->thn", q_codes, k_codes).relu()
    return torch.einsum("thn,th->tn", dots, weights_out) * k_scale[:, 0]


def butterfly_128_rows(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, 128)
    return torch.stack([butterfly_128(row) for row in flat]).reshape(x.shape)


@pytest.mark.sglang
def test_quantised_view_reproduces_sglangs_logits_and_selection() -> None:
    gen = torch.Generator().manual_seed(1)
    t, h, n, topk = 24, 8, 300, 32
    q = torch.randn(t, h, 128, generator=gen)
    k = torch.randn(n, 128, generator=gen) * torch.rand(n, 1, generator=gen)
    w = torch.rand(t, h, generator=gen)
    want = sglang_logits(q, w, k)
    got = torch.einsum("thd,nd->thn", quantised_view(q), quantised_view(k)).relu()
    got = torch.einsum("thn,th->tn", got, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    exact = torch.einsum("th,thn->tn", w, torch.einsum("thd,nd->thn", q, k).relu())
    picked = got.topk(topk).indices.sort().values
    assert torch.equal(picked, want.topk(topk).indices.sort().values)
    exact_picked = exact.topk(topk).indices
    same = sum(
        len(set(a.tolist()) & set(b.tolist())) for a, b in zip(picked, exact_picked, strict=True)
    )
    assert 0.8 * t * topk < same < t * topk  # quantisation reorders a few near entries


def test_fp8_selection_needs_a_power_of_two_head_dim() -> None:
    with pytest.raises(ConfigError, match="power of two"):
        DSV4AttentionConfig.tiny(index_head_dim=96, indexer_selection="fp8")
    with pytest.raises(ConfigError, match="indexer_selection='fp6'"):
        DSV4AttentionConfig.tiny(indexer_selection="fp6")
    assert DSV4AttentionConfig.tiny().indexer_selection == "exact"


CONFIG = DSV4AttentionConfig.tiny(speculative=True)


def _backend(pool: PagedRequestPool) -> DSV4AttentionBackend:
    runner = harness.mock_runner(pool, harness.tiny_hf_config(CONFIG))
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    runner.attn_backend = backend
    return backend


@pytest.mark.sglang
def test_environment_setting_switches_the_adapter_to_fp8_keys(monkeypatch) -> None:
    pool = PagedRequestPool(CONFIG, [140, 270], generator=torch.Generator().manual_seed(0))
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(1))
    sim = harness.SimulatedModel(model)
    exact = _backend(pool)
    monkeypatch.setenv(INDEXER_SELECTION_ENV, "fp8")
    fp8 = _backend(pool)
    assert (exact.config.indexer_selection, fp8.config.indexer_selection) == ("exact", "fp8")
    step = harness.BatchBuilder(pool).extend([0, 1], [0, 0], [120, 250])
    with force_path("torch"):
        for backend in (exact, fp8):
            backend.init_forward_metadata(step.batch)
            sim.layer(backend, step, 1)
    slots = fp8.forward_metadata.c4.out_loc
    slots = slots[slots >= 0]
    keys = exact.state.pools.indexer(1).gather(slots)
    torch.testing.assert_close(fp8.state.pools.indexer(1).gather(slots), quantised_view(keys))
    monkeypatch.setenv(INDEXER_SELECTION_ENV, "int8")
    with pytest.raises(ConfigError, match=f"{INDEXER_SELECTION_ENV}='int8'"):
        _backend(pool)
    monkeypatch.setenv(INDEXER_SELECTION_ENV, "exact")
    monkeypatch.setenv("DSV4_ATTENTION_KERNEL", "ws9")  # refused when built, too
    with pytest.raises(ConfigError, match="DSV4_ATTENTION_KERNEL=ws9: unknown attention variant"):
        _backend(pool)
