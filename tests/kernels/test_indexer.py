"""Lightning indexer (dsv4_backend.kernels.indexer) against brute-force loops and the reference.

Tiny configuration: HI = 4 heads of DI = 64, topk 16. Rows are decode-style: each row is the
last token of its own request, with a random page table, so a row of sequence length L has
L // 4 candidates.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_backend.cache import IndexerKeyCache
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ContractError
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.kernels.dispatch import TORCH, TRITON_INTERPRETER, force_path
from dsv4_backend.kernels.indexer import bounded as indexer_bounded
from dsv4_backend.kernels.indexer import table as indexer
from dsv4_backend.kernels.indexer import topk as indexer_topk
from dsv4_backend.kernels.indexer.common import select_entries
from dsv4_backend.kernels.variants import Target, choose, force_unverified
from dsv4_backend.testing.reference import make_random_layer, reference_layer
from dsv4_backend.tools.op_counter import LaunchCounter

CFG = DSV4AttentionConfig.tiny()
HI, DI, TOPK = CFG.index_n_heads, CFG.index_head_dim, CFG.index_topk
E = 64  # c4 entries per full page
#: Sequence lengths around the boundaries: 0 ... 64 candidates, around topk = 16.
SEQ_LENS = (1, 3, 4, 5, 6, 7, 8, 9, 63, 64, 65, 127, 128, 129, 255, 256, 257)
PAGES_PER_ROW = 2  # 257 tokens -> 64 c4 entries -> 1 page; a second one is never read
NUM_PAGES = 2 * len(SEQ_LENS) + 3


@dataclass
class Batch:
    q: torch.Tensor  # [T, HI, DI]
    w: torch.Tensor  # [T, HI]
    keys: torch.Tensor  # [num_slots, DI] fp32, what was stored
    page_table: torch.Tensor  # [T, PAGES_PER_ROW] int32
    num: torch.Tensor  # [T] int32

    def cache(self, fmt: str, dtype: torch.dtype = torch.float32) -> IndexerKeyCache:
        cache = IndexerKeyCache(self.keys.shape[0], DI, fmt, dtype=dtype)
        with force_path(TORCH):
            store_rows(cache, self.keys, torch.arange(self.keys.shape[0]))
        return cache


def make_batch(seed: int, seq_lens=SEQ_LENS, keys: torch.Tensor | None = None) -> Batch:
    g = torch.Generator().manual_seed(seed)
    rows = len(seq_lens)
    pages = torch.randperm(NUM_PAGES, generator=g)[: rows * PAGES_PER_ROW].int()
    if keys is None:
        keys = torch.randn(NUM_PAGES * E, DI, generator=g)
    return Batch(
        q=torch.randn(rows, HI, DI, generator=g),
        w=torch.randn(rows, HI, generator=g) * (DI * HI) ** -0.5,
        keys=keys,
        page_table=pages.view(rows, PAGES_PER_ROW),
        num=torch.tensor([n // 4 for n in seq_lens], dtype=torch.int32),
    )


def slot_of(page_table: torch.Tensor, row: int, entry: int) -> int:
    """cache-format.md: c4 entry j sits at page_table[j*4 // 256] * 64 + j % 64."""
    return int(page_table[row, entry * 4 // 256]) * 64 + entry % 64


def brute_scores(b: Batch, keys: torch.Tensor, cols: int) -> torch.Tensor:
    out = torch.full((len(b.num), cols), float("-inf"))
    for t in range(len(b.num)):
        for s in range(int(b.num[t])):
            k = keys[slot_of(b.page_table, t, s)]
            out[t, s] = sum(float(b.w[t, h]) * max(float(b.q[t, h] @ k), 0.0) for h in range(HI))
    return out


def brute_select(scores: torch.Tensor, num: torch.Tensor, page_table, topk: int) -> torch.Tensor:
    """The definition: all candidates if <= topk, else the best (ties to the smaller entry)."""
    out = torch.full((len(num), topk), -1, dtype=torch.int32)
    for t in range(len(num)):
        cand = list(range(min(int(num[t]), scores.shape[1])))
        best = sorted(cand, key=lambda j: (-float(scores[t, j]), j))[:topk]
        for i, j in enumerate(sorted(best)):
            out[t, i] = slot_of(page_table, t, j)
    return out


def selected(b: Batch, cache: IndexerKeyCache, path: str, cols: int | None = None):
    out = torch.full((len(b.num), TOPK), -7, dtype=torch.int32)
    with force_path(path):
        indexer.run_indexer(b.q, b.w, cache, b.page_table, b.num, TOPK, out, cols)
    return out


# ------------------------------------------------------------------------------- scores
@pytest.mark.parametrize(
    ("fmt", "cache_dtype", "q_dtype"),
    [
        ("dense", torch.float32, torch.float32),
        ("dense", torch.bfloat16, torch.bfloat16),
        ("fp8", torch.float32, torch.float32),
    ],
)
def test_triton_scores_match_torch_and_brute_force(fmt, cache_dtype, q_dtype):
    b = make_batch(1)
    b.q = b.q.to(q_dtype).float()  # values exactly representable in q_dtype
    cache = b.cache(fmt, cache_dtype)
    cols = 70  # two column blocks; rows of 257 tokens have 64 candidates
    args = (b.q.to(q_dtype), b.w, cache, b.page_table, b.num, cols)
    with force_path(TORCH):
        ref = indexer.index_scores(*args)
    with force_path(TRITON_INTERPRETER):
        tri = indexer.index_scores(*args)
    assert tri.shape == (len(SEQ_LENS), cols) and tri.dtype == torch.float32
    torch.testing.assert_close(tri, ref, atol=1e-5, rtol=1e-5)
    stored = cache.gather(torch.arange(b.keys.shape[0]))
    torch.testing.assert_close(ref, brute_scores(b, stored, cols), atol=1e-5, rtol=1e-5)
    finite = torch.arange(cols)[None, :] < b.num[:, None]
    assert torch.equal(torch.isfinite(ref), finite)


def test_scores_clamp_candidates_to_columns_and_strided_inputs():
    b = make_batch(2)
    q = torch.randn(HI, len(SEQ_LENS), DI).transpose(0, 1)  # non-contiguous [T, HI, DI]
    num = torch.stack([b.num, b.num.flip(0)], dim=1)[:, 0]  # non-contiguous [T]
    cache = b.cache("dense")
    cols = 20  # fewer columns than some rows' candidates
    with force_path(TRITON_INTERPRETER):
        tri = indexer.index_scores(q, b.w, cache, b.page_table, num, cols)
    with force_path(TORCH):
        ref = indexer.index_scores(q, b.w, cache, b.page_table, num, cols)
    torch.testing.assert_close(tri, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isfinite(ref).sum(1), b.num.clamp(max=cols).long())


# ---------------------------------------------------------------------------- selection
@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "replaced"])
@pytest.mark.parametrize("path", [TORCH, TRITON_INTERPRETER])
def test_selection_matches_brute_force_at_boundary_lengths(path, bounded):
    """Both Triton indexers: the length-bounded kernels and the ones they replace (still the
    CUDA default until they pass on a GPU)."""
    b = make_batch(3)
    cache = b.cache("dense")
    with force_unverified(bounded):
        out = selected(b, cache, path)
    expected = brute_select(brute_scores(b, b.keys, 64), b.num, b.page_table, TOPK)
    assert torch.equal(out, expected)
    for t, n in enumerate(b.num.tolist()):
        assert (out[t] >= 0).sum() == min(n, TOPK)
        if n == 0:
            assert (out[t] == -1).all()


def test_length_bounded_topk_over_several_blocks_with_ties():
    """The radix top-k kernel on rows longer than one column block (64 in the interpreter),
    with exact ties at the boundary and columns past each row's count left as garbage."""
    g = torch.Generator().manual_seed(12)
    rows, cols, topk = 5, 300, 40
    scores = torch.randint(-3, 4, (rows, cols), generator=g).float() * 0.5
    scores[0] = -scores[0].abs() - 1.0  # all negative
    scores[1, :150] = float("-inf")  # -inf candidates are still candidates
    num = torch.tensor([300, 290, 129, 41, 40], dtype=torch.int32)
    garbage = torch.where(torch.arange(cols)[None, :] < num[:, None].long(), scores, 1e30)
    pages = torch.arange(rows * 5, dtype=torch.int32).flip(0).view(rows, 5)
    out = torch.full((rows, topk), -7, dtype=torch.int32)
    with force_path(TRITON_INTERPRETER):
        indexer.select_topk(garbage, num, pages, topk, out)
    assert torch.equal(out, brute_select(scores, num, pages, topk))


def _long_rows() -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(scores [R, 200], num [R], topk)``: rows of the length-bounded top-k's every case at
    top-k 8 (interpreter chunks: a multiple of 64 entries, at least ``sqrt(num * 8)``; at 4
    programs a row): split over 4 chunks (the last as long as top-k), 3 and 2 chunks (the
    last longer), one chunk of top-k + 1, exactly top-k, fewer, none; three score levels
    (ties everywhere), all equal, and a tie straddling the first chunk boundary (column 64)
    at the top-k's edge."""
    g = torch.Generator().manual_seed(13)
    num = torch.tensor([200, 200, 200, 150, 100, 9, 8, 3, 0], dtype=torch.int32)
    scores = torch.randint(0, 3, (len(num), 200), generator=g).float()
    scores[1] = 0.0  # all equal: the first 8 entries
    scores[2] = 0.0
    scores[2, 61:67] = 1.0  # 3 in chunk 0, 3 in chunk 1; then the first 2 zeros
    return scores, num, 8


@pytest.mark.parametrize("parts", [1, 4])
def test_length_bounded_topk_splits_long_rows_over_programs(parts, monkeypatch):
    """Chunks' best then their merge select what the definition selects, however many
    programs a row takes (200 entries: 1 or 4 chunks; programs past a row's chunks exit at
    once); columns past each row's count hold garbage (NaN, huge)."""
    monkeypatch.setattr(indexer_bounded, "INTERPRETER_TOPK_PARTS", parts)
    scores, num, topk = _long_rows()
    past = torch.arange(scores.shape[1])[None, :] >= num[:, None].long()
    garbage = scores.masked_fill(past, float("nan"))
    garbage[::2] = garbage[::2].nan_to_num(nan=1e30)
    garbage = garbage.t().contiguous().t()  # column-major: the kernels read a contiguous copy
    pages = torch.arange(4, dtype=torch.int32).expand(len(num), 4)  # slot = entry
    out = torch.full((len(num), topk), -7, dtype=torch.int32)
    with force_path(TRITON_INTERPRETER):
        indexer.select_topk(garbage, num, pages, topk, out)
    assert torch.equal(out, brute_select(scores, num, pages, topk))
    assert out[2].tolist() == [0, 1, *range(61, 67)] and (out[-1] == -1).all()


def test_length_bounded_topk_work_of_a_long_row(monkeypatch):
    """One row of 150 entries at top-k 8: 3 chunk programs do work (64 + 64 + 22 entries)
    and the merge reads their 24 candidates, not the row; a 9-entry row is one chunk; rows
    of at most top-k leave the chunks' kernel nothing to do."""
    monkeypatch.setattr(indexer_bounded, "INTERPRETER_TOPK_PARTS", 4)
    scores, num, topk = _long_rows()
    programs = {}
    for row in (3, 5, 6):
        args = (scores[row : row + 1], num[row : row + 1], torch.zeros(1, 4, dtype=torch.int32))
        out = torch.empty(1, topk, dtype=torch.int32)
        with force_path(TRITON_INTERPRETER), LaunchCounter() as launches:
            indexer.select_topk(*args, topk, out)
        assert launches.total == 2, launches.summary()
        programs[int(num[row])] = launches.working_programs["triton:_topk_chunks_kernel"]
        if row == 3:
            chunks = launches.bytes_loaded["triton:_topk_chunks_kernel"]
            merge = launches.bytes_loaded["triton:_merge_topk_slots_kernel"]
            assert merge < chunks / 4, (merge, chunks)
    assert programs == {150: 3, 9: 1, 8: 0}


def test_ties_go_to_the_smaller_entry():
    b = make_batch(4)
    scores = torch.randint(-2, 3, (len(SEQ_LENS), 64)).float()  # many exact ties
    out = torch.empty(len(SEQ_LENS), TOPK, dtype=torch.int32)
    indexer.select_topk(scores, b.num, b.page_table, TOPK, out)
    assert torch.equal(out, brute_select(scores, b.num, b.page_table, TOPK))
    zeros = torch.zeros(1, 40)
    entries = select_entries(zeros, torch.tensor([40], dtype=torch.int32), TOPK)
    assert entries.tolist() == [list(range(TOPK))]


@st.composite
def _levelled_rows(draw, max_rows: int, max_cols: int, max_topk: int):
    """``(scores [rows, cols], num [rows], topk)``: scores of a few integer values (exact
    ties), candidate counts up to a few past the columns."""
    rows, cols = draw(st.integers(1, max_rows)), draw(st.integers(0, max_cols))
    levels, seed = draw(st.integers(1, 6)), draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (rows, cols), generator=g).float()
    num = torch.randint(0, cols + 3, (rows,), generator=g, dtype=torch.int32)
    return scores, num, draw(st.integers(1, max_topk))


