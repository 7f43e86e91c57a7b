"""The backend under sglang 0.5.23's EAGLE draft-extend CUDA-graph runner, on the CPU.

sglang builds this runner only for the backend classes it lists (speculative/eagle_worker_v2.py
``_capture_cuda_graphs``, ``graph_supported_backend_types``), so a server with this backend
runs the draft extend eagerly. The runner is built around this backend here anyway, so the
backend is ready for what it hands over once sglang builds it for any backend.

sglang code that runs here, called, not re-implemented
(``sglang/srt/speculative/eagle_draft_extend_cuda_graph_runner.py`` unless named otherwise):

* ``EAGLEDraftExtendCudaGraphRunner.__init__``: its capture sizes and width
  (``speculative_num_draft_tokens`` rows a request), ``init_cuda_graph_state`` of the
  draft-extend backend, the seq-len fill value (``resolve_draft_extend_seq_len_fill_value``),
  static buffers (``EagleDraftExtendInputBuffers``), then ``capture``;
* ``capture_one_shape`` for every capture size: the capture ``ForwardBatch`` over the static
  buffers (pool row 0, ``seq_lens`` the fill value 1 below the width, a placeholder
  ``out_cache_loc``), the backend's ``init_forward_metadata_out_graph(fb, in_capture=True)``
  and ``run_once`` (the model on that batch);
* ``can_run_graph`` and ``execute`` (the replay): the bucket (``_pad_to_bucket``), the static
  buffers reset and filled, the backend's ``init_forward_metadata_out_graph`` with the runner's
  namespace view (the whole ``max_bs`` buffers, the live tokens' ``out_cache_loc``);
* ``EagleDraftWorker._draft_extend_for_decode`` (speculative/eagle_worker_v2.py) choosing the
  graph through ``prepare_for_draft_extend`` (speculative/eagle_worker_common.py), inside the
  EAGLE v2 rounds of ``eagle_host.Host.round``.

Stand-ins where sglang's code needs CUDA: the graph backend and ``capture``'s CUDA set-up, as in
``test_host_draft_graphs.py`` (``eagle_host.EagerGraphs``, ``capture_graphs``).

Verdicts: live rows equal the full causal pass, padding rows output 0, every replay plan lies in
the storage the captured run read, and the caches equal those of a host that ran the same
rounds with an eager draft extend, outside sglang's padding page.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from eagle_host import (
    DP_EXTRA_REQUESTS,
    NUM_DRAFT,
    EagerGraphs,
    Host,
    assert_equal_outside_the_padding_page,
    capture_graphs,
    eagle_server,
    install_worker_stand_ins,
    untranslating_translator,
)
from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative import eagle_draft_extend_cuda_graph_runner
from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import (
    EAGLEDraftExtendCudaGraphRunner,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from dsv4_backend.errors import BatchError
from dsv4_backend.sglang_adapter.batch_read import GraphCall, batch_view

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

#: The pool holds 3 requests: 1 request replays in the graph of 2.
CAPTURE_BS = [2, 3]


def bucket(n: int) -> int:
    return min(bs for bs in CAPTURE_BS if bs >= n)


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    install_worker_stand_ins(monkeypatch)
    monkeypatch.setattr(EAGLEDraftExtendCudaGraphRunner, "capture", capture_graphs)


def server(monkeypatch: pytest.MonkeyPatch) -> Any:
    graphs = CudaGraphConfig.from_dict({"decode": {"bs": CAPTURE_BS}})
    return eagle_server(monkeypatch, cuda_graph_config=graphs)


class Views:
    """The batches the runner hands the draft-extend backend's graph planning, recorded."""

    def __init__(self, host: Host) -> None:
        self.captures: list[Any] = []
        self.replays: list[Any] = []
        plan = host.draft_extend.init_forward_metadata_out_graph

        def recorded(forward_batch: Any, in_capture: bool = False) -> None:
            (self.captures if in_capture else self.replays).append(forward_batch)
            plan(forward_batch, in_capture)

        host.draft_extend.init_forward_metadata_out_graph = recorded  # type: ignore[method-assign]


