"""DeepSeek-V4.1 under prefill context parallelism (``--enable-prefill-cp --cp-strategy
interleave``), two ranks simulated in one process on sglang 0.5.23's own CP code
(``prepare_cp_forward``, the interleave shard, ``cp_materialize_global_token_order``) and its V4.1
pool (fp8 caches over it, one pool per rank). A rank's layer is what sglang's ``MQALayer`` hands
the backend under CP: the window keys of every row (the model all-gathers them and writes them
into the pool, ``set_swa_key_buffer_radix_fused_norm_rope``, a CUDA kernel: mirrored by
``store_cache`` of the same keys), the rank's own rows to ``forward_low_ratio_sources`` (whose
compressors the backend runs over every row, all-gathered through the CP group as sglang's own
V4.1 backend does) and to the attention (``testing.context_parallel.v41_cp_forward`` under the
decoder SWA bounded replay: each rank over its share of the tail). Over gloo:
``test_context_parallel.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from context_parallel import (
    V41_CP_CONFIG,
    CPRank,
    SimulatedCPGroup,
    as_rank,
    interleave_cp,
    own_rows,
    row_positions,
    v41_cp_forward,
    v41_cp_runner,
)
from v41_host import SglangV41Model

from dsv4_backend.errors import ConfigError
from dsv4_backend.planning import late_layer_tail, tail_cp_layout
from dsv4_backend.self_check.requests import PagedRequestPool
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

CONFIG = V41_CP_CONFIG
SIZE = 2
LAYERS = range(len(CONFIG.compress_ratios))
FP8_RELATIVE = 0.1  # fp8 window keys and entries: the other V4.1 fp8 tests' bound
TAIL = 128  # sglang's SWA_WINDOW: the tail of a request's extend


def _ranks(paged: PagedRequestPool, groups: list[SimulatedCPGroup], **flags: Any) -> list[CPRank]:
    """A CP rank per simulated collective, each over its own sglang pool."""
    return [
        CPRank(DSV4AttentionBackend(v41_cp_runner(paged, SIZE, **flags)), rank, SIZE,
               {"attn_cp_group": group})
        for rank, group in enumerate(groups)
    ]  # fmt: skip


def test_v41_cp_ranks_equal_the_single_rank() -> None:
    """Two chunked CP prefills of two requests (each rank's rows interleaved, padded to the
    physical count), then a decode (not split): every rank's rows equal the single rank's and
    the reference, its padding rows are 0, and every rank's caches hold every entry (the
    decode, reading them whole, equals the single rank's on each rank)."""
    lengths = (280, 150)
    paged = PagedRequestPool(CONFIG, lengths, generator=torch.Generator().manual_seed(11))
    model = SglangV41Model(CONFIG, lengths)
    single = DSV4AttentionBackend(v41_cp_runner(paged, 1))
    groups = [SimulatedCPGroup(rank) for rank in range(SIZE)]
    ranks = _ranks(paged, groups)
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
            # Where sglang's model writes the gathered window keys: every row's slot, any rank.
            slots = single.get_swa_out_cache_loc(step.batch)
            for rank, local in zip(ranks, planned, strict=True):
                with rank.context():
                    assert torch.equal(rank.backend.get_swa_out_cache_loc(local.batch), slots)
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
                                rank.backend, local.batch, layer, own, row_positions(local.rows),
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


