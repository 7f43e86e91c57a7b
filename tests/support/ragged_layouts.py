"""sglang's compact ragged verify as its own layout builders lay it out, over a
``PagedRequestPool``: a test helper, not a test."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout

from dsv4_backend.planning import BatchView
from dsv4_backend.self_check.requests import PagedRequestPool
from dsv4_backend.testing import harness


def token_tiers(max_slots: int, width: int) -> list[int]:
    """sglang's token tiers of capture sizes ``1 ... max_slots`` (``DecodeCudaGraphRunner.
    _build_ragged_verify_token_buckets``: each capture size times the verify width)."""
    return [bs * width for bs in range(1, max_slots + 1)]


def ragged_batch(
    pool: PagedRequestPool,
    requests: Sequence[int],
    seq_lens: Sequence[int],
    verify_lens: Sequence[int],
    *,
    width: int,
    slots: int | None,
) -> tuple[BatchView, RaggedVerifyLayout]:
    """The ragged verify sglang hands the backend, and its layout: the layout from sglang's
    ``RaggedVerifyLayout.from_verify_lens`` over the tiers of ``width`` tokens a request, then
    the batch of ``slots`` requests (a graph's capture slots; None: the live requests only, as
    eager), the padding requests' rows from sglang's ``padded_to_bucket``."""
    grid = token_tiers(slots or len(requests), width)
    layout = RaggedVerifyLayout.from_verify_lens(
        verify_lens_cpu=list(verify_lens), device=torch.device("cpu"), grid=grid
    )
    padding: list[int] = []
    if slots is not None and slots > len(requests):
        padding = layout.padded_to_bucket(padded_bs=slots).verify_lens.tolist()[len(requests) :]
    view = pool.ragged_verify(
        requests, seq_lens, verify_lens, layout.graph_num_tokens, padding=padding
    )
    return view, layout


def ragged_step(
    view: BatchView, layout: RaggedVerifyLayout, rows: Sequence[tuple[int, int]], width: int
) -> harness.Step:
    """The live ``ForwardBatch`` of a ragged ``view`` whose requests' rows are ``rows``: the
    tier's leftover rows at position 0 (as sglang's ``build_ragged_verify_window`` lays them
    out; ``None`` rows of the step), the layout carried by sglang's ``DFlashVerifyInput``."""
    padding = view.num_rows - len(rows)
    step = harness.forward_batch(view, [*rows, *[(0, 0)] * padding])
    step.batch.capture_hidden_mode = CaptureHiddenMode.NULL
    step.batch.spec_info = DFlashVerifyInput(
        draft_token=step.batch.input_ids, positions=step.batch.positions,
        draft_token_num=width, custom_mask=None, capture_hidden_mode=CaptureHiddenMode.NULL,
        ragged_verify_layout=layout,
    )  # fmt: skip
    return harness.Step(step.batch, [*rows, *[None] * padding])
