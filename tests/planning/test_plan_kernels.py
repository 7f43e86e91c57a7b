"""The planning kernels against their torch implementations, exactly.

``planning/kernels/compress_plan_tvm.py`` (TVM, symbolic ``num_rows``) vs
``planning.kernels.compress_plan_torch.compute_compress_plans``; the forced dispatch paths.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_backend.config import REQUIRED_PAGE_SIZE, compress_span
from dsv4_backend.errors import ConfigError, ContractError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.variants import Target, choose
from dsv4_backend.planning.kernels import table
from dsv4_backend.planning.kernels.compress_plan_call import CompressPlanCall
from dsv4_backend.planning.kernels.compress_plan_torch import compute_compress_plans
from dsv4_backend.planning.kernels.table import build_compress_plans

tvm = pytest.importorskip("tvm")

from dsv4_backend.planning.kernels import compress_plan_tvm as cpt  # noqa: E402

LLVM = json.dumps({"kind": "llvm"})
CUDA_SM90 = json.dumps({"kind": "cuda", "arch": "sm_90"})
PAGE = REQUIRED_PAGE_SIZE


def plan_inputs(
    prefixes: list[int], extends: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of requests extending ``prefix[b]`` by ``extend[b]`` tokens (any batch kind)."""
    extend = torch.tensor(extends, dtype=torch.int64)
    prefix = torch.tensor(prefixes, dtype=torch.int64)
    batch_ids = torch.repeat_interleave(torch.arange(len(extends)), extend)
    starts = torch.cumsum(extend, 0) - extend
    offsets = torch.arange(int(extend.sum())) - starts[batch_ids]
    first = prefix[batch_ids]
    return (
        batch_ids.to(torch.int32),
        first + offsets,
        first,
        (prefix + extend)[batch_ids].to(torch.int32),
    )


def assert_plans_equal(got: tuple, want: tuple) -> None:
    for g, w, name in zip(got, want, ("compress_plan", "write_plan"), strict=True):
        assert g.dtype == torch.int32 and g.shape == w.shape, name
        assert torch.equal(g, w), f"{name} differs:\n{g}\nvs torch\n{w}"


requests = st.lists(st.tuples(st.integers(0, 1100), st.integers(1, 400)), min_size=0, max_size=8)


# -------------------------------------------------------------------- TVM compress plans
@settings(max_examples=25, deadline=None)
@given(reqs=requests, ratio=st.sampled_from([4, 128]), page=st.sampled_from([64, PAGE]))
def test_tvm_plans_equal_torch(reqs: list[tuple[int, int]], ratio: int, page: int) -> None:
    inputs = plan_inputs([p for p, _ in reqs], [e for _, e in reqs])
    want = compute_compress_plans(CompressPlanCall(*inputs, ratio, page))
    assert_plans_equal(cpt.compress_plans_tvm(CompressPlanCall(*inputs, ratio, page)), want)


@settings(max_examples=15, deadline=None)
@given(reqs=requests, ratio=st.sampled_from([4, 128]), threads=st.sampled_from([7, 1024]))
def test_cuda_decomposition_on_cpu_equals_torch(
    reqs: list[tuple[int, int]], ratio: int, threads: int
) -> None:
    """The CUDA kernel's per-thread count / scan / emit / pad code, with its thread count,
    run as virtual threads on the CPU (chunks of several rows, uneven last chunks)."""
    inputs = plan_inputs([p for p, _ in reqs], [e for _, e in reqs])
    rows = inputs[0].shape[0]
    out = torch.full((rows, 4), 7, dtype=torch.int32), torch.full((rows, 4), 7, dtype=torch.int32)
    cpt.compiled_kernel(LLVM, threads)(*inputs, *out, ratio, compress_span(ratio), PAGE)
    assert_plans_equal(out, compute_compress_plans(CompressPlanCall(*inputs, ratio)))


