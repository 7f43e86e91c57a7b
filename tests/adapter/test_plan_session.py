"""The plan's life (``sglang_adapter/plan_session.py``) without a runner: sglang
``ForwardBatch``es of the simulation's pool, read by ``batch_read``, planned by a
``PlanSession`` with the torch planner; the lazy-init contract's cases (no plan, another kind,
a stale plan, a copy matched by value, padding that grows a draft's plan and is refused
elsewhere, pending device checks, the late-layer tail's swap)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ContractError
from dsv4_backend.planning import AttentionMetadata, BatchView, GraphMetadataBuffers, plan
from dsv4_backend.testing.harness import BatchBuilder, forward_batch
from dsv4_backend.testing.simulation import PagedRequestPool

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("torch_path")]

CONFIG = DSV4AttentionConfig.tiny(speculative=True)


def _session(draft_step: bool = False) -> Any:
    from dsv4_backend.sglang_adapter.plan_session import PlanSession

    def planner(view: BatchView, buffers: GraphMetadataBuffers | None) -> AttentionMetadata:
        return plan(CONFIG, view)

    return PlanSession(CONFIG, planner, draft_step=draft_step)


def _pool() -> PagedRequestPool:
    return PagedRequestPool(CONFIG, [200, 90], generator=torch.Generator().manual_seed(0))


def _plan(session: Any, pool: PagedRequestPool, fb: Any) -> AttentionMetadata:
    from dsv4_backend.sglang_adapter.batch_read import read_batch

    read = functools.partial(
        read_batch, fb, req_to_token=pool.req_to_token, full_to_swa=pool.full_to_swa,
        num_draft_tokens=4,
    )  # fmt: skip
    metadata, _ = session.plan(read, None)
    return metadata


def _consumer(fb: Any) -> Any:
    from dsv4_backend.sglang_adapter.batch_read import read_consumer

    return read_consumer(fb)


def test_the_planned_batch_and_an_equal_copy_pass() -> None:
    pool, session = _pool(), _session()
    step = BatchBuilder(pool).decode([0, 1], [150, 60])
    metadata = _plan(session, pool, step.batch)
    assert session.metadata(_consumer(step.batch), 2, "store") is metadata
    copy = BatchBuilder(pool).decode([0, 1], [150, 60]).batch  # another object, equal values
    assert session.metadata(_consumer(copy), 2, "store") is metadata
    assert session.planned.accepted.mismatch(**_consumer(copy).objects) is None  # now accepted


def test_no_plan_another_kind_and_a_stale_plan_are_refused() -> None:
    pool, session = _pool(), _session()
    builder = BatchBuilder(pool)
    decode = builder.decode([0, 1], [150, 60]).batch
    with pytest.raises(ContractError, match="no attention metadata was planned"):
        session.metadata(_consumer(decode), 2, "forward")
    _plan(session, pool, decode)
    extend = builder.extend([0], [0], [40]).batch
    with pytest.raises(ContractError, match="planned for DECODE but the batch is EXTEND"):
        session.metadata(_consumer(extend), 40, "forward")
    other = builder.decode([0, 1], [151, 60]).batch
    with pytest.raises(ContractError, match=r"another batch: it was planned with seq_lens_cpu="):
        session.metadata(_consumer(other), 2, "forward")
    decode.seq_lens.add_(1)  # the planned batch written in place after planning
    with pytest.raises(ContractError, match="was made for another batch"):
        session.metadata(_consumer(decode), 2, "forward")


def test_padding_grows_a_draft_steps_plan_and_is_refused_elsewhere() -> None:
    """sglang pads a draft step's batch for data-parallel sync after planning it: the plan
    grows by padding requests (no write, output 0). A decode backend's batch is planned after
    padding, so the same growth there is a stale plan."""
    pool = _pool()
    for draft_step in (True, False):
        session = _session(draft_step=draft_step)
        view = pool.decode([0, 1], [150, 60])
        fb = forward_batch(view, [(0, 149), (1, 59)]).batch
        metadata = _plan(session, pool, fb)
        padded = forward_batch(pool.pad_requests(view, 2), [(0, 149), (1, 59)]).batch
        padded.batch_size = 4
        if draft_step:
            grown = session.metadata(_consumer(padded), 4, "forward")
            assert (grown.batch_size, grown.num_rows) == (4, 4) and grown is not metadata
            assert session.forward_metadata is grown
        else:
            with pytest.raises(ContractError, match="batch_size"):
                session.metadata(_consumer(padded), 4, "forward")


class _Pending:
    """A device-side check whose verdict reaches the host when ``ready``."""

    def __init__(self, failed: bool) -> None:
        self.failed, self.is_ready = failed, False

    def ready(self) -> bool:
        return self.is_ready

    def raise_if_failed(self) -> None:
        if self.failed:
            raise BatchError("out_cache_loc[3]=99999 is past the cache (a stand-in)")


def test_pending_checks_are_raised_at_the_next_plan_once_ready() -> None:
    """A device-side verdict not on the host yet is kept; the first plan after it arrives
    raises it (before planning), and drops the verdicts that arrived with it."""
    pool = _pool()
    failing, later = _Pending(failed=True), _Pending(failed=False)
    attached = [failing, later]
    session = _session()
    planner = session.planner
    session.planner = lambda view, buffers: dataclasses.replace(
        planner(view, buffers), pending_checks=attached.pop(0) if attached else None
    )
    builder = BatchBuilder(pool)
    _plan(session, pool, builder.decode([0, 1], [150, 60]).batch)
    second = _plan(session, pool, builder.decode([0, 1], [151, 61]).batch)  # not ready: kept
    assert session.pending_checks == [failing, later]
    failing.is_ready = True
    with pytest.raises(BatchError, match="a stand-in"):
        _plan(session, pool, builder.decode([0, 1], [152, 62]).batch)
    assert session.forward_metadata is second  # raised before the next plan replaced it
    assert session.pending_checks == [later]  # not ready: still kept
    later.is_ready = True
    session.raise_pending_checks()
    assert session.pending_checks == []


def test_a_batch_that_cannot_be_read_leaves_no_plan() -> None:
    pool, session = _pool(), _session()
    fb = BatchBuilder(pool).decode([0, 1], [150, 60]).batch
    _plan(session, pool, fb)

    def unreadable() -> Any:
        raise BatchError("seq_lens[0]=0; expected >= 1 (a stand-in)")

    with pytest.raises(BatchError, match="a stand-in"):
        session.plan(unreadable, None)
    assert session.forward_metadata is None and session.planned is None
    with pytest.raises(ContractError, match="no attention metadata was planned"):
        session.metadata(_consumer(fb), 2, "forward")


def test_the_tail_is_entered_once_and_restored() -> None:
    pool, session = _pool(), _session()
    fb = BatchBuilder(pool).extend([0], [0], [150]).batch
    metadata = _plan(session, pool, fb)
    with pytest.raises(ContractError, match="no late-layer tail was planned"):
        session.enter_tail()
    tail_plan = plan(CONFIG, pool.extend([0], [22], [128]))
    tail = type("Tail", (), {"metadata": tail_plan, "cp_read": None})()
    session.add_tail(tail)
    saved = session.enter_tail()
    assert session.forward_metadata is tail_plan and session.in_tail
    with pytest.raises(ContractError, match="or the tail is entered already"):
        session.enter_tail()
    session.tail_source_kv_layer_id = 1
    session.exit_tail(saved)
    assert session.forward_metadata is metadata and not session.in_tail
    assert session.tail_source_kv_layer_id is None
