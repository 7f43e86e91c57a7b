"""Kernels compiled ahead of time, launched through the CUDA driver API (no Triton at run time).

The Gluon ``ws`` attention kernels use Triton 3.8's APIs; a host with an older Triton (the GPU
check's image has Triton 3.6) cannot compile them, so they are compiled elsewhere with 3.8
(``dsv4_backend.tools.precompile``) and carried as cubins with their launch metadata. This
module needs neither Triton nor a GPU to import; :meth:`PrecompiledKernel.launch` needs the
driver (``libcuda.so.1``, through ctypes) and a CUDA device.

A package is a directory (:data:`DIRECTORY_ENV` names the one the launchers look in) with two
files per kernel, ``<key>.cubin`` and ``<key>.json``. The key (:func:`kernel_key`) hashes the
function's qualified name, the source fingerprint of the code it was compiled from
(:func:`kernel_fingerprint`: a package built from other source is never found), the target
and the constexprs and launch options. The JSON holds:

* ``kernel_name`` (the cubin's entry symbol), ``function``, ``fingerprint``, ``target``
  (``sm_90a``), ``triton_version`` (of the build), ``constexprs``, ``options``
  (``num_warps``, as the launch passes it);
* ``params``: the runtime parameters in order, ``{"name", "kind"}`` with kind ``*bf16`` /
  ``*u8`` / ``*i32`` / ``*fp32`` ... (a pointer), ``i32``, ``i64`` or ``fp32``;
* ``divisible_by_16``: the parameters the kernel was compiled to assume 16-divisible (a
  pointer: 16-byte aligned). No integer is specialised to 1 (Triton's JIT does that for
  arguments equal to 1; a precompiled kernel must serve every value);
* ``threads`` (the block: ``.reqntid`` of the PTX, which for a warp-specialised kernel counts
  every partition's warps, not ``num_warps``), ``shared`` (dynamic shared memory bytes);
* ``scratch``: the pointers Triton appends after the parameters, in order (Triton 3.8:
  ``global_scratch``, then ``profile_scratch``), with the bytes a program needs and their
  alignment; a zero size is passed as a null pointer.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import inspect
import json
import math
import os
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dsv4_backend import envs
from dsv4_backend.errors import ContractError

#: Environment variable naming the directory of precompiled kernels.
DIRECTORY_ENV = envs.PRECOMPILED_DIR.name
#: Version of the JSON layout (a loader refuses another).
FORMAT = 1
#: The pointers Triton 3.8's launcher appends after a kernel's parameters, in order.
SCRATCH_NAMES = ("global_scratch", "profile_scratch")

#: ctypes types of the scalar kinds.
_SCALARS: dict[str, type[ctypes.c_int32] | type[ctypes.c_int64] | type[ctypes.c_float]] = {
    "i32": ctypes.c_int32,
    "i64": ctypes.c_int64,
    "fp32": ctypes.c_float,
}
_INT_RANGE = {"i32": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1)}
#: Tensor dtypes of the pointer kinds whose element type torch names alike.
_POINTER_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
    "i8": torch.int8,
    "u8": torch.uint8,
    "i16": torch.int16,
    "i32": torch.int32,
    "i64": torch.int64,
}
_FLOAT32_MAX = 3.4028234663852886e38
#: Dynamic shared memory a launch gets without opting in (cuFuncSetAttribute).
_DEFAULT_SHARED = 48 * 1024
#: ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``.
_MAX_DYNAMIC_SHARED_ATTRIBUTE = 8


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed (the message names the call and the driver's error)."""


# ------------------------------------------------------------------------------ identity
def qualified_name(function: Any) -> str:
    """``module.name`` of a ``@triton.jit`` / ``@gluon.jit`` function (or a plain one)."""
    fn = getattr(function, "fn", function)
    return f"{fn.__module__}.{fn.__qualname__}"


def _python_function(obj: Any) -> types.FunctionType | None:
    """The Python function of a project JIT function (None for anything else, Triton's own
    functions included: their code is baked into the cubin with the Triton that built it)."""
    fn = getattr(obj, "fn", None)
    if isinstance(fn, types.FunctionType) and not fn.__module__.startswith("triton"):
        return fn
    return None


