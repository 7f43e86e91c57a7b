"""The backend driven by sglang 0.5.23's own host code on the CPU: the eager runner's copy of
every batch, and the EAGLE v2 worker's draft, verify and draft-extend flows.

What runs is sglang's (called, not re-implemented):

* ``EagerRunner.__init__`` (its input registry, ``build_eager_registry``), ``load_batch``
  (``CudaGraphBufferRegistry.fill_from`` / ``extract_buffer``, or ``dataclasses.replace`` with
  ``SGLANG_EAGER_INPUT_NO_COPY``), ``execute`` -> ``_execute_decode`` / ``_execute_extend`` /
  ``_execute_idle`` (model_executor/runner/eager_runner.py);
* ``ModelRunner.forward`` -> ``_forward_raw`` -> ``_prepare_eager_forward_batch`` ->
  ``ForwardBatch.prepare_mlp_sync_batch`` / ``_pad_inputs_to_size`` (data-parallel padding) and
  ``post_forward_mlp_sync_batch`` (model_executor/model_runner.py, forward_batch_info.py), on a
  ``ModelRunner`` made with ``__new__`` and given the attributes those read;
* ``EagleDraftWorker.draft`` / ``draft_forward`` / ``_draft_extend_for_decode``
  (speculative/eagle_worker_v2.py), ``prepare_for_draft`` / ``prepare_for_draft_extend``
  (speculative/eagle_worker_common.py), ``eagle_prepare_for_verify`` (speculative/eagle_utils.py),
  ``TpModelWorker.forward_batch_generation`` (managers/tp_worker.py), each called unbound with a
  namespace ``self`` holding what it reads; ``ForwardBatch.init_mlp_sync_metadata``.

The host around them and its stand-ins (``init_new``, ``schedule_batch``,
``build_eagle_verify_input``, the model) are ``eagle_host.py``'s.

Verdicts: every real row of every forward equals the full causal pass (dense caches, torch path);
padding rows output 0 and write nothing outside sglang's padding page (slot 0, pool row 0: a
data-parallel host's caches and rings equal an unpadded host's elsewhere); a plan handed another
batch (other values in the same shapes, a copy refilled by the next batch, the planned tensors
written in place) is refused with ``ContractError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from eagle_host import (
    KEPT,
    LENS,
    NUM_DRAFT,
    NUM_STEPS,
    TOPK,
    Host,
    assert_equal_outside_the_padding_page,
    check_forward,
    draft_input,
    eagle_server,
    execute,
    install_worker_stand_ins,
    schedule_batch,
    state_tensors,
    sync_metadata,
)
from sglang.srt.environ import envs
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.forward_context import (
    ForwardContext,
    forward_context,
)
from sglang.srt.speculative import eagle_worker_v2
from sglang.srt.speculative.eagle_utils import (
    per_step_draft_out_cache_loc,
)
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

from dsv4_backend.errors import ContractError
from dsv4_backend.testing import harness

pytestmark = pytest.mark.sglang


@pytest.fixture(autouse=True)
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-rank CPU EAGLE server without CUDA graphs (``eagle_server``)."""
    with eagle_server(monkeypatch):
        yield


@pytest.fixture
def worker_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """``init_new`` and ``build_eagle_verify_input`` replaced where the worker calls them."""
    install_worker_stand_ins(monkeypatch)


COPY_MODES = [pytest.param(False, id="copy"), pytest.param(True, id="no-copy")]


@contextlib.contextmanager
def eager_input_mode(no_copy: bool) -> Iterator[None]:
    """``SGLANG_EAGER_INPUT_NO_COPY``: ``load_batch`` returns ``dataclasses.replace(fb)``.
    (Restored even when the body raises: sglang's ``EnvField.override`` does not.)"""
    flag = envs.SGLANG_EAGER_INPUT_NO_COPY
    saved = os.environ.get(flag.name)
    flag.set(no_copy)
    try:
        yield
    finally:
        if saved is None:
            flag.clear()
        else:
            os.environ[flag.name] = saved


