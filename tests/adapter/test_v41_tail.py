"""DeepSeek-V4.1's decoder SWA bounded replay (``--enable-decoder-swa-bounded-replay``, sglang's
default for V4.1) through the adapter, with sglang 0.5.23's own objects on the CPU: the
late-layer tail against sglang's ``late_layer_tail_layout`` (rows, lengths, window floors), and
extends whose late layers run over their tail as sglang's model drives them
(``SglangV41Model.forward``: ``write_tail_source_kv``, ``enter_late_layer_tail``, the tail
rows, ``exit_late_layer_tail``) against the reference with the tail's window floors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from v41_host import SglangV41Model, v41_hf_config

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError, ContractError
from dsv4_backend.planning import late_layer_tail
from dsv4_backend.self_check.requests import PagedRequestPool
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing.harness import BatchBuilder, Step, mock_runner
from dsv4_backend.testing.simulation.v41 import TINY_V41_SOURCES, tiny_v41

pytestmark = pytest.mark.sglang

TAIL = 128  # sglang's SWA_WINDOW: the tail of a request's extend


def _runner(pool: PagedRequestPool, config: DSV4AttentionConfig, **flags: Any) -> Any:
    return mock_runner(
        pool, v41_hf_config(config), topk=0, speculative_algorithm="DSPARK",
        num_draft_tokens=config.num_draft_tokens, enable_decoder_swa_bounded_replay=True,
        **flags,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("prefix", "extend", "whole"),
    [
        ([0], [300], None),  # one request: its last 128 rows, a contiguous tail
        ([0], [90], None),  # shorter than the tail: all of it, the floor before the extend
        ([0, 256, 40], [300, 20, 129], None),
        ([100, 0, 7], [50, 300, 128], [False, True, False]),  # prompt logprobs: a whole extend
    ],
)
def test_the_tail_is_sglangs_late_layer_tail_layout(
    prefix: list[int], extend: list[int], whole: list[bool] | None
) -> None:
    from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import late_layer_tail_layout

    config = tiny_v41()
    lens = [p + n + 1 for p, n in zip(prefix, extend, strict=True)]
    pool = PagedRequestPool(config, lens, generator=torch.Generator().manual_seed(3))
    view = pool.extend(list(range(len(prefix))), prefix, extend)
    tail = late_layer_tail(view, TAIL, whole)
    seq = [p + n for p, n in zip(prefix, extend, strict=True)]
    indices, tail_lens, floor = late_layer_tail_layout(
        extend_lens_cpu=extend, seq_lens_cpu=seq, tail_len=TAIL, device=torch.device("cpu"),
        whole_extend=whole,
    )  # fmt: skip
    assert tail.tail_lens == tail_lens and torch.equal(tail.token_indices, indices.long())
    per_row = torch.repeat_interleave(torch.tensor(tail.window_floors), torch.tensor(tail_lens))
    assert torch.equal(per_row, floor.long())
    assert tail.batch.extend_seq_lens == tail_lens
    assert torch.equal(tail.batch.out_cache_loc, view.out_cache_loc[indices])
    assert (tail.contiguous_start is not None) == (len(extend) == 1)


def _floors(lengths: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=torch.int64) for n in lengths]


def test_extends_run_their_late_layers_over_the_tail_eagerly_and_from_tail_graphs(
    torch_path: None,
) -> None:
    """Chunked prefills of two requests (a tail of each request's last 128 rows with its floor
    at the first; extends shorter than the tail reading back into the previous chunk's tail),
    then a DSpark verify (no tail), on two backends: one with the tail run eagerly, one from
    sglang's decoder tail graphs (``testing.tail_graphs``: buckets of 128 and 256 rows, each
    captured on first use with two warmups, then replayed). Every computed row of every layer
    equals the reference with the tail's window floors, the graphs' rows equal the eager ones
    bit for bit, and the late layers' first tail rows differ from the plain window (the check
    can fail)."""
    config = tiny_v41(speculative=True, num_draft_tokens=5)
    lengths = (260, 120)
    pool = PagedRequestPool(config, lengths, generator=torch.Generator().manual_seed(4))
    eager = DSV4AttentionBackend(_runner(pool, config), cache_format="dense")
    graphed = DSV4AttentionBackend(_runner(pool, config), cache_format="dense")
    model = SglangV41Model(config, lengths)
    graphs = model.tail_graphs(max_rows=2 * TAIL)
    plain = list(model.expected)
    builder = BatchBuilder(pool)
    floors = _floors(lengths)
    chunks = [
        ([0, 1], [0, 0], [200, 90]),  # 218 tail rows: the 256-row bucket, captured
        ([0], [200], [50]),  # 50: the 128-row bucket, captured
        ([0, 1], [250, 90], [1, 20]),  # 21: the 128-row bucket, replayed
    ]
    steps: list[Step] = []
    for requests, prefix, extend in chunks:
        steps.append(builder.extend(requests, prefix, extend))
        for r, p, n in zip(requests, prefix, extend, strict=True):
            tail = min(TAIL, n)
            floors[r][p + n - tail : p + n] = max(0, p + n - TAIL)
    steps.append(builder.verify([0, 1], [251, 110], 5))
    model.replay_late_layers(floors)
    late = config.late_layer_start
    projected: list[int] = []  # rows the tail's kv source compresses, call by call
    compressor = model.layers[late].compressor
    project = compressor.project
    compressor.project = lambda x: (projected.append(x.shape[0]), project(x))[1]
    worst, plain_gap, captures = 0.0, 0.0, []
    for step in steps:
        is_extend = (
            step.batch.forward_mode.is_extend() and not step.batch.forward_mode.is_target_verify()
        )
        runs = []
        for backend, tail_graphs in ((eager, None), (graphed, graphs)):
            projected.clear()
            backend.init_forward_metadata(step.batch)
            assert (backend.tail_forward_metadata is not None) == is_extend
            runs.append(model.forward(backend, step, tail_graphs))
            assert projected == [len(step.rows)]  # every row once, not again inside the tail
            assert not backend.session.in_tail and backend.session.tail_source_kv_layer_id is None
        captures.append(graphs.captures)
        for (rows, out), (graph_rows, graph_out) in zip(*runs, strict=True):
            assert graph_rows == rows and torch.equal(graph_out, out)
        for layer, (rows, out) in enumerate(runs[0]):
            assert out.shape[0] == len(rows) and len(rows) <= len(step.rows)
            if is_extend and layer >= late:
                assert len(rows) == sum(min(TAIL, n) for n in step.batch.extend_seq_lens_cpu)
            worst = max(worst, model.max_error(rows, layer, out))
            if is_extend and layer >= late:
                want = torch.stack([plain[r].outputs[layer][p] for r, p in rows])
                plain_gap = max(plain_gap, float((out.float() - want).abs().max()))
    assert captures == [1, 2, 2, 2] and sorted(graphs.graphs) == [TAIL, 2 * TAIL]
    assert worst < 2e-2, worst  # the output is bf16 (q's dtype)
    assert plain_gap > 0.1, plain_gap


def test_dp_padded_extends_run_their_late_layers_over_the_real_rows_tail(
    torch_path: None,
) -> None:
    """``--enable-dp-attention``: an extend padded by sglang's ``_pad_inputs_to_size`` with
    tokens of no request (``prepare_mlp_sync_batch``) and a decode padded with requests: the
    tail is the real requests' rows, run from sglang's decoder tail graphs (``testing.
    tail_graphs``), every computed row equals the reference with the tail's floors, and the
    padded decode's real rows too."""
    config = tiny_v41(speculative=True, num_draft_tokens=5)
    lengths = (160, 30)
    pool = PagedRequestPool(config, lengths, generator=torch.Generator().manual_seed(7))
    runner = _runner(pool, config, enable_dp_attention=True, tp_size=2, dp_size=2)
    backend = runner.attn_backend = DSV4AttentionBackend(runner, cache_format="dense")
    model = SglangV41Model(config, lengths)
    builder = BatchBuilder(pool)
    floors = _floors(lengths)
    floors[0][150 - TAIL : 150] = 150 - TAIL  # request 0's tail; request 1's floor is 0
    model.replay_late_layers(floors)
    extend = builder.pad(builder.extend([0, 1], [0, 0], [150, 20]), runner, 0, 1, 30)
    decode = builder.pad(builder.decode([0, 1], [151, 21]), runner, 2, 1)
    worst = 0.0
    graphs = model.tail_graphs(max_rows=2 * TAIL)
    for step in (extend, decode):
        backend.init_forward_metadata(step.batch)
        outputs = model.forward(backend, step, graphs)
        tail_rows = outputs[config.late_layer_start][0]
        if step is extend:
            assert None not in tail_rows and len(tail_rows) == TAIL + 20
            assert graphs.captures == 1
        worst = max(
            worst, *(model.max_error(rows, i, out) for i, (rows, out) in enumerate(outputs))
        )
    assert worst < 2e-2, worst


def test_the_tail_outside_an_extend_is_refused() -> None:
    config = tiny_v41(speculative=True, num_draft_tokens=5)
    pool = PagedRequestPool(config, (40,), generator=torch.Generator().manual_seed(5))
    backend = DSV4AttentionBackend(_runner(pool, config), cache_format="dense")
    decode = BatchBuilder(pool).decode([0], [10])
    backend.init_forward_metadata(decode.batch)
    with pytest.raises(ContractError, match="no late-layer tail was planned"):
        backend.enter_late_layer_tail(decode.batch)


def test_a_model_the_tail_cannot_serve_is_refused_when_built() -> None:
    """The last kv source must also be the candidate source (sglang's model asserts it)."""
    sources = TINY_V41_SOURCES.__class__(**{**vars(TINY_V41_SOURCES), "candidate_source_layer": 1})
    v41 = tiny_v41(v41=sources, speculative=True, num_draft_tokens=5)
    pool = PagedRequestPool(v41, (40,), generator=torch.Generator().manual_seed(6))
    with pytest.raises(ConfigError, match="to be an index source and the candidate"):
        DSV4AttentionBackend(_runner(pool, v41), cache_format="dense")