@settings(max_examples=40, deadline=None)
@given(case=_levelled_rows(6, 40, 24))
def test_select_entries_is_the_definition(case):
    scores, num, topk = case
    rows = scores.shape[0]
    identity = torch.arange(64, dtype=torch.int32).expand(rows, 64)  # slot = entry
    got = select_entries(scores, num, topk)
    assert got.shape == (rows, topk) and got.dtype == torch.int64
    assert torch.equal(got.int(), brute_select(scores, num, identity, topk))


@settings(max_examples=6, deadline=None)
@given(case=_levelled_rows(3, 140, 12), parts=st.integers(1, 5))
def test_length_bounded_topk_is_the_definition(case, parts):
    """The interpreted chunks-and-merge top-k on random rows (few score levels: ties across
    chunks), any programs a row."""
    scores, num, topk = case
    rows = scores.shape[0]
    identity = torch.arange(3, dtype=torch.int32).expand(rows, 3)  # slot = entry
    out = torch.full((rows, topk), -7, dtype=torch.int32)
    with force_path(TRITON_INTERPRETER), pytest.MonkeyPatch.context() as patch:
        patch.setattr(indexer_bounded, "INTERPRETER_TOPK_PARTS", parts)
        indexer.select_topk(scores, num, identity, topk, out)
    assert torch.equal(out, brute_select(scores, num, identity, topk))


