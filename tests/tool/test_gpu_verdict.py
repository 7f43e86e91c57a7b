"""The GPU check's verdict (``tools/gpu_verdict.py``) on the CPU: it passes the kernels in the
interpreter with fp8 caches and bf16 queries and a bf16-rounded indexer whose selections differ
from the exact ones at near ties, and it catches an injected attention bug, store bug and wrong
top-k, each in the step that made it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_backend.kernels import dispatch
from dsv4_backend.self_check import bounds
from dsv4_backend.self_check import judge as jm
from dsv4_backend.tools import gpu_verdict as gv

BF16 = torch.bfloat16


def _failed_steps(judge: jm.StepwiseJudge) -> set[str]:
    return {f.step for f in judge.findings if not f.passed}


def _run(judge: jm.StepwiseJudge, schedule: jm.Schedule = jm.FULL_SCHEDULE) -> jm.StepwiseJudge:
    for mode, batch in schedule.batches(judge.model.pool):
        judge.forward(batch, mode)
    return judge


def test_score_bound_covers_bf16_operands() -> None:
    """Scores from bf16-rounded q, weights and keys stay within the bound of the fp64 score,
    and use a fair part of it (the bound is not vacuous)."""
    g = torch.Generator().manual_seed(1)
    q, w, k = torch.randn(30, 4, 64, generator=g), torch.rand(30, 4, generator=g), None
    k = torch.randn(30, 50, 64, generator=g)

    def score(q, w, k, dtype):
        dots = torch.einsum("thd,tnd->thn", q.to(dtype), k.to(dtype)).relu()
        return torch.einsum("th,thn->tn", w.to(dtype), dots)

    rounded = score(q.to(BF16).float(), w.to(BF16).float(), k.to(BF16).float(), torch.float32)
    exact = score(q, w, k, torch.float64)
    error = (rounded.double() - exact).abs()
    bound = bounds.score_bound(q, w, k, BF16).double()
    assert (error <= bound).all()
    assert (error / bound).max() > 0.05
    assert (bounds.score_bound(q, w, k, torch.float32) < bound / 100).all()


@given(st.integers(0, 2**31 - 1), st.integers(1, 12), st.integers(0, 30))
def test_check_selection(seed: int, topk: int, num: int) -> None:
    """The exact top-k passes; so does a swap across the boundary within the bounds; a swap
    beyond them, a missing, duplicate or foreign entry fails."""
    g = torch.Generator().manual_seed(seed)
    width = 32
    scores = torch.randn(1, width, generator=g)
    candidates = torch.where(torch.arange(width) < num, torch.arange(width) + 100, -1)[None]
    keep = min(topk, num)
    order = torch.sort(torch.where(candidates >= 0, scores, -math.inf), descending=True).indices
    selected = torch.full((1, topk), -1)
    selected[0, :keep] = candidates[0, order[0, :keep]]
    tight = torch.full_like(scores, 1e-9)
    assert bounds.check_selection(selected, candidates, scores, tight, topk) == (0.0, "")
    if keep:
        twice = selected.clone()
        twice[0, keep - 1] = twice[0, 0] if keep > 1 else 7
        assert bounds.check_selection(twice, candidates, scores, tight, topk)[0] == math.inf
        short = selected.clone()
        short[0, keep - 1] = -1
        assert bounds.check_selection(short, candidates, scores, tight, topk)[0] == math.inf
    if num > topk:  # swap the last kept entry for the first dropped one
        swapped = selected.clone()
        swapped[0, keep - 1] = candidates[0, order[0, keep]]
        gap = float(scores[0, order[0, keep - 1]] - scores[0, order[0, keep]])
        loose = torch.full_like(scores, gap / 2 + 1e-6)
        assert bounds.check_selection(swapped, candidates, scores, loose, topk) == (0.0, "")
        if gap > 1e-6:
            excess, detail = bounds.check_selection(swapped, candidates, scores, tight, topk)
            assert excess > 1 and "row 0" in detail


def test_interpreter_kernels_pass_with_fp8_caches_and_bf16_queries() -> None:
    """Every step of every mode, the Triton kernels in the interpreter against the torch path."""
    judge = gv.judge_serving_modes(
        "cpu",
        dispatch.TRITON_INTERPRETER,
        schedule=jm.SHORT_SCHEDULE,
        fmt="fp8",
        query_dtype=BF16,
    )
    steps = {f.step for f in judge.findings}
    assert {"plan", "window-store", "indexer-scores", "indexer-selection", "attention"} <= steps
    assert {"indexer-keys cache", "compressor entries", "compressor rings"} <= steps
    assert judge.passed, [f for f in judge.findings if not f.passed]


def test_stores_of_the_interpreter_kernels_equal_the_torch_bytes() -> None:
    findings = jm.judge_stores("cpu", dispatch.TRITON_INTERPRETER)
    assert len(findings) == 20 and all(f.passed for f in findings), findings
    assert [f.mode for f in findings if "fp4" in f.mode] == [
        f"indexer-fp4-{fmt} {dtype} rows"
        for fmt in ("dense", "fp8")
        for dtype in ("float32", "bfloat16")
    ]


def _bf16_indexer(judge: jm.StepwiseJudge, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the state under test select from bf16-rounded queries and keys (a GPU's operands);
    returns a list that gains, per call, the rows whose selection differs from the exact one."""
    real = jm.select_c4_entries
    changed: list[int] = []

    def rounded(state, layer, metadata, index_q, index_weights):
        if state is not judge.model.state:
            return real(state, layer, metadata, index_q, index_weights)
        storage = state.pools.indexer(layer).storage
        exact_keys = storage.clone()
        real(state, layer, metadata, index_q, index_weights)
        exact = metadata.c4.page_indices.clone()
        storage.copy_(storage.to(BF16).float())
        real(state, layer, metadata, index_q.to(BF16).float(), index_weights.to(BF16).float())
        storage.copy_(exact_keys)
        changed.append(int((metadata.c4.page_indices != exact).any(1).sum()))

    monkeypatch.setattr(jm, "select_c4_entries", rounded)
    return changed