def test_tvm_plans_arbitrary_rows_equal_torch() -> None:
    """Rows in no request order, negative window lengths, positions at every boundary."""
    g = torch.Generator().manual_seed(3)
    rows = 2000
    positions = torch.randint(0, 3000, (rows,), generator=g)
    inputs = (
        torch.randint(0, 50, (rows,), generator=g, dtype=torch.int32),
        positions,
        positions - torch.randint(-5, 300, (rows,), generator=g),
        (positions + torch.randint(1, 300, (rows,), generator=g)).to(torch.int32),
    )
    out = torch.empty(rows, 4, dtype=torch.int32), torch.empty(rows, 4, dtype=torch.int32)
    for ratio in (4, 128):
        want = compute_compress_plans(CompressPlanCall(*inputs, ratio))
        assert_plans_equal(cpt.compress_plans_tvm(CompressPlanCall(*inputs, ratio)), want)
        # The CUDA thread count: 2 rows per thread.
        kernel = cpt.compiled_kernel(LLVM, cpt.CUDA_THREADS)
        kernel(*inputs, *out, ratio, compress_span(ratio), PAGE)
        assert_plans_equal(out, want)


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("reqs", [[], [(0, 1)], [(3, 1)], [(127, 1)], [(6, 1)]])
def test_tvm_plans_edge_sizes(reqs: list[tuple[int, int]], ratio: int) -> None:
    inputs = plan_inputs([p for p, _ in reqs], [e for _, e in reqs])
    got = cpt.compress_plans_tvm(CompressPlanCall(*inputs, ratio))
    assert got[0].shape == (len(reqs), 4)
    assert_plans_equal(got, compute_compress_plans(CompressPlanCall(*inputs, ratio)))
    assert_plans_equal(build_compress_plans(*inputs, ratio), got)


def test_tvm_plan_records_by_hand() -> None:
    # One request extending 5 + 4 (positions 5..8, seq_len 9), ratio 4: entry ending at 7.
    got_c, got_w = cpt.compress_plans_tvm(CompressPlanCall(*plan_inputs([5], [4]), 4))
    assert got_c.tolist() == [[2, 0, 7, 3]] + [[-1] * 4] * 3
    # Kept from (9 // 4) * 4 - 4 = 4: every row; window_len = min(8, p - 5 + 1).
    assert got_w.tolist() == [[0, 0, 5, 1], [1, 0, 6, 2], [2, 0, 7, 3], [3, 0, 8, 4]]


def test_tvm_kernel_compiled_once() -> None:
    inputs = plan_inputs([0, 9], [5, 3])
    cpt.compress_plans_tvm(CompressPlanCall(*inputs, 4))
    before = cpt.compiled_kernel.cache_info()
    cpt.compress_plans_tvm(CompressPlanCall(*inputs, 128))  # another ratio: same kernel
    cpt.compress_plans_tvm(CompressPlanCall(*plan_inputs([2], [40]), 4))  # another T: same kernel
    after = cpt.compiled_kernel.cache_info()
    assert after.misses == before.misses
    assert after.hits == before.hits + 2


def test_tvm_mismatched_rows_raise_contract_error_before_the_call() -> None:
    rb, pos, first, seq = plan_inputs([0], [6])
    with pytest.raises(ContractError, match=r"symbolic dim num_rows.*request_seq_lens disagrees"):
        cpt.compress_plans_tvm(CompressPlanCall(rb, pos, first, seq[:5], 4))
    with pytest.raises(ContractError, match=r"row_batch_ids \(6,\) torch.int64"):
        cpt.compress_plans_tvm(CompressPlanCall(rb.long(), pos, first, seq, 4))
    with pytest.raises(ConfigError, match="ratio=8"):
        cpt.compress_plans_tvm(CompressPlanCall(rb, pos, first, seq, 8))