# ------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("no_copy", COPY_MODES)
def test_load_batch_hands_over_a_copy_in_the_eager_registry(no_copy: bool) -> None:
    """``EagerRunner.load_batch``: a new ``ForwardBatch`` (``extract_buffer``'s
    ``dataclasses.replace``) whose tensors are the registry's buffers holding the batch's
    values; with ``SGLANG_EAGER_INPUT_NO_COPY``, ``dataclasses.replace(fb)`` (same tensors)."""
    host = Host()
    step = host.batches.decode(host.requests, host.lens)
    fb = step.batch
    registry = host.target_runner.eager_runner._eager_registry
    with eager_input_mode(no_copy):
        copy = host.target_runner.eager_runner.load_batch(fb)
    assert copy is not fb and copy.batch_size == fb.batch_size
    for name in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc", "positions"):
        got, want = getattr(copy, name), getattr(fb, name)
        assert torch.equal(got, want), name
        buffer = registry.get_slot(name).buffer
        if no_copy:
            assert got is want, name
        else:
            assert got is not want and got.data_ptr() == buffer.data_ptr(), name


@pytest.mark.parametrize("no_copy", COPY_MODES)
@pytest.mark.parametrize("mode", ["decode", "extend", "draft_extend"])
def test_a_marked_batch_reaches_the_backend_as_the_eager_runners_copy(
    mode: str, no_copy: bool
) -> None:
    """Planned and marked ready, then ``EagerRunner.execute`` (``_execute_decode`` /
    ``_execute_extend``): not re-planned (``needs_forward_metadata_init()`` is False), the model
    gets ``load_batch``'s copy, and every consumer accepts the plan of the original for it."""
    host = Host()
    host.prefill()
    if mode == "decode":
        step = host.batches.decode(host.requests, [n + 1 for n in host.lens])
    elif mode == "extend":  # a chunked prefill: the next chunk of each request
        step = host.batches.extend(host.requests, host.lens, [6, 20, 3])
    else:
        step = host.batches.draft_extend(host.requests, host.lens, NUM_DRAFT)
    runner, model = host.target_runner, host.target_model
    if mode == "draft_extend":
        runner, model = host.draft_runner, host.draft_model
    fb = step.batch
    runner.attn_backend.init_forward_metadata(fb)
    fb.mark_forward_metadata_ready()
    plans = len(host.plans)
    model.requests = [row[0] for row in step.rows]
    with eager_input_mode(no_copy):
        execute(runner, fb)
    assert len(host.plans) == plans  # marked: not re-planned
    record = model.forwards[-1]
    assert record.batch is not fb and record.backend is runner.attn_backend
    for name in KEPT:
        assert torch.equal(record.values[name], getattr(fb, name)), name
        assert (getattr(record.batch, name) is getattr(fb, name)) == no_copy, name
    check_forward(host.sim, record)


@pytest.mark.parametrize("no_copy", COPY_MODES)
def test_eagle_v2_rounds_through_sglangs_worker(no_copy: bool, worker_stand_ins: None) -> None:
    """Prefill, then two EAGLE v2 rounds (all drafts accepted; then rejections) and a decode
    each, through sglang's worker and runner code; a second host does the same padded by
    data-parallel sync. Every real row matches; padding rows output 0 and write nothing outside
    sglang's padding page."""
    hosts = [Host(), Host(dp=True)]
    with eager_input_mode(no_copy):
        for host in hosts:
            host.prefill()
            host.round([NUM_DRAFT] * len(LENS))
            host.round([2, 1, 4])
    plain, padded = hosts
    assert plain.lens == padded.lens == [124 + 5 + 3, 250 + 5 + 2, 7 + 5 + 5]
    # prefill; per round: 2 draft steps, verify, draft extend, decode.
    assert plain.check() == padded.check() == 1 + 2 * 5
    padding = [r for r in padded.forwards if any(row is None for row in r.rows)]
    assert len(padding) == 1 + 2 * 5
    for record in plain.forwards:
        assert all(row is not None for row in record.rows)
    assert_equal_outside_the_padding_page(padded, plain)


