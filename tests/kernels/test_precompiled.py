"""Precompiled kernels (``kernels/device/precompiled.py``, built by ``tools/precompile.py``).

Hopper's ws attention kernel is compiled here for sm_90a (once a session, in a subprocess with
``TRITON_INTERPRET=0``) into a package; its metadata is checked against the PTX ``.entry``
(parsed here, apart from the code under test), the launcher's argument packing against the
arguments ``sparse_attention_ws`` passes, the lookup and the reason a Triton without the Gluon
APIs gives. The launch itself (``cuLaunchKernel`` through libcuda) needs a GPU: it runs in
``scripts/gpu_check.sh`` (``DSV4_PRECOMPILED_DIR`` set, Triton 3.6), not here.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
from attention_inputs import make_cache, random_indices, random_keys

from dsv4_backend.errors import ContractError
from dsv4_backend.kernels.attention import ws as wa
from dsv4_backend.kernels.attention.common import AttentionCall, key_spans
from dsv4_backend.kernels.device import precompiled

#: The configuration compiled: fp8 caches, a compressed layer, 5 ... 8 splits.
CONFIG = "ws-fp8-extra-bs8"
SPLITS = 5
#: PTX parameter types by kind (a pointer: .u64 with .ptr).
PTX_TYPES = {"i32": ("u32", "b32", "s32"), "i64": ("u64", "b64", "s64"), "fp32": ("f32",)}
PTX_SIZES = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}
CTYPES: dict[str, type[ctypes.c_int32 | ctypes.c_int64 | ctypes.c_float]] = {
    "i32": ctypes.c_int32,
    "i64": ctypes.c_int64,
    "fp32": ctypes.c_float,
}


def _launch(block_s: int = 8, fp8: bool = True, has_extra: bool = True) -> tuple[Any, dict]:
    """Hopper's ws kernel and its launch keyword arguments at Flash's shapes."""
    return wa.ws_kernel(9, 512, 448, block_s, has_extra, fp8)


@pytest.fixture(scope="session")
def package(tmp_path_factory) -> tuple[Path, precompiled.PrecompiledKernel, str]:
    """The package directory holding :data:`CONFIG` for sm_90a, its kernel and its PTX."""
    out = tmp_path_factory.mktemp("precompiled")
    command = [sys.executable, "-m", "dsv4_backend.tools.precompile", "--target", "sm_90a"]
    subprocess.run(
        [*command, "--out", str(out), "--ptx", CONFIG],
        check=True,
        env={**os.environ, "TRITON_INTERPRET": "0"},
        capture_output=True,
        text=True,
    )
    (meta,) = out.glob("*.json")
    return out, precompiled.PrecompiledKernel.load(out, meta.stem), meta.with_suffix(".ptx")


def _ptx_entry(ptx: str) -> tuple[str, list[tuple[str, bool, str]]]:
    """The entry's name and its parameters ``(type, is a pointer, name)`` in order."""
    entry = re.search(r"\.visible\s+\.entry\s+(\w+)\s*\(([^)]*)\)", ptx)
    assert entry is not None, "no .entry in the PTX"
    params = []
    for line in entry.group(2).split(","):
        tokens = line.split()
        assert tokens[0] == ".param", line
        params.append((tokens[1].lstrip("."), ".ptr" in tokens, tokens[-1]))
    return entry.group(1), params


