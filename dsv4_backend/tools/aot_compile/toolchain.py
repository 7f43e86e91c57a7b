"""The compile of one configuration and its figures: ``compile_report``.

* ``mma``: the PTX matrix instructions, e.g. ``wgmma.mma_async.sp...bf16.bf16`` opcodes with
  their operand types (``tf32`` shows up here if a dot fell back to fp32 operands); Blackwell's
  ``tcgen05.mma`` carries its shape and types in an instruction descriptor, decoded into
  ``mma_shapes`` (``m64n16k16.bf16``, for wgmma from the opcode);
* ``registers``, ``spill_stores``, ``spill_loads``, ``stack``: from ``ptxas -v`` (Triton's
  bundled ptxas for the target, the same call Triton makes);
* ``cp_async``: asynchronous global -> shared copies in the PTX (a software-pipelined gather);
* ``shared``: the shared memory Triton allocates (bytes);
* ``instructions``, ``integer_ops``, ``e4m3_converts``, ``main_loop_calls``, ``local_ops``:
  from the SASS (:func:`sass_facts`).

ptxas figures and SASS listings are kept beside Triton's cache, so a kernel found there is
neither assembled nor disassembled again.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import tempfile

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from dsv4_backend.tools import sass

#: Hopper (H100 / H200) and Blackwell datacenter parts (B200 / B300 / GB200 / GB300).
TARGETS = {"sm_90a": GPUTarget("cuda", 90, 32), "sm_100a": GPUTarget("cuda", 100, 32)}


def _ptxas_figures(log: str) -> dict[str, int] | None:
    """Registers, spills and stack from a ``ptxas -v`` log (None without them)."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    if not (regs and spill and stack):
        return None
    return dict(
        registers=int(regs.group(1)),
        spill_stores=int(spill.group(1)),
        spill_loads=int(spill.group(2)),
        stack=int(stack.group(1)),
    )


def _figures_path(ptx: str, target: str) -> str:
    """Where the ptxas figures of ``ptx`` are kept, beside Triton's own cache: a later run
    that finds the kernel in Triton's cache need not run ptxas again."""
    ptxas = get_ptxas(TARGETS[target].arch).path  # bundled: its version goes with Triton's
    key = hashlib.sha256(f"{triton.__version__}\n{ptxas}\n{target}\n{ptx}".encode()).hexdigest()
    return os.path.join(knobs.cache.dir, "dsv4-ptxas", f"{key}.json")


def _keep(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (test workers may write it at once)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), delete=False) as f:
        f.write(data)
    os.replace(f.name, path)


def _keep_figures(ptx: str, target: str, figures: dict[str, int]) -> None:
    _keep(_figures_path(ptx, target), json.dumps(figures).encode())


