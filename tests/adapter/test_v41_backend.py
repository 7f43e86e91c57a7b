"""DeepSeek-V4.1 through the sglang adapter, with sglang 0.5.23's own objects on the CPU: its
``DeepseekV41Compressor`` / ``DeepseekV41Indexer`` modules, ``ForwardBatch``, ``ReqToTokenPool``
and its V4.1 ``DeepSeekV4TokenToKVPool`` (the caches alias its c1 / c2, fp4 index-K and pair
buffers). The backend's outputs are compared with the model reference ``reference_v41`` fed the
modules' own projections; the launches sglang 0.5.23 cannot serve with this backend yet are
refused when it is built, naming the flag.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_pool import inside

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend, shared_state
from dsv4_backend.testing.harness import BatchBuilder, mock_runner, tiny_hf_config
from dsv4_backend.testing.reference.v41_model import V41LayerInputs, reference_v41
from dsv4_backend.testing.simulation.pool import PagedRequestPool
from dsv4_backend.testing.simulation.v41 import TINY_V41_SOURCES, tiny_v41

pytestmark = pytest.mark.sglang

HIDDEN, Q_LORA = 96, 48
V41_KEYS: dict[str, Any] = dict(
    kv_source_layer_ids=list(TINY_V41_SOURCES.kv_source_layers),
    index_source_layer_ids=list(TINY_V41_SOURCES.index_source_layers),
    candidate_source_layer_id=TINY_V41_SOURCES.candidate_source_layer,
    candidate_topk_blocks=TINY_V41_SOURCES.candidate_topk_blocks,
    candidate_block_size=TINY_V41_SOURCES.candidate_block_size,
)


def _modules(config: DSV4AttentionConfig, seed: int = 0) -> list[SimpleNamespace]:
    """sglang's V4.1 modules of every layer (its torch paths), random bf16 weights: the
    ``MQALayer`` attributes the backend reads (``layer_id``, ``compressor``, ``indexer``)."""
    from sglang.srt.layers.attention.dsv4.dsv41_sparse import (
        DeepseekV41Compressor,
        DeepseekV41Indexer,
    )

    hf = SimpleNamespace(
        **V41_KEYS, index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
        qk_rope_head_dim=config.rope_dim, index_topk=config.index_topk,
        rms_norm_eps=config.rms_norm_eps, q_lora_rank=Q_LORA, hidden_size=HIDDEN,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    layers = []
    for layer, ratio in enumerate(config.compress_ratios):
        compressor = indexer = None
        if layer in TINY_V41_SOURCES.kv_source_layers:
            compressor = DeepseekV41Compressor(
                HIDDEN, config.head_dim, ratio, config.rms_norm_eps, fused_compress=False
            )
        if layer in TINY_V41_SOURCES.index_source_layers:
            indexer = DeepseekV41Indexer(hf, layer, config.head_dim, None, "indexer")
        for module in (compressor, indexer):
            if module is not None:
                with torch.no_grad():
                    for parameter in module.parameters():
                        parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.2)
        layers.append(
            SimpleNamespace(
                layer_id=layer, compress_ratio=ratio, compressor=compressor, indexer=indexer
            )
        )
    return layers


def _request(config: DSV4AttentionConfig, layers: list[SimpleNamespace], length: int, seed: int):
    """One request's activations (``x``, ``q_lora``, queries, window keys per layer) and the
    reference inputs they make through sglang's modules."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).bfloat16()

    acts, inputs = [], []
    sinks = torch.linspace(-1, 1, config.num_heads)
    for spec in layers:
        act = dict(
            x=rand(length, HIDDEN), q_lora=rand(length, Q_LORA),
            q=rand(length, config.num_heads, config.head_dim), kv=rand(length, config.head_dim),
        )  # fmt: skip
        extra: dict[str, Any] = {}
        with torch.no_grad():
            if spec.compressor is not None:
                kv, score = spec.compressor.project(act["x"])
                extra.update(
                    kv_proj=kv.float(), score_proj=None if score is None else score.float(),
                    norm_weight=spec.compressor.norm.weight.detach().float(),
                )  # fmt: skip
                if spec.indexer is not None:
                    extra.update(
                        wk=spec.indexer.wk.weight.detach().float(),
                        k_norm_weight=spec.indexer.k_norm.weight.detach().float(),
                    )
            if spec.indexer is not None:
                q_proj = spec.indexer.wq_b(act["q_lora"])[0]
                extra.update(
                    index_q_proj=q_proj.view(length, config.index_n_heads, -1).float(),
                    index_weights_raw=spec.indexer.head_weights_raw(act["x"]).float(),
                )
        acts.append(act)
        inputs.append(
            V41LayerInputs(q=act["q"].float(), window_kv=act["kv"].float(), sink=sinks, **extra)
        )
    return acts, inputs, sinks


def _runner(pool: PagedRequestPool, config: DSV4AttentionConfig, **flags: Any) -> Any:
    hf = tiny_hf_config(config, **V41_KEYS)
    flags.setdefault("cuda_graph_backend_decode", "disabled")
    return mock_runner(pool, hf, topk=0, **flags)


