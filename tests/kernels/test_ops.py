"""The runtime's ops (RoPE table, RMSNorm, pooling, entry finishing) against the reference's
own implementations of the same formulas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stress import STRESS

from dsv4_backend import ops
from dsv4_backend.config import DSV4AttentionConfig, compress_overlap
from dsv4_backend.errors import ConfigError, ContractError
from dsv4_backend.testing import reference

CONFIG = DSV4AttentionConfig.tiny()
NO_YARN = DSV4AttentionConfig.tiny(yarn_original_max_position=0)


@pytest.mark.parametrize("config", [CONFIG, NO_YARN], ids=["yarn", "plain"])
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_rope_table_equals_reference(config: DSV4AttentionConfig, ratio: int) -> None:
    table = ops.RopeTable(ops.rope_for_ratio(config, ratio), 70_000)  # more than one chunk
    positions = torch.tensor([[0, 1, 255], [4096, 65_535, 69_999]])
    cos, sin = table.cos_sin(positions)
    want_cos, want_sin = reference.rope_cos_sin(config, ratio, positions)
    assert cos.shape == (2, 3, config.rope_dim // 2)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-6)


@pytest.mark.sglang
@pytest.mark.parametrize("config", [CONFIG, NO_YARN], ids=["yarn", "plain"])
@pytest.mark.parametrize("ratio", [0, 4])
def test_rope_table_rows_are_sglangs_freqs_cis(config: DSV4AttentionConfig, ratio: int) -> None:
    from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis

    params = ops.rope_for_ratio(config, ratio)
    n = 1 << 20 if STRESS else 1 << 17  # past the yarn context (65,536) both ways
    sglang = precompute_freqs_cis(
        dim=config.rope_dim, seqlen=n, base=params.theta,
        original_seq_len=config.yarn_original_max_position if params.yarn else 0,
        factor=config.yarn_factor, beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow,
    )  # fmt: skip
    cos, sin = ops.RopeTable(params, n).cos_sin(torch.arange(n))
    # One float32 ulp at most (torch.polar vs cos/sin); exact angles would be 6e-3 (at 2^17
    # positions) to 5e-2 (2^20) off here.
    torch.testing.assert_close(cos, sglang.real, rtol=0, atol=2e-7)
    torch.testing.assert_close(sin, sglang.imag, rtol=0, atol=2e-7)


def test_rope_table_bounds() -> None:
    table = ops.RopeTable(ops.rope_for_ratio(CONFIG, 4), 8)
    cos, sin = table.cos_sin(torch.tensor([-4, 0]))
    assert torch.equal(cos[0], cos[1]) and torch.equal(sin[0], sin[1])  # negative reads row 0
    with pytest.raises(IndexError):
        table.cos_sin(torch.tensor([8]))
    with pytest.raises(ConfigError, match="max_positions=0"):
        ops.RopeTable(ops.rope_for_ratio(CONFIG, 4), 0)
    with pytest.raises(ConfigError, match="ratio=3"):
        ops.rope_for_ratio(CONFIG, 3)
    assert ops.rope_for_ratio(CONFIG, 2) == ops.rope_for_ratio(CONFIG, 4)  # one compressed RoPE


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), inverse=st.booleans(), heads=st.integers(1, 3))
def test_apply_rope_equals_reference(seed: int, inverse: bool, heads: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, heads, CONFIG.head_dim, generator=g)
    positions = torch.randint(0, 1000, (5,), generator=g)
    cos, sin = ops.RopeTable(ops.rope_for_ratio(CONFIG, 4), 1000).cos_sin(positions)
    got = ops.apply_rope(x, cos, sin, inverse=inverse)
    want = reference.apply_rope(x, cos, sin, inverse=inverse)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # The non-rope channels pass through untouched.
    assert torch.equal(got[..., : CONFIG.nope_dim], x[..., : CONFIG.nope_dim])


def test_apply_rope_rejects_mismatched_tables() -> None:
    cos, sin = ops.RopeTable(ops.rope_for_ratio(CONFIG, 0), 4).cos_sin(torch.arange(3))
    with pytest.raises(ContractError, match="apply_rope"):
        ops.apply_rope(torch.zeros(4, 128), cos, sin)


def test_rms_norm_equals_reference() -> None:
    x = torch.randn(4, 3, 64, dtype=torch.bfloat16)
    weight = torch.rand(64) + 0.5
    for w in (None, weight):
        torch.testing.assert_close(ops.rms_norm(x, w), reference.rms_norm(x, w))


@pytest.mark.parametrize("ratio", [4, 128])
def test_pool_and_finish_equal_reference(ratio: int) -> None:
    g = torch.Generator().manual_seed(ratio)
    kv = torch.randn(6, 8, CONFIG.head_dim, generator=g)
    score = torch.randn(6, 8, CONFIG.head_dim, generator=g)
    score[0, :4] = float("-inf")  # the missing previous block of entry 0
    pooled = ops.pool_slots(kv, score)
    torch.testing.assert_close(pooled, reference.pool_slots(kv, score))
    entry_ids = torch.tensor([0, 1, 2, 7, 30, 31])
    norm_weight = torch.rand(CONFIG.head_dim, generator=g) + 0.5
    table = ops.RopeTable(ops.rope_for_ratio(CONFIG, ratio), 32 * ratio)
    got = ops.finish_entries(pooled, entry_ids, norm_weight, ratio, table)
    want = reference.finish_entries(
        pooled, entry_ids, norm_weight, ratio, reference.rope_for_ratio(CONFIG, ratio)
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    zero = ops.finish_entries(
        torch.zeros(2, CONFIG.head_dim), entry_ids[:2], norm_weight, ratio, table
    )
    assert torch.equal(zero, torch.zeros_like(zero))
    assert compress_overlap(ratio) == reference.overlap(ratio)
