"""Compress and write plans as a TVM kernel with a symbolic row count (docs/design.md §4).

The records are those of ``planning/metadata.py``: ``[T, 4]`` int32 rows
``(ragged_id, batch_id, position, window_len)``, the valid ones first in row order, then ``-1``
rows; ``planning.kernels.compress_plan_torch.compute_compress_plans`` is the torch reference
this kernel matches exactly. ``T`` is the symbolic dim ``num_rows`` shared by all six tensors,
so one compiled kernel serves every batch size, and TVM checks on every call that the tensors
agree on it: a plan built for another ``T`` (metadata planned before the batch was padded) is
refused with a ``ContractError``.

Algorithm (one thread block; ``NT`` threads, each owning ``ceil(T / NT)`` consecutive rows):

1. *count* — each thread counts its rows that the compress / write plan keeps;
2. *scan* — an inclusive Hillis-Steele scan over the ``NT`` counts (``ceil(log2 NT)`` rounds)
   turns them into each thread's first output slot and the totals;
3. *emit* — each thread writes its kept rows' records from its first slot on, in row order;
4. *pad* — rows from each total to ``T`` are set to ``-1`` (thread-strided).

On CUDA the phases are separated by ``__syncthreads``; on the CPU each phase is a loop over
the ``NT`` virtual threads, so the CPU build runs the very same per-thread code. The CPU
default is one virtual thread (a plain serial scan); tests also build it with many.

Compiled once per process per (target, thread count), on first use (``functools.cache``); the
ratio and its span (``config.compress_span``) are runtime arguments.

On CUDA the TVM compiler is not needed at run time (the PyPI apache-tvm wheel has no CUDA
runtime, and GPU hosts carry only tvm-ffi): ``generate_cuda_source`` writes TVM's CUDA C for the
kernel, followed by the tvm-ffi launcher ``compress_plan_launcher.cu`` (argument checks on the
symbolic ``num_rows``, launch on the caller's stream), into ``compress_plan_cuda.cu``, shipped
in the package; regenerate it with ``python -m dsv4_backend.planning.kernels.compress_plan_tvm``.
At run time ``tvm_ffi.cpp.load_inline`` compiles that file with ``nvcc`` once per process
(tvm-ffi also caches the build on disk). ``planning/kernels/table.py`` runs the torch reference
where neither can run.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dsv4_backend.config import REQUIRED_PAGE_SIZE, check_compressed_ratio, compress_span
from dsv4_backend.errors import ContractError
from dsv4_backend.planning.kernels.compress_plan_call import CompressPlanCall

#: Name of the symbolic row count in the kernel signature (and in its error messages).
SYMBOLIC_DIM = "num_rows"
#: Threads of the CUDA kernel's single block.
CUDA_THREADS = 1024
#: Virtual threads of the CPU kernel: one is a plain serial scan, the fastest on a CPU core.
CPU_THREADS = 1
#: The ``[T]`` inputs, in the kernel's order, and their dtypes.
_INPUT_DTYPES = {
    "row_batch_ids": torch.int32,
    "positions": torch.int64,
    "first_new_positions": torch.int64,
    "request_seq_lens": torch.int32,
}
#: Tensor arguments, in the kernel's order: 4 inputs ``[T]``, 2 outputs ``[T, 4]`` (then the
#: scalars ``ratio``, ``span`` and ``page``).
KERNEL_ARGS = (*_INPUT_DTYPES, "compress_plan", "write_plan")
#: The shipped CUDA source (generated): TVM's kernel, then the tvm-ffi launcher.
CUDA_SOURCE = Path(__file__).with_name("compress_plan_cuda.cu")
_CUDA_LAUNCHER = Path(__file__).with_name("compress_plan_launcher.cu")
#: Entry point exported by the launcher, with ``launch_compress_plan_kernel``'s arguments.
CUDA_ENTRY = "launch_compress_plan"
#: The kernel as TVM 0.27 emits it (parameters sorted by name; ``cse_v2`` is the overlap
#: ``span - ratio``, ``cse_v9`` the rows per thread): the launcher calls exactly this, so
#: generation fails if TVM emits another.
_CUDA_KERNEL_SIGNATURE = (
    'extern "C" __global__ void __launch_bounds__(1024) compress_plan_kernel_kernel('
    "int* __restrict__ compress_plan_ptr, int64_t* __restrict__ first_new_positions_ptr, "
    "int64_t* __restrict__ positions_ptr, int* __restrict__ request_seq_lens_ptr, "
    "int* __restrict__ row_batch_ids_ptr, int* __restrict__ write_plan_ptr, int64_t cse_v2, "
    "int64_t cse_v9, int64_t num_rows, int64_t page, int64_t ratio, int64_t span)"
)


# -------------------------------------------------------------------------------- kernel
def _plan_prim_func(num_threads: int, gpu: bool) -> Any:
    """The plan kernel as a ``tvm.tirx.PrimFunc`` for ``num_threads`` (virtual) threads."""
    from tvm import tirx
    from tvm.script import tirx as T

    nt = num_threads
    rounds = (nt - 1).bit_length()  # Hillis-Steele rounds: 2**rounds >= nt

    def completes(p: Any, ratio: Any) -> Any:  # the row completes a compressed entry
        return tirx.floormod(p + 1, ratio) == 0

    def keeps(p: Any, seq_len: Any, ratio: Any, overlap: Any, page: Any) -> Any:
        # State stays in the ring: the request's tail, and (c4) the last block of every page.
        tail = p >= tirx.floordiv(tirx.Cast("int64", seq_len), ratio) * ratio - overlap
        return tirx.Or(tail, tirx.And(overlap > 0, tirx.floormod(p, page) >= page - ratio))

    # The phases of virtual thread ``t`` (rows [t * chunk, (t + 1) * chunk) of ``rows``).
    @T.macro
    def count(t, rows, chunk, ratio, overlap, page, positions, seq_lens, counts):
        first_row: T.let = T.Cast("int64", t) * chunk
        kept_c: T.int32 = 0
        kept_w: T.int32 = 0
        for j in T.serial(chunk):
            if first_row + j < rows:
                p: T.let = positions[first_row + j]
                if completes(p, ratio):
                    kept_c = kept_c + 1
                if keeps(p, seq_lens[first_row + j], ratio, overlap, page):
                    kept_w = kept_w + 1
        counts[0, t + 1] = kept_c
        counts[1, t + 1] = kept_w
        if t == 0:
            counts[0, 0] = 0
            counts[1, 0] = 0

    @T.macro
    def scan_read(t, r, counts, partial):
        # counts[k, 0] == 0, so clamping the partner index at 0 adds nothing.
        for k in T.serial(2):
            partial[k, t] = counts[k, t + 1] + counts[k, T.max(t + 1 - T.shift_left(1, r), 0)]

    @T.macro
    def scan_write(t, counts, partial):
        for k in T.serial(2):
            counts[k, t + 1] = partial[k, t]

    @T.macro
    def store(plan, slot, row, batch_id, p, window_len):
        plan[slot, 0] = T.Cast("int32", row)
        plan[slot, 1] = batch_id
        plan[slot, 2] = T.Cast("int32", p)
        plan[slot, 3] = window_len

    @T.macro
    def emit(t, rows, chunk, ratio, span, overlap, page, ins, c_plan, w_plan, counts):
        # Unpacking names the buffers: the kernel's own names keep its error messages.
        row_batch_ids, positions, first_new_positions, request_seq_lens = ins
        first_row: T.let = T.Cast("int64", t) * chunk
        slot_c: T.int32 = counts[0, t]
        slot_w: T.int32 = counts[1, t]
        for j in T.serial(chunk):
            row: T.let = first_row + j
            if row < rows:
                p: T.let = positions[row]
                first: T.let = first_new_positions[row]
                window_len: T.let = T.Cast("int32", T.min(span, p - first + 1))
                if completes(p, ratio):
                    store(c_plan, slot_c, row, row_batch_ids[row], p, window_len)
                    slot_c = slot_c + 1
                if keeps(p, request_seq_lens[row], ratio, overlap, page):
                    store(w_plan, slot_w, row, row_batch_ids[row], p, window_len)
                    slot_w = slot_w + 1

    @T.macro
    def pad(t, rows, c_plan, w_plan, counts):
        for j in T.serial(T.floordiv(rows + (nt - 1), nt)):
            row: T.let = j * nt + T.Cast("int64", t)
            if row < rows:
                for c in T.serial(4):
                    if row >= T.Cast("int64", counts[0, nt]):
                        c_plan[row, c] = -1
                    if row >= T.Cast("int64", counts[1, nt]):
                        w_plan[row, c] = -1

    @T.prim_func
    def compress_plan_kernel(
        row_batch_ids_h: T.handle,
        positions_h: T.handle,
        first_new_positions_h: T.handle,
        request_seq_lens_h: T.handle,
        compress_plan_h: T.handle,
        write_plan_h: T.handle,
        ratio: T.int64,
        span: T.int64,
        page: T.int64,
    ):
        num_rows = T.int64()
        row_batch_ids = T.match_buffer(row_batch_ids_h, (num_rows,), "int32")
        positions = T.match_buffer(positions_h, (num_rows,), "int64")
        first_new_positions = T.match_buffer(first_new_positions_h, (num_rows,), "int64")
        request_seq_lens = T.match_buffer(request_seq_lens_h, (num_rows,), "int32")
        compress_plan = T.match_buffer(compress_plan_h, (num_rows, 4), "int32")
        write_plan = T.match_buffer(write_plan_h, (num_rows, 4), "int32")
        ins = (row_batch_ids, positions, first_new_positions, request_seq_lens)
        overlap: T.let = span - ratio  # c4 entries reach one block back: keep it in the ring
        chunk: T.let = T.floordiv(num_rows + (nt - 1), nt)  # rows per thread
        if gpu:
            for _b in T.thread_binding(1, thread="blockIdx.x"):
                for t in T.thread_binding(nt, thread="threadIdx.x"):
                    # counts[k, i]: rows kept by plan k (0 compress, 1 write) in chunks < i.
                    counts = T.alloc_buffer((2, nt + 1), "int32", scope="shared")
                    partial = T.alloc_buffer((2, nt), "int32", scope="shared")
                    count(
                        t,
                        num_rows,
                        chunk,
                        ratio,
                        overlap,
                        page,
                        positions,
                        request_seq_lens,
                        counts,
                    )
                    T.tvm_storage_sync("shared")
                    for r in T.serial(rounds):
                        scan_read(t, r, counts, partial)
                        T.tvm_storage_sync("shared")
                        scan_write(t, counts, partial)
                        T.tvm_storage_sync("shared")
                    emit(
                        t,
                        num_rows,
                        chunk,
                        ratio,
                        span,
                        overlap,
                        page,
                        ins,
                        compress_plan,
                        write_plan,
                        counts,
                    )
                    pad(t, num_rows, compress_plan, write_plan, counts)
        else:
            counts = T.alloc_buffer((2, nt + 1), "int32")
            partial = T.alloc_buffer((2, nt), "int32")
            for t in T.serial(nt):
                count(t, num_rows, chunk, ratio, overlap, page, positions, request_seq_lens, counts)
            for r in T.serial(rounds):
                for t in T.serial(nt):
                    scan_read(t, r, counts, partial)
                for t in T.serial(nt):
                    scan_write(t, counts, partial)
            for t in T.serial(nt):
                emit(
                    t,
                    num_rows,
                    chunk,
                    ratio,
                    span,
                    overlap,
                    page,
                    ins,
                    compress_plan,
                    write_plan,
                    counts,
                )
            for t in T.serial(nt):
                pad(t, num_rows, compress_plan, write_plan, counts)

    return compress_plan_kernel


def _kernel_source(target_json: str, num_threads: int) -> tuple[Any, Any]:
    """``(tvm Target, PrimFunc)`` for a target in TVM's JSON dict form."""
    import tvm

    target = tvm.target.Target(json.loads(target_json))
    return target, _plan_prim_func(num_threads, gpu=target.kind.name == "cuda")


