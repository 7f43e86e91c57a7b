"""Prefill context parallelism (``--enable-prefill-cp --cp-strategy interleave``) on the CPU:
``cp`` ranks, each a backend of its own, fed what sglang 0.5.23 hands a rank, laid out by
sglang's own CP code (``context_parallel``): simulated in one process,
and two processes over gloo, where sglang's ``cp_materialize_global_token_order`` all-gathers
each rank's window keys and projections.

Verdicts: every rank's output equals the single-rank output at its rows and the full causal
pass, padding rows 0; the c4 top-k equal; every cache and ring bit-identical on all ranks and
to the single rank's; a decode after the CP prefill (no CP) equal too. Negative controls: a
contiguous split, writes of the rank's rows only and padding off by one are caught.
"""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest
import torch
from context_parallel import (
    CPRank,
    as_rank,
    gloo_rank,
    interleave_cp,
    own_rows,
)

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ContractError
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
HF = harness.tiny_hf_config(CONFIG)
ATOL = 2e-5


def single_backend(pool: PagedRequestPool) -> DSV4AttentionBackend:
    return DSV4AttentionBackend(harness.mock_runner(pool, HF), cache_format="dense")


@pytest.mark.parametrize("size", [2, 3, 4])
def test_cp_ranks_equal_the_single_rank(size: int) -> None:
    """Two prefill chunks (a request shorter than ``size`` tokens, lengths across the window,
    c4 blocks, c128 entries and pages), then a decode: each rank's rows equal the single rank
    and the reference, padding rows 0, the c4 top-k equal, every cache and ring identical."""
    pool = PagedRequestPool(CONFIG, [140, 300, 40], generator=torch.Generator().manual_seed(size))
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(7))
    sim, batches = harness.SimulatedModel(model), harness.BatchBuilder(pool)
    single = single_backend(pool)
    with interleave_cp(size):
        ranks = [CPRank.build(pool, HF, rank, size) for rank in range(size)]
        assert all(r.backend.local_heads == CONFIG.num_heads for r in ranks)  # attention TP 1
        for step in (
            batches.extend([0, 1, 2], [0, 0, 0], [100, 131, 1]),
            batches.extend([0, 1, 2], [100, 131, 1], [30, 160, 20]),
            batches.decode([0, 1, 2], [131, 292, 22]),
        ):
            single.init_forward_metadata(step.batch)
            locals_ = [r.plan(step) for r in ranks]
            split = locals_[0].rows is not step.rows
            assert split == step.batch.forward_mode.is_extend()  # decode runs unsplit
            for layer, ratio in enumerate(CONFIG.compress_ratios):
                want = sim.layer(single, step, layer)
                for rank, local in zip(ranks, locals_, strict=True):
                    out = rank.layer(sim, step, local, layer)
                    mine = own_rows(rank.rank, size, len(step.rows)) if split else None
                    real = out[: len(mine)] if mine is not None else out
                    torch.testing.assert_close(
                        real, want[mine] if mine is not None else want, atol=1e-6, rtol=0
                    )
                    assert not out[real.shape[0] :].any()  # padding rows: 0
                    assert sim.max_error(local.rows, layer, out) <= ATOL
                    if ratio == 4:  # the rank's top-k: the single rank's at its rows
                        session = rank.backend.session
                        read = session.cp_read_metadata or session.forward_metadata
                        full = single.forward_metadata
                        assert read is not None and read.c4 is not None
                        assert full is not None and full.c4 is not None
                        selected = full.c4.page_indices
                        expected = selected[mine] if mine is not None else selected
                        assert torch.equal(read.c4.page_indices[: real.shape[0]], expected)
    reference = single.state.named_tensors()
    for rank in ranks:
        for name, tensor in rank.backend.state.named_tensors().items():
            assert torch.equal(tensor, reference[name]), (rank.rank, name)


