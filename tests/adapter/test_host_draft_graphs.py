"""The backend under sglang 0.5.23's EAGLE multi-step draft CUDA-graph runner, on the CPU.

sglang code that runs here, called, not re-implemented
(``sglang/srt/speculative/eagle_draft_cuda_graph_runner.py`` unless named otherwise):

* ``EAGLEDraftCudaGraphRunner.__init__``: its capture sizes, ``init_cuda_graph_state`` of the
  multi-step draft backend, static buffers (``EagleDraftInputBuffers``), then ``capture``;
* ``capture_one_shape`` for every capture size: the capture ``ForwardBatch`` over the static
  buffers (pool row 0, ``seq_lens`` the backend's fill value, slot 0), the backend's
  ``init_forward_metadata_out_graph(fb, in_capture=True)``, ``mark_forward_metadata_ready`` and
  ``run_once`` (``EagleDraftWorker.draft_forward`` -> ``ModelRunner.forward`` -> the eager
  runner's copy -> the model, once per attending step);
* ``can_run_graph`` and ``execute`` (the replay): the bucket (``_pad_to_bucket``; under DP
  attention of the largest rank's count), static buffers padded (pool row 0, length 1, slot 0)
  and filled, the backend's ``init_forward_metadata_out_graph`` with the runner's namespace view
  (``num_padding`` = bucket - live requests; an idle DP rank's view keeps ``forward_mode`` IDLE);
* ``EagleDraftWorker.draft`` (speculative/eagle_worker_v2.py) choosing the graph through
  ``prepare_for_draft`` (speculative/eagle_worker_common.py); ``KVIndexTranslator`` binding the
  capture batch's slots (mem_cache/kv_index_translator.py, ``bind_runner_slots``).

Stand-ins, where sglang's code needs CUDA: the graph backend ``resolve_decode_backend`` returns
(``EagerGraphs``: sglang's breakable CUDA-graph backend as its debug-eager mode runs a graph,
runner_backend/breakable_cuda_graph_backend.py ``capture_one``, lines 113-160: two warm-up runs,
then the captured run; a replay runs the captured forward again), and ``capture``'s CUDA set-up
(``capture_graphs``: what ``DecodeCudaGraphRunner._capture`` / ``_capture_one_stream`` do besides
it, runner/decode_cuda_graph_runner.py lines 1283-1288 and 1325-1364). The host around them is
``eagle_host.py``'s.

A replayed graph runs no Python on a GPU: its kernels read the plan the capture run was handed.
So each replay also checks that the replay plan lies in the storage the captured run read
(``GraphMetadataBuffers``), field by field.

Verdicts: live rows equal the full causal pass; padding rows output 0 and write only sglang's
padding page; an idle DP rank's replay plans every row as padding (not the last batch's plan,
which the graph would replay with).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from eagle_host import (
    DP_EXTRA_REQUESTS,
    LENS,
    NUM_STEPS,
    EagerGraphs,
    Forward,
    Host,
    assert_equal_outside_the_padding_page,
    capture_graphs,
    check_forward,
    draft_input,
    eagle_server,
    install_worker_stand_ins,
    schedule_batch,
    state_tensors,
    untranslating_translator,
)
from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative import eagle_draft_cuda_graph_runner
from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

#: The pool holds 3 requests (sglang clamps the sizes to it): 1 request replays in the graph of 2.
CAPTURE_BS = [2, 3]
DP_RANKS = 2


def bucket(n: int) -> int:
    return min(bs for bs in CAPTURE_BS if bs >= n)


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    install_worker_stand_ins(monkeypatch)
    monkeypatch.setattr(EAGLEDraftCudaGraphRunner, "capture", capture_graphs)


def server(monkeypatch: pytest.MonkeyPatch, *, dp: bool) -> Any:
    fields: dict[str, Any] = dict(
        cuda_graph_config=CudaGraphConfig.from_dict({"decode": {"bs": CAPTURE_BS}})
    )
    if dp:
        fields.update(attn_dp_size=DP_RANKS, tp_size=DP_RANKS, enable_dp_attention=True)
    return eagle_server(monkeypatch, **fields)


def draft_graphs(host: Host, monkeypatch: pytest.MonkeyPatch) -> EAGLEDraftCudaGraphRunner:
    """sglang's draft graph runner for ``host``'s draft worker, built and captured."""
    host.draft_runner.kv_index_translator = untranslating_translator(host.draft_runner)
    host.worker.dsa_seed_topk_width = 0
    # EagleDraftWorker.init_attention_backend (eagle_worker_v2.py, line 412).
    host.draft_runner.draft_attn_backend = host.draft
    host.draft_runner.server_args.dllm_algorithm = None
    graphs = EagerGraphs(host.draft.attending_backends)
    monkeypatch.setattr(eagle_draft_cuda_graph_runner, "resolve_decode_backend", lambda r: graphs)
    runner = EAGLEDraftCudaGraphRunner(host.worker)
    assert runner.capture_bs == CAPTURE_BS
    assert set(graphs.graphs) == {runner._make_graph_key(bs) for bs in CAPTURE_BS}
    host.worker.cuda_graph_runner = runner
    return runner


class ReplayViews:
    """The views sglang's replay hands the multi-step draft backend, recorded."""

    def __init__(self, host: Host) -> None:
        self.views: list[Any] = []
        plan = host.draft.init_forward_metadata_out_graph

        def recorded(forward_batch: Any, in_capture: bool = False) -> None:
            if not in_capture:
                self.views.append(forward_batch)
            plan(forward_batch, in_capture)

        host.draft.init_forward_metadata_out_graph = recorded  # type: ignore[method-assign]