def draft_extend_graphs(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> EAGLEDraftExtendCudaGraphRunner:
    """sglang's draft-extend graph runner for ``host``'s draft worker, built and captured, and
    installed where ``_draft_extend_for_decode`` looks for it."""
    draft_runner = host.draft_runner
    draft_runner.kv_index_translator = untranslating_translator(draft_runner)
    draft_runner.server_args.dllm_algorithm = None
    draft_runner.graph_shared_output = SimpleNamespace(  # as in test_host_graph_replay.py
        get_logits_buffer=lambda vocab_size, rows: torch.zeros(rows, vocab_size)
    )
    host.worker.draft_extend_attn_backend = host.draft_extend
    host.worker.speculative_algorithm = SpeculativeAlgorithm.EAGLE
    host.worker.dsa_seed_topk_width = 0
    graphs = EagerGraphs([host.draft_extend])
    monkeypatch.setattr(
        eagle_draft_extend_cuda_graph_runner, "resolve_decode_backend", lambda r: graphs
    )
    runner = EAGLEDraftExtendCudaGraphRunner(host.worker)
    assert runner.capture_bs == CAPTURE_BS and runner.captured_req_width == NUM_DRAFT
    assert set(graphs.graphs) == {runner._make_graph_key(bs) for bs in CAPTURE_BS}
    host.worker.cuda_graph_runner_for_draft_extend = runner
    return runner


def run_round(host: Host, lens: dict[int, int], requests: list[int], accepts: list[int]) -> None:
    """``Host.round`` of ``requests`` at their lengths in ``lens`` (updated)."""
    host.requests, host.lens = list(requests), [lens[r] for r in requests]
    host.round(accepts)
    lens.update(zip(requests, host.lens, strict=True))


#: (requests, verify tokens each commits) of each round: 1, 2 and 3 requests.
ROUNDS = [([0], [2]), ([1, 2], [4, 1]), ([2, 0, 1], [1, 3, 2]), ([1], [3])]


def test_draft_extend_graphs_replay_every_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """EAGLE v2 rounds of 1, 2 and 3 requests whose draft extend replays the graphs of 2 and 3
    requests (1 in the graph of 2: a padding request of ``NUM_DRAFT`` rows at the fill value
    1). The capture batches and every replay view are planned; live rows equal the reference,
    padding rows output 0, and the caches equal an eager draft extend's outside the padding
    page."""
    with server(monkeypatch):
        graphed, eager = Host(), Host()
        for host in (graphed, eager):
            host.prefill()
        runner = draft_extend_graphs(graphed, monkeypatch)
        views = Views(graphed)
        graphed_lens, eager_lens = dict(enumerate(graphed.lens)), dict(enumerate(eager.lens))
        for requests, accepts in ROUNDS:
            run_round(graphed, graphed_lens, requests, accepts)
            view = views.replays[-1]
            assert view.batch_size == runner.bs == bucket(len(requests))
            assert view.seq_lens.numel() == max(CAPTURE_BS)  # the runner's whole buffers
            assert view.out_cache_loc.numel() == len(requests) * NUM_DRAFT  # the live tokens'
            run_round(eager, eager_lens, requests, accepts)
        assert len(views.replays) == len(ROUNDS) and not views.captures
        assert graphed_lens == eager_lens
        # Each round: draft steps, verify, draft extend, decode; the capture ran 3 a size.
        assert graphed.check() == eager.check() + 3 * len(CAPTURE_BS)
        assert_equal_outside_the_padding_page(graphed, eager)


def test_the_capture_batches_are_planned_as_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """``capture_one_shape``'s batch (every request at pool row 0 with ``seq_lens`` 1 below its
    ``NUM_DRAFT`` rows, the runner's placeholder slots) is planned as padding requests from
    position 0 writing only sglang's padding slot; before this, a negative prefix was refused."""
    with server(monkeypatch):
        host = Host()
        host.prefill()
        views = Views(host)
        calls: list[Any] = []
        session = host.draft_extend.session
        plan = session.planner

        def planned(view: Any, buffers: Any) -> Any:
            calls.append(view)
            return plan(view, buffers)

        session.planner = planned
        runner = draft_extend_graphs(host, monkeypatch)
        assert len(views.captures) == len(CAPTURE_BS) and len(calls) == len(CAPTURE_BS)
        for fb, view in zip(views.captures, calls, strict=True):
            bs = fb.batch_size
            assert fb.seq_lens.tolist() == [runner.seq_len_fill_value] * bs == [1] * bs
            assert view.extend_prefix_lens == [0] * bs
            assert view.extend_seq_lens == [NUM_DRAFT] * bs
            assert not view.out_cache_loc.any()
        metadata = host.draft_extend.forward_metadata
        assert metadata is not None and metadata.kind.name == "DRAFT_EXTEND"
        assert metadata.swa_out_loc.eq(int(host.pool.full_to_swa[0])).all()


def replay_view(host: Host, **fields: Any) -> Any:
    """A replay namespace as ``execute`` builds it: 1 live request (request 0 after a verify)
    in the graph of 2, the static buffers of 3 requests; ``fields`` replace entries."""
    request = host.pool.pool_index(0)
    length = host.lens[0] + NUM_DRAFT
    slots = host.pool.slots(0, range(host.lens[0], length))
    base: dict[str, Any] = dict(
        batch_size=2,
        forward_mode=ForwardMode.DRAFT_EXTEND_V2,
        req_pool_indices=torch.tensor([request, 0, 0]),
        seq_lens=torch.tensor([length, 1, 1]),
        seq_lens_cpu=torch.tensor([length, 1, 1]),
        out_cache_loc=slots.long(),
    )
    base.update(fields)
    return SimpleNamespace(**base)


def view_of(host: Host, fb: Any) -> Any:
    backend = host.draft_extend
    return batch_view(
        fb,
        req_to_token=backend.req_to_token_pool.req_to_token,
        full_to_swa=None,
        num_draft_tokens=NUM_DRAFT,
        graph=GraphCall.REPLAY,
    )


def test_a_replay_view_is_read_as_the_runner_lays_it_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The live request's rows and slots, then a padding request from position 0 at slot 0."""
    with server(monkeypatch):
        host = Host()
        view = view_of(host, replay_view(host))
        length = host.lens[0] + NUM_DRAFT
        assert view.batch_size == 2
        assert view.extend_prefix_lens == [host.lens[0], 0]
        assert view.seq_lens.tolist() == list(view.seq_lens_cpu) == [length, NUM_DRAFT]
        assert view.out_cache_loc[:NUM_DRAFT].tolist() == replay_view(host).out_cache_loc.tolist()
        assert not view.out_cache_loc[NUM_DRAFT:].any()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(seq_lens_cpu=None), "seq_lens_cpu None"),
        (dict(extend_seq_lens_cpu=[3, 4]), "extend_seq_lens_cpu=\\[3, 4\\]"),
        (dict(seq_lens_cpu=torch.tensor([1, 20, 1])), "padding, which only follows"),
        (dict(out_cache_loc=torch.zeros(3, dtype=torch.int64)), "whole requests' slots"),
        (dict(out_cache_loc=torch.zeros(12, dtype=torch.int64)), "at most 8"),
        (dict(out_cache_loc=torch.zeros(0, dtype=torch.int64)), "expected 4"),
    ],
)
def test_a_malformed_replay_view_is_refused(
    monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any], message: str
) -> None:
    with server(monkeypatch):
        host = Host()
        with pytest.raises(BatchError, match=message):
            view_of(host, replay_view(host, **fields))