def test_a_bf16_indexer_passes_the_tie_aware_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 operands change selections at near ties (so a plain comparison would fail); the
    check passes them with the bf16 bound and fails them with an fp32 one."""
    judge = gv.make_judge("cpu", dispatch.TORCH, operand_dtype=BF16)
    changed = _bf16_indexer(judge, monkeypatch)
    _run(judge)
    assert sum(changed) > 0, "no selection changed: the schedule has no near tie"
    assert judge.passed, [f for f in judge.findings if not f.passed]
    strict = gv.make_judge("cpu", dispatch.TORCH, operand_dtype=torch.float32)
    _bf16_indexer(strict, monkeypatch)
    assert _failed_steps(_run(strict)) == {"indexer-selection"}


def test_an_attention_bug_fails_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state under test drops each row's newest window key."""
    judge = gv.make_judge("cpu", dispatch.TORCH, schedule=jm.SHORT_SCHEDULE)
    real = jm.attend

    def dropping(state, layer, metadata, q, sink):
        if state is not judge.model.state:
            return real(state, layer, metadata, q, sink)
        lengths = metadata.swa_topk_lengths
        saved = lengths.clone()
        lengths.sub_(1).clamp_(min=1)
        try:
            return real(state, layer, metadata, q, sink)
        finally:
            lengths.copy_(saved)

    monkeypatch.setattr(jm, "attend", dropping)
    assert _failed_steps(_run(judge, jm.SHORT_SCHEDULE)) == {"attention", "reference"}


def test_a_store_bug_fails_the_window_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state under test writes one key with a flipped bit."""
    judge = gv.make_judge("cpu", dispatch.TORCH, schedule=jm.SHORT_SCHEDULE)
    real = jm.store_window_keys

    def flipping(state, layer, metadata, kv):
        if state is not judge.model.state:
            return real(state, layer, metadata, kv)
        kv = kv.clone()
        kv.view(torch.int32)[0, 3] ^= 1 << 20
        return real(state, layer, metadata, kv)

    monkeypatch.setattr(jm, "store_window_keys", flipping)
    failed = _failed_steps(_run(judge, jm.SHORT_SCHEDULE))
    assert "window-store" in failed and failed <= {"window-store", "reference"}


def test_a_store_kernel_bug_fails_the_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    real = jm.store_rows

    def off_by_one(cache, rows, slots):
        if dispatch.select_path(rows.device) == dispatch.TORCH:
            return real(cache, rows, slots)
        return real(cache, rows, torch.where(slots >= 0, (slots + 1) % cache.num_slots, -1))

    monkeypatch.setattr(jm, "store_rows", off_by_one)
    findings = jm.judge_stores("cpu", dispatch.TRITON_INTERPRETER)
    assert not any(f.passed for f in findings)


def test_a_wrong_topk_fails_the_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state under test keeps each long row's first ``topk`` candidates."""
    judge = gv.make_judge("cpu", dispatch.TORCH, schedule=jm.SHORT_SCHEDULE)
    real = jm.select_c4_entries
    topk = judge.model.config.index_topk

    def first_entries(state, layer, metadata, index_q, index_weights):
        real(state, layer, metadata, index_q, index_weights)
        if state is judge.model.state:
            comp = metadata.c4
            long_rows = comp.topk_lengths_raw > topk
            first = jm.entry_slots(
                metadata.page_table, torch.arange(topk).expand(len(long_rows), -1)
            )
            comp.page_indices[long_rows] = first[long_rows].int()

    monkeypatch.setattr(jm, "select_c4_entries", first_entries)
    failed = _failed_steps(_run(judge, jm.SHORT_SCHEDULE))
    assert failed == {"indexer-selection"}  # attention is judged on the same selection