def test_padding_columns_do_not_change_the_selection():
    b = make_batch(5)
    cache = b.cache("dense")
    narrow = selected(b, cache, TORCH, cols=64)
    assert torch.equal(selected(b, cache, TORCH, cols=200), narrow)
    assert torch.equal(selected(b, cache, TORCH), narrow)  # default: Pw * 64 columns


def test_select_topk_writes_in_place():
    b = make_batch(6)
    out = torch.full((len(SEQ_LENS), TOPK), -1, dtype=torch.int32)
    ptr = out.data_ptr()
    scores = torch.randn(len(SEQ_LENS), 64)
    indexer.select_topk(scores, b.num, b.page_table, TOPK, out)
    assert out.data_ptr() == ptr and (out >= 0).any()


# ---------------------------------------------------------------------------- reference
def _assert_same_selection(ours: list[int], ref: list[int], ref_scores: torch.Tensor) -> None:
    """Equal sets, except entries whose scores tie the boundary within fp32 rounding."""
    if set(ours) == set(ref):
        return
    boundary = float(ref_scores[ref].min())
    for j in set(ours) ^ set(ref):
        assert abs(float(ref_scores[j]) - boundary) <= 1e-5 * max(1.0, abs(boundary)), (ours, ref)


def test_matches_reference_indexer_select():
    seq = 260  # 65 c4 entries
    g = torch.Generator().manual_seed(7)
    inputs, params = make_random_layer(CFG, 4, seq, g)
    result = reference_layer(CFG, 4, inputs, params)
    n_entries = result.index_keys.shape[0]
    positions = torch.tensor([n - 1 for n in SEQ_LENS if n <= seq] + [100, 200, 259])
    rows = len(positions)
    # One request; its pages scattered over a larger cache.
    request_pages = torch.tensor([5, 2], dtype=torch.int32)
    cache = IndexerKeyCache(8 * E, DI, "dense")
    entry_slots = [int(request_pages[j // E]) * E + j % E for j in range(n_entries)]
    with force_path(TORCH):
        store_rows(cache, result.index_keys, torch.tensor(entry_slots))
    out = torch.full((rows, TOPK), -1, dtype=torch.int32)
    indexer.run_indexer(
        inputs.index_q[positions],
        inputs.index_weights[positions],
        cache,
        request_pages.expand(rows, 2).contiguous(),
        ((positions + 1) // 4).int(),
        TOPK,
        out,
        max_candidates=n_entries,
    )
    slot_to_entry = {s: j for j, s in enumerate(entry_slots)}
    for i, p in enumerate(positions.tolist()):
        ours = [slot_to_entry[s] for s in out[i].tolist() if s >= 0]
        ref = [j for j in result.selected[p].tolist() if j >= 0]
        assert ours == sorted(ours) and len(ours) == len(ref)
        q, w = inputs.index_q[p], inputs.index_weights[p]
        ref_scores = ((q @ result.index_keys.T).relu() * w[:, None]).sum(0)
        _assert_same_selection(ours, ref, ref_scores)


# ---------------------------------------------------------------------------------- fp8
def _fp8_representable_keys(g: torch.Generator) -> torch.Tensor:
    """Keys that the indexer's fp8 format stores exactly: e4m3 values times a power of two,
    with one channel at +-448 so that amax / 448 is that power of two."""
    codes = (torch.randn(NUM_PAGES * E, DI, generator=g) * 40).to(torch.float8_e4m3fn).float()
    codes[:, 0] = 448.0 * torch.sign(torch.randn(NUM_PAGES * E, generator=g))
    scale = 2.0 ** torch.randint(-12, -4, (NUM_PAGES * E, 1), generator=g).float()
    return codes * scale


def test_fp8_cache_selects_like_dense_when_keys_are_representable():
    b = make_batch(8, keys=_fp8_representable_keys(torch.Generator().manual_seed(8)))
    dense, fp8 = b.cache("dense"), b.cache("fp8")
    all_slots = torch.arange(b.keys.shape[0])
    assert torch.equal(fp8.gather(all_slots), b.keys)
    expected = selected(b, dense, TORCH)
    assert torch.equal(selected(b, fp8, TRITON_INTERPRETER), expected)
    assert torch.equal(selected(b, fp8, TORCH), expected)


def test_fp8_scores_within_quantisation_bound():
    b = make_batch(9)
    cols = 64
    with force_path(TRITON_INTERPRETER):
        got = indexer.index_scores(b.q, b.w, b.cache("fp8"), b.page_table, b.num, cols)
    exact = brute_scores(b, b.keys, cols)
    # e4m3 keeps 3 mantissa bits: |k - deq(k)| <= |k| / 16 + scale * 2^-10 per channel.
    amax = b.keys.abs().amax(1, keepdim=True)
    err_keys = b.keys.abs() / 16 + amax / 448 * 2**-10
    bound = brute_scores(Batch(b.q.abs(), b.w.abs(), err_keys, b.page_table, b.num), err_keys, cols)
    finite = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(got), finite)
    assert ((got - exact).abs()[finite] <= bound[finite] + 1e-6).all()
    assert not torch.equal(got[finite], exact[finite])  # the fp8 path really quantised


# ------------------------------------------------------------------------------- errors
def test_bad_inputs_raise_contract_errors():
    b = make_batch(10)
    cache = b.cache("dense")
    out = torch.empty(len(SEQ_LENS), TOPK, dtype=torch.int32)
    with pytest.raises(ContractError, match="page_table"):
        indexer.index_scores(b.q, b.w, cache, b.page_table.long(), b.num, 64)
    with pytest.raises(ContractError, match="num_candidates"):
        indexer.index_scores(b.q, b.w, cache, b.page_table, b.num[:-1], 64)
    with pytest.raises(ContractError, match="weights"):
        indexer.index_scores(b.q, b.w[:, :2], cache, b.page_table, b.num, 64)
    with pytest.raises(ContractError, match="dim 32"):
        indexer.index_scores(b.q, b.w, IndexerKeyCache(64, 32, "dense"), b.page_table, b.num, 64)
    with pytest.raises(ContractError, match="out has shape"):
        indexer.select_topk(torch.zeros(len(SEQ_LENS), 64), b.num, b.page_table, TOPK, out.long())


# ---------------------------------------------------------------------- flashinfer path
def test_flashinfer_branch_passes_arguments_flashinfer_accepts(monkeypatch):
    """The GPU top-k branch, run on the CPU with a stand-in module; the keyword arguments it
    passes are checked against the installed flashinfer's ``top_k`` signature (without
    importing flashinfer, which needs seconds and a GPU to run)."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        pytest.skip("flashinfer is not installed")
    with open(spec.origin.replace("__init__.py", "topk.py")) as source:
        tree = ast.parse(source.read())
    real = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "top_k")
    accepted = {a.arg for a in real.args.args}
    calls = []

    def fake_top_k(input, k, **kwargs):
        assert set(kwargs) <= accepted
        calls.append(kwargs)
        order = torch.sort(input, dim=1, descending=True, stable=True).indices[:, :k]
        return input.gather(1, order), order

    fake = types.SimpleNamespace(top_k=fake_top_k, TopKTieBreak=types.SimpleNamespace(SMALL=1))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    _choose_as_on_a_cuda_host(monkeypatch)
    b = make_batch(11)
    scores = torch.randn(len(SEQ_LENS), 64)
    out = torch.empty(len(SEQ_LENS), TOPK, dtype=torch.int32)
    with force_unverified(False):  # the length-bounded indexer has its own top-k
        indexer.select_topk(scores, b.num, b.page_table, TOPK, out)
    assert calls == [{"tie_break": 1, "dsa_graph_safe": True}]
    assert torch.equal(out, brute_select(scores, b.num, b.page_table, TOPK))


def test_warm_up_topk_runs_flashinfer_once_before_capture(monkeypatch):
    """On a flashinfer device the warm-up runs one top-k (JIT build, workspace); elsewhere
    nothing."""
    calls = []
    monkeypatch.setattr(indexer_topk, "best_columns", lambda x, k: calls.append((x.shape, k)))
    indexer_topk.warm_up_topk("cpu", 8)
    assert calls == []
    _choose_as_on_a_cuda_host(monkeypatch)
    indexer_topk.warm_up_topk("cpu", 8)
    assert calls == [((1, 9), 8)]


def _choose_as_on_a_cuda_host(monkeypatch):
    """The top-k's variant as a CUDA host with flashinfer chooses it (the CPU tensors stay)."""
    hopper = Target.cuda_host((9, 0))
    chosen = choose(indexer_topk.INDEXER_TOPK, hopper, None)
    assert chosen.variant is indexer_topk.FLASHINFER
    monkeypatch.setattr(indexer_topk, "resolve", lambda table, device: chosen)


# ---------------------------------------------------------------------- deep_gemm bench
def test_deep_gemm_comparison_says_why_it_cannot_run(capsys):
    """``bench_ops.py --against deep_gemm`` without a CUDA device (or deep_gemm): one line
    saying so, nothing compared, a clean return."""
    path = Path(__file__).parents[2] / "benchmarks" / "bench_ops.py"
    spec = importlib.util.spec_from_file_location("bench_ops", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if bench.ON_GPU and importlib.util.find_spec("deep_gemm") is not None:
        pytest.skip("a GPU with deep_gemm: the comparison really runs (benchmarks)")
    bench.compare_deep_gemm([1], 64, 1)
    out = capsys.readouterr().out
    assert out.startswith("--against deep_gemm: ") and "nothing compared" in out