def test_cp_decode_attention_tp_splits_the_heads_of_the_other_batches() -> None:
    """``--enable-cp-decode-attn-tp``: a CP prefill keeps every head on every rank; a decode
    (not split) gives each rank its ``1 / cp`` of the heads and the sink, and the ranks' outputs
    side by side equal the single rank's; a rank handed every head in a decode is refused."""
    size = 2
    pool = PagedRequestPool(CONFIG, [140, 40], generator=torch.Generator().manual_seed(11))
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(12))
    sim, batches = harness.SimulatedModel(model), harness.BatchBuilder(pool)
    single = single_backend(pool)
    with interleave_cp(size):
        ranks = [CPRank.build(pool, HF, r, size, decode_attn_tp=True) for r in range(size)]
        assert [r.backend.split_heads for r in ranks] == [CONFIG.num_heads // size] * size
        for step in (batches.extend([0, 1], [0, 0], [130, 30]), batches.decode([0, 1], [131, 31])):
            single.init_forward_metadata(step.batch)
            locals_ = [r.plan(step) for r in ranks]
            for layer in range(len(CONFIG.compress_ratios)):
                want = sim.layer(single, step, layer)
                outs = [
                    r.layer(sim, step, local, layer)
                    for r, local in zip(ranks, locals_, strict=True)
                ]
                if locals_[0].rows is step.rows:  # the decode: heads split over the ranks
                    torch.testing.assert_close(torch.cat(outs, dim=1), want, atol=1e-6, rtol=0)
                else:
                    for rank, out in zip(ranks, outs, strict=True):
                        mine = own_rows(rank.rank, size, len(step.rows))
                        torch.testing.assert_close(out[: len(mine)], want[mine], atol=1e-6, rtol=0)
        decode = locals_[0]
        with ranks[0].context(), pytest.raises(ContractError, match="serves 4 query heads"):
            sim.layer(ranks[0].backend, decode, 0)  # every head: not what this rank serves


def test_negative_controls_are_caught() -> None:
    """What a wrong CP layout would do: a rank fed a contiguous block of queries (not its
    interleaved rows) is wrong against the reference; window keys of the rank's rows only
    (local writes) and a layout of other counts (padding off by one) are refused by name."""
    from sglang.srt.layers.cp.utils import prepare_cp_forward

    pool = PagedRequestPool(CONFIG, [300], generator=torch.Generator().manual_seed(1))
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(2))
    sim, batches = harness.SimulatedModel(model), harness.BatchBuilder(pool)
    step = batches.extend([0], [0], [200])
    with interleave_cp(2):
        first = CPRank.build(pool, HF, 0, 2)
        local = first.plan(step)
        contiguous = harness.Step(local.batch, step.rows[: len(local.rows)])
        out = first.layer(sim, step, contiguous, 0)
        assert sim.max_error(contiguous.rows, 0, out) > 1e-2  # rows 0..99, planned 0, 2, ...
        feed = sim.feed(local.rows, 0)
        with first.context(), pytest.raises(ContractError, match="store_cache"):
            first.backend.store_cache(layer_id=0, swa_k=feed.kv, forward_batch=local.batch)
        other = dataclasses.replace(step.batch)
        with as_rank(0, 2):
            prepare_cp_forward(other)
            other.attn_cp_metadata.per_rank_logical_token = [99, 101]  # padding off by one
            with pytest.raises(BatchError, match="prepare_cp_forward ran on another batch"):
                first.backend.init_forward_metadata(other)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_processes_over_gloo_equal_the_single_rank(tmp_path) -> None:
    """Two ranks in two processes: each layer's window keys and compressor projections are
    each rank's own rows, all-gathered by sglang's ``cp_materialize_global_token_order`` over
    gloo; the gathered tensors are the batch's, each rank's rows equal the single rank and the
    reference, padding rows 0, and both ranks' caches and rings equal the single rank's. Then
    DeepSeek-V4.1 over sglang's pools: a CP prefill under the decoder SWA bounded replay, its
    low-ratio sources' and tail's rows gathered over gloo, equal to the single rank and the
    reference with the tail's floors."""
    import torch.multiprocessing as mp

    mp.spawn(gloo_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["gather"] == 0.0
        assert result["single"] <= 1e-6 and result["reference"] <= ATOL
        assert result["padding_zero"] and result["state"] == result["single_state"]
        # DeepSeek-V4.1 with its tail: bf16 outputs, fp8 caches against the reference.
        assert result["v41_single"] < 2e-2 and result["v41_reference"] < 0.1
        assert result["v41_padding_zero"]
