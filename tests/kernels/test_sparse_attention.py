"""Sparse attention with sink: Triton (interpreter) == torch path == reference, every key mix.

Three independent answers are compared: the Triton kernel (one split and several, i.e. the
finalising and the split-merge kernels), the torch path, and ``dsv4_backend.testing.reference``
(``reference_attention`` for whole requests laid out in caches the way the planner indexes them,
``sink_attention`` per row for synthetic index tensors).

FP8 tolerance (``_fp8_tolerance``): every key channel satisfies ``|k - deq(k)| <= b`` with
``b = 2^-4 |k| + 2^-10 * scale`` (fp8_format's bound; rope channels are exact because the test
keys are bf16 values). Then every logit moves by at most ``delta = scale_qk * sum_d |q_d| b_d``,
each softmax weight by a factor within ``exp(+-2 delta)``, and the output by at most
``(exp(2 delta) - 1) * max|k| + max b``.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_inputs import (
    PAGE_TOKENS,
    REQUEST_ROWS,
    ROPE,
    TINY,
    make_cache,
    random_indices,
    random_keys,
    request_inputs,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from marks import needs_interpreter
from stress import STRESS, sized

from dsv4_backend.cache import TokenCache
from dsv4_backend.errors import BatchError, ContractError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention.common import (
    MAX_SPLITS,
    AttentionCall,
    attention_tolerance,
    default_num_splits,
    dot_operand_dtype,
    force_num_splits,
    group_rows,
)
from dsv4_backend.kernels.attention.table import sparse_attention_with_sink
from dsv4_backend.kernels.attention.torch import sparse_attention_torch
from dsv4_backend.kernels.attention.triton import sparse_attention_triton
from dsv4_backend.testing.reference import reference_attention, sink_attention

pytestmark = needs_interpreter

ATOL = 2e-5


def _rowwise(q, spans, sink, scale) -> torch.Tensor:
    """``sink_attention`` per row over the valid keys of ``spans`` ``[(rows, idx, lengths)]``."""
    out = []
    for t in range(q.shape[0]):
        keys = []
        for rows, idx, lengths in spans:
            cols = idx[t, : int(lengths[t])].long()
            keys.append(rows[cols[cols >= 0]])
        out.append(sink_attention(q[t], torch.cat(keys), sink, scale))
    return torch.stack(out)


def _all_paths(*args, splits=(1, 3), groups=(1,)) -> dict[str, torch.Tensor]:
    """Outputs of the torch path and of the Triton kernel at each split count and each
    ``rows_per_group``."""
    outs = {"torch": sparse_attention_torch(AttentionCall.of(*args))}
    for s in splits:
        for rows in groups:
            outs[f"triton-s{s}-g{rows}"] = sparse_attention_triton(
                AttentionCall.of(*args, rows_per_group=rows), num_splits=s
            )
    return outs


def _assert_all_close(outs: dict[str, torch.Tensor], expected: torch.Tensor, atol=ATOL) -> None:
    for name, out in outs.items():
        assert out.dtype == torch.float32 and out.shape == expected.shape, name
        torch.testing.assert_close(out, expected, atol=atol, rtol=1e-5, msg=name)


# ------------------------------------------------------------------------ synthetic rows
def test_window_lengths_cross_block_boundaries():
    """Window-only rows of 1, 3-9, 31-33, 127-129 and full-width keys (BLOCK_N = 32), and rows
    without a valid key (length 0, or only -1 slots), which output exactly 0."""
    g = torch.Generator().manual_seed(1)
    lengths = [1, 3, 4, 5, 6, 7, 8, 9, 31, 32, 33, 127, 128, 129, 192, 40, 0]
    rows = random_keys(500, 128, g)
    win = make_cache(rows, 128, "dense")
    idx, lens = random_indices(lengths, 192, 500, g)
    idx[-3, :40] = -1  # a whole first block of holes
    idx[-2] = -1
    q = torch.randn(len(lengths), 8, 128, generator=g)
    sink = torch.randn(8, generator=g)
    args = (q, win, idx, lens, None, None, None, sink, TINY.softmax_scale)
    outs = _all_paths(*args, splits=(1, 4))
    _assert_all_close(outs, _rowwise(q, [(rows, idx, lens)], sink, TINY.softmax_scale))
    for name, out in outs.items():
        assert (out[-2:] == 0).all(), name


@pytest.mark.parametrize("extra_kind", ["c4", "c128"])
def test_window_plus_extra(extra_kind):
    """Window keys plus c4 top-k slots (with -1 holes) or c128 slots, including extra-only
    rows, rows where every index is -1, and lengths past the index width (clamped)."""
    g = torch.Generator().manual_seed(2)
    ke, n_extra, holes = (16, 40, 0.3) if extra_kind == "c4" else (3, 5, 0.0)
    win_len = [0, 1, 3, 9, 64, 100, 127, 128, 128, 0]
    ext_len = [4, 1, 0, ke, 1, 2, ke, ke + 5, 2, 0]
    rows, ext_rows = random_keys(300, 128, g), random_keys(n_extra, 128, g)
    win = make_cache(rows, 128, "dense")
    ext = make_cache(ext_rows, PAGE_TOKENS[4 if extra_kind == "c4" else 128], "dense")
    idx, lens = random_indices(win_len, 128, 300, g)
    eidx, elens = random_indices(ext_len, ke, n_extra, g, holes)
    eidx[-2] = -1  # window keys plus an all-hole extra row
    q = torch.randn(len(win_len), 8, 128, generator=g)
    sink = torch.randn(8, generator=g)
    args = (q, win, idx, lens, ext, eidx, elens, sink, TINY.softmax_scale)
    spans = [(rows, idx, lens), (ext_rows, eidx, elens)]
    outs = _all_paths(*args)
    _assert_all_close(outs, _rowwise(q, spans, sink, TINY.softmax_scale))
    for name, out in outs.items():
        assert (out[-1] == 0).all(), name


@pytest.mark.parametrize("sink_value", [-1e4, 60.0])
def test_extreme_sinks(sink_value):
    """A very negative sink gives the plain softmax; a very positive one an output near 0."""
    g = torch.Generator().manual_seed(3)
    rows = random_keys(200, 128, g)
    win = make_cache(rows, 128, "dense")
    idx, lens = random_indices([1, 5, 70, 128], 128, 200, g, holes=0.1)
    q = torch.randn(4, 8, 128, generator=g)
    sink = torch.full((8,), sink_value)
    args = (q, win, idx, lens, None, None, None, sink, TINY.softmax_scale)
    outs = _all_paths(*args)
    if sink_value < 0:
        expected = []
        for t in range(4):
            cols = idx[t, : int(lens[t])].long()
            keys = rows[cols[cols >= 0]]
            weights = torch.softmax(TINY.softmax_scale * q[t] @ keys.T, dim=-1)
            expected.append(weights @ keys)
        _assert_all_close(outs, torch.stack(expected))
    else:
        for name, out in outs.items():
            assert out.abs().max() < 1e-12, name


def test_flash_width_heads_and_dim():
    """H = 16, D = 512 (the Flash head dim, 448 nope + 64 rope), dense bf16 cache."""
    g = torch.Generator().manual_seed(4)
    rows = random_keys(160, 512, g)
    win = make_cache(rows, 128, "dense", torch.bfloat16)
    ext = make_cache(random_keys(9, 512, g), 2, "dense", torch.bfloat16)
    idx, lens = random_indices([128, 40, 1], 128, 160, g)
    eidx, elens = random_indices([3, 0, 2], 4, 9, g)
    q = torch.randn(3, 16, 512, generator=g)
    sink = torch.randn(16, generator=g)
    args = (q, win, idx, lens, ext, eidx, elens, sink, 512**-0.5)
    expected = _rowwise(
        q, [(rows, idx, lens), (ext.gather(torch.arange(9)), eidx, elens)], sink, 512**-0.5
    )
    _assert_all_close(_all_paths(*args), expected)


def test_bf16_q_and_strided_q():
    """bf16 q is upcast exactly; a q with non-unit channel stride is read through its strides."""
    g = torch.Generator().manual_seed(5)
    rows = random_keys(200, 128, g)
    win = make_cache(rows, 128, "dense", torch.bfloat16)
    idx, lens = random_indices([128, 7, 33], 128, 200, g)
    q = torch.randn(3, 128, 8, generator=g).bfloat16().transpose(1, 2)  # [T, H, D], stride_d 8
    sink = torch.randn(8, generator=g)
    args = (q, win, idx, lens, None, None, None, sink, TINY.softmax_scale)
    expected = _rowwise(q.float(), [(rows, idx, lens)], sink, TINY.softmax_scale)
    _assert_all_close(_all_paths(*args), expected)


def _fp8_tolerance(q, spans, scale) -> torch.Tensor:
    """``[T, H, 1]`` output error bound of an fp8 cache (module docstring)."""
    tol = []
    for t in range(q.shape[0]):
        keys = torch.cat(
            [rows[idx[t, : int(n[t])][idx[t, : int(n[t])] >= 0].long()] for rows, idx, n in spans]
        )
        nope = keys[:, : keys.shape[1] - ROPE].reshape(keys.shape[0], -1, 64)
        group_scale = torch.exp2(torch.ceil(torch.log2(nope.abs().amax(-1, keepdim=True) / 448)))
        b = torch.cat(
            [
                (2**-4 * nope.abs() + 2**-10 * group_scale).flatten(1),
                torch.zeros(keys.shape[0], ROPE),
            ],
            dim=1,
        )
        delta = scale * (q[t].abs() @ b.T).amax(-1)  # [H]
        tol.append(torch.expm1(2 * delta) * keys.abs().max() + b.max())
    return torch.stack(tol)[..., None]


@pytest.mark.parametrize("dim", [128, 512])
def test_fp8_cache(dim):
    """fp8 window + c4 caches: Triton == torch on the same bytes (tight), and both within the
    FP8 bound of the unquantised keys."""
    g = torch.Generator().manual_seed(6)
    rows, ext_rows = random_keys(300, dim, g), random_keys(80, dim, g)
    win, ext = make_cache(rows, 128, "fp8"), make_cache(ext_rows, 64, "fp8")
    heads = 8 if dim == 128 else 16
    idx, lens = random_indices([128, 1, 5, 0], 128, 300, g)
    eidx, elens = random_indices([16, 3, 0, 7], 16, 80, g)
    q = torch.randn(4, heads, dim, generator=g)
    sink = torch.randn(heads, generator=g)
    scale = dim**-0.5
    args = (q, win, idx, lens, ext, eidx, elens, sink, scale)
    outs = _all_paths(*args)
    dequantised = [
        (win.gather(torch.arange(300)), idx, lens),
        (ext.gather(torch.arange(80)), eidx, elens),
    ]
    _assert_all_close(outs, _rowwise(q, dequantised, sink, scale))
    spans = [(rows, idx, lens), (ext_rows, eidx, elens)]
    exact = _rowwise(q, spans, sink, scale)
    tol = _fp8_tolerance(q, spans, scale)
    for name, out in outs.items():
        err = (out - exact).abs()
        assert (err <= tol + ATOL).all(), f"{name}: error {err.max()} above the FP8 bound"
    assert (outs["torch"] - exact).abs().max() > 1e-4  # the fp8 path really quantised


def test_bf16_output_and_splits_without_keys():
    """``out_dtype=bfloat16`` (the GPU's choice for bf16 queries): the output, and with key
    splits the partials, in bf16 -- the fp32 result within bf16 roundoffs. Rows of 0, 1, 2 and
    5 key blocks under up to 7 splits: splits share the blocks evenly, the empty ones hold no
    numerator the merge reads, and a row without keys stays 0."""
    g = torch.Generator().manual_seed(8)
    win = make_cache(random_keys(300, 128, g), 128, "fp8")
    idx, lens = random_indices([0, 5, 33, 150], 160, 300, g)
    q = torch.randn(4, 8, 128, generator=g)
    sink = torch.randn(8, generator=g)
    args = (q, win, idx, lens, None, None, None, sink, TINY.softmax_scale)
    expected = sparse_attention_torch(AttentionCall.of(*args))
    for splits in (1, 4, 7):
        out = sparse_attention_triton(
            AttentionCall.of(*args), num_splits=splits, out_dtype=torch.bfloat16
        )
        assert out.dtype == torch.bfloat16, splits
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2**-7, msg=str(splits))
        assert (out[0] == 0).all(), splits


@pytest.mark.parametrize("heads", [16, 32])
@pytest.mark.parametrize("fmt", ["dense", "fp8"])
def test_verify_rows_at_attention_tp_heads(heads, fmt):
    """Verify / draft-extend rows (consecutive rows of two requests sharing most keys: windows
    shifted by one position, top-k sets drawn from one pool) with 16 and 32 heads a rank, one
    split and several, one row a program and a request's rows together (and groups that
    straddle the two requests): Triton == torch path == per-row reference over the stored
    keys."""
    g = torch.Generator().manual_seed(20 + heads)
    window, draft, num_slots, num_entries = 128, 4, 400, 40
    win = make_cache(random_keys(num_slots, 128, g), PAGE_TOKENS[0], fmt)
    ext = make_cache(random_keys(num_entries, 128, g), PAGE_TOKENS[4], fmt)
    idx, lens, eidx, elens = [], [], [], []
    for first_pos, base in ((150, 0), (60, 200)):  # request 2 is shorter than the window
        for d in range(draft):
            pos = first_pos + d
            span = torch.arange(max(0, pos - window + 1), pos + 1)
            idx.append(
                torch.full((window,), -1).index_copy(0, torch.arange(len(span)), base + span)
            )
            lens.append(len(span))
            picks = torch.randperm(num_entries // 2, generator=g)[: 8 + d] + base // 10
            eidx.append(torch.full((16,), -1).index_copy(0, torch.arange(len(picks)), picks))
            elens.append(len(picks))
    idx, eidx = torch.stack(idx).int(), torch.stack(eidx).int()
    lens, elens = torch.tensor(lens, dtype=torch.int32), torch.tensor(elens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, 128, generator=g)
    sink = torch.randn(heads, generator=g)
    args = (q, win, idx, lens, ext, eidx, elens, sink, 128**-0.5)
    stored = [
        (win.gather(torch.arange(num_slots)), idx, lens),
        (ext.gather(torch.arange(num_entries)), eidx, elens),
    ]
    # One row a program (groups 1) and one split are other tests' schedules (and any split with
    # any group: test_any_split_matches_torch): the long variant only.
    splits, groups = ((1, 2, 5), (1, 3, draft)) if STRESS else ((5,), (3, draft))
    outs = _all_paths(*args, splits=splits, groups=groups)
    _assert_all_close(outs, _rowwise(q, stored, sink, 128**-0.5))


@pytest.mark.parametrize("win_fmt, ext_dtype", [("dense", torch.bfloat16), ("fp8", torch.float32)])
def test_window_and_extra_caches_of_different_types(win_fmt, ext_dtype):
    """A window cache and an extra cache of different storage types (fp32 / bf16 dense, fp8 /
    dense) take the kernel's two-gather path; same answer as the torch path."""
    g = torch.Generator().manual_seed(8)
    win = make_cache(random_keys(200, 128, g), 128, win_fmt)
    ext = make_cache(random_keys(30, 128, g), 64, "dense", ext_dtype)
    idx, lens = random_indices([128, 3, 0, 70], 128, 200, g)
    eidx, elens = random_indices([5, 16, 2, 0], 16, 30, g)
    q = torch.randn(4, 8, 128, generator=g)
    args = (q, win, idx, lens, ext, eidx, elens, torch.randn(8, generator=g), TINY.softmax_scale)
    outs = _all_paths(*args)
    expected = outs.pop("torch")
    _assert_all_close(outs, expected)


