"""DeepSeek-V4.1 served by the package's steps (planning, caches, compressors, indexer,
attention) against the model reference ``reference_v41``, request by request: one-shot and
chunked prefills (chunks ending on odd and even positions, so the ratio-2 pair waits in its
ring), decodes, and two requests in one batch."""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.cache.state import AttentionState
from dsv4_backend.planning import plan
from dsv4_backend.testing.reference.v41_model import reference_v41
from dsv4_backend.testing.simulation.pool import PagedRequestPool
from dsv4_backend.testing.simulation.v41 import TINY_V41_RATIOS as RATIOS
from dsv4_backend.testing.simulation.v41 import V41Model, tiny_v41, v41_inputs

LENGTHS = (150, 97)


def _serve(fmt: str, steps: list[tuple[str, list[int], list[int], list[int]]]) -> None:
    config = tiny_v41()
    g = torch.Generator().manual_seed(0)
    pool = PagedRequestPool(config, LENGTHS, generator=g)
    model = V41Model(config, [v41_inputs(config, n, seed=i + 1) for i, n in enumerate(LENGTHS)])
    expected = [reference_v41(config, layers) for layers in model.requests]
    state = AttentionState.allocate(
        config, num_full_slots=pool.num_full_slots, num_swa_slots=pool.num_full_slots,
        num_request_slots=pool.num_requests + 1, fmt=fmt,
    )  # fmt: skip
    errors: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {
        layer: [] for layer in range(len(RATIOS))
    }
    for kind, requests, starts, counts in steps:
        if kind == "extend":
            view = pool.extend(requests, starts, counts)
        else:
            view = pool.decode(requests, [s + 1 for s in starts])
        rows = [
            (r, s + i) for r, s, c in zip(requests, starts, counts, strict=True) for i in range(c)
        ]
        metadata = plan(config, view)
        outputs = model.forward(state, metadata, view.req_pool_indices, rows)
        for layer, out in enumerate(outputs):
            want = torch.stack([expected[r].outputs[layer][p] for r, p in rows])
            errors[layer].append((out.float() - want, want))
    for layer, pieces in errors.items():
        error = torch.cat([e for e, _ in pieces]).abs()
        want = torch.cat([w for _, w in pieces]).abs()
        if fmt == "dense":
            assert error.max() < 1e-4, (layer, error.max())
        else:  # e4m3 window keys and entries: a few percent, as for DeepSeek-V4
            assert 1e-4 < error.mean() / want.mean() < 0.1, (layer, error.mean() / want.mean())


@pytest.mark.parametrize("fmt", ["dense", "fp8"])
def test_one_shot_prefill_of_two_requests(fmt: str) -> None:
    _serve(fmt, [("extend", [0, 1], [0, 0], list(LENGTHS))])


def test_chunked_prefill_then_decodes() -> None:
    steps = [
        ("extend", [0], [0], [63]),  # ends on an even position: its pair waits in the ring
        ("extend", [0, 1], [63, 0], [50, 96]),
        ("extend", [0], [113], [30]),
    ]
    steps += [("decode", [0, 1], [143 + i, 96 + i], [1, 1]) for i in range(1)]
    steps += [("decode", [0], [144 + i], [1]) for i in range(6)]
    _serve("dense", steps)