@pytest.mark.compiled
def test_metadata_matches_the_ptx_entry(package) -> None:
    _, kernel, ptx_path = package
    ptx = ptx_path.read_text()
    name, entry = _ptx_entry(ptx)
    assert name == kernel.kernel_name == "_ws_attention_kernel"
    assert [p[2] for p in entry] == [f"{name}_param_{i}" for i in range(len(entry))]
    declared = [*kernel.params, *kernel.scratch]
    assert len(entry) == len(declared) == 30  # 28 runtime arguments, 2 scratch pointers
    for (ptx_type, pointer, _), param in zip(entry, kernel.params, strict=False):
        if param.kind.startswith("*"):
            assert (ptx_type, pointer) == ("u64", True), param
        else:
            assert ptx_type in PTX_TYPES[param.kind] and not pointer, param
    for ptx_type, pointer, _ in entry[len(kernel.params) :]:
        assert (ptx_type, pointer) == ("u64", True)
    assert [s.name for s in kernel.scratch] == ["global_scratch", "profile_scratch"]
    assert all(s.size == 0 for s in kernel.scratch)  # passed as null pointers
    reqntid = re.search(r"\.reqntid\s+(\d+)", ptx)
    assert reqntid is not None and kernel.threads == int(reqntid.group(1))
    # Warp specialisation: the softmax warpgroup (num_warps) plus the value and producer ones.
    assert kernel.options == {"num_warps": 4} and kernel.threads == 3 * 128
    assert 48 * 1024 < kernel.shared <= 227 * 1024
    assert kernel.cubin[:4] == b"\x7fELF" and kernel.kernel_name.encode() in kernel.cubin
    _, launch = _launch()
    assert kernel.constexprs == {k: v for k, v in launch.items() if k != "num_warps"}
    assert (kernel.target, kernel.triton_version) == ("sm_90a", triton.__version__)


def _inputs(splits: int = SPLITS) -> tuple:
    """The arguments ``sparse_attention_ws`` passes for 6 rows of a compressed fp8 layer
    (CPU tensors: the launcher's own argument builder)."""
    g = torch.Generator().manual_seed(0)
    window = make_cache(random_keys(300, 512, g), 128, "fp8")
    ext = make_cache(random_keys(200, 512, g), 64, "fp8")
    idx, lens = random_indices([128, 1, 77, 0, 128, 128], 128, 300, g)
    eidx, elens = random_indices([512, 3, 0, 0, 100, 512], 512, 200, g)
    q = torch.randn(6, 64, 512, generator=g).bfloat16()
    spans = key_spans(window, idx, lens, (ext, eidx, elens), 64)
    args, _ = wa.ws_arguments(q, window, spans, torch.randn(64, generator=g), 512**-0.5, splits)
    return args


def _replaced(kernel: precompiled.PrecompiledKernel, args: tuple, name: str, value) -> tuple:
    index = [p.name for p in kernel.params].index(name)
    return (*args[:index], value, *args[index + 1 :])


@pytest.mark.compiled
def test_packing_points_at_each_value(package, monkeypatch) -> None:
    _, kernel, ptx_path = package
    _, entry = _ptx_entry(ptx_path.read_text())
    monkeypatch.setattr(precompiled, "_is_cuda", lambda tensor: True)  # CPU tensors stand in
    args = _inputs()
    packed = kernel.pack_arguments(args)
    assert len(packed.params) == len(entry) == len(packed.values)
    assert packed.device == torch.device("cpu")
    assert len(packed.tensors) == sum(isinstance(a, torch.Tensor) for a in args) == 12
    for i, (param, value) in enumerate(zip(kernel.params, args, strict=True)):
        assert packed.params[i] == ctypes.addressof(packed.values[i])
        assert ctypes.sizeof(packed.values[i]) == PTX_SIZES[entry[i][0]], param
        if param.kind.startswith("*"):
            pointer = ctypes.cast(packed.params[i], ctypes.POINTER(ctypes.c_uint64))
            assert pointer.contents.value == value.data_ptr(), param
        else:
            scalar = ctypes.cast(packed.params[i], ctypes.POINTER(CTYPES[param.kind]))
            assert scalar.contents.value == pytest.approx(value, rel=2**-23), param
    for i in range(len(kernel.params), len(entry)):  # the scratch pointers: null
        assert ctypes.cast(packed.params[i], ctypes.POINTER(ctypes.c_uint64)).contents.value == 0
    # An int device address is taken as it is.
    address = args[0].data_ptr() + 4096
    repacked = kernel.pack_arguments(_replaced(kernel, args, "q_ptr", address))
    assert ctypes.cast(repacked.params[0], ctypes.POINTER(ctypes.c_uint64)).contents.value == (
        address
    )