# ------------------------------------------------------- whole requests vs the reference
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_matches_reference_attention(ratio):
    """Rows of one request (window-only, c4 and c128 layers) == reference_attention."""
    seq_len, rows = REQUEST_ROWS[ratio]
    args, (q_all, kv, compressed, selected, sink) = request_inputs(
        ratio, seq_len, rows, "dense", seed=10 + ratio
    )
    expected = reference_attention(TINY, ratio, q_all, kv, compressed, selected, sink)[rows]
    _assert_all_close(_all_paths(*args), expected)


def test_public_op_dispatches():
    """The public op runs the interpreter or the torch path per dispatch, same answer."""
    args, _ = request_inputs(4, 40, [3, 20, 39], "fp8", seed=7)
    with dispatch.force_path("torch"):
        via_torch = sparse_attention_with_sink(AttentionCall.of(*args))
    with dispatch.force_path("triton-interpreter"):
        via_triton = sparse_attention_with_sink(AttentionCall.of(*args))
    torch.testing.assert_close(via_triton, via_torch, atol=ATOL, rtol=1e-5)


@settings(max_examples=sized(6, 60), deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 12)), min_size=1, max_size=4),
    splits=st.integers(1, 6),
    rows_per_group=st.integers(1, 9),
    holes=st.floats(0.0, 1.0),
    sink=st.floats(-20.0, 20.0),
    seed=st.integers(0, 2**16),
)
def test_any_split_matches_torch(lengths, splits, rows_per_group, holes, sink, seed):
    """Invariant: any split count, rows per program, holes and lengths give the torch path's
    answer."""
    g = torch.Generator().manual_seed(seed)
    win, ext = (
        make_cache(random_keys(90, 128, g), 128, "dense"),
        make_cache(random_keys(20, 128, g), 64, "dense"),
    )
    idx, lens = random_indices([w for w, _ in lengths], 64, 90, g, holes)
    eidx, elens = random_indices([e for _, e in lengths], 8, 20, g, holes)
    q = torch.randn(len(lengths), 8, 128, generator=g)
    args = (q, win, idx, lens, ext, eidx, elens, torch.full((8,), sink), TINY.softmax_scale)
    torch.testing.assert_close(
        sparse_attention_triton(
            AttentionCall.of(*args, rows_per_group=rows_per_group), num_splits=splits
        ),
        sparse_attention_torch(AttentionCall.of(*args)),
        atol=ATOL,
        rtol=1e-5,
    )