def test_v41_cp_over_caches_that_are_not_the_pools_views_is_refused_when_built() -> None:
    """sglang's V4.1 model writes a CP prefill's window keys into its pool itself."""
    paged = PagedRequestPool(CONFIG, (40,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=r"--attention-context-parallel-size with DeepSeek-V4\.1"):
        DSV4AttentionBackend(v41_cp_runner(paged, SIZE), cache_format="dense")


@pytest.mark.parametrize("size", [2, 3])
def test_the_tail_cp_layout_is_sglangs(size: int) -> None:
    """Each rank's share of a tail of three requests (one shorter than the tail) equals
    sglang's ``_late_layer_tail_cp_layout`` of the same tail rows."""
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

    paged = PagedRequestPool(CONFIG, (300, 200, 60), generator=torch.Generator().manual_seed(2))
    view = paged.extend([0, 1, 2], [0, 40, 0], [290, 150, 57])
    tail = late_layer_tail(view, TAIL)
    step = harness.BatchBuilder(paged).extend([0, 1, 2], [0, 40, 0], [290, 150, 57])
    lens = torch.tensor(tail.tail_lens)
    for rank in range(size):
        with as_rank(rank, size):
            want = DeepseekV4AttnBackend._late_layer_tail_cp_layout(
                None, step.batch, tail.token_indices, lens
            )
        got = tail_cp_layout(view, tail, rank, size)
        meta = want["cp_metadata"]
        assert meta.per_rank_logical_token == got.rank_rows
        assert torch.equal(meta.gather_index, got.gather_index)
        assert torch.equal(meta.local_index, got.local_index)
        assert torch.equal(want["local_token_indices"], got.local_token_indices)
        assert want["local_lens_cpu"] == got.local_lens
        assert want["pad_rows"] == got.max_rows - got.rank_rows[rank]


def test_v41_cp_ranks_run_the_late_layers_over_their_share_of_the_tail() -> None:
    """``--enable-decoder-swa-bounded-replay`` with prefill CP: two chunked CP prefills whose
    late layers run over each rank's share of the tail; every rank's rows equal the single
    rank's eager tail and the reference with the tail's window floors, padding rows 0."""
    lengths = (280, 150)
    paged = PagedRequestPool(CONFIG, lengths, generator=torch.Generator().manual_seed(12))
    model = SglangV41Model(CONFIG, lengths)
    replay = {"enable_decoder_swa_bounded_replay": True}
    single = DSV4AttentionBackend(v41_cp_runner(paged, 1, **replay))
    groups = [SimulatedCPGroup(rank) for rank in range(SIZE)]
    ranks = _ranks(paged, groups, **replay)
    builder = harness.BatchBuilder(paged)
    chunks = [([0, 1], [0, 0], [200, 101]), ([0, 1], [200, 101], [61, 30])]
    floors = [torch.zeros(n, dtype=torch.int64) for n in lengths]
    steps = []
    for requests, prefix, extend in chunks:
        steps.append(builder.extend(requests, prefix, extend))
        for r, p, n in zip(requests, prefix, extend, strict=True):
            floors[r][p + n - min(TAIL, n) : p + n] = max(0, p + n - TAIL)
    model.replay_late_layers(floors)
    worst_single, worst_reference = 0.0, 0.0
    with interleave_cp(SIZE):
        for step in steps:
            single.init_forward_metadata(step.batch)
            single_out = [
                dict(zip(rows, out, strict=True)) for rows, out in model.forward(single, step)
            ]
            planned = [rank.plan(step) for rank in ranks]
            single_tail = single.tail_forward_metadata.late_layer_tail
            tail_tokens = single_tail.token_indices.tolist()
            for rank in ranks:  # the gathered tail's window-key slots: the whole tail's
                tail = rank.backend.tail_forward_metadata.late_layer_tail
                assert torch.equal(tail.swa_out_cache_loc, single_tail.swa_out_cache_loc)
                assert torch.equal(tail.pos_global, single_tail.positions.long())
            for rank_outputs in v41_cp_forward(model, ranks, step, planned, tail_tokens, groups):
                for layer, (rows, out) in enumerate(rank_outputs):
                    real = [k for k, row in enumerate(rows) if row is not None]
                    assert not out[len(real) :].any()
                    got = out[real].float()
                    expected = torch.stack([single_out[layer][rows[k]] for k in real]).float()
                    worst_single = max(worst_single, float((got - expected).abs().max()))
                    ref = torch.stack(
                        [model.expected[rows[k][0]].outputs[layer][rows[k][1]] for k in real]
                    )
                    error = (got - ref).abs().mean() / ref.abs().mean()
                    worst_reference = max(worst_reference, float(error))
    assert worst_single < 2e-2, worst_single
    assert worst_reference < FP8_RELATIVE, worst_reference


def test_the_pd_prefill_cp_dspark_launch_is_served() -> None:
    """sglang PR 39746's cell: a V4.1 PD prefill server with prefill CP and DSpark, fp8 caches
    over sglang's pool (its regions carry them to the decode side)."""
    paged = PagedRequestPool(CONFIG, (40,), generator=torch.Generator().manual_seed(0))
    backend = DSV4AttentionBackend(v41_cp_runner(paged, SIZE, disaggregation_mode="prefill"))
    assert backend.dspark and not backend.bounded_replay