@pytest.mark.compiled
@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("q_ptr", lambda q: q.float(), r"q_ptr is a torch.float32 tensor; expected torch.bfloat16"),
        ("q_ptr", lambda q: q.view(-1)[1:], r"q_ptr is at 0x[0-9a-f]+; .*16-byte aligned"),
        ("win_idx_ptr", lambda t: t.data_ptr() + 4, r"win_idx_ptr is at .*16-byte aligned"),
        ("count_ptr", lambda t: -1, r"count_ptr=-1; expected a device address"),
        ("H", lambda h: 2**31, r"H=2147483648; expected an int in -2147483648 \.\.\. 2147483647"),
        ("H", lambda h: True, r"H=True; expected an int"),
        ("stride_qt", lambda s: s + 8, r"stride_qt=32776; .*multiple of 16"),
        ("qk_scale", lambda s: 1, r"qk_scale=1; expected a Python float"),
        ("qk_scale", lambda s: 1e39, r"qk_scale=1e\+39; expected a Python float in float32"),
    ],
)
def test_packing_refuses_bad_arguments(package, monkeypatch, name, bad, message) -> None:
    _, kernel, _ = package
    monkeypatch.setattr(precompiled, "_is_cuda", lambda tensor: True)
    args = _inputs()
    value = args[[p.name for p in kernel.params].index(name)]
    with pytest.raises(ContractError, match=message):
        kernel.pack_arguments(_replaced(kernel, args, name, bad(value)))


@pytest.mark.compiled
def test_packing_refuses_missing_arguments_and_cpu_tensors(package) -> None:
    _, kernel, _ = package
    args = _inputs()
    with pytest.raises(ContractError, match=r"takes 28 runtime arguments .*missing \['qk_scale'\]"):
        kernel.pack_arguments(args[:-1])
    with pytest.raises(ContractError, match="more than its parameters"):
        kernel.pack_arguments((*args, 0))
    with pytest.raises(ContractError, match="q_ptr is on cpu; expected a CUDA tensor"):
        kernel.pack_arguments(args)
    # launch checks its arguments before it touches the driver (none here).
    with pytest.raises(ContractError, match="q_ptr is on cpu"):
        kernel.launch((6, SPLITS), args)
    with pytest.raises(ContractError, match=r"grid=\(6, 5, 1, 1\); expected 1 to 3 counts"):
        kernel.launch((6, SPLITS, 1, 1), args)


@pytest.mark.compiled
def test_an_empty_grid_launches_nothing(package, monkeypatch) -> None:
    _, kernel, _ = package
    monkeypatch.setattr(precompiled, "_is_cuda", lambda tensor: True)
    monkeypatch.setattr(precompiled, "_driver", lambda: pytest.fail("the driver was called"))
    assert kernel.launch((0, SPLITS), _inputs()) is None


@pytest.mark.compiled
def test_the_package_arguments_are_what_sparse_attention_ws_passes(package) -> None:
    """Every launch the builder covers has the kinds ``ws_signature`` names for the arguments
    ``ws_arguments`` builds (dtypes, count), with one split and several."""
    _, kernel, _ = package
    for splits in (1, SPLITS):
        args = _inputs(splits)
        kinds, aligned = wa.ws_signature(*_launch(triton.next_power_of_2(splits)))
        assert list(kinds) == [p.name for p in kernel.params]
        assert ("stride_pt" in aligned) is (splits > 1)  # a [1] placeholder with one split
        for (name, kind), value in zip(kinds.items(), args, strict=True):
            if kind.startswith("*"):
                assert value.dtype == precompiled._POINTER_DTYPES[kind[1:]], name
            else:
                assert isinstance(value, float if kind == "fp32" else int), name
            if name in aligned and not kind.startswith("*"):
                assert value % 16 == 0, (name, value)
    assert kernel.divisible_by_16 == wa.ws_signature(*_launch())[1]