def draft(host: Host, requests: Sequence[int], *, graph: bool = True) -> list[Forward]:
    """``EagleDraftWorker.draft`` of ``requests`` (none: an idle DP rank) at their prefilled
    lengths, through the draft graph unless ``graph`` is false; the step forwards it ran."""
    host.requests, host.lens = list(requests), [LENS[r] for r in requests]
    mode = ForwardMode.DECODE if requests else ForwardMode.IDLE
    batch = schedule_batch(host, mode)
    batch.spec_info = draft_input(len(requests))
    if not requests:  # ScheduleBatch.prepare_for_idle (managers/schedule_batch.py)
        batch.out_cache_loc = torch.zeros(0, dtype=torch.int64)
    batch.can_run_decode_cuda_graph = batch.can_run_dp_draft_cuda_graph = graph
    host.draft_model.requests = list(requests)
    forwards = len(host.draft_model.forwards)
    EagleDraftWorker.draft(host.worker, batch)
    return host.draft_model.forwards[forwards:]


def test_draft_graphs_replay_every_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Live drafts of 1, 2 and 3 requests replay the graphs of 2 and 3 requests (1 in the graph
    of 2: one padding request); every step's live rows equal the reference, padding rows output
    0, and the caches equal those of a host that drafted the same requests eagerly, outside
    sglang's padding page."""
    with server(monkeypatch, dp=False):
        graphed, eager = Host(), Host()
        for host in (graphed, eager):
            host.prefill()
        draft_graphs(graphed, monkeypatch)
        views = ReplayViews(graphed)
        for requests in ([0], [1, 2], [2, 0, 1], [1]):
            steps = draft(graphed, requests)
            view = views.views[-1]
            bs = bucket(len(requests))
            assert (view.batch_size, view.num_padding) == (bs, bs - len(requests))
            assert [len(step.rows) for step in steps] == [bs] * (NUM_STEPS - 1)
            assert [step.backend for step in steps] == graphed.draft.attending_backends
            eager_steps = draft(eager, requests, graph=False)
            assert [len(step.rows) for step in eager_steps] == [len(requests)] * (NUM_STEPS - 1)
        assert len(views.views) == 4
        # The capture's runs (two warm-ups and the capture a size) drafted padding only.
        captured = 3 * len(CAPTURE_BS) * (NUM_STEPS - 1)
        assert eager.check() == 1 + 4 * (NUM_STEPS - 1)
        assert graphed.check() == eager.check() + captured
        assert_equal_outside_the_padding_page(graphed, eager)


def test_an_idle_dp_rank_replays_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Data-parallel attention, two ranks: this rank drafts 1 request (the other rank 2 more:
    the graph of 3), then is idle while the other rank drafts 2 (its ``ScheduleBatch`` IDLE, the
    graph of 2 replayed with ``raw_bs = 0``). sglang's runner hands the idle replay a view whose
    ``forward_mode`` is IDLE; the graph replays the DECODE draft steps, so the plan must be 2
    padding requests, not the previous replay's (a GPU graph would write with it). Every step's
    rows are padding, output 0, and nothing outside sglang's padding page changes."""
    with server(monkeypatch, dp=True):
        host = Host(dp=True)
        host.prefill()
        runner = draft_graphs(host, monkeypatch)
        assert runner.require_mlp_tp_gather
        views = ReplayViews(host)
        steps = draft(host, [0])
        assert views.views[-1].batch_size == bucket(1 + DP_EXTRA_REQUESTS) == 3
        assert [len(step.rows) for step in steps] == [3] * (NUM_STEPS - 1)
        assert host.check() == 1 + (3 * len(CAPTURE_BS) + 1) * (NUM_STEPS - 1)
        before = {name: t.clone() for name, (t, _) in state_tensors(host.target).items()}
        idle = draft(host, [])  # the other rank drafts DP_EXTRA_REQUESTS requests
        view = views.views[-1]
        assert view.forward_mode == ForwardMode.IDLE
        assert view.batch_size == view.num_padding == bucket(DP_EXTRA_REQUESTS)
        assert [len(step.rows) for step in idle] == [view.batch_size] * (NUM_STEPS - 1)
        for step in idle:
            check_forward(host.sim, step)
        for backend in host.draft.attending_backends:
            metadata = backend.forward_metadata
            assert metadata is not None and metadata.kind.name == "DECODE"
            assert metadata.swa_out_loc.eq(int(host.pool.full_to_swa[0])).all()
        for name, (now, skip) in state_tensors(host.target).items():
            assert torch.equal(now[skip:], before[name][skip:]), name