def test_v41_extend_verify_and_decodes_through_the_backend() -> None:
    """Two requests prefilled in chunks (one ending on an even position), a DSpark verify of 5
    tokens (every draft accepted), then decodes: every layer's output equals the reference fed
    sglang's module projections (dense caches)."""
    config = tiny_v41(speculative=True, num_draft_tokens=5)
    lengths = (140, 80)
    pool = PagedRequestPool(config, lengths, generator=torch.Generator().manual_seed(1))
    runner = _runner(pool, config, speculative_algorithm="DSPARK", num_draft_tokens=5)
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    assert backend.state.compressor_states[1].ring_rows == 8  # sglang's pair ring for 5 drafts
    layers = _modules(config)
    requests = [_request(config, layers, n, seed=10 + i) for i, n in enumerate(lengths)]
    expected = [reference_v41(config, inputs) for _, inputs, _ in requests]
    sinks = requests[0][2]
    builder = BatchBuilder(pool)
    steps = [
        builder.extend([0, 1], [0, 0], [71, 40]),
        builder.extend([0, 1], [71, 40], [60, 29]),
        builder.decode([0, 1], [132, 70]),
        builder.verify([0, 1], [132, 70], 5),
        builder.decode([0, 1], [138, 76]),
        builder.decode([0], [139]),
    ]
    worst = 0.0
    for step in steps:
        fb = step.batch
        backend.init_forward_metadata(fb)
        rows = [row for row in step.rows if row is not None]

        def take(layer: int, name: str, rows: list = rows) -> torch.Tensor:
            return torch.stack([requests[r][0][layer][name][p] for r, p in rows])

        for spec in layers:
            layer = spec.layer_id
            backend.store_cache(layer_id=layer, swa_k=take(layer, "kv"), forward_batch=fb)
            if spec.compressor is not None or spec.indexer is not None:
                with torch.no_grad():
                    backend.forward_low_ratio_sources(
                        layer=spec, x=take(layer, "x"), q_lora=take(layer, "q_lora"),
                        positions=fb.positions, forward_batch=fb,
                    )  # fmt: skip
            q = take(layer, "q")
            attn_layer = SimpleNamespace(layer_id=layer, tp_q_head_num=config.num_heads)
            out = backend.forward(
                q=q, k=q, v=q, layer=attn_layer, forward_batch=fb,
                compress_ratio=spec.compress_ratio, attn_sink=sinks, save_kv_cache=False,
            )  # fmt: skip
            want = torch.stack([expected[r].outputs[layer][p] for r, p in rows])
            worst = max(worst, float((out.float() - want).abs().max()))
    assert worst < 2e-2, worst  # the output is bf16 (q's dtype)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"cuda_graph_backend_decode": None}, "--cuda-graph-backend-decode disabled"),
        ({"pp_size": 2}, "--pipeline-parallel-size"),
        ({"enable_two_batch_overlap": True}, "--enable-two-batch-overlap"),
        ({"disaggregation_mode": "prefill"}, "--disaggregation-mode"),
        ({"enable_decoder_swa_bounded_replay": True}, "--no-enable-decoder-swa-bounded-replay"),
    ],
)
def test_v41_launches_not_served_yet_are_refused_when_built(flags: dict, named: str) -> None:
    config = tiny_v41()
    pool = PagedRequestPool(config, (40,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=named.replace("-", r"\-")):
        DSV4AttentionBackend(_runner(pool, config, **flags), cache_format="dense")


def test_the_caches_alias_sglangs_v41_pool() -> None:
    """sglang's V4.1 pool (Flash widths, kv sources 1 (c2) and 3 (c1)): the backend's c1 / c2
    caches, fp4 index keys and c2 pair ring are views of its buffers."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.runtime_context import get_context

    config = tiny_v41(head_dim=512, index_head_dim=128, num_heads=8)
    ratios = list(config.compress_ratios)
    with get_context().override_server_args(device="cpu"):
        pool = DeepSeekV4TokenToKVPool(
            max_num_reqs=3, num_req_slots=4, swa_size=512, c4_size=256, c128_size=8,
            c4_state_pool_size=16, c128_state_pool_size=512, page_size=256, swa_page_size=256,
            dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
            indexer_head_dim=128, layer_num=len(ratios), start_layer=0, end_layer=len(ratios),
            device="cpu", enable_memory_saver=False, compression_ratios=ratios,
            full_size=1024, kv_source_layers=[1, 3],
        )  # fmt: skip
    runner = SimpleNamespace(
        token_to_kv_pool=pool,
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(4, 2048)),
        device="cpu",
    )
    state = shared_state(runner, config, "fp8")
    pools = state.pools
    assert sorted(pools.compressed_caches) == sorted(pools.index_key_caches) == [1, 3]
    for layer in range(1, len(ratios)):
        source = config.kv_source_of(layer)
        assert pools.compressed(layer) is pools.compressed_caches[source]
        assert inside(pools.compressed(layer).storage, pool.get_extra_key_buffer(layer))
        assert inside(pools.index_keys(layer).storage, pool.get_index_k_with_scale_buffer(source))
    pair = pool.get_attention_compress_states(1).kv_score_buffer.kv_score
    assert inside(state.compressor_states[1].ring, pair)
    assert state.compressor_states[1].ring.shape == (4, 2, 2 * config.head_dim)
    assert 3 not in state.compressor_states  # a c1 source pools nothing