# The barriers are the kernel's own, so it is built with TVM's ``tirx`` pipeline (the default
# ``s_tir`` pipeline re-plans buffers and barriers for schedule-built code and breaks this one).
def lower_kernel(target_json: str, num_threads: int) -> Any:
    """The kernel lowered by TVM's ``tirx`` pipeline, an ``IRModule`` (no nvcc needed)."""
    import tvm

    target, func = _kernel_source(target_json, num_threads)
    mod = tvm.tirx.transform.BindTarget(target.with_host("llvm"))(tvm.IRModule.from_expr(func))
    return tvm.tirx.get_tir_pipeline("tirx")[0](mod)


@functools.cache
def compiled_kernel(target_json: str, num_threads: int) -> Any:
    """The kernel compiled for a target (TVM JSON dict form), once per process."""
    import tvm

    target, func = _kernel_source(target_json, num_threads)
    return tvm.compile(func, target=target, tir_pipeline="tirx")


_LLVM_TARGET = json.dumps({"kind": "llvm"})
#: Target of the shipped CUDA source (TVM's CUDA C does not depend on the arch; nvcc compiles
#: it for the GPU at hand).
CUDA_GENERATION_TARGET = json.dumps({"kind": "cuda", "arch": "sm_90"})


def generate_cuda_source() -> str:
    """The text of ``CUDA_SOURCE``: TVM's CUDA C for the kernel, then the tvm-ffi launcher.

    Needs apache-tvm (its CUDA codegen runs on the CPU; no GPU or nvcc). Raises
    ``RuntimeError`` if TVM emits a kernel signature other than the one the launcher calls.
    """
    module = compiled_kernel(CUDA_GENERATION_TARGET, CUDA_THREADS).mod
    kernel = module.imports[0].inspect_source()
    if _CUDA_KERNEL_SIGNATURE not in kernel:
        raise RuntimeError(
            f"TVM emitted another signature for compress_plan_kernel_kernel; update "
            f"{_CUDA_LAUNCHER.name} and _CUDA_KERNEL_SIGNATURE (expected {_CUDA_KERNEL_SIGNATURE})"
        )
    header = (
        "// Generated by `python -m dsv4_backend.planning.kernels.compress_plan_tvm`: "
        "do not edit.\n"
        "// TVM's CUDA C for the compress / write plan kernel, then compress_plan_launcher.cu.\n"
    )
    return f"{header}{kernel}\n{_CUDA_LAUNCHER.read_text()}"