@pytest.mark.parametrize("heads_per_program", [1, 2, 8], ids=["gpu", "2", "interpreter"])
def test_merge_takes_any_heads_a_program(heads_per_program: int, monkeypatch) -> None:
    """The merge of key splits gives the same output whether a program takes one head (the
    GPU's), all of them (the interpreter's) or a block that does not divide them; empty rows
    and splits without a key included."""
    from dsv4_backend.kernels.attention import triton as sa

    g = torch.Generator().manual_seed(3)
    win, ext = (
        make_cache(random_keys(90, 128, g), 128, "dense"),
        make_cache(random_keys(20, 128, g), 64, "dense"),
    )
    idx, lens = random_indices([60, 0, 3, 40, 64], 64, 90, g, 0.3)
    eidx, elens = random_indices([8, 0, 0, 5, 2], 8, 20, g, 0.3)
    q = torch.randn(5, 6, 128, generator=g)  # 6 heads: a block of 8 or 4 leaves some masked
    args = (q, win, idx, lens, ext, eidx, elens, torch.linspace(-2, 2, 6), TINY.softmax_scale)
    monkeypatch.setattr(sa, "merge_heads_per_program", lambda heads, device: heads_per_program)
    torch.testing.assert_close(
        sparse_attention_triton(AttentionCall.of(*args), num_splits=4),
        sparse_attention_torch(AttentionCall.of(*args)), atol=ATOL, rtol=1e-5,
    )  # fmt: skip


