"""The pipelined FP8 sparse-attention kernel (interpreter) == the torch path on the same bytes.

Every row kind (decode rows at 64 heads, a request's verify / draft-extend rows taken together
at fewer heads, prefill rows of one request) and layer kind (window-only, c4, c128), one split
and several (the last split merges), rows without keys; the torch path is checked against the
reference in ``test_sparse_attention.py``. The kernel writes bf16, which the interpreter
rounds toward zero: ``rtol`` is one bf16 ulp (2^-7). Selection: ``DSV4_ATTENTION_KERNEL`` and
``force_attention_kernel``.
"""

from __future__ import annotations

import pytest
import torch
from attention_inputs import REQUEST_ROWS, make_cache, random_indices, random_keys, request_inputs
from marks import needs_interpreter

from dsv4_backend.compute.kernel_choice import describe
from dsv4_backend.errors import BatchError, ConfigError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention.common import AttentionCall, force_num_splits
from dsv4_backend.kernels.attention.pipelined import sparse_attention_pipelined
from dsv4_backend.kernels.attention.table import ATTENTION, sparse_attention_with_sink
from dsv4_backend.kernels.attention.torch import sparse_attention_torch
from dsv4_backend.kernels.attention.triton import sparse_attention_triton
from dsv4_backend.kernels.attention.ws import (
    sparse_attention_ws,
    ws_arch_reason,
    ws_inputs_reason,
)
from dsv4_backend.kernels.variants import force_variant, resolve

pytestmark = needs_interpreter

ATOL = 2e-5
#: One bf16 ulp: the interpreter truncates the kernel's bf16 output.
RTOL = 2**-7


def _assert_matches_torch(args, runs=((1, 1), (3, 1))) -> None:
    """The kernel at each ``(num_splits, rows_per_group)`` of ``runs`` == the torch path."""
    expected = sparse_attention_torch(AttentionCall.of(*args))
    for s, rows in runs:
        out = sparse_attention_pipelined(AttentionCall.of(*args, rows_per_group=rows), num_splits=s)
        assert out.dtype == torch.bfloat16 and out.shape == expected.shape
        torch.testing.assert_close(
            out.float(), expected, atol=ATOL, rtol=RTOL, msg=f"splits {s}, rows {rows}"
        )


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_prefill_rows_of_every_layer_kind(ratio):
    """Rows of one request at many positions (prefill; lengths across block boundaries, c128
    entries from the first), one row a program and a request's rows together."""
    seq_len, rows = REQUEST_ROWS[ratio]
    args, _ = request_inputs(ratio, seq_len, rows, "fp8", seed=30 + ratio)
    _assert_matches_torch(args, runs=((1, 1), (3, 4)))


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_verify_rows_together(ratio):
    """A request's verify / draft-extend rows (consecutive positions) at 8 heads: four rows a
    program over their union key list."""
    args, _ = request_inputs(ratio, 300, [200, 201, 202, 203], "fp8", seed=40 + ratio)
    _assert_matches_torch(args, runs=((1, 4), (2, 4)))


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_decode_rows_at_flash_heads(ratio):
    """Decode rows with all 64 heads in one program: random slots with holes, lengths 0 to
    the full width, more splits than a row has blocks (those splits write nothing)."""
    g = torch.Generator().manual_seed(50 + ratio)
    win = make_cache(random_keys(300, 128, g), 128, "fp8")
    idx, lens = random_indices([128, 1, 65, 0], 128, 300, g)
    extra = (None, None, None)
    if ratio:
        page = 64 if ratio == 4 else 2
        extra = (
            make_cache(random_keys(40, 128, g), page, "fp8"),
            *random_indices([16, 0, 9, 0], 16, 40, g),
        )
    q = torch.randn(4, 64, 128, generator=g)
    args = (q, win, idx, lens, *extra, torch.randn(64, generator=g), 128**-0.5)
    _assert_matches_torch(args, runs=((1, 1), (5, 1)))
    assert (
        sparse_attention_pipelined(AttentionCall.of(*args), num_splits=5)[3] == 0
    ).all()  # no key: 0


def test_flash_head_dim():
    """D = 512 (448 e4m3 + 64 bf16 channels, 7 scales a token; 16-key blocks)."""
    g = torch.Generator().manual_seed(60)
    win, ext = (
        make_cache(random_keys(100, 512, g), 128, "fp8"),
        make_cache(random_keys(30, 512, g), 64, "fp8"),
    )
    idx, lens = random_indices([40, 3], 64, 100, g)
    eidx, elens = random_indices([16, 5], 16, 30, g)
    q = torch.randn(2, 64, 512, generator=g)
    args = (q, win, idx, lens, ext, eidx, elens, torch.randn(64, generator=g), 512**-0.5)
    _assert_matches_torch(args, runs=((1, 1), (2, 1)))


