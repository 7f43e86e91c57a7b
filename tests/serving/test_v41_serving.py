"""DeepSeek-V4.1 served by the package's steps (planning, caches, compressors, indexer,
attention) against the model reference ``reference_v41``, request by request: one-shot and
chunked prefills (chunks ending on odd and even positions, so the ratio-2 pair waits in its
ring), decodes, verifies of DSpark's block (5 tokens) whose rejected drafts are overwritten by
the next forward, and two requests in one batch. The dense-cache runs take the torch kernels
(their interpreter twins are compared with them in ``tests/kernels/``); the fp8 runs, the
verifies and the graph buckets run the Triton kernels in the interpreter."""

from __future__ import annotations

import contextlib

import pytest
import torch
from ragged_layouts import ragged_batch

from dsv4_backend.cache.state import AttentionState
from dsv4_backend.kernels.dispatch import TORCH, force_path
from dsv4_backend.planning import GraphMetadataBuffers, PlanWidths, plan
from dsv4_backend.self_check.requests import PagedRequestPool
from dsv4_backend.testing.reference.v41_model import reference_v41
from dsv4_backend.testing.simulation.v41 import TINY_V41_RATIOS as RATIOS
from dsv4_backend.testing.simulation.v41 import V41Model, tiny_v41, v41_inputs

LENGTHS = (150, 97)


Step = tuple[str, list[int], list[int], list[int]]


def _serve(
    fmt: str,
    steps: list[Step],
    *,
    bucket: int | None = None,
    lengths: tuple[int, ...] = LENGTHS,
    **overrides: object,
) -> None:
    """Run ``steps`` (``(kind, requests, first positions, rows per request)``; a verify's
    third list is the committed lengths, its fourth the drafts each request accepts: its rows
    after the accepted ones get other inputs and are not compared; a ``"ragged"`` verify's
    fourth list is each request's verify length, the first request accepting all its drafts,
    the others all but their last) and compare every committed
    row of every layer with the reference. ``bucket``: decodes and verifies are planned into
    CUDA-graph buffers for ``bucket`` requests (padding rows past the batch's); ``lengths``:
    the requests' lengths."""
    config = tiny_v41(**overrides)
    g = torch.Generator().manual_seed(0)
    pool = PagedRequestPool(config, lengths, generator=g)
    model = V41Model(config, [v41_inputs(config, n, seed=i + 1) for i, n in enumerate(lengths)])
    drafts = V41Model(config, [v41_inputs(config, n, seed=i + 7) for i, n in enumerate(lengths)])
    expected = [reference_v41(config, layers) for layers in model.requests]
    state = AttentionState.allocate(
        config, num_full_slots=pool.num_full_slots, num_swa_slots=pool.num_full_slots,
        num_request_slots=pool.num_requests + 1, fmt=fmt,
    )  # fmt: skip
    per_request = max(1, config.num_draft_tokens)
    buffers = GraphMetadataBuffers(
        config, max_batch_size=bucket or 1, max_rows=(bucket or 1) * per_request,
        widths=PlanWidths.for_max_len(pool.max_context), device="cpu",
    )  # fmt: skip
    errors: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {
        layer: [] for layer in range(len(RATIOS))
    }
    for kind, requests, starts, counts in steps:
        stepped, first = model, dict.fromkeys(requests, 1 << 30)
        if kind == "extend":
            view = pool.extend(requests, starts, counts)
            spans = list(zip(requests, starts, counts, strict=True))
        elif kind == "decode":
            view = pool.decode(requests, [s + 1 for s in starts])
            spans = list(zip(requests, starts, counts, strict=True))
        else:  # verify: the anchor and the accepted drafts are committed
            n = int(config.num_draft_tokens)
            if kind == "ragged":  # sglang's compact verify: ``counts`` are the verify lengths
                view, _ = ragged_batch(pool, requests, starts, counts, width=n, slots=bucket)
                spans = list(zip(requests, starts, counts, strict=True))
                # The first request accepts its every draft, the others all but the last.
                accepted = [max(c - 1 - min(i, 1), 0) for i, c in enumerate(counts)]
            else:
                view = pool.verify(requests, starts, n)
                spans = [(r, s, n) for r, s in zip(requests, starts, strict=True)]
                accepted = counts
            first = {r: s + 1 + a for r, s, a in zip(requests, starts, accepted, strict=True)}
            stepped = model.diverging(drafts, [first.get(r, 1 << 30) for r in range(len(lengths))])
        rows = [(r, s + i) for r, s, c in spans for i in range(c)]
        fed: list[tuple[int, int] | None] = list(rows)
        padded = view.num_rows if kind == "ragged" else len(rows)
        if bucket is None or kind == "extend":
            metadata = plan(config, view)
        else:  # a graph replay: the bucket's rows, the padding ones planned with sentinels
            if kind != "ragged":  # (a ragged verify's bucket is its token tier)
                padded = bucket * (per_request if kind == "verify" else 1)
            metadata = buffers.plan(view, num_rows=padded)
        fed += [None] * (padded - len(rows))
        outputs = stepped.forward(state, metadata, view.req_pool_indices, fed)
        keep = torch.tensor([i for i, (r, p) in enumerate(rows) if p < first[r]])
        for layer, out in enumerate(outputs):
            want = torch.stack([expected[r].outputs[layer][p] for r, p in rows])
            errors[layer].append(((out[: len(rows)].float() - want)[keep], want[keep]))
    for layer, pieces in errors.items():
        error = torch.cat([e for e, _ in pieces]).abs()
        want = torch.cat([w for _, w in pieces]).abs()
        if fmt == "dense":
            assert error.max() < 1e-4, (layer, error.max())
        else:  # e4m3 window keys and entries: a few percent, as for DeepSeek-V4
            assert 1e-4 < error.mean() / want.mean() < 0.1, (layer, error.mean() / want.mean())