def test_cuda_tolerance_covers_bf16_operand_rounding():
    """The GPU kernel rounds q, keys and softmax weights to bf16 once each (fp32 sums): that
    rounding, emulated in fp32 on random rows (flat and peaked softmaxes), stays within
    ``attention_tolerance`` for CUDA, with a margin."""
    g = torch.Generator().manual_seed(9)
    tol = attention_tolerance(torch.device("cuda"))
    assert dot_operand_dtype("cuda") == torch.bfloat16
    assert attention_tolerance("cpu") == pytest.approx(2e-5)
    bf16 = lambda x: x.bfloat16().float()  # noqa: E731
    worst = 0.0
    for q_scale in (1.0, 3.0):
        for _ in range(20):
            q, k = torch.randn(8, 128, generator=g) * q_scale, random_keys(144, 128, g)
            sink = torch.randn(8, generator=g)
            exact = sink_attention(q, k, sink, TINY.softmax_scale)
            logits = bf16(q) @ k.T * TINY.softmax_scale
            m = torch.maximum(logits.amax(-1), sink)
            p = torch.exp(logits - m[:, None])
            emulated = bf16(p) @ k / (p.sum(-1) + torch.exp(sink - m))[:, None]
            worst = max(worst, (emulated - exact).abs().max().item())
    assert 1e-3 < worst < tol / 1.5, worst