def kernel_fingerprint(function: Any) -> str:
    """sha256 of the source of ``function`` and of every project JIT function it reaches by
    global name, with the global constexprs and numbers they read: what the cubin was compiled
    from. Independent of the Triton version and of ``TRITON_INTERPRET`` (it reads the Python
    functions, not Triton's wrappers)."""
    root = _python_function(function)
    if root is None:
        raise ContractError(f"{function!r} is not a @triton.jit / @gluon.jit function")
    parts: dict[str, str] = {}
    stack = [root]
    while stack:
        fn = stack.pop()
        name = f"{fn.__module__}.{fn.__qualname__}"
        if name in parts:
            continue
        parts[name] = inspect.getsource(fn)
        for global_name in fn.__code__.co_names:
            if global_name not in fn.__globals__:
                continue
            value = fn.__globals__[global_name]
            if (dependency := _python_function(value)) is not None:
                stack.append(dependency)
            elif type(value).__name__ == "constexpr" and hasattr(value, "value"):
                parts[f"{fn.__module__}:{global_name}"] = repr(value.value)
            elif isinstance(value, (bool, int, float)):
                parts[f"{fn.__module__}:{global_name}"] = repr(value)
    text = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def split_options(function: Any, launch: Mapping[str, Any]) -> tuple[dict, dict]:
    """A launch's keyword arguments as ``(constexprs, options)``: the function's parameters,
    and the rest (``num_warps``...)."""
    names = set(getattr(function, "arg_names", ()))
    constexprs = {k: v for k, v in launch.items() if k in names}
    return constexprs, {k: v for k, v in launch.items() if k not in names}


def kernel_key(function: Any, launch: Mapping[str, Any], target: str) -> str:
    """The package key of ``function`` compiled for ``target`` with the keyword arguments of
    ``launch`` (constexprs and options): ``<name>-<target>-<hash>``."""
    constexprs, options = split_options(function, launch)
    identity = dict(
        function=qualified_name(function),
        fingerprint=kernel_fingerprint(function),
        target=target,
        constexprs=constexprs,
        options=options,
    )
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return f"{getattr(function, 'fn', function).__name__}-{target}-{digest[:20]}"


def precompiled_directory() -> Path | None:
    """The directory :data:`DIRECTORY_ENV` names (None when it is unset or empty)."""
    value = envs.PRECOMPILED_DIR.get()
    return Path(value) if value else None


# ------------------------------------------------------------------------------ metadata
@dataclasses.dataclass(frozen=True)
class Param:
    """A runtime parameter: its name and kind (``*bf16``: a pointer; ``i32``, ``i64``,
    ``fp32``)."""

    name: str
    kind: str


@dataclasses.dataclass(frozen=True)
class Scratch:
    """A pointer Triton appends to the parameters: ``size`` bytes a program (0: null),
    aligned to ``align``."""

    name: str
    size: int
    align: int


@dataclasses.dataclass(frozen=True)
class PackedArguments:
    """:meth:`PrecompiledKernel.pack_arguments`' result. ``params`` is the ``void *[]``
    ``cuLaunchKernel`` takes (entry i points at parameter i's value); ``values`` holds those
    values (ctypes scalars) and ``tensors`` the tensors passed, alive while this is.
    ``device``: the CUDA device of the tensors (None when every pointer was an int)."""

    params: ctypes.Array[ctypes.c_void_p]
    values: tuple[ctypes.c_uint64 | ctypes.c_int32 | ctypes.c_int64 | ctypes.c_float, ...]
    tensors: tuple[torch.Tensor, ...]
    device: torch.device | None