@pytest.mark.parametrize("fmt", ["dense", "fp8"])
def test_one_shot_prefill_of_two_requests(fmt: str) -> None:
    # fp8: shorter prompts (still past the window and the top-k), the interpreter's fp8 paths
    # cost 3x the dense ones.
    lengths = LENGTHS if fmt == "dense" else (90, 57)
    with force_path(TORCH) if fmt == "dense" else contextlib.nullcontext():
        _serve(fmt, [("extend", [0, 1], [0, 0], list(lengths))], lengths=lengths)


@pytest.mark.usefixtures("torch_path")
def test_chunked_prefill_then_decodes() -> None:
    steps = [
        ("extend", [0], [0], [63]),  # ends on an even position: its pair waits in the ring
        ("extend", [0, 1], [63, 0], [50, 96]),
        ("extend", [0], [113], [30]),
    ]
    steps += [("decode", [0, 1], [143 + i, 96 + i], [1, 1]) for i in range(1)]
    steps += [("decode", [0], [144 + i], [1]) for i in range(6)]
    _serve("dense", steps)


def test_dspark_verifies_with_rejected_drafts() -> None:
    """DSpark's verify of 5 tokens (the anchor and 4 drafts; the pair rings of 8 rows keep them
    all): rejected drafts write caches, rings and index keys that the next forward overwrites
    or never reads, so every committed row equals the reference."""
    steps: list[Step] = [("extend", [0, 1], [0, 0], [100, 61])]
    committed = [100, 61]
    for accepted in ([1, 0], [4, 2], [0, 3], [2, 4]):
        steps.append(("verify", [0, 1], list(committed), accepted))
        committed = [c + a + 1 for c, a in zip(committed, accepted, strict=True)]
    steps.append(("decode", [0, 1], committed, [1, 1]))
    _serve("dense", steps, speculative=True, num_draft_tokens=5)


@pytest.mark.parametrize("bucket", [None, 4], ids=["eager", "graph"])
def test_compact_ragged_verifies(bucket: int | None) -> None:
    """DSpark's compact ragged verifies (each request its own count of the anchor and drafts,
    laid out by sglang's ``RaggedVerifyLayout``; graph: 4 request slots, the padding requests
    taking the token tier's leftover rows), their rejected drafts overwritten or never read:
    every committed row equals the reference. (The torch path, fast: the fused planner's plan
    of a ragged verify is compared with the torch planner's in ``test_ragged_verify.py``,
    and the kernels run as for a static verify.)"""
    steps: list[Step] = [("extend", [0, 1], [0, 0], [100, 61])]
    committed = [100, 61]
    for lens in ([5, 2], [1, 4], [3, 5]):
        steps.append(("ragged", [0, 1], list(committed), lens))
        accepted = [max(n - 1 - min(i, 1), 0) for i, n in enumerate(lens)]
        committed = [c + a + 1 for c, a in zip(committed, accepted, strict=True)]
    steps.append(("decode", [0, 1], committed, [1, 1]))
    with force_path(TORCH):
        _serve("dense", steps, bucket=bucket, speculative=True, num_draft_tokens=5)


@pytest.mark.parametrize("path", ["default", "torch"])
def test_graph_buckets_of_decodes_and_verifies(path: str) -> None:
    """Decodes and DSpark verifies planned into CUDA-graph buffers for 4 requests while 2 run
    (the default planner, the fused one under the interpreter, or the torch planner and
    ``load``): the padding rows write only the padding slots and pool row, so the live rows
    equal the reference, step after step."""
    steps: list[Step] = [("extend", [0, 1], [0, 0], [100, 61])]
    committed = [100, 61]
    for accepted in ([1, 0], [4, 3]):
        steps.append(("verify", [0, 1], list(committed), accepted))
        committed = [c + a + 1 for c, a in zip(committed, accepted, strict=True)]
    steps += [("decode", [0, 1], [c + i for c in committed], [1, 1]) for i in range(3)]
    with force_path(TORCH) if path == "torch" else contextlib.nullcontext():
        _serve("dense", steps, bucket=4, speculative=True, num_draft_tokens=5)