def cuda_unavailable_reason() -> str | None:
    """Why the shipped CUDA kernel cannot be built here, or ``None`` if it can."""
    if importlib.util.find_spec("tvm_ffi") is None:
        return "apache-tvm-ffi is not installed"
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "nvcc not found (PATH or CUDA_HOME) to build the shipped CUDA source"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


@functools.cache
def cuda_kernel() -> Any:
    """The shipped CUDA source built by tvm-ffi (``nvcc``, for the visible GPU's arch), once per
    process; its ``launch_compress_plan`` takes ``launch_compress_plan_kernel``'s arguments
    plus the span."""
    import tvm_ffi.cpp

    module = tvm_ffi.cpp.load_inline(
        name="dsv4_compress_plan", cuda_sources=CUDA_SOURCE.read_text(), functions=[CUDA_ENTRY]
    )
    return getattr(module, CUDA_ENTRY)


def _kernel_for(device: torch.device) -> tuple[Any, bool]:
    """``(compiled kernel, on_cuda)`` for tensors on ``device``."""
    if device.type == "cuda":
        return cuda_kernel(), True
    return compiled_kernel(_LLVM_TARGET, CPU_THREADS), False


def _describe(tensors: dict[str, torch.Tensor]) -> str:
    return ", ".join(
        f"{name} {tuple(t.shape)} {t.dtype} on {t.device}" for name, t in tensors.items()
    )