def test_a_data_parallel_rank_replays_the_largest_ranks_bucket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Data-parallel attention, two ranks: the other rank has ``DP_EXTRA_REQUESTS`` more
    requests, so this rank's draft extend of 1 request replays the graph of 3 (2 padding
    requests); live rows equal the reference and padding rows output 0."""
    fields = dict(attn_dp_size=2, tp_size=2, enable_dp_attention=True)
    graphs = CudaGraphConfig.from_dict({"decode": {"bs": CAPTURE_BS}})
    with eagle_server(monkeypatch, cuda_graph_config=graphs, **fields):
        host = Host(dp=True)
        host.prefill()
        runner = draft_extend_graphs(host, monkeypatch)
        assert runner.require_mlp_tp_gather
        views = Views(host)
        lens = dict(enumerate(host.lens))
        run_round(host, lens, [0], [3])
        assert views.replays[-1].batch_size == runner.bs == bucket(1 + DP_EXTRA_REQUESTS)
        host.check()


def test_an_idle_ranks_replay_view_is_all_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle DP rank replays the largest rank's bucket with no live token (``execute`` with
    ``raw_bs = 0``: the buffers reset, ``out_cache_loc`` empty): every request is planned as
    padding, writing only sglang's padding slot."""
    with server(monkeypatch):
        host = Host()
        host.prefill()
        runner = draft_extend_graphs(host, monkeypatch)
        ones = torch.ones(3, dtype=torch.int64)
        fb = replay_view(
            host,
            req_pool_indices=torch.zeros(3, dtype=torch.int64),
            seq_lens=ones,
            seq_lens_cpu=ones,
            out_cache_loc=torch.zeros(0, dtype=torch.int64),
        )
        assert view_of(host, fb).extend_prefix_lens == [0, 0]
        host.draft_extend.init_forward_metadata_out_graph(fb)
        metadata = host.draft_extend.forward_metadata
        assert metadata is not None and metadata.num_rows == 2 * runner.captured_req_width
        assert metadata.swa_out_loc.eq(int(host.pool.full_to_swa[0])).all()