def test_refuses_dense_caches():
    g = torch.Generator().manual_seed(61)
    win = make_cache(random_keys(20, 128, g), 128, "dense")
    idx, lens = random_indices([5], 8, 20, g)
    q = torch.randn(1, 8, 128, generator=g)
    with pytest.raises(BatchError, match="the window cache is dense"):
        sparse_attention_pipelined(
            AttentionCall.of(q, win, idx, lens, None, None, None, torch.zeros(8), 0.1)
        )


def test_selection(monkeypatch):
    """``sparse_attention_with_sink`` (what compute/layer.py calls) runs the pipelined variant
    when named (a bf16-rounded answer) and the triton one otherwise; named on dense caches it
    refuses them (no other kernel runs in its place), and the Gluon ws variant is refused in
    the interpreter; ``info``'s description says which variant runs."""
    args, _ = request_inputs(4, 40, [20, 39], "fp8", seed=62)
    with dispatch.force_path("triton-interpreter"), force_num_splits(2):
        default = sparse_attention_with_sink(AttentionCall.of(*args))
        assert torch.equal(default, sparse_attention_triton(AttentionCall.of(*args)))
        monkeypatch.setenv(ATTENTION.env, "pipelined")
        assert resolve(ATTENTION, "cpu").name == "pipelined"
        chosen = sparse_attention_with_sink(AttentionCall.of(*args))
        dense, _ = request_inputs(4, 40, [39], "dense", seed=62)
        with pytest.raises(BatchError, match="the window cache is dense"):
            sparse_attention_with_sink(AttentionCall.of(*dense))
        ops = describe("cpu")["ops"]["attention"]
        assert ops["chosen"]["here"] == {
            "variant": "pipelined",
            "why": "DSV4_ATTENTION_KERNEL=pipelined",
        }
    torch.testing.assert_close(chosen, default, atol=ATOL, rtol=RTOL)
    assert chosen.dtype == torch.float32
    assert torch.equal(chosen, chosen.bfloat16().float()) and not torch.equal(chosen, default)
    with force_variant(ATTENTION, "ws"), dispatch.force_path("triton-interpreter"):
        with pytest.raises(ConfigError, match="the ws attention variant cannot run on cpu"):
            sparse_attention_with_sink(AttentionCall.of(*args))
        here = describe("cpu")["ops"]["attention"]["chosen"]["here"]
        assert here["variant"] is None and "runs on the triton path" in here["error"]
    monkeypatch.setenv(ATTENTION.env, "fastest")
    with pytest.raises(ConfigError, match="DSV4_ATTENTION_KERNEL=fastest: unknown attention"):
        resolve(ATTENTION, "cpu")
    monkeypatch.delenv(ATTENTION.env)
    with force_variant(ATTENTION, "pipelined"):
        assert resolve(ATTENTION, "cpu").reason == "pinned by force_variant"
    assert resolve(ATTENTION, "cpu").name in ("triton", "torch")


def test_ws_takes_fp8_or_dense_bf16_caches_of_one_format_on_hopper_or_blackwell() -> None:
    """What the ws kernels take (Gluon: GPUs only), judged from the caches and shapes alone:
    fp8 caches or dense bf16 ones, not a mix, not fp32 storage, at most 64 heads of dim 512;
    compute capability 9.x or 10.x. On the CPU the launcher refuses with the reason."""
    g = torch.Generator().manual_seed(3)
    keys = random_keys(4, 512, g)
    fp8 = make_cache(keys, 64, "fp8")
    bf16 = make_cache(keys, 64, "dense", torch.bfloat16)
    assert ws_inputs_reason(fp8, fp8, 64, 512) is None
    assert ws_inputs_reason(bf16, bf16, 64, 512) is None
    assert ws_inputs_reason(bf16, None, 16, 512) is None
    assert "one format" in str(ws_inputs_reason(fp8, bf16, 64, 512))
    fp32 = make_cache(keys, 64, "dense")
    assert "torch.float32; dense caches must be bf16" in str(ws_inputs_reason(fp32, None, 64, 512))
    assert "128 heads of dim 512" in str(ws_inputs_reason(fp8, None, 128, 512))
    small = make_cache(random_keys(4, 128, g), 64, "dense", torch.bfloat16)
    assert "heads of dim 128" in str(ws_inputs_reason(small, None, 8, 128))
    assert ws_arch_reason((9, 0)) is None and ws_arch_reason((10, 3)) is None
    assert "compute capability 12.0" in str(ws_arch_reason((12, 0)))
    assert "compute capability 8.0" in str(ws_arch_reason((8, 0)))
    idx, lens = random_indices([3], 8, 4, g)
    q = torch.randn(1, 64, 512, generator=g).bfloat16()
    with pytest.raises(BatchError, match="CUDA devices only"):
        sparse_attention_ws(
            AttentionCall.of(q, bf16, idx, lens, None, None, None, torch.zeros(64), 0.1)
        )
