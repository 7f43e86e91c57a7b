"""DeepSeek-V4.1 through the sglang adapter, with sglang 0.5.23's own objects on the CPU: its
``DeepseekV41Compressor`` / ``DeepseekV41Indexer`` modules, ``ForwardBatch``, ``ReqToTokenPool``
and its V4.1 ``DeepSeekV4TokenToKVPool`` (the caches alias its c1 / c2, fp4 index-K and pair
buffers). The backend's outputs are compared with the model reference ``reference_v41`` fed the
modules' own projections; the launches sglang 0.5.23 cannot serve with this backend yet are
refused when it is built, naming the flag. The kernels take the torch path: this file checks the
adapter, and the interpreter's kernels are compared with the torch ones in ``tests/kernels/``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_pool import inside
from v41_host import SglangV41Model, v41_hf_config, v41_sglang_pool

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.self_check.requests import PagedRequestPool
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.sglang_adapter.pool_alias import shared_state
from dsv4_backend.testing.harness import BatchBuilder, Step, mock_runner
from dsv4_backend.testing.simulation.v41 import tiny_v41

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]


def _runner(pool: PagedRequestPool, config: DSV4AttentionConfig, **flags: Any) -> Any:
    return mock_runner(pool, v41_hf_config(config), topk=0, **flags)


def test_v41_extend_verify_and_decodes_through_the_backend() -> None:
    """Two requests prefilled in chunks (one ending on an even position), a MIXED batch (a
    chunk beside a decode, ``--enable-mixed-chunk``), a DSpark verify of 5 tokens (every draft
    accepted), then decodes: every layer's output equals the reference fed sglang's module
    projections (dense caches)."""
    config = tiny_v41(speculative=True, num_draft_tokens=5)
    lengths = (140, 80)
    pool = PagedRequestPool(config, lengths, generator=torch.Generator().manual_seed(1))
    runner = _runner(pool, config, speculative_algorithm="DSPARK", num_draft_tokens=5)
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    assert backend.state.compressor_states[1].ring_rows == 8  # sglang's pair ring for 5 drafts
    model = SglangV41Model(config, lengths)
    builder = BatchBuilder(pool)
    steps = [
        builder.extend([0, 1], [0, 0], [71, 40]),
        builder.extend([0, 1], [71, 40], [60, 29]),
        builder.mixed([1], [69], [1], [0], [132]),  # request 1's last chunk beside a decode
        builder.verify([0, 1], [132, 70], 5),
        builder.decode([0, 1], [138, 76]),
        builder.decode([0], [139]),
    ]
    worst = 0.0
    for step in steps:
        backend.init_forward_metadata(step.batch)
        for layer in range(len(config.compress_ratios)):
            out = model.layer(backend, step, layer)
            worst = max(worst, model.max_error(step.rows, layer, out))
    assert worst < 2e-2, worst  # the output is bf16 (q's dtype)


def test_v41_dp_attention_padding_leaves_the_real_rows_exact() -> None:
    """``--enable-dp-attention``: DSpark verifies and decodes padded by sglang's
    ``ForwardBatch._pad_inputs_to_size`` (padding requests at pool row 0, slot 0: their entries,
    index keys and pair-ring rows land in the padding row and slot); an idle rank's padded IDLE
    batch; the EXTEND sglang fabricates for an idle rank (MAX_LEN padding). The real requests'
    rows equal the reference step after step. (DP ranks replaying CUDA graphs under sglang's
    graph runner: ``test_host_graph_replay.py``.)"""
    config = tiny_v41(speculative=True, num_draft_tokens=5)
    lengths = (80, 50)
    pool = PagedRequestPool(config, lengths, generator=torch.Generator().manual_seed(2))
    runner = _runner(
        pool, config, speculative_algorithm="DSPARK", num_draft_tokens=5,
        enable_dp_attention=True, tp_size=2, dp_size=2,
    )  # fmt: skip
    backend = runner.attn_backend = DSV4AttentionBackend(runner, cache_format="dense")
    model = SglangV41Model(config, lengths)
    builder = BatchBuilder(pool)
    layers = range(len(config.compress_ratios))

    def run(step: Step, extra: int, rows_per_request: int) -> float:
        step = builder.pad(step, runner, extra, rows_per_request)
        assert step.batch.req_pool_indices[-extra:].tolist() == [0] * extra
        backend.init_forward_metadata(step.batch)
        assert backend.forward_metadata.batch_size == step.batch.batch_size
        return max(model.max_error(step.rows, i, model.layer(backend, step, i)) for i in layers)

    backend.init_forward_metadata((prefill := builder.extend([0, 1], [0, 0], [65, 37])).batch)
    worst = max(model.max_error(prefill.rows, i, model.layer(backend, prefill, i)) for i in layers)
    worst = max(worst, run(builder.verify([0, 1], [65, 37], 5), 3, 5))  # all 5 accepted
    worst = max(worst, run(builder.decode([0, 1], [71, 43]), 2, 1))

    idle = builder.pad(builder.idle(), runner, 3, 1)
    backend.init_forward_metadata(idle.batch)
    assert backend.forward_metadata.num_rows == 0
    assert not model.layer(backend, idle, 1).any()
    dummy = builder.dp_dummy_extend(40)
    backend.init_forward_metadata(dummy.batch)
    assert all(torch.isfinite(model.layer(backend, dummy, i)).all() for i in layers)
    for seq_lens in ([72, 44], [73, 45]):  # the real requests' caches and rings are intact
        worst = max(worst, run(builder.decode([0, 1], seq_lens), 1, 1))
    assert worst < 2e-2, worst


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"pp_size": 2}, "--pipeline-parallel-size"),
        ({"enable_two_batch_overlap": True}, "--enable-two-batch-overlap"),
    ],
)
def test_v41_launches_not_served_are_refused_when_built(flags: dict, named: str) -> None:
    config = tiny_v41()
    pool = PagedRequestPool(config, (40,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=named.replace("-", r"\-")):
        DSV4AttentionBackend(_runner(pool, config, **flags), cache_format="dense")


def test_the_caches_alias_sglangs_v41_pool() -> None:
    """sglang's V4.1 pool (Flash widths, kv sources 1 (c2) and 3 (c1)): the backend's c1 / c2
    caches, fp4 index keys and c2 pair ring are views of its buffers."""
    config = tiny_v41(head_dim=512, index_head_dim=128, num_heads=8)
    ratios = list(config.compress_ratios)
    paged = PagedRequestPool(config, (300, 300, 300), generator=torch.Generator().manual_seed(0))
    pool = v41_sglang_pool(config, paged)
    runner = SimpleNamespace(
        token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=paged.req_to_token),
        device="cpu",
    )  # fmt: skip
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
