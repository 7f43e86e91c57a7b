"""Sanity of the plain torch reference itself, against independent hand formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ContractError
from dsv4_backend.testing.reference import (
    RopeParams,
    apply_rope,
    compress_entries,
    indexer_scores,
    indexer_select,
    make_random_layer,
    reference_attention,
    reference_layer,
    rms_norm,
    rope_cos_sin,
    rope_for_ratio,
    sink_attention,
)

CONFIG = DSV4AttentionConfig.tiny()


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------- rope
@settings(max_examples=20, deadline=None)
@given(ratio=st.sampled_from([0, 4, 128]), pos=st.lists(st.integers(0, 200_000), min_size=1))
def test_rope_inverse_undoes_rope(ratio: int, pos: list[int]) -> None:
    x = torch.randn(len(pos), 3, CONFIG.head_dim, generator=gen())
    cos, sin = rope_cos_sin(CONFIG, ratio, torch.tensor(pos))
    back = apply_rope(apply_rope(x, cos, sin), cos, sin, inverse=True)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


def test_rope_rotates_interleaved_pairs_of_trailing_dims_only() -> None:
    rope = RopeParams(rope_dim=4, theta=10.0)
    x = torch.arange(1.0, 7.0)[None]  # D = 6: dims 0-1 nope, pairs (2,3) and (4,5)
    cos, sin = rope.cos_sin(torch.tensor([3]))
    out = apply_rope(x, cos, sin)[0]
    a0, a1 = 3 * 1.0, 3 * 10.0**-0.5
    want = [
        1.0, 2.0,
        3 * math.cos(a0) - 4 * math.sin(a0), 3 * math.sin(a0) + 4 * math.cos(a0),
        5 * math.cos(a1) - 6 * math.sin(a1), 5 * math.sin(a1) + 6 * math.cos(a1),
    ]  # fmt: skip
    torch.testing.assert_close(out, torch.tensor(want))


def test_rope_dot_product_depends_on_relative_position_only() -> None:
    q, k = torch.randn(2, CONFIG.head_dim, generator=gen(1)).unbind(0)
    rope = rope_for_ratio(CONFIG, 4)

    def dot(tq: int, tk: int) -> torch.Tensor:
        cq, sq = rope.cos_sin(torch.tensor([tq]))
        ck, sk = rope.cos_sin(torch.tensor([tk]))
        return apply_rope(q[None], cq, sq)[0] @ apply_rope(k[None], ck, sk)[0]

    torch.testing.assert_close(dot(10, 3), dot(510, 503), atol=1e-4, rtol=1e-4)


def test_window_layers_use_rope_theta_without_yarn() -> None:
    rope = rope_for_ratio(CONFIG, 0)
    assert rope.yarn is None and rope.theta == CONFIG.rope_theta
    want = 1.0 / CONFIG.rope_theta ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(rope.frequencies(), want.float())


def test_yarn_with_factor_one_equals_plain_rope() -> None:
    cfg = DSV4AttentionConfig.tiny(yarn_factor=1.0)
    plain = RopeParams(rope_dim=cfg.rope_dim, theta=cfg.compress_rope_theta)
    assert rope_for_ratio(cfg, 128).yarn is not None
    torch.testing.assert_close(rope_for_ratio(cfg, 128).frequencies(), plain.frequencies())


def test_yarn_blends_fast_dims_unchanged_and_slow_dims_divided() -> None:
    yarn_freqs = rope_for_ratio(CONFIG, 4).frequencies()
    plain = RopeParams(rope_dim=64, theta=CONFIG.compress_rope_theta).frequencies()
    ratio = plain / yarn_freqs  # 1 for fast dims, factor for slow dims, a ramp between
    # DeepSeek-V4's correction range for theta 160000, 64 dims, beta 32/1, 65536 positions:
    # floor(15.45) = 15 .. ceil(24.70) = 25.
    low, high = 15, 25
    torch.testing.assert_close(ratio[: low + 1], torch.ones(low + 1))
    torch.testing.assert_close(ratio[high:], torch.full((32 - high,), 16.0))
    ramp = (torch.arange(32, dtype=torch.float32) - low) / (high - low)
    want = plain * (1 - ramp.clamp(0, 1)) + plain / 16 * ramp.clamp(0, 1)
    torch.testing.assert_close(yarn_freqs, want)


@pytest.mark.sglang
@pytest.mark.parametrize("ratio", [0, 4])
@pytest.mark.parametrize("yarn", [{}, {"yarn_factor": 8.0, "yarn_original_max_position": 4096}])
def test_cos_sin_are_sglangs_float32_table_rows(ratio: int, yarn: dict) -> None:
    from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis

    cfg = DSV4AttentionConfig.tiny(**yarn)
    rope = rope_for_ratio(cfg, ratio)
    kwargs = dict(
        dim=cfg.rope_dim,
        original_seq_len=0 if rope.yarn is None else cfg.yarn_original_max_position,
        base=rope.theta,
        factor=cfg.yarn_factor,
        beta_fast=cfg.yarn_beta_fast,
        beta_slow=cfg.yarn_beta_slow,
    )
    positions = torch.tensor([0, 1, 17, 4095, 65_535, 700_001, 1_048_575])
    table = precompute_freqs_cis(seqlen=int(positions.max()) + 1, **kwargs)[positions]
    cos, sin = rope.cos_sin(positions)
    torch.testing.assert_close(cos, table.real, atol=2e-7, rtol=0)
    torch.testing.assert_close(sin, table.imag, atol=2e-7, rtol=0)
    # Negative control: exact (float64) angles are far off at large positions.
    exact = positions.double()[:, None] * rope.frequencies().double()
    assert (exact.cos().float() - table.real).abs().max() > 1e-2


def test_yarn_off_when_original_max_position_is_zero() -> None:
    cfg = DSV4AttentionConfig.tiny(yarn_original_max_position=0)
    assert rope_for_ratio(cfg, 4).yarn is None


def test_apply_rope_rejects_mismatched_tables() -> None:
    cos, sin = rope_cos_sin(CONFIG, 0, torch.arange(3))
    with pytest.raises(ContractError, match="expected cos/sin"):
        apply_rope(torch.zeros(4, 128), cos, sin)


def test_rms_norm() -> None:
    x = torch.tensor([[3.0, 4.0]])
    rms = math.sqrt(12.5 + 1e-6)
    torch.testing.assert_close(rms_norm(x, None), x / rms)
    torch.testing.assert_close(
        rms_norm(x, torch.tensor([2.0, 0.5])), x * torch.tensor([2.0, 0.5]) / rms
    )


# ---------------------------------------------------------------------------------- compressor
def hand_entries(kv_proj, score_proj, ape, ratio, d):
    """Pooled entries (before norm/rope) by explicit per-channel loops over the slots."""
    s = kv_proj.shape[0]
    out = torch.zeros(s // ratio, d)
    for w in range(s // ratio):
        for ch in range(d):
            slots = []  # (kv, score) of every slot of entry w in channel ch
            if ratio == 4:
                for j in range(4 * w - 4, 4 * w):
                    if j >= 0:
                        slots.append((kv_proj[j, ch], score_proj[j, ch] + ape[j % 4, ch]))
                for j in range(4 * w, 4 * w + 4):
                    slots.append((kv_proj[j, d + ch], score_proj[j, d + ch] + ape[j % 4, d + ch]))
            else:
                for j in range(128 * w, 128 * w + 128):
                    slots.append((kv_proj[j, ch], score_proj[j, ch] + ape[j % 128, ch]))
            m = max(float(sc) for _, sc in slots)
            z = sum(math.exp(float(sc) - m) for _, sc in slots)
            out[w, ch] = sum(float(v) * math.exp(float(sc) - m) / z for v, sc in slots)
    return out


@pytest.mark.parametrize(("ratio", "seq_len"), [(4, 3), (4, 4), (4, 13), (128, 127), (128, 257)])
def test_compress_entries_match_hand_loop(ratio: int, seq_len: int) -> None:
    d, c = 6, 2 if ratio == 4 else 1
    g = gen(ratio + seq_len)
    kv_proj, score_proj = torch.randn(2, seq_len, c * d, generator=g).unbind(0)
    ape, norm_weight = torch.randn(ratio, c * d, generator=g), torch.rand(d, generator=g) + 0.5
    rope = RopeParams(rope_dim=4, theta=100.0)
    got = compress_entries(kv_proj, score_proj, ape, norm_weight, ratio, rope, d)
    pooled = hand_entries(kv_proj, score_proj, ape, ratio, d)
    cos, sin = rope.cos_sin(torch.arange(seq_len // ratio) * ratio)
    want = apply_rope(rms_norm(pooled, norm_weight), cos, sin)
    assert got.shape == (seq_len // ratio, d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_c4_first_entry_ignores_missing_previous_block() -> None:
    d = 4
    kv_proj, score_proj = torch.randn(2, 4, 2 * d, generator=gen(3)).unbind(0)
    ape = torch.zeros(4, 2 * d)
    rope = RopeParams(rope_dim=2, theta=10.0)
    got = compress_entries(kv_proj, score_proj, ape, torch.ones(d), 4, rope, d)
    # Only the current block's second halves take part.
    pooled = (torch.softmax(score_proj[:, d:], dim=0) * kv_proj[:, d:]).sum(0, keepdim=True)
    torch.testing.assert_close(got, rms_norm(pooled, None), atol=1e-6, rtol=1e-6)  # rope at 0


def test_compress_entries_checks_shapes() -> None:
    rope = rope_for_ratio(CONFIG, 4)
    with pytest.raises(ContractError, match=r"ape has shape \(4, 128\), expected \(4, 256\)"):
        compress_entries(
            torch.zeros(8, 256), torch.zeros(8, 256), torch.zeros(4, 128), torch.ones(128), 4,
            rope, 128,
        )  # fmt: skip


# ----------------------------------------------------------------------------------- attention
def test_sink_attention_single_key_and_sink() -> None:
    q, k = torch.randn(2, 8, generator=gen(4)).unbind(0)
    h_q = q[None].expand(3, 8)
    no_sink = sink_attention(h_q, k[None], torch.full((3,), -math.inf), 0.5)
    torch.testing.assert_close(no_sink, k[None].expand(3, 8))
    sink = torch.tensor([-1.0, 0.0, 2.0])
    got = sink_attention(h_q, k[None], sink, 0.5)
    l = 0.5 * float(q @ k)
    weight = torch.exp(torch.tensor(l)) / (torch.exp(torch.tensor(l)) + sink.exp())
    torch.testing.assert_close(got, weight[:, None] * k[None])
    assert (weight < 1).all()


def test_sink_attention_without_keys_is_zero() -> None:
    out = sink_attention(torch.randn(2, 8), torch.zeros(0, 8), torch.zeros(2), 1.0)
    assert out.shape == (2, 8) and not out.any()


def dense_attention(config, ratio, q, kv, compressed, selected, sink):
    """Independent formula: one masked softmax over [window | entries | sink] per row."""
    s = q.shape[0]
    t = torch.arange(s)[:, None]
    mask = (torch.arange(s)[None] <= t) & (torch.arange(s)[None] > t - config.window_size)
    keys = kv
    if ratio:
        n = compressed.shape[0]
        visible = torch.arange(n)[None] < (t + 1) // ratio
        if selected is not None:
            chosen = torch.zeros(s, n + 1, dtype=torch.bool)
            chosen.scatter_(1, torch.where(selected < 0, n, selected), True)
            visible &= chosen[:, :n]
        mask = torch.cat([mask, visible], dim=1)
        keys = torch.cat([kv, compressed])
    logits = torch.einsum("thd,kd->thk", q, keys) * config.softmax_scale
    logits = logits.masked_fill(~mask[:, None], -math.inf)
    logits = torch.cat([logits, sink[None, :, None].expand(s, -1, 1)], dim=-1)
    return torch.einsum("thk,kd->thd", torch.softmax(logits, -1)[..., :-1], keys)


@pytest.mark.parametrize(("ratio", "seq_len"), [(0, 200), (4, 300), (128, 390)])
def test_reference_layer_matches_dense_masked_softmax(ratio: int, seq_len: int) -> None:
    inputs, params = make_random_layer(CONFIG, ratio, seq_len, gen(ratio))
    res = reference_layer(CONFIG, ratio, inputs, params)
    want = dense_attention(
        CONFIG, ratio, inputs.q, inputs.kv, res.compressed, res.selected, params.sink
    )
    torch.testing.assert_close(res.out, want, atol=1e-5, rtol=1e-5)
    assert res.out.shape == (seq_len, CONFIG.num_heads, CONFIG.head_dim)


def test_c4_selection_matters_and_all_visible_is_default() -> None:
    inputs, params = make_random_layer(CONFIG, 4, 200, gen(5))
    res = reference_layer(CONFIG, 4, inputs, params)
    args = (CONFIG, 4, inputs.q, inputs.kv, res.compressed)
    everything = reference_attention(*args, None, params.sink)
    assert torch.equal(everything[:67], res.out[:67])  # <= 16 visible entries: all selected
    assert not torch.allclose(everything[67:], res.out[67:])


def test_first_query_sees_only_itself() -> None:
    inputs, params = make_random_layer(CONFIG, 128, 1, gen(6))
    out = reference_layer(CONFIG, 128, inputs, params).out[0]
    l = CONFIG.softmax_scale * (inputs.q[0] @ inputs.kv[0])
    weight = 1 / (1 + torch.exp(params.sink - l))
    torch.testing.assert_close(out, weight[:, None] * inputs.kv[0][None])


# ------------------------------------------------------------------------------------- indexer
def test_indexer_scores_formula_and_visibility() -> None:
    g = gen(7)
    q, w, k = (
        torch.randn(9, 2, 5, generator=g),
        torch.randn(9, 2, generator=g),
        torch.randn(2, 5, generator=g),
    )
    scores = indexer_scores(q, w, k)
    for t in range(9):
        for s in range(2):
            if s < (t + 1) // 4:
                want = sum(float(w[t, h]) * max(float(q[t, h] @ k[s]), 0.0) for h in range(2))
                assert scores[t, s].item() == pytest.approx(want, abs=1e-5)
            else:
                assert scores[t, s] == -math.inf


def test_indexer_select_all_when_few_then_topk_sorted() -> None:
    inputs, params = make_random_layer(CONFIG, 4, 300, gen(8))
    keys = reference_layer(CONFIG, 4, inputs, params).index_keys
    sel = indexer_select(inputs.index_q, inputs.index_weights, keys, 16)
    scores = indexer_scores(inputs.index_q, inputs.index_weights, keys)
    assert sel.shape == (300, 16) and sel.dtype == torch.int64
    for t in (0, 3, 7, 63, 64, 67, 68, 150, 299):
        n = (t + 1) // 4
        row = sel[t]
        if n <= 16:
            assert row.tolist() == list(range(n)) + [-1] * (16 - n)
        else:
            assert (row >= 0).all() and (row.diff() > 0).all() and (row < n).all()
            kth = scores[t, row].min()
            rest = scores[t, :n][~torch.isin(torch.arange(n), row)]
            assert (rest < kth).all()


def test_reference_layer_fields_per_ratio() -> None:
    for ratio, n in ((0, None), (4, 32), (128, 1)):
        inputs, params = make_random_layer(CONFIG, ratio, 130, gen(9))
        res = reference_layer(CONFIG, ratio, inputs, params)
        assert (res.compressed is None) == (n is None)
        if n is not None:
            assert res.compressed.shape == (n, CONFIG.head_dim)
        assert (res.selected is None) == (ratio != 4)
        if ratio == 4:
            assert res.index_keys.shape == (32, CONFIG.index_head_dim)
