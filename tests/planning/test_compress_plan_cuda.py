"""The shipped CUDA source of the compress / write plan kernel
(``planning/kernels/compress_plan_cuda.cu``).

It is TVM's CUDA C for ``planning/kernels/compress_plan_tvm.py`` plus the tvm-ffi launcher; GPU
hosts build it with nvcc through tvm-ffi at run time. Here: the shipped file is what the generator
writes today (needs apache-tvm), it compiles for sm_90a (needs nvcc, not a GPU), and the
variant table reports the CUDA path or the reason it cannot run.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from dsv4_backend.kernels.variants import Target, choose
from dsv4_backend.planning.kernels import compress_plan_tvm as cpt
from dsv4_backend.planning.kernels import table


def test_shipped_cuda_source_is_regenerated_unchanged() -> None:
    pytest.importorskip("tvm")
    assert cpt.CUDA_SOURCE.read_text() == cpt.generate_cuda_source(), (
        "compress_plan_cuda.cu is stale: run "
        "python -m dsv4_backend.planning.kernels.compress_plan_tvm"
    )


def test_shipped_cuda_source_is_package_data() -> None:
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert '"dsv4_backend.planning.kernels" = ["*.cu"]' in pyproject
    source = cpt.CUDA_SOURCE.read_text()
    assert source.count("__syncthreads()") == 3  # count | scan rounds (read, write) | emit
    assert f"void {cpt.CUDA_ENTRY}(" in source
    assert "compress_plan_kernel_kernel<<<1, kThreads, 0, stream>>>" in source


@pytest.mark.compiled
def test_shipped_cuda_source_compiles_for_sm90a(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvcc compiles kernel and launcher, as tvm-ffi builds them on a GPU host (no linking:
    this machine may lack libcudart). The build directory sits beside Triton's cache, as the
    compile checks' figures do: tvm-ffi's ninja build rebuilds only what changed (about 10 s
    of CPU a cold compile)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    tvm_ffi_cpp = pytest.importorskip("tvm_ffi.cpp")
    from triton import knobs

    monkeypatch.setenv("TVM_FFI_CUDA_ARCH_LIST", "9.0a")
    build = Path(knobs.cache.dir) / "dsv4-nvcc" / "compress_plan_sm90a"
    build.mkdir(parents=True, exist_ok=True)
    obj = tvm_ffi_cpp.build_inline(
        name="dsv4_compress_plan",
        cuda_sources=cpt.CUDA_SOURCE.read_text(),
        functions=[cpt.CUDA_ENTRY],
        build_directory=str(build),
        output="compress_plan.o",
    )
    assert Path(obj).stat().st_size > 0 and Path(obj).parent == build


def test_cuda_path_or_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's ``tvm`` variant runs on CUDA exactly when tvm-ffi, nvcc and a CUDA device
    are there; else ``torch`` runs and the ``tvm`` row says why (here, and with the toolkit and
    the device faked present or absent)."""
    reason = cpt.cuda_unavailable_reason()
    assert cpt.tvm_unavailable_reason("cuda") == reason
    # A CUDA device of this process, as Target.of gives it (not info's described host)
    hopper = dataclasses.replace(Target.cuda_host((9, 0)), hypothetical=False)
    tvm = table.COMPRESS_PLANS["tvm"]
    # the live check, not the process's cached one, so the fakes below take effect
    monkeypatch.setattr(table, "tvm_unavailable_reason", lambda kind: cpt.cuda_unavailable_reason())
    assert tvm.unmet(hopper) == reason
    assert choose(table.COMPRESS_PLANS, hopper, None).name == ("torch" if reason else "tvm")
    pytest.importorskip("tvm_ffi")
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose(table.COMPRESS_PLANS, hopper, None).name == "tvm"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tvm.unmet(hopper) == "no CUDA device"


def test_cuda_tensors_use_the_shipped_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA tensors get the tvm-ffi build of the shipped source, never TVM's compiler."""
    shipped = object()
    monkeypatch.setattr(cpt, "cuda_kernel", lambda: shipped)
    monkeypatch.setattr(cpt, "compiled_kernel", lambda *a: pytest.fail("TVM compiler used"))
    assert cpt._kernel_for(torch.device("cuda", 0)) == (shipped, True)
