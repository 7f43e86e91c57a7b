"""DeepSeek-V4.1 under prefill context parallelism (``--enable-prefill-cp --cp-strategy
interleave``), two ranks simulated in one process on sglang 0.5.23's own CP code
(``prepare_cp_forward``, the interleave shard, ``cp_materialize_global_token_order``) and its V4.1
pool (fp8 caches over it, one pool per rank). A rank's layer is what sglang's ``MQALayer`` hands
the backend under CP: the window keys of every row (the model all-gathers them and writes them
into the pool, ``set_swa_key_buffer_radix_fused_norm_rope``, a CUDA kernel: mirrored by
``store_cache`` of the same keys), the rank's own rows to ``forward_low_ratio_sources`` (whose
compressors the backend runs over every row, all-gathered through the CP group as sglang's own
V4.1 backend does) and to the attention.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4_backend.errors import ConfigError
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.context_parallel import CPRank, SimulatedCPGroup, interleave_cp, own_rows
from dsv4_backend.testing.simulation.pool import PagedRequestPool
from dsv4_backend.testing.simulation.v41 import tiny_v41
from dsv4_backend.testing.v41_host import SglangV41Model, v41_hf_config, v41_sglang_pool

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

DRAFT = 5  # DSpark's block
SIZE = 2
CONFIG = tiny_v41(head_dim=512, index_head_dim=128, num_heads=8, speculative=True,
                  num_draft_tokens=DRAFT)  # fmt: skip
LAYERS = range(len(CONFIG.compress_ratios))
FP8_RELATIVE = 0.1  # fp8 window keys and entries: the other V4.1 fp8 tests' bound


def _runner(paged: PagedRequestPool, cp: int, **server_args: Any) -> Any:
    runner = harness.mock_runner(
        paged, v41_hf_config(CONFIG), topk=0, speculative_algorithm="DSPARK",
        num_draft_tokens=DRAFT, tp_size=cp, attn_cp_size=cp, **server_args,
    )  # fmt: skip
    runner.server_args.enable_prefill_cp = cp > 1
    runner.token_to_kv_pool = v41_sglang_pool(CONFIG, paged, DRAFT)
    return runner


def _positions(rows: list[Any]) -> torch.Tensor:
    return torch.tensor([0 if row is None else row[1] for row in rows])


def test_v41_cp_ranks_equal_the_single_rank() -> None:
    """Two chunked CP prefills of two requests (each rank's rows interleaved, padded to the
    physical count), then a decode (not split): every rank's rows equal the single rank's and
    the reference, its padding rows are 0, and every rank's caches hold every entry (the
    decode, reading them whole, equals the single rank's on each rank)."""
    lengths = (280, 150)
    paged = PagedRequestPool(CONFIG, lengths, generator=torch.Generator().manual_seed(11))
    model = SglangV41Model(CONFIG, lengths)
    single = DSV4AttentionBackend(_runner(paged, 1))
    groups = [SimulatedCPGroup(rank) for rank in range(SIZE)]
    ranks = [
        CPRank(DSV4AttentionBackend(_runner(paged, SIZE)), rank, SIZE, {"attn_cp_group": group})
        for rank, group in enumerate(groups)
    ]
    builder = harness.BatchBuilder(paged)
    steps = [
        builder.extend([0, 1], [0, 0], [200, 101]),
        builder.extend([0, 1], [200, 101], [61, 30]),
        builder.decode([0, 1], [262, 132]),
    ]
    worst_single, worst_reference = 0.0, 0.0
    with interleave_cp(SIZE):
        for step in steps:
            single.init_forward_metadata(step.batch)
            planned = [rank.plan(step) for rank in ranks]
            split = planned[0].rows is not step.rows
            for layer in LAYERS:
                want = model.layer(single, step, layer)
                whole = model.feed(step.rows, layer)
                owns = [model.feed(local.rows, layer) for local in planned]
                for group in groups:
                    group.world = [
                        own.x[: sum(row is not None for row in local.rows)]
                        for own, local in zip(owns, planned, strict=True)
                    ]
                for rank, local, own in zip(ranks, planned, owns, strict=True):
                    with rank.context():
                        if split:
                            out = model.run_feed(
                                rank.backend, local.batch, layer, own, _positions(local.rows),
                                window_keys=whole.kv,
                            )  # fmt: skip
                        else:
                            out = model.layer(rank.backend, local, layer)
                    mine = own_rows(rank.rank, SIZE, len(step.rows)) if split else None
                    real = len(mine) if mine is not None else len(step.rows)
                    expected = want[mine] if mine is not None else want
                    diff = float((out[:real].float() - expected.float()).abs().max())
                    worst_single = max(worst_single, diff)
                    assert not out[real:].any()  # padding rows
                    rows = local.rows[:real]
                    ref = torch.stack([model.expected[r].outputs[layer][p] for r, p in rows])
                    error = (out[:real].float() - ref).abs().mean() / ref.abs().mean()
                    worst_reference = max(worst_reference, float(error))
    kv_sources = len(CONFIG.v41.kv_source_layers)
    assert all(group.gathers == 2 * kv_sources for group in groups)  # each CP prefill's sources
    assert worst_single < 2e-2, worst_single  # bf16 outputs
    assert worst_reference < FP8_RELATIVE, worst_reference


@pytest.mark.parametrize(
    ("flags", "fmt", "named"),
    [
        # sglang's V4.1 model writes a CP prefill's window keys into its pool itself.
        ({}, "dense", "--attention-context-parallel-size with DeepSeek-V4.1"),
        ({"enable_decoder_swa_bounded_replay": True}, "fp8", "the late-layer tail's CP layout"),
    ],
    ids=["dense-caches", "bounded-replay"],
)
def test_what_v41_cp_is_not_served_with_is_refused_when_built(
    flags: dict, fmt: str, named: str
) -> None:
    paged = PagedRequestPool(CONFIG, (40,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=named):
        DSV4AttentionBackend(_runner(paged, SIZE, **flags), cache_format=fmt)  # type: ignore[arg-type]


def test_the_pd_prefill_cp_dspark_launch_is_served() -> None:
    """sglang PR 39746's cell: a V4.1 PD prefill server with prefill CP and DSpark, fp8 caches
    over sglang's pool (its regions carry them to the decode side)."""
    paged = PagedRequestPool(CONFIG, (40,), generator=torch.Generator().manual_seed(0))
    backend = DSV4AttentionBackend(_runner(paged, SIZE, disaggregation_mode="prefill"))
    assert backend.dspark and not backend.bounded_replay