def test_draft_steps_hand_each_step_its_backend_and_slots(worker_stand_ins: None) -> None:
    """``EagleDraftWorker.draft``: the draft batch planned by the multi-step backend and marked;
    ``draft_forward`` publishes step ``i``'s backend and ``per_step_draft_out_cache_loc(...)[i]``,
    and the eager runner's copy reaches the model with them (positions advanced in place)."""
    host = Host()
    host.prefill()
    bs = len(host.requests)
    batch = schedule_batch(host, ForwardMode.DECODE)
    batch.spec_info = draft_input(bs)
    host.draft_model.requests = list(host.requests)
    EagleDraftWorker.draft(host.worker, batch)
    whole = host.pool.draft_out_cache_loc(host.requests, host.lens, NUM_STEPS)
    assert torch.equal(batch.out_cache_loc, whole)  # sglang's assign kernel: the harness slots
    per_step = per_step_draft_out_cache_loc(whole, bs, TOPK, NUM_STEPS)
    steps = host.draft_model.forwards
    assert len(steps) == NUM_STEPS - 1
    for i, record in enumerate(steps):
        assert record.backend is host.draft.attn_backends[i]
        assert torch.equal(record.values["out_cache_loc"], per_step[i])
        assert [row[1] for row in record.rows] == [n + i for n in host.lens]
        check_forward(host.sim, record)


@pytest.mark.parametrize("padded", [True, False], ids=["dp-padded", "unpadded"])
def test_an_idle_rank(padded: bool) -> None:
    """``EagerRunner._execute_idle``: an IDLE batch grown by data-parallel padding is copied and
    re-planned (every consumer writes nothing and outputs 0); an unpadded one drops the stale
    plan (``forward_metadata = None``)."""
    host = Host()
    host.prefill()
    before = {name: t.clone() for name, (t, _) in state_tensors(host.target).items()}
    empty = torch.zeros(0, dtype=torch.int64)
    fb = ForwardBatch(
        forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=empty, req_pool_indices=empty,
        seq_lens=empty, seq_lens_cpu=empty, seq_lens_sum=0, out_cache_loc=empty,
        positions=empty,
    )  # fmt: skip
    if padded:
        sync_metadata(fb, [3])
    host.target_model.requests = []
    plans = len(host.plans)
    host.target_runner.forward(fb)
    record = host.target_model.forwards[-1]
    metadata = host.target.forward_metadata
    if padded:
        assert host.planned(plans) == [(host.target, record.batch)] and record.batch is not fb
        assert record.batch.batch_size == 3 and len(record.rows) == 3
        assert metadata is not None and metadata.kind.name == "IDLE"
        assert all(out.abs().max() == 0 for out in record.outputs.values())
    else:
        assert host.planned(plans) == [] and record.batch is fb
        assert metadata is None and len(record.rows) == 0
    after = state_tensors(host.target)
    assert all(torch.equal(before[name], t) for name, (t, _) in after.items())


# ----------------------------------------------------------------------------- refusals
def planned_decode(host: Host) -> harness.Step:
    """A decode batch planned by the target backend and marked ready (a pre-planned batch)."""
    step = host.batches.decode(host.requests, [n + 1 for n in host.lens])
    host.target.init_forward_metadata(step.batch)
    step.batch.mark_forward_metadata_ready()
    host.target_model.requests = list(host.requests)
    return step


@pytest.mark.parametrize("no_copy", COPY_MODES)
@pytest.mark.parametrize("other", ["seq_lens", "req_pool_indices"])
def test_a_plan_is_refused_for_another_batch_of_the_same_shapes(other: str, no_copy: bool) -> None:
    """Plan batch A; ``EagerRunner.execute`` of a marked batch B of A's shapes hands B's copy
    to A's plan: refused. B: the next step's lengths, or A's lengths and slots with the first
    two requests' pool rows swapped (only ``req_pool_indices`` differs)."""
    host = Host()
    host.prefill()
    planned_decode(host)
    lens = [n + 1 for n in host.lens]
    if other == "seq_lens":
        b = host.batches.decode(host.requests, [n + 1 for n in lens])
    else:
        b = host.batches.decode(host.requests, lens)
        b.batch.req_pool_indices = b.batch.req_pool_indices[[1, 0, 2]].contiguous()
    b.batch.mark_forward_metadata_ready()
    with eager_input_mode(no_copy), pytest.raises(ContractError, match="made for another batch"):
        execute(host.target_runner, b.batch)