# ---------------------------------------------------------------------------- bad input
def _valid_args():
    g = torch.Generator().manual_seed(0)
    win, ext = (
        make_cache(random_keys(20, 128, g), 128, "dense"),
        make_cache(random_keys(8, 128, g), 64, "dense"),
    )
    idx, lens = random_indices([3, 4], 8, 20, g)
    eidx, elens = random_indices([1, 2], 4, 8, g)
    q = torch.randn(2, 8, 128, generator=g)
    return dict(
        q=q,
        window=win,
        swa_indices=idx,
        swa_lengths=lens,
        extra=ext,
        extra_indices=eidx,
        extra_lengths=elens,
        sink=torch.zeros(8),
        softmax_scale=TINY.softmax_scale,
    )


@pytest.mark.parametrize(
    "change, error, text",
    [
        (dict(q=torch.zeros(2, 8, 128, dtype=torch.float16)), BatchError, "q has shape"),
        (dict(sink=torch.zeros(4)), BatchError, "expected [8] float32"),
        (dict(softmax_scale=math.nan), BatchError, "softmax_scale=nan"),
        (dict(extra=None), BatchError, "must all be given"),
        (
            dict(
                swa_indices=torch.zeros(3, 8, dtype=torch.int32),
                swa_lengths=torch.ones(3, dtype=torch.int32),
            ),
            ContractError,
            "q has T=2",
        ),
        (dict(extra_indices=torch.zeros(2, 4, dtype=torch.int64)), BatchError, "extra_indices"),
        (dict(swa_lengths=torch.ones(2, dtype=torch.int64)), BatchError, "swa_lengths"),
        (dict(swa_indices=torch.full((2, 8), 20, dtype=torch.int32)), BatchError, "[0, 20)"),
        (dict(extra=TokenCache(8, 64, 32, 64, "dense")), BatchError, "head_dim 64"),
    ],
)
def test_bad_input_is_refused(change, error, text):
    """The op's checks run once, where a call is made (``AttentionCall.of``: the op's entry
    point and every variant take a checked call)."""
    args = _valid_args() | change
    with pytest.raises(error) as info:
        AttentionCall.of(**args)
    assert text in str(info.value)