def ptxas_report(ptx: str, target: str = "sm_90a") -> dict[str, int]:
    """Registers, spills and stack of the kernel from ``ptxas -v`` for ``target`` (with the
    register-allocation flag Triton 3.8 passes), kept by :func:`_figures_path`."""
    path = _figures_path(ptx, target)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [
                get_ptxas(TARGETS[target].arch).path,
                "-v",
                "--regAllocOptLevel=2",
                f"--gpu-name={target}",
                src,
                "-o",
                src + ".o",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stderr
    figures = _ptxas_figures(log)
    assert figures is not None, log
    _keep_figures(ptx, target, figures)
    return figures


#: tcgen05 instruction-descriptor operand types (kind::f16): bits 7-9 (A), 10-12 (B).
_TCGEN05_TYPES = {0: "f16", 1: "bf16", 2: "tf32"}


def mma_shapes(ptx: str) -> list[str]:
    """The MMA instruction shapes of ``ptx`` with their A operand type, e.g.
    ``m64n256k16.bf16``: wgmma / mma.sync from the opcode; tcgen05.mma (kind::f16, K = 16)
    from its 32-bit instruction descriptor, N / 8 in bits 17-22 and M / 16 in bits 24-28,
    where the descriptor is a constant (``mov.b32 %r, imm``)."""
    shapes = {
        f"{m.group(1)}.{m.group(2)}"
        for m in re.finditer(
            r"\b(?:wgmma\.mma_async|mma\.sync)[\w.]*?\.(m\d+n\d+k\d+)"
            r"[\w.]*?\.f32\.(\w+)\.",
            ptx,
        )
    }
    consts = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", ptx))
    for m in re.finditer(r"tcgen05\.mma\.cta_group::\d\.kind::f16\s[^;]*?,\s*(%r\d+),\s*%p", ptx):
        desc = consts.get(m.group(1))
        if desc is None:
            shapes.add("tcgen05.unknown")
            continue
        d = int(desc)
        n, mm = ((d >> 17) & 0x3F) * 8, ((d >> 24) & 0x1F) * 16
        shapes.add(f"m{mm}n{n}k16.{_TCGEN05_TYPES.get((d >> 7) & 7, 'other')}")
    return sorted(shapes, key=lambda s: [int(x) for x in re.findall(r"\d+", s.split(".")[0])])


def compile_kernel(src: ASTSource, options: dict, target: str = "sm_90a"):
    """``triton.compile`` of ``src`` for ``target`` (a key of :data:`TARGETS`). When Triton
    compiles (no cache hit) its own ``ptxas -v`` log is kept for :func:`ptxas_report`, so
    the kernel goes through ptxas once."""
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # Triton prints its ptxas log after compiling
        kernel = triton.compile(src, target=TARGETS[target], options=options)
    figures = _ptxas_figures(log.getvalue())
    if figures is not None:
        _keep_figures(kernel.asm["ptx"], target, figures)
    return kernel


def sass_listing(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin (Triton's bundled cuobjdump; about a second of CPU a
    kernel), kept compressed beside Triton's cache as the ptxas figures are."""
    cuobjdump = knobs.nvidia.cuobjdump.path
    key = hashlib.sha256(cuobjdump.encode() + b"\n" + cubin).hexdigest()
    kept = os.path.join(knobs.cache.dir, "dsv4-sass", f"{key}.sass.gz")
    if os.path.exists(kept):
        with open(kept, "rb") as f:
            return gzip.decompress(f.read()).decode()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        listing = subprocess.run(
            [cuobjdump, "-sass", path], check=True, capture_output=True, text=True
        ).stdout
    _keep(kept, gzip.compress(listing.encode()))
    return listing


#: SASS opcodes of the integer ALU (what an arithmetic e4m3 decode is made of).
INTEGER_OPCODES = ("LOP3", "SHF", "IADD3", "IMAD", "ISETP", "SEL", "PRMT", "LEA", "IABS")


def sass_facts(listing: str) -> dict[str, int]:
    """Instruction facts of a ``cuobjdump -sass`` listing: ``instructions`` in all,
    ``integer_ops`` (``INTEGER_OPCODES``), ``e4m3_converts`` (``F2FP`` unpacking e4m3: the
    hardware fp8 conversion), ``main_loop_calls`` (subroutine calls in the body of the
    main loop, ``tools.sass.main_loop``: a 64-bit division or modulo is one) and
    ``local_ops`` (local-memory loads and stores, ``LDL`` / ``STL``: what a stack frame costs;
    ptxas may reserve a frame the code never touches)."""
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[.\s;]", listing)
    loop = sass.main_loop(listing)
    calls = sum(i.op.startswith("CALL") for i in loop.instructions) if loop else 0
    return dict(
        instructions=len(opcodes),
        integer_ops=sum(op in INTEGER_OPCODES for op in opcodes),
        e4m3_converts=len(re.findall(r"\bF2FP\.[\w.]*E4M3[\w.]*", listing)),
        main_loop_calls=calls,
        local_ops=sum(op in ("LDL", "STL") for op in opcodes),
    )


def compile_report(
    name: str,
    src: ASTSource,
    options: dict,
    target: str = "sm_90a",
    kernel=None,
    listing: str | None = None,
) -> dict:
    """The module docstring's figures of one configuration (``kernel``: already compiled;
    ``listing``: its :func:`sass_listing`)."""
    kernel = kernel or compile_kernel(src, options, target)
    listing = listing or sass_listing(kernel.asm["cubin"])
    ptx = kernel.asm["ptx"]
    mma = sorted(set(re.findall(r"\b((?:wgmma\.mma_async|mma\.sync|tcgen05\.mma)[\w.:]*)", ptx)))
    return dict(
        name=name,
        target=target,
        mma=mma,
        mma_shapes=mma_shapes(ptx),
        cp_async=len(re.findall(r"\bcp\.async\.(?:c[ag]\.shared|bulk)", ptx)),
        shared=kernel.metadata.shared,
        num_warps=options["num_warps"],
        **ptxas_report(ptx, target),
        **sass_facts(listing),
    )