@pytest.mark.compiled
def test_find(package, tmp_path, monkeypatch) -> None:
    directory, kernel, _ = package
    fn, launch = _launch()
    assert precompiled.find(directory, fn, launch, "sm_90a") == kernel
    assert precompiled.find(tmp_path, fn, launch, "sm_90a") is None
    assert precompiled.find(None, fn, launch, "sm_90a") is None
    assert precompiled.find(directory, *_launch(block_s=4), "sm_90a") is None
    assert precompiled.find(directory, fn, launch, "sm_100a") is None
    assert precompiled.find(directory, fn, {**launch, "num_warps": 8}, "sm_90a") is None
    monkeypatch.setenv(precompiled.DIRECTORY_ENV, str(directory))
    assert precompiled.precompiled_directory() == directory
    monkeypatch.delenv(precompiled.DIRECTORY_ENV)
    assert precompiled.precompiled_directory() is None


def test_the_key_follows_the_source(monkeypatch) -> None:
    fn, launch = _launch()
    key = precompiled.kernel_key(fn, launch, "sm_90a")
    assert key.startswith("_ws_attention_kernel-sm_90a-")
    assert precompiled.kernel_key(fn, launch, "sm_100a") != key
    assert precompiled.kernel_key(*_launch(block_s=16), "sm_90a") != key
    # A dependency's source and a global constexpr a partition reads are part of it.
    monkeypatch.setattr(wa, "producer_partition", wa._value_partition)
    assert precompiled.kernel_key(fn, launch, "sm_90a") != key
    monkeypatch.undo()
    assert precompiled.kernel_key(fn, launch, "sm_90a") == key
    monkeypatch.setattr(wa, "LOG2E", type(wa.LOG2E)(1.0))
    assert precompiled.kernel_key(fn, launch, "sm_90a") != key


@pytest.mark.compiled
def test_load_refuses_malformed_metadata(package, tmp_path) -> None:
    directory, kernel, _ = package
    for suffix in (".json", ".cubin"):
        shutil.copy(directory / f"{kernel.key}{suffix}", tmp_path)
    meta = json.loads((tmp_path / f"{kernel.key}.json").read_text())

    def load_with(drop: str = "", **changes):
        changed = {k: v for k, v in meta.items() if k != drop} | changes
        (tmp_path / f"{kernel.key}.json").write_text(json.dumps(changed))
        return precompiled.PrecompiledKernel.load(tmp_path, kernel.key)

    assert load_with() == kernel
    with pytest.raises(ContractError, match="format 2; expected 1"):
        load_with(format=2)
    params = [*meta["params"][:-1], {"name": "qk_scale", "kind": "f16x"}]
    with pytest.raises(ContractError, match="qk_scale has kind 'f16x'"):
        load_with(params=params)
    with pytest.raises(ContractError, match=r"divisible_by_16 names no parameter: \['nope'\]"):
        load_with(divisible_by_16=["nope"])
    with pytest.raises(ContractError, match="missing or malformed field 'threads'"):
        load_with(drop="threads")
    with pytest.raises(ContractError, match="key 'other'; expected"):
        load_with(key="other")
    (tmp_path / f"{kernel.key}.cubin").unlink()
    with pytest.raises(ContractError, match="cannot be read"):
        load_with()