@pytest.mark.parametrize("no_copy", COPY_MODES)
def test_the_planned_batch_written_in_place_is_refused(no_copy: bool) -> None:
    """Plan A, then write its ``seq_lens`` in place before ``EagerRunner.execute``: the copy
    (or, without copying, the same tensor) no longer holds what was planned: refused."""
    host = Host()
    host.prefill()
    step = planned_decode(host)
    step.batch.seq_lens.add_(1)
    step.batch.seq_lens_cpu.add_(1)
    with eager_input_mode(no_copy), pytest.raises(ContractError) as refused:
        execute(host.target_runner, step.batch)
    assert "seq_lens" in str(refused.value)


def test_a_copy_refilled_by_the_next_batch_is_refused() -> None:
    """The eager registry is one set of buffers (shared process-wide, ``share_input_buffer``):
    A's copy holds B's values once ``load_batch(B)`` ran. A's plan handed A's copy then: refused."""
    host = Host()
    host.prefill()
    a = planned_decode(host)
    runner = host.target_runner.eager_runner
    copy_a = runner.load_batch(a.batch)
    b = host.batches.decode(host.requests, [n + 2 for n in host.lens])
    runner.load_batch(b.batch)
    assert torch.equal(copy_a.seq_lens, b.batch.seq_lens)  # refilled in place
    with (
        forward_context(ForwardContext(attn_backend=host.target), forward_batch=copy_a),
        pytest.raises(ContractError, match="made for another batch"),
    ):
        host.target_model.forward(copy_a.input_ids, copy_a.positions, copy_a)


def test_no_copy_mode_is_dataclasses_replace() -> None:
    """``SGLANG_EAGER_INPUT_NO_COPY``: ``load_batch`` is ``dataclasses.replace(fb)`` exactly."""
    host = Host()
    fb = host.batches.decode(host.requests, host.lens).batch
    with eager_input_mode(True):
        copy = host.target_runner.eager_runner.load_batch(fb)
    for item in dataclasses.fields(fb):
        assert getattr(copy, item.name) is getattr(fb, item.name), item.name


def test_sglangs_worker_batches_are_the_harness_layouts(worker_stand_ins: None) -> None:
    """The batches sglang's worker functions build (``prepare_for_draft``'s slots from its
    ``assign_draft_cache_locs_contiguous`` kernel, ``eagle_prepare_for_verify``,
    ``prepare_for_draft_extend``; with the ``init_new`` stand-in) hold what the harness's
    ``BatchBuilder`` lays out for the same round (the layouts every other CPU test uses), and
    the verify slots of sglang's ``assign_extend_cache_locs_uniform`` kernel are the harness's."""
    host = Host()
    host.prefill()
    plans = len(host.plans)
    host.round([2, 3, 1])
    draft, verify, extend = (host.plans[plans + i] for i in (0, NUM_STEPS - 1, NUM_STEPS))
    lens, builder = list(LENS), host.batches
    expected = [
        (draft, builder.draft(host.requests, lens, NUM_STEPS).batch),
        (verify, builder.verify(host.requests, lens, NUM_DRAFT).batch),
        (extend, builder.draft_extend(host.requests, lens, NUM_DRAFT).batch),
    ]
    for plan, want in expected:
        mode = plan.batch.forward_mode
        assert mode == want.forward_mode, mode
        for name, got in plan.values.items():
            assert torch.equal(got.long(), getattr(want, name).long()), (mode.name, name)
    assert extend.batch.extend_seq_lens_cpu == [NUM_DRAFT] * len(LENS)
    assert extend.batch.extend_prefix_lens_cpu == lens


def test_a_draft_step_handed_another_steps_slots_is_refused(
    worker_stand_ins: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host bug: ``draft_forward`` handing step ``i`` the slots of step ``n - 1 - i`` (its
    ``per_step_draft_out_cache_loc`` reversed). Step 0's plan refuses the copy."""
    host = Host()
    host.prefill()

    def reversed_steps(*args: Any) -> torch.Tensor:
        return per_step_draft_out_cache_loc(*args).flip(0)

    monkeypatch.setattr(eagle_worker_v2, "per_step_draft_out_cache_loc", reversed_steps)
    bs = len(host.requests)
    batch = schedule_batch(host, ForwardMode.DECODE)
    batch.spec_info = draft_input(bs)
    host.draft_model.requests = list(host.requests)
    with pytest.raises(ContractError, match="made for another batch") as refused:
        EagleDraftWorker.draft(host.worker, batch)
    assert "out_cache_loc" in str(refused.value)
    assert not host.draft_model.forwards[-1].outputs  # refused at its first consumer
