"""DeepSeek-V4.1's pieces the package already describes, against sglang 0.5.23's own code on
the CPU: the configuration (sglang's ``DeepseekV41Config``, the V4.1-Flash values), the fp4
rounding (``sglang/kernels/ops/quantization/fp4_fake_quant.py``: every e2m1 code, every tie,
scales across the whole exponent range) and the ratio-1 / ratio-2 compressor latents
(``DeepseekV41Compressor``'s projections, pair pooling and norm, sglang's ``rope_tail`` and
``fake_quant_compressed_kv``) -- each equal, bit for bit, to the reference written from the
formulas (``testing/reference/fp4.py``, ``testing/reference/low_ratio.py``). The backend does
not serve V4.1 yet: a V4.1 model is refused when built.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4_backend.config import DSV4AttentionConfig, V41Sources
from dsv4_backend.errors import ConfigError
from dsv4_backend.hf_config import config_from_hf
from dsv4_backend.testing.reference import (
    candidate_blocks,
    fake_quant_e4m3,
    fake_quant_ue8m0,
    index_head_weights,
    index_keys,
    index_queries,
    index_scores,
    low_ratio_entries,
    rope_for_ratio,
    round_e2m1,
    select_entries,
    select_from_candidates,
)
from dsv4_backend.testing.reference.fp4 import E2M1_VALUES, e4m3_scales, ue8m0_scales

pytestmark = pytest.mark.sglang

#: The public DeepSeek-V4.1-Flash configuration (as ports quote it): 40 layers, three DSpark
#: stage slots after them.
FLASH_V41: dict[str, Any] = dict(
    num_hidden_layers=40, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
    candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8,
    index_n_heads=32, index_head_dim=128, index_topk=512, rms_norm_eps=1e-20, sliding_window=128,
    num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
)  # fmt: skip


# ------------------------------------------------------------------------- configuration
def test_the_v41_flash_config_through_sglangs_config_class() -> None:
    from sglang.srt.configs.deepseek_v41 import DeepseekV41Config

    config = config_from_hf(DeepseekV41Config(**FLASH_V41))
    assert config.compress_ratios == tuple([0, 0] + [2] * 18 + [1] * 20)  # stage slots dropped
    assert config.v41 == V41Sources(
        kv_source_layers=(2, 8, 14, 20), index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8,
    )  # fmt: skip
    assert [config.kv_source_of(layer) for layer in (2, 7, 8, 19, 20, 39)] == [2, 2, 8, 14, 20, 20]
    assert config.candidate_consumers == (24, 28, 32, 36)
    assert (config.index_n_heads, config.index_head_dim, config.rms_norm_eps) == (32, 128, 1e-20)
    with pytest.raises(ConfigError, match=r"layer 0 .* reads no shared compressed cache"):
        config.kv_source_of(0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"kv_source_layer_ids": [2, 8, 14]},
            r"layer 20 has compress ratio 1 .* nearest kv source",
        ),
        ({"kv_source_layer_ids": [8, 14, 20]}, r"layer 2 has compress ratio 2 .* None"),
        ({"kv_source_layer_ids": [0, 2, 8, 14, 20]}, r"kv_source_layers=\[0, 2"),
        ({"index_source_layer_ids": [20, 2]}, r"index_source_layers=\[20, 2\]; expected"),
        ({"candidate_source_layer_id": 25}, r"candidate_source_layer_id=25 .* index source"),
        ({"candidate_topk_blocks": 0}, r"candidate_topk_blocks=0"),
    ],
)
def test_v41_sources_that_do_not_fit_the_layers_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_hf({**FLASH_V41, **change})


def test_low_ratios_without_v41_sources_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"compress_ratios contains \[1, 2\].*DeepSeek-V4.1"):
        config_from_hf({**FLASH_V41, "kv_source_layer_ids": []})


# ---------------------------------------------------------------------------- fp4 rounding
def _sglang_fp4() -> Any:
    from sglang.kernels.ops.quantization import fp4_fake_quant

    return fp4_fake_quant


def test_e2m1_rounding_every_code_tie_and_saturation() -> None:
    """Every code maps to itself, every halfway point to its even neighbour, and a dense sweep
    of [-6, 6] (and past it, clamped) equals sglang's ``round_fp4``."""
    sglang = _sglang_fp4()
    codes = torch.tensor(E2M1_VALUES)
    assert torch.equal(round_e2m1(codes), codes) and torch.equal(round_e2m1(-codes), -codes)
    halfway = (codes[1:] + codes[:-1]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5
    assert round_e2m1(halfway).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    sweep = torch.cat([torch.linspace(-6, 6, 200_001), halfway, -halfway, codes])
    sweep = torch.cat([sweep, torch.nextafter(sweep, torch.tensor(7.0)).clamp(-6, 6)])
    assert torch.equal(round_e2m1(sweep), sglang.round_fp4(sweep))


def _blocks(block: int, generator: torch.Generator) -> torch.Tensor:
    """Blocks of every kind: random magnitudes from 2^-140 to 2^30, blocks whose amax / 6 is
    an exact power of two or just around one, blocks holding every e2m1 code times a power of
    two (so every code and tie occurs after scaling), zero blocks."""
    rows = []
    for exponent in range(-140, 31, 3):
        rows.append(torch.randn(4, block, generator=generator) * 2.0**exponent)
        top = torch.tensor(6.0 * 2.0**exponent)
        for amax in (top, torch.nextafter(top, top * 2), torch.nextafter(top, top * 0)):
            row = torch.rand(block, generator=generator) * amax
            row[0] = amax
            rows.append(row[None])
        grid = torch.tensor(E2M1_VALUES).repeat(block // 8 + 1)[:block] * 2.0**exponent
        rows.append((grid * torch.where(torch.rand(block, generator=generator) < 0.5, -1, 1))[None])
    rows.append(torch.zeros(2, block))
    return torch.cat(rows).float()


def test_ue8m0_fake_quant_equals_sglangs() -> None:
    """Index keys and queries: per-32 ue8m0 scales and values equal sglang's ``block_scale`` /
    ``fake_quant_fp4`` on every block kind, in fp32 and from bf16 inputs."""
    sglang = _sglang_fp4()
    x = _blocks(32, torch.Generator().manual_seed(0))
    want_scales = sglang.block_scale(x, 32, sglang.FP4_MAX, sglang.FP4_AMAX_FLOOR)
    assert torch.equal(ue8m0_scales(x), want_scales)
    assert torch.equal(fake_quant_ue8m0(x), sglang.fake_quant_fp4(x))
    x16 = x.bfloat16()
    assert torch.equal(fake_quant_ue8m0(x16).bfloat16(), sglang.fake_quant_fp4(x16))


def test_e4m3_fake_quant_equals_sglangs() -> None:
    """Compressed latents: per-16 e4m3 scales (clamped to [2^-9, 448]) and values equal
    sglang's ``fake_quant_compressed_kv`` on every block kind; the scales are e4m3 values."""
    sglang = _sglang_fp4()
    x = _blocks(16, torch.Generator().manual_seed(1))
    scales = e4m3_scales(x)
    assert torch.equal(scales.to(torch.float8_e4m3fn).float(), scales)
    assert float(scales.min()) == 2.0**-9 and float(scales.max()) == 448.0
    assert torch.equal(fake_quant_e4m3(x), sglang.fake_quant_compressed_kv(x))
    x16 = x.bfloat16()
    assert torch.equal(fake_quant_e4m3(x16).bfloat16(), sglang.fake_quant_compressed_kv(x16))


# --------------------------------------------------------------------- low-ratio latents
@pytest.mark.parametrize("ratio", [1, 2])
def test_low_ratio_latents_equal_sglangs_compressor(ratio: int) -> None:
    """sglang's ``DeepseekV41Compressor`` (its torch path: bf16 weights, fp32 projections,
    pair softmax, bf16 RMSNorm), RoPE by its ``rope_tail`` at each entry's first position and
    ``fake_quant_compressed_kv``: bit for bit the reference's entries of the same
    projections, for every entry of a 37-token request."""
    from sglang.kernels.ops.quantization.fp4_fake_quant import fake_quant_compressed_kv
    from sglang.srt.layers.attention.dsv4.dsv41_sparse import DeepseekV41Compressor, rope_tail

    config = config_from_hf(FLASH_V41)
    head_dim, rope_dim, hidden, tokens = config.head_dim, config.rope_dim, 96, 37
    g = torch.Generator().manual_seed(ratio)
    module = DeepseekV41Compressor(
        hidden, head_dim, ratio, config.rms_norm_eps, fused_compress=False
    )
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.2)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    with torch.no_grad():
        kv, score = module.project(x)
        pooled = (
            kv.float()
            if ratio == 1
            else module.pool_pairs(
                kv.float()[: tokens // 2 * 2].unflatten(0, (-1, 2)),
                score.float()[: tokens // 2 * 2].unflatten(0, (-1, 2)),
            )
        )
        latent = module.finish(pooled)
        rope = rope_for_ratio(config, ratio)
        positions = torch.arange(latent.shape[0]) * ratio
        cos, sin = rope.cos_sin(positions)
        freqs = torch.complex(cos, sin)  # sglang's freqs_cis rows: e^(i p f)
        want = fake_quant_compressed_kv(rope_tail(latent, freqs, rope_dim))
    got = low_ratio_entries(
        kv.float(), None if score is None else score.float(), module.norm.weight.detach(),
        ratio, rope, config.rms_norm_eps,
    )  # fmt: skip
    assert got.shape == (tokens // ratio, head_dim)
    assert torch.equal(got.bfloat16(), want)


# ---------------------------------------------------------------------------- the indexer
def _indexer(layer: int = 20) -> tuple[Any, DSV4AttentionConfig]:
    """sglang's ``DeepseekV41Indexer`` of a V4.1-Flash kv-source layer (hidden 96, q_lora 48;
    Flash's indexer widths), random bf16 weights."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.dsv4.dsv41_sparse import DeepseekV41Indexer

    config = config_from_hf(FLASH_V41)
    hf = SimpleNamespace(**FLASH_V41, q_lora_rank=48, hidden_size=96)
    module = DeepseekV41Indexer(hf, layer, config.head_dim, None, "indexer")
    g = torch.Generator().manual_seed(layer)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.1)
    return module, config


def test_index_keys_queries_and_weights_equal_sglangs_indexer() -> None:
    """``index_keys`` (of sglang's own ``wk`` projections), ``index_queries`` (of its ``wq_b``
    projections) and the head weights equal ``DeepseekV41Indexer.index_keys`` / ``queries`` /
    ``head_weights`` bit for bit (its torch path); the scores equal its ``scores`` within
    its bf16 arithmetic."""
    module, config = _indexer()
    assert module.owns_k and module.is_candidate_source
    g = torch.Generator().manual_seed(5)
    rope = rope_for_ratio(config, 1)
    positions = torch.arange(0, 300, 7)
    cos, sin = rope.cos_sin(positions)
    freqs = torch.complex(cos, sin)
    latents = torch.randn(len(positions), config.head_dim, generator=g).bfloat16()
    q_lora = torch.randn(len(positions), 48, generator=g).bfloat16()
    x = torch.randn(len(positions), 96, generator=g).bfloat16()
    with torch.no_grad():
        keys = module.index_keys(latents, freqs)
        queries = module.queries(q_lora, freqs)
        weights = module.head_weights(x)
        scores = module.scores(queries, keys, weights)
        k_proj, q_proj = module.forward_wk(latents), module.wq_b(q_lora)[0]
        raw = module.head_weights_raw(x)
    k_norm = module.k_norm.weight.detach()
    got_keys = index_keys(k_proj, k_norm, rope, positions, config.rms_norm_eps)
    assert torch.equal(got_keys.bfloat16(), keys)
    got_queries = index_queries(q_proj.view(-1, 32, 128), rope, positions)
    assert torch.equal(got_queries.bfloat16(), queries)
    got_weights = index_head_weights(raw, config.index_head_dim)
    assert torch.equal(got_weights.bfloat16(), weights)
    got = index_scores(got_queries, got_keys, got_weights)
    scale = got.abs().amax()
    assert float((got - scores).abs().max()) <= 2e-2 * float(scale)  # sglang sums in bf16


def test_the_full_and_the_two_level_top_k() -> None:
    """The full top-k keeps each row's best visible entries (ties: the lower id; ``-1`` past a
    short row). The two-level top-k: with blocks enough to cover a row it is the full top-k;
    otherwise its entries come from the candidate blocks only, which hold the newest block and
    the blocks of the best keys, and an entry of a dropped block is lost."""
    g = torch.Generator().manual_seed(9)
    scores = torch.randn(3, 64, generator=g)
    scores[0, 5] = scores[0, 6] = 10.0  # a tie: 5 before 6
    visible = torch.tensor([64, 20, 3])
    full = select_entries(scores, visible, 8)
    assert full[0, :2].tolist() == [5, 6] and full[2, 3:].tolist() == [-1] * 5
    assert torch.equal(full[1], scores[1, :20].topk(8).indices)
    covering = candidate_blocks(scores, visible, block_size=8, num_blocks=8)
    assert torch.equal(select_from_candidates(scores, visible, covering, 8, 8), full)
    blocks = candidate_blocks(scores, visible, block_size=8, num_blocks=2)
    assert [b[0] for b in blocks] == [7, 2, 0]  # the newest block first
    keys = scores[0].unflatten(0, (8, 8)).amax(dim=1)
    assert blocks[0][1] == int(keys[:7].argmax())
    two_level = select_from_candidates(scores, visible, blocks, 8, 8)
    allowed = {e for b in blocks[0] for e in range(8 * b, 8 * b + 8)}
    assert set(two_level[0].tolist()) <= allowed
    lost = [e for e in full[0].tolist() if e not in allowed]
    assert lost and not set(lost) & set(two_level[0].tolist())


# ------------------------------------------------------- the two-level top-k, the runtime's
@pytest.mark.parametrize("seed", range(4))
def test_the_runtime_candidate_top_k_equals_sglangs(seed: int) -> None:
    """The runtime's candidate blocks and its top-k among them (``kernels/low_ratio/selection.py``)
    against sglang's torch candidate scheme (``candidate_blocks.select_candidate_block_ids``,
    ``topk_among_blocks``) on the same scores: the same block sets (the newest block always
    among them) and the same entries, for rows of every length up to past the blocks' reach.
    Scores are distinct, so no tie decides a set."""
    from sglang.kernels.ops.attention.dsv4.candidate_blocks import (
        select_candidate_block_ids,
        topk_among_blocks,
    )

    from dsv4_backend.kernels.low_ratio.selection import best_columns, publish_blocks

    g = torch.Generator().manual_seed(seed)
    rows, width, block, num_blocks, k = 40, 203, 8, 6, 16
    lens = torch.randint(0, width + 1, (rows,), generator=g)
    lens[:3] = torch.tensor([0, 1, width])
    scores = torch.randperm(rows * width, generator=g).float().view(rows, width)
    cols = torch.arange(width)[None, :]
    scores = scores.masked_fill(cols >= lens[:, None], float("-inf"))
    ours = publish_blocks(scores, lens, block, num_blocks)
    theirs = select_candidate_block_ids(
        scores, lens[:, None], topk_blocks=num_blocks, block_size=block
    )
    for t in range(rows):
        assert set(ours[t][ours[t] >= 0].tolist()) == set(theirs[t][theirs[t] >= 0].tolist()), t
        if lens[t]:
            assert (int(lens[t]) - 1) // block in ours[t].tolist()  # the newest block kept
    kept = torch.zeros(rows, width // block + 2, dtype=torch.bool)
    kept.scatter_(1, torch.where(ours >= 0, ours, kept.shape[1] - 1).long(), True)
    allowed = (cols < lens[:, None]) & kept[:, :-1].repeat_interleave(block, 1)[:, :width]
    mine = best_columns(scores, allowed, k)
    sglang = topk_among_blocks(scores, lens, theirs, k, block)
    for t in range(rows):
        assert set(mine[t][mine[t] >= 0].tolist()) == set(sglang[t][sglang[t] >= 0].tolist()), t


def test_pair_ring_rows_are_sglangs() -> None:
    """The ratio-2 pair ring has sglang's rows (``get_compress_state_ring_size``) for every draft
    count, so the rings alias its pair state pool."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import get_compress_state_ring_size

    plain = config_from_hf(FLASH_V41)
    assert plain.ring_rows(2) == get_compress_state_ring_size(2, 0)
    for n in range(1, 9):
        config = config_from_hf(FLASH_V41, speculative=True, num_draft_tokens=n)
        assert config.ring_rows(2) == get_compress_state_ring_size(2, n), n