@pytest.mark.parametrize(
    ("bad", "tvm_says"),
    [
        ("compress_plan", "Mismatched compress_plan.shape[0]"),
        ("positions", "Mismatched positions.shape[0]"),
        ("write_plan_dtype", "Mismatched write_plan.dtype"),
    ],
)
def test_tvm_kernel_refusal_is_a_contract_error(bad: str, tvm_says: str) -> None:
    """The low-level entry has no checks of its own: TVM's symbolic-shape check refuses."""
    rb, pos, first, seq = plan_inputs([0, 4], [6, 2])
    c_plan, w_plan = torch.empty(8, 4, dtype=torch.int32), torch.empty(8, 4, dtype=torch.int32)
    if bad == "compress_plan":
        c_plan = c_plan[:7]  # planned for another T
    elif bad == "positions":
        pos = pos[:7]
    else:
        w_plan = w_plan.long()
    with pytest.raises(ContractError) as info:
        cpt.launch_compress_plan_kernel(rb, pos, first, seq, c_plan, w_plan, 4)
    message = str(info.value)
    assert "symbolic dim num_rows" in message
    assert tvm_says in message
    assert f"compress_plan {tuple(c_plan.shape)}" in message
    assert f"positions {tuple(pos.shape)}" in message


def test_table_picks_tvm_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpt.tvm_unavailable_reason("cpu") is None
    assert cpt.tvm_unavailable_reason("cuda") == cpt.cuda_unavailable_reason()
    cpu = Target.of("cpu")
    assert choose(table.COMPRESS_PLANS, cpu, None).name == "tvm"
    monkeypatch.setattr(table, "tvm_unavailable_reason", lambda device_type: "no tvm here")
    chosen = choose(table.COMPRESS_PLANS, cpu, None)
    assert chosen.name == "torch"
    with pytest.raises(ConfigError, match=r"the tvm compress_plans variant cannot run.*no tvm"):
        choose(table.COMPRESS_PLANS, cpu, ("tvm", "DSV4_COMPRESS_PLANS_KERNEL=tvm"))


def test_a_described_cuda_host_is_not_probed_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """``info``'s CUDA columns describe a host with sglang's libraries: the TVM variant runs
    there whatever this machine's nvcc says, and not without tvm-ffi; a real CUDA target is
    still probed."""
    monkeypatch.setattr(table, "tvm_unavailable_reason", lambda device_type: "no nvcc here")
    hopper = Target.cuda_host((9, 0))
    assert choose(table.COMPRESS_PLANS, hopper, None).name == "tvm"
    without_ffi = dataclasses.replace(hopper, libraries=hopper.libraries - {"tvm_ffi"})
    assert choose(table.COMPRESS_PLANS, without_ffi, None).name == "torch"
    real = dataclasses.replace(hopper, hypothetical=False)
    assert choose(table.COMPRESS_PLANS, real, None).name == "torch"


def test_cuda_kernel_builds() -> None:
    """The CUDA variant lowers (one block of 1024 threads, explicit barriers) and TVM emits its
    CUDA C (shipped and compiled in ``tests/planning/test_compress_plan_cuda.py``)."""
    lowered = cpt.lower_kernel(CUDA_SM90, cpt.CUDA_THREADS).script()
    assert '"threadIdx.x", 1024' in lowered
    assert lowered.count("tvm_storage_sync") == 3
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: the CUDA source was lowered but not compiled")
    source = cpt.compiled_kernel(CUDA_SM90, cpt.CUDA_THREADS).mod.imports[0].inspect_source()
    assert "__launch_bounds__(1024)" in source
    assert source.count("__syncthreads()") == 3


def test_forced_paths_and_their_refusals() -> None:
    cpu = torch.device("cpu")
    with dispatch.force_path(dispatch.TORCH):
        assert dispatch.select_path(cpu) == dispatch.TORCH
        refused = pytest.raises(ConfigError, match="'triton' was forced for tensors on cpu")
        with dispatch.force_path(dispatch.TRITON), refused:  # the innermost block wins
            dispatch.select_path(cpu)
        assert dispatch.select_path(cpu) == dispatch.TORCH
    unknown = pytest.raises(ConfigError, match=r"unknown kernel path 'cuda'; expected one of \(")
    with unknown, dispatch.force_path("cuda"):
        pass
    assert dispatch.select_path("meta") == dispatch.TORCH
