"""The planning checks of window slots and of every slot a plan reads from ``req_to_token``:
the same typed error (``BatchError`` naming the value and the range) on the torch path and
on the fused Triton path (interpreter), read at once or deferred (a GPU without strict mode),
and a deferred failure keeps the request from writing."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.planning import BatchView, checks, plan
from dsv4_backend.testing.simulation import PagedRequestPool

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
PAGE = CONFIG.page_size
PATHS = ("torch", "triton-interpreter")


def sized(view: BatchView, pool: PagedRequestPool) -> BatchView:
    """``view`` with the slot counts a backend over ``pool`` plans with (full and window
    slots as sglang sizes its buffers: ``size + 256``)."""
    return dataclasses.replace(
        view, num_cache_slots=pool.full_size + PAGE, num_swa_slots=pool.swa_size + PAGE
    )


@pytest.fixture
def pool() -> PagedRequestPool:
    return PagedRequestPool(CONFIG, [300, 40], generator=torch.Generator().manual_seed(0))


def corrupt_window_map(pool: PagedRequestPool, position: int) -> BatchView:
    """A decode of request 0 at position 200 (and of request 1 at 29) whose window map sends
    request 0's full slot of ``position`` past the window cache."""
    full_to_swa = pool.full_to_swa.clone()
    full_to_swa[pool.slots(0, [position])] = pool.swa_size + PAGE
    view = pool.decode([0, 1], [201, 30])
    return sized(dataclasses.replace(view, full_to_swa=full_to_swa), pool)


@pytest.mark.parametrize("path", PATHS)
def test_a_write_mapped_past_the_window_cache_is_refused(pool: PagedRequestPool, path: str) -> None:
    batch = corrupt_window_map(pool, 200)  # the decoded row's own slot
    limit = pool.swa_size + PAGE
    message = f"is window slot {limit} (full_to_swa); expected a window-cache slot in [0, {limit})"
    with force_path(path), pytest.raises(BatchError, match=re.escape(message)):
        plan(CONFIG, batch)


@pytest.mark.parametrize("path", PATHS)
def test_a_window_key_mapped_past_the_window_cache_is_refused(
    pool: PagedRequestPool, path: str
) -> None:
    batch = corrupt_window_map(pool, 150)  # 50 positions back: inside the window
    limit = pool.swa_size + PAGE
    message = (
        f"request 0: the window key at position 150 is window slot {limit} (full_to_swa); "
        f"expected a window-cache slot in [0, {limit})"
    )
    with force_path(path), pytest.raises(BatchError, match=re.escape(message)):
        plan(CONFIG, batch)


def test_a_window_key_outside_the_window_is_not_read(pool: PagedRequestPool) -> None:
    """Position 50 is 150 back from the decoded row: outside the window, never read."""
    plan(CONFIG, corrupt_window_map(pool, 50))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("position", [100, 0], ids=["window-key", "page-table"])
def test_a_slot_past_the_full_cache_in_req_to_token_is_refused(
    pool: PagedRequestPool, path: str, position: int
) -> None:
    """A window key 100 back from the row, or the first slot of a page-table page: both are
    read by the plan, so both are range-checked."""
    view = sized(pool.decode([0], [201]), pool)
    req_to_token = view.req_to_token.clone()
    req_to_token[pool.pool_index(0), position] = pool.full_size + PAGE
    batch = dataclasses.replace(view, req_to_token=req_to_token)
    with force_path(path), pytest.raises(BatchError) as refused:
        plan(CONFIG, batch)
    assert (
        f"request 0: req_to_token holds slot {pool.full_size + PAGE} at position {position}, "
        "which the plan reads" in str(refused.value)
    )


def test_deferred_window_checks_agree_and_keep_the_request_from_writing(
    pool: PagedRequestPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deferred (a GPU without strict mode), both paths plan the failing request as writing
    nothing and hand back the same verdict; the other request is planned as usual."""
    monkeypatch.setattr(checks, "defer_checks", lambda device: True)
    batch = corrupt_window_map(pool, 150)
    verdicts, writes = [], []
    for path in PATHS:
        with force_path(path):
            metadata = plan(CONFIG, batch)
        writes.append(metadata.swa_out_loc.tolist())
        assert metadata.pending_checks is not None
        with pytest.raises(BatchError, match="window key at position 150") as raised:
            metadata.pending_checks.raise_if_failed()
        verdicts.append(str(raised.value))
    assert verdicts[0] == verdicts[1]
    assert writes[0] == writes[1]
    assert writes[0][0] == -1 and writes[0][1] == int(pool.full_to_swa[pool.slots(1, [29])])