# ------------------------------------------------------------------------------ launcher
def launch_compress_plan_kernel(
    row_batch_ids: torch.Tensor,
    positions: torch.Tensor,
    first_new_positions: torch.Tensor,
    request_seq_lens: torch.Tensor,
    compress_plan: torch.Tensor,
    write_plan: torch.Tensor,
    ratio: int,
    page_size: int = REQUIRED_PAGE_SIZE,
) -> None:
    """Run the compiled kernel, filling ``compress_plan`` and ``write_plan`` in place.

    The low-level entry: it checks only the ratio. TVM checks every tensor against the
    signature (all share the symbolic ``num_rows``; contiguous; dtypes and device as below)
    and any refusal is raised as ``ContractError`` (on CUDA the shipped launcher checks the
    same, with TVM's wording). Inputs ``[T]``: ``row_batch_ids`` int32,
    ``positions`` int64, ``first_new_positions`` int64, ``request_seq_lens`` int32; outputs
    ``[T, 4]`` int32; ``ratio`` 4 or 128; ``page_size`` the KV page size. On CUDA the kernel
    runs on torch's current stream.
    """
    check_compressed_ratio(ratio, "compress plan")
    args = (
        row_batch_ids,
        positions,
        first_new_positions,
        request_seq_lens,
        compress_plan,
        write_plan,
    )
    kernel, on_cuda = _kernel_for(positions.device)
    try:
        if on_cuda:
            import tvm_ffi

            with tvm_ffi.use_torch_stream():
                kernel(*args, ratio, compress_span(ratio), page_size)
        else:
            kernel(*args, ratio, compress_span(ratio), page_size)
    except (TypeError, ValueError) as err:
        raise ContractError(
            f"compress plan kernel refused its arguments: every tensor shares the symbolic dim "
            f"{SYMBOLIC_DIM} (= T, the query rows) and must match its signature; got "
            f"{_describe(dict(zip(KERNEL_ARGS, args, strict=True)))}. TVM: {err}"
        ) from err