def _is_cuda(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on a CUDA device (a seam the CPU tests replace)."""
    return tensor.device.type == "cuda"


@dataclasses.dataclass(frozen=True)
class PrecompiledKernel:
    """One compiled kernel and what launching it needs (the module docstring's JSON)."""

    key: str
    kernel_name: str
    function: str
    fingerprint: str
    target: str
    triton_version: str
    constexprs: dict[str, Any]
    options: dict[str, Any]
    params: tuple[Param, ...]
    divisible_by_16: frozenset[str]
    threads: int
    shared: int
    scratch: tuple[Scratch, ...]
    cubin: bytes = dataclasses.field(repr=False)

    # -------------------------------------------------------------------------- files
    def metadata(self) -> dict[str, Any]:
        """The JSON object of ``<key>.json``."""
        return dict(
            format=FORMAT,
            key=self.key,
            kernel_name=self.kernel_name,
            function=self.function,
            fingerprint=self.fingerprint,
            target=self.target,
            triton_version=self.triton_version,
            constexprs=self.constexprs,
            options=self.options,
            params=[dataclasses.asdict(p) for p in self.params],
            divisible_by_16=sorted(self.divisible_by_16),
            threads=self.threads,
            shared=self.shared,
            scratch=[dataclasses.asdict(s) for s in self.scratch],
        )

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``<key>.cubin`` and ``<key>.json`` into ``directory`` (created if needed);
        the JSON last, so a reader that finds it finds the cubin."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        (root / f"{self.key}.cubin").write_bytes(self.cubin)
        tmp = root / f".{self.key}.json.tmp"
        tmp.write_text(json.dumps(self.metadata(), indent=1, sort_keys=True) + "\n")
        tmp.replace(root / f"{self.key}.json")

    @classmethod
    def load(cls, directory: str | os.PathLike[str], key: str) -> PrecompiledKernel:
        """The kernel ``key`` of ``directory``; ``ContractError`` naming the file when it is
        missing or malformed."""
        path = Path(directory) / f"{key}.json"
        try:
            meta = json.loads(path.read_text())
            cubin = path.with_suffix(".cubin").read_bytes()
        except (OSError, ValueError) as exc:
            raise ContractError(f"precompiled kernel {path} cannot be read: {exc}") from exc
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else meta
            raise ContractError(f"{path}: format {found!r}; expected {FORMAT}")
        try:
            kernel = cls(
                key=meta["key"],
                kernel_name=meta["kernel_name"],
                function=meta["function"],
                fingerprint=meta["fingerprint"],
                target=meta["target"],
                triton_version=meta["triton_version"],
                constexprs=dict(meta["constexprs"]),
                options=dict(meta["options"]),
                params=tuple(Param(p["name"], p["kind"]) for p in meta["params"]),
                divisible_by_16=frozenset(meta["divisible_by_16"]),
                threads=int(meta["threads"]),
                shared=int(meta["shared"]),
                scratch=tuple(Scratch(s["name"], s["size"], s["align"]) for s in meta["scratch"]),
                cubin=cubin,
            )
        except (KeyError, TypeError) as exc:
            raise ContractError(f"{path}: missing or malformed field {exc}") from exc
        kernel._validate(path)
        return kernel

    def _validate(self, path: Path) -> None:
        """``ContractError`` for metadata the launcher cannot honour."""
        if self.key != path.stem:
            raise ContractError(f"{path}: key {self.key!r}; expected {path.stem!r}")
        for p in self.params:
            if not (p.kind.startswith("*") or p.kind in _SCALARS):
                raise ContractError(
                    f"{path}: parameter {p.name} has kind {p.kind!r}; expected a pointer "
                    f"(*bf16, *u8...) or one of {sorted(_SCALARS)}"
                )
        unknown = self.divisible_by_16 - {p.name for p in self.params}
        if unknown:
            raise ContractError(f"{path}: divisible_by_16 names no parameter: {sorted(unknown)}")
        if [s.name for s in self.scratch] != list(SCRATCH_NAMES):
            found = [s.name for s in self.scratch]
            raise ContractError(f"{path}: scratch {found}; expected {list(SCRATCH_NAMES)}")
        if not (0 < self.threads <= 1024 and self.threads % 32 == 0):
            raise ContractError(f"{path}: threads={self.threads}; expected whole warps, <= 1024")

    # ------------------------------------------------------------------------- launch
    def pack_arguments(
        self, args: Sequence[object], scratch: Sequence[int] = ()
    ) -> PackedArguments:
        """Check ``args`` (the runtime arguments in :attr:`params` order) and pack them with
        the ``scratch`` pointers (one per :attr:`scratch` entry; empty: all null, for
        kernels needing none) for ``cuLaunchKernel``.

        A pointer is a tensor on a CUDA device (of the kind's dtype where torch has it;
        ``ContractError`` for a CPU tensor) or an int device address; a pointer or int in
        :attr:`divisible_by_16` must be a multiple of 16 (as the compile assumed); ``i32`` /
        ``i64`` take ints in range, ``fp32`` a float. ``ContractError`` names the argument,
        its value and what was expected."""
        names = [p.name for p in self.params]
        if len(args) != len(names):
            missing, extra = names[len(args) :], len(args) - len(names)
            detail = f"missing {missing}" if missing else f"{extra} more than its parameters"
            raise ContractError(
                f"{self.kernel_name} takes {len(names)} runtime arguments ({', '.join(names)}); "
                f"got {len(args)}: {detail}"
            )
        values: list[ctypes.c_uint64 | ctypes.c_int32 | ctypes.c_int64 | ctypes.c_float] = []
        tensors: list[torch.Tensor] = []
        for param, value in zip(self.params, args, strict=True):
            if param.kind.startswith("*"):
                values.append(ctypes.c_uint64(self._pointer(param, value, tensors)))
            else:
                values.append(self._scalar(param, value))
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ContractError(
                f"{self.kernel_name}'s tensors are on {sorted(map(str, devices))}; expected one "
                "CUDA device"
            )
        if scratch and len(scratch) != len(self.scratch):
            raise ContractError(
                f"{self.kernel_name} takes {len(self.scratch)} scratch pointers "
                f"({', '.join(SCRATCH_NAMES)}); got {len(scratch)}"
            )
        for s, pointer in zip(self.scratch, scratch or [0] * len(self.scratch), strict=True):
            if s.size and pointer % s.align:
                raise ContractError(f"{s.name} pointer {pointer:#x} is not {s.align}-aligned")
            values.append(ctypes.c_uint64(pointer))
        params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        device = devices.pop() if devices else None
        return PackedArguments(params, tuple(values), tuple(tensors), device)

    def _pointer(self, param: Param, value: object, tensors: list[torch.Tensor]) -> int:
        """The device address of pointer argument ``value``, checked."""
        aligned = param.name in self.divisible_by_16
        if isinstance(value, torch.Tensor):
            dtype = _POINTER_DTYPES.get(param.kind[1:])
            if dtype is not None and value.dtype != dtype:
                raise ContractError(
                    f"{self.kernel_name} argument {param.name} is a {value.dtype} tensor; "
                    f"expected {dtype} ({param.kind})"
                )
            if not _is_cuda(value):
                raise ContractError(
                    f"{self.kernel_name} argument {param.name} is on {value.device}; expected "
                    "a CUDA tensor"
                )
            tensors.append(value)
            address = value.data_ptr()
        elif isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value < 2**64:
                raise ContractError(
                    f"{self.kernel_name} argument {param.name}={value}; expected a device "
                    "address (0 ... 2^64 - 1)"
                )
            address = value
        else:
            raise ContractError(
                f"{self.kernel_name} argument {param.name}={value!r}; expected a CUDA tensor "
                f"({param.kind}) or an int device address"
            )
        if aligned and address % 16:
            raise ContractError(
                f"{self.kernel_name} argument {param.name} is at {address:#x}; the kernel was "
                "compiled for 16-byte aligned pointers there"
            )
        return address

    def _scalar(
        self, param: Param, value: object
    ) -> ctypes.c_int32 | ctypes.c_int64 | ctypes.c_float:
        """The ctypes value of scalar argument ``value``, checked."""
        if param.kind == "fp32":
            if not isinstance(value, float) or (math.isfinite(value) and abs(value) > _FLOAT32_MAX):
                raise ContractError(
                    f"{self.kernel_name} argument {param.name}={value!r}; expected a Python "
                    "float in float32 range (fp32)"
                )
            return ctypes.c_float(value)
        low, high = _INT_RANGE[param.kind]
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ContractError(
                f"{self.kernel_name} argument {param.name}={value!r}; expected an int in "
                f"{low} ... {high} ({param.kind})"
            )
        if param.name in self.divisible_by_16 and value % 16:
            raise ContractError(
                f"{self.kernel_name} argument {param.name}={value}; the kernel was compiled "
                "for a multiple of 16 there"
            )
        return _SCALARS[param.kind](value)

    def launch(
        self,
        grid: Sequence[int],
        args: Sequence[object],
        stream: torch.cuda.Stream | int | None = None,
    ) -> None:
        """Launch on ``grid`` (1 to 3 program counts, as ``kernel[grid]``) with ``args``
        (:meth:`pack_arguments`) on ``stream`` (None: torch's current stream of the tensors'
        device; an int is a ``CUstream`` handle). Needs the CUDA driver and a device; an empty
        grid launches nothing."""
        limits = (2**31 - 1, 65535, 65535)
        dims = (*grid, 1, 1)[:3]
        if not 1 <= len(grid) <= 3 or not all(
            isinstance(d, int) and 0 <= d <= m for d, m in zip(dims, limits, strict=True)
        ):
            raise ContractError(f"grid={tuple(grid)}; expected 1 to 3 counts within {limits}")
        packed = self.pack_arguments(args)
        programs = math.prod(dims)
        if programs == 0:
            return
        device = packed.device or torch.device("cuda", torch.cuda.current_device())
        buffers = [self._scratch_buffer(s, programs, device) for s in self.scratch]
        if any(buffer is not None for buffer, _ in buffers):
            packed = self.pack_arguments(args, [address for _, address in buffers])
        with torch.cuda.device(device):
            driver = _driver()
            function = driver.function(self, device)
            if stream is None:
                handle = torch.cuda.current_stream(device).cuda_stream
            else:
                handle = stream if isinstance(stream, int) else stream.cuda_stream
            driver.launch(function, dims, self.threads, self.shared, handle, packed.params)

    @staticmethod
    def _scratch_buffer(
        scratch: Scratch, programs: int, device: torch.device
    ) -> tuple[torch.Tensor | None, int]:
        """A scratch allocation for ``programs`` programs (as Triton's launcher sizes it) and
        its aligned address; ``(None, 0)`` for none."""
        if scratch.size == 0:
            return None, 0
        buffer = torch.empty(
            programs * scratch.size + scratch.align, dtype=torch.uint8, device=device
        )
        return buffer, -(-buffer.data_ptr() // scratch.align) * scratch.align


# ------------------------------------------------------------------------------- lookup
_found: dict[tuple[str, str, str, str], PrecompiledKernel | None] = {}


def find(
    directory: str | os.PathLike[str] | None,
    function: Any,
    launch: Mapping[str, Any],
    target: str,
) -> PrecompiledKernel | None:
    """The kernel of ``directory`` compiled from ``function``'s current source for ``target``
    with the keyword arguments ``launch`` (its constexprs and ``num_warps``); None when the
    directory (None: no directory) has none. Each lookup reads the directory once a process
    (a launch must not hash source and read files; the source does not change under it)."""
    if directory is None:
        return None
    lookup = (str(directory), qualified_name(function), target, repr(sorted(launch.items())))
    if lookup not in _found:
        _found[lookup] = _find(Path(directory), function, launch, target)
    return _found[lookup]


def _find(
    directory: Path, function: Any, launch: Mapping[str, Any], target: str
) -> PrecompiledKernel | None:
    """:func:`find` without the memo; ``ContractError`` for a file its key misdescribes."""
    key = kernel_key(function, launch, target)
    if not (directory / f"{key}.json").is_file():
        return None
    kernel = PrecompiledKernel.load(directory, key)
    constexprs, options = split_options(function, launch)
    expected = (qualified_name(function), target, constexprs, options)
    found = (kernel.function, kernel.target, kernel.constexprs, kernel.options)
    if found != expected:
        raise ContractError(f"{directory / key}.json describes {found}; its key says {expected}")
    return kernel


# ------------------------------------------------------------------------------- driver
class _Driver:
    """``libcuda.so.1`` through ctypes: module loads (one per context and kernel) and
    launches."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaDriverError(
                f"the CUDA driver (libcuda.so.1) cannot be loaded: {exc}"
            ) from exc
        p, u, v = ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)
        signatures: dict[str, list[Any]] = {
            "cuInit": [u],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuCtxGetCurrent": [v],
            "cuCtxSetCurrent": [p],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [v, ctypes.c_int],
            "cuModuleLoadData": [v, ctypes.c_char_p],
            "cuModuleGetFunction": [v, p, ctypes.c_char_p],
            "cuFuncSetAttribute": [p, ctypes.c_int, ctypes.c_int],
            "cuLaunchKernel": [p, u, u, u, u, u, u, u, p, v, v],
        }
        for name, argtypes in signatures.items():
            getattr(self.lib, name).argtypes = argtypes
            getattr(self.lib, name).restype = ctypes.c_int
        self.functions: dict[tuple[int, str], ctypes.c_void_p] = {}
        self.check(self.lib.cuInit(0), "cuInit(0)")

    def check(self, result: int, call: str) -> None:
        """``CudaDriverError`` naming ``call`` and the driver's error when ``result`` is not
        ``CUDA_SUCCESS``."""
        if result == 0:
            return
        name = ctypes.c_char_p()
        named = self.lib.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value
        text = name.value.decode() if named and name.value else "unknown error"
        raise CudaDriverError(f"{call} failed: {text} ({result})")

    def context(self, device: torch.device) -> ctypes.c_void_p:
        """The current context, made torch's primary context of ``device`` where none is."""
        torch.cuda.init()
        context = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        if not context.value:
            handle = ctypes.c_int()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.check(self.lib.cuDeviceGet(ctypes.byref(handle), index), f"cuDeviceGet({index})")
            self.check(
                self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle),
                "cuDevicePrimaryCtxRetain",
            )
            self.check(self.lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        return context

    def function(self, kernel: PrecompiledKernel, device: torch.device) -> ctypes.c_void_p:
        """``kernel``'s ``CUfunction`` in the current context, its module loaded once."""
        context = self.context(device)
        assert context.value is not None
        cache_key = (context.value, kernel.key)
        if cache_key in self.functions:
            return self.functions[cache_key]
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(
            self.lib.cuModuleLoadData(ctypes.byref(module), kernel.cubin),
            f"cuModuleLoadData({kernel.key}.cubin)",
        )
        self.check(
            self.lib.cuModuleGetFunction(
                ctypes.byref(function), module, kernel.kernel_name.encode()
            ),
            f"cuModuleGetFunction({kernel.kernel_name})",
        )
        if kernel.shared > _DEFAULT_SHARED:
            self.check(
                self.lib.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED_ATTRIBUTE, kernel.shared),
                f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, {kernel.shared})",
            )
        self.functions[cache_key] = function
        return function

    def launch(
        self,
        function: ctypes.c_void_p,
        grid: tuple[int, ...],
        threads: int,
        shared: int,
        stream: int,
        params: ctypes.Array[ctypes.c_void_p],
    ) -> None:
        """``cuLaunchKernel`` of ``function`` on ``grid`` blocks of ``threads`` threads."""
        gx, gy, gz = grid
        result = self.lib.cuLaunchKernel(
            function, gx, gy, gz, threads, 1, 1, shared, ctypes.c_void_p(stream), params, None
        )
        self.check(result, f"cuLaunchKernel(grid={grid}, block={threads}, shared={shared})")


_the_driver: list[_Driver] = []


def _driver() -> _Driver:
    """The process's driver binding, created (``cuInit``) on first use."""
    if not _the_driver:
        _the_driver.append(_Driver())
    return _the_driver[0]