def test_bad_split_count_is_refused():
    with pytest.raises(BatchError, match="num_splits=40"):
        sparse_attention_triton(AttentionCall.of(**_valid_args()), num_splits=40)
    with pytest.raises(BatchError, match="num_splits=0"):  # not taken as "pick one"
        sparse_attention_triton(AttentionCall.of(**_valid_args()), num_splits=0)


def test_bad_rows_per_group_is_refused():
    for bad in (0, -2, 1.5):
        with pytest.raises(BatchError, match=f"rows_per_group={bad}"):
            sparse_attention_triton(AttentionCall.of(**_valid_args(), rows_per_group=bad))


def test_rows_a_program_fill_one_wgmma_tile():
    """Rows packed a program: as many as make 64 M lines with the heads (at most the rows a
    request has, at most ``MAX_GROUP``); none at H = 64, none below a 16-line dot."""
    assert group_rows(64, 4) == 1
    assert group_rows(32, 4) == 2 and group_rows(16, 4) == 4 and group_rows(16, 3) == 3
    assert group_rows(8, 16) == 8 and group_rows(16, 1) == 1
    assert group_rows(4, 2) == 1  # 4 heads x 2 rows: an 8-line tile, below a dot's 16
    assert group_rows(4, 8) == 8


def test_default_split_count_fills_the_gpu():
    """At most one wave of programs: bs 1 at Flash shapes (one 64-head program per row)
    splits its 640 keys into as many chunks as SMs allow, never more than its key blocks or
    ``MAX_SPLITS``; a batch that fills the SMs alone takes one split; 0 rows are fine."""
    assert default_num_splits(1, 64, 640, 64, sms=132) == 10  # 10 key blocks of 64
    assert default_num_splits(1, 64, 640, 16, sms=132) == MAX_SPLITS
    assert default_num_splits(8, 64, 640, 64, sms=132) == 10  # 17 wanted, 10 blocks
    assert default_num_splits(64, 64, 640, 64, sms=132) == 2  # one wave: 128 programs
    assert default_num_splits(132, 64, 640, 64, sms=132) == 1
    assert default_num_splits(8, 8, 640, 64, sms=132) == 10  # tiny: 16-head programs
    assert 1 <= default_num_splits(0, 64, 640, 64, sms=132) <= MAX_SPLITS


def test_forced_split_count_applies_and_is_checked():
    """``force_num_splits`` pins the split count of launches without ``num_splits`` (the
    serving-mode tests use it) and refuses counts outside 1 ... MAX_SPLITS."""
    args = _valid_args()
    with force_num_splits(3):
        forced = sparse_attention_triton(AttentionCall.of(**args))
    torch.testing.assert_close(
        forced, sparse_attention_torch(AttentionCall.of(**args)), atol=ATOL, rtol=1e-5
    )
    for bad in (0, MAX_SPLITS + 1):
        with pytest.raises(BatchError, match=f"num_splits={bad}"), force_num_splits(bad):
            pass