def _check_inputs(tensors: dict[str, torch.Tensor]) -> None:
    rows = tensors["positions"].shape[0] if tensors["positions"].dim() == 1 else None
    device = tensors["positions"].device
    for name, tensor in tensors.items():
        if tensor.dim() != 1 or tensor.shape[0] != rows or tensor.dtype != _INPUT_DTYPES[name]:
            raise ContractError(
                f"compress plan inputs must be [T] tensors sharing the symbolic dim "
                f"{SYMBOLIC_DIM} (T = positions.shape[0]) with dtypes "
                f"{ {n: str(d) for n, d in _INPUT_DTYPES.items()} }; {name} disagrees. Got "
                f"{_describe(tensors)}"
            )
        if tensor.device != device:
            raise ContractError(f"{name} is on {tensor.device}; positions is on {device}")


def compress_plans_tvm(call: CompressPlanCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress plan and write plan of ``call.ratio`` from the TVM kernel.

    Same contract as ``planning.kernels.compress_plan_torch.compute_compress_plans``: inputs
    ``[T]`` (``row_batch_ids`` int32, ``positions`` int64, ``first_new_positions`` int64,
    ``request_seq_lens`` int32, all on one device), ``ratio`` 4 or 128, ``page_size``; returns
    ``(compress_plan, write_plan)``, each ``[T, 4]`` int32. Tensors that disagree on ``T``
    raise ``ContractError``; a bad ratio ``ConfigError``.
    """
    ratio, page_size = call.ratio, call.page_size
    check_compressed_ratio(ratio, "compress plan")
    inputs = call[:4]
    tensors = dict(zip(_INPUT_DTYPES, inputs, strict=True))
    _check_inputs(tensors)
    rows = call.positions.shape[0]
    compress_plan = torch.empty(rows, 4, dtype=torch.int32, device=call.positions.device)
    write_plan = torch.empty_like(compress_plan)
    row_ids, pos, first_new, seq_lens = (t.contiguous() for t in inputs)
    launch_compress_plan_kernel(
        row_ids, pos, first_new, seq_lens, compress_plan, write_plan, ratio, page_size
    )
    return compress_plan, write_plan


@functools.cache
def tvm_unavailable_reason(device_type: str) -> str | None:
    """Why the TVM kernel cannot run for tensors of ``device_type`` (``None``: it can).

    On the CPU it needs apache-tvm with its ``llvm`` runtime; on CUDA the shipped source,
    built by tvm-ffi with ``nvcc`` (:func:`cuda_unavailable_reason`; no TVM compiler needed).
    """
    if device_type == "cuda":
        return cuda_unavailable_reason()
    if device_type != "cpu":
        return f"no TVM kernel for {device_type} tensors"
    if importlib.util.find_spec("tvm") is None:
        return "apache-tvm is not installed"
    import tvm

    if not tvm.runtime.enabled("llvm"):
        return "the installed TVM runtime has no llvm support"
    return None


if __name__ == "__main__":
    CUDA_SOURCE.write_text(generate_cuda_source())
    print(f"wrote {CUDA_SOURCE}")