@pytest.mark.compiled
def test_ws_reason_names_the_triton_and_the_missing_kernel(package, tmp_path, monkeypatch):
    directory = package[0]
    g = torch.Generator().manual_seed(0)
    window = make_cache(random_keys(8, 512, g), 128, "fp8")
    extra = make_cache(random_keys(8, 512, g), 64, "fp8")
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert wa.missing_gluon_apis() == ()  # this Triton (3.8) compiles them: no package needed
    monkeypatch.delenv(precompiled.DIRECTORY_ENV, raising=False)
    assert wa.ws_unsupported_reason(cuda, window, extra, 64, 512) is None
    # A Triton without the Gluon APIs (3.6) and no package.
    monkeypatch.setattr(wa, "missing_gluon_apis", lambda: ("mbarrier.allocate_mbarrier",))
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    reason = str(wa.ws_unsupported_reason(cuda, window, extra, 64, 512))
    assert "Triton 3.6.0 cannot compile the Gluon ws kernels" in reason
    assert "lacks mbarrier.allocate_mbarrier" in reason
    assert "no precompiled _ws_attention_kernel for sm_90a with D=512" in reason
    assert "DSV4_PRECOMPILED_DIR is not set" in reason
    monkeypatch.setenv(precompiled.DIRECTORY_ENV, str(tmp_path))
    reason = str(wa.ws_unsupported_reason(cuda, window, extra, 64, 512, splits=SPLITS))
    key = precompiled.kernel_key(*_launch(), "sm_90a")
    assert f"DSV4_PRECOMPILED_DIR={tmp_path} has no {key}.json" in reason
    assert "BLOCK_S=8" in reason and "FP8=True" in reason and "HAS_EXTRA=True" in reason
    # The package holds this launch's kernel, not the other split counts' or layer kinds'.
    monkeypatch.setenv(precompiled.DIRECTORY_ENV, str(directory))
    assert wa.ws_unsupported_reason(cuda, window, extra, 64, 512, splits=SPLITS) is None
    assert "BLOCK_S=1," in str(wa.ws_unsupported_reason(cuda, window, extra, 64, 512))
    assert "HAS_EXTRA=False" in str(wa.ws_unsupported_reason(cuda, window, None, 64, 512, 8))
    assert "BLOCK_S=2," in str(wa.ws_unsupported_reason(cuda, window, extra, 64, 512, 2))


@pytest.mark.compiled
def test_sparse_attention_ws_launches_the_precompiled_kernel(package, monkeypatch) -> None:
    """Under a Triton without the Gluon APIs ``sparse_attention_ws`` hands the package's
    kernel its grid and arguments (the device and the launch itself simulated: CPU tensors,
    the launch recorded), with an fp32 q rounded to bf16 as the kernel would."""
    directory, kernel, _ = package
    launches = []
    monkeypatch.setenv(precompiled.DIRECTORY_ENV, str(directory))
    monkeypatch.setattr(wa, "missing_gluon_apis", lambda: ("gl.barrier",))
    monkeypatch.setattr(wa, "ws_unsupported_reason", lambda *args: None)  # (a CPU device)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(precompiled, "_is_cuda", lambda tensor: True)
    monkeypatch.setattr(
        precompiled.PrecompiledKernel,
        "launch",
        lambda self, grid, args: launches.append((self, grid, self.pack_arguments(args))),
    )
    g = torch.Generator().manual_seed(0)
    window = make_cache(random_keys(300, 512, g), 128, "fp8")
    ext = make_cache(random_keys(200, 512, g), 64, "fp8")
    idx, lens = random_indices([128, 1, 77, 0, 128, 128], 128, 300, g)
    eidx, elens = random_indices([512, 3, 0, 0, 100, 512], 512, 200, g)
    q = torch.randn(6, 64, 512, generator=g)
    args = (q, window, idx, lens, ext, eidx, elens, torch.randn(64, generator=g), 512**-0.5)
    out = wa.sparse_attention_ws(AttentionCall.of(*args), num_splits=SPLITS)
    ((launched, grid, packed),) = launches
    assert launched == kernel and grid == (6, SPLITS)
    q_sent = packed.tensors[0]
    assert q_sent.dtype == torch.bfloat16 and torch.equal(q_sent, q.bfloat16())
    assert packed.tensors[8] is out and out.shape == (6, 64, 512)
    assert out.dtype == torch.bfloat16


def _has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_has_driver(), reason="the CUDA driver is installed here")
def test_the_launcher_says_when_the_driver_is_missing() -> None:
    with pytest.raises(precompiled.CudaDriverError, match=r"libcuda\.so\.1.*cannot be loaded"):
        precompiled._Driver()
