"""Compile the Gluon ``ws`` attention kernels ahead of time into a precompiled-kernel package.

``python -m dsv4_backend.tools.precompile --target sm_90a --out DIR [--list] [--ptx]
[NAME ...]`` (with ``TRITON_INTERPRET=0``: the interpreter turns every kernel into an
interpreted function) compiles with the installed Triton, which must be 3.8, and writes
``kernels/device/precompiled.py``'s format: ``<key>.cubin`` and ``<key>.json`` a kernel, found
at run time through ``DSV4_PRECOMPILED_DIR`` by ``kernels/attention/ws.py`` under a Triton too
old to compile them. ``--list`` prints the configurations without compiling, ``--ptx`` also
writes ``<key>.ptx`` (for inspection; no launcher reads it), ``NAME`` substrings select
configurations.

The configurations are every launch the backend makes at DeepSeek-V4-Flash shapes (D = 512,
448 nope + 64 rope channels, up to 64 heads: the head count is a runtime argument): fp8 and
dense bf16 caches, window-only and compressed layers (``HAS_EXTRA``), and each ``BLOCK_S``
(``next_power_of_2`` of 1 ... ``MAX_SPLITS`` = 32 splits: 1, 2, 4, 8, 16, 32). That is 24
kernels a target (all of them: every split count the launcher may pick, not only the GPU
check's), 0.3 MB of cubin each, 7.7 MB in all; sm_90a compiles Hopper's kernel, sm_100a
Blackwell's. One takes 3 to 6 s of one core here (Triton 3.8, a cold cache), 24 about 90 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from dsv4_backend.kernels.attention import ws as wa
from dsv4_backend.kernels.device import precompiled

#: Flash's attention head: 448 e4m3 nope + 64 bf16 rope channels.
DIM, ROPE = 512, 64
_TARGET = re.compile(r"sm_(\d+)a")


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One ws launch: ``kernel`` with the keyword arguments ``launch`` (constexprs and
    ``num_warps``), named ``ws-{fp8|dense}-{window|extra}-bs{BLOCK_S}``."""

    name: str
    kernel: Any
    launch: dict[str, Any]


def capability_of(target: str) -> tuple[int, int]:
    """The compute capability of an architecture-specific ``target`` (``sm_90a`` -> 9.0);
    ``ValueError`` for another spelling."""
    match = _TARGET.fullmatch(target)
    if match is None:
        raise ValueError(f"target {target!r}; expected sm_<major><minor>a, e.g. sm_90a")
    digits = match.group(1)
    return int(digits[:-1]), int(digits[-1])


def configurations(target: str) -> list[Configuration]:
    """The ws launches of the module docstring for ``target``."""
    major = capability_of(target)[0]
    out = []
    for fp8 in (True, False):
        for has_extra in (False, True):
            for block_s in wa.BLOCK_S_VALUES:
                kernel, launch = wa.ws_kernel(major, DIM, DIM - ROPE, block_s, has_extra, fp8)
                name = f"ws-{'fp8' if fp8 else 'dense'}-{'extra' if has_extra else 'window'}"
                out.append(Configuration(f"{name}-bs{block_s}", kernel, launch))
    return out


def _threads(ptx: str) -> int:
    """Threads a block from the PTX's ``.reqntid`` (else ``.maxntid``): x * y * z."""
    match = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", ptx)
    if match is None:
        raise RuntimeError("the PTX declares no .reqntid / .maxntid block size")
    threads = 1
    for group in match.groups():
        threads *= int(group or 1)
    return threads


def compile_configuration(
    config: Configuration, target: str
) -> tuple[precompiled.PrecompiledKernel, str]:
    """``config`` compiled for ``target`` as a package entry, and its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    constexprs, options = precompiled.split_options(config.kernel, config.launch)
    kinds, aligned = wa.ws_signature(config.kernel, config.launch)
    signature = {n: "constexpr" if n in constexprs else kinds[n] for n in config.kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(signature) if n in aligned}
    src = GluonASTSource(config.kernel, signature, constexprs, attrs)
    major, minor = capability_of(target)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", major * 10 + minor, 32), options=options
    )
    md, ptx = compiled.metadata, compiled.asm["ptx"]
    # The launcher makes plain launches: no clusters, cooperative grids, PDL or instrumentation.
    plain = dict(num_ctas=1, launch_cooperative_grid=False, launch_pdl=False)
    found = {k: getattr(md, k) for k in plain}
    if found != plain or md.instrumentation_mode:
        raise RuntimeError(f"{config.name}: needs a launch {found} the launcher does not make")
    threads = _threads(ptx)
    if threads != 32 * md.num_warps:
        raise RuntimeError(f"{config.name}: PTX block {threads} != 32 x {md.num_warps} warps")
    params = tuple(precompiled.Param(n, k) for n, k in kinds.items())
    scratch = (
        precompiled.Scratch("global_scratch", md.global_scratch_size, md.global_scratch_align),
        precompiled.Scratch("profile_scratch", md.profile_scratch_size, md.profile_scratch_align),
    )
    entry = re.search(rf"\.entry\s+{re.escape(md.name)}\s*\(([^)]*)\)", ptx)
    declared = len(re.findall(r"\.param\s", entry.group(1))) if entry else -1
    if declared != len(params) + len(scratch):
        raise RuntimeError(
            f"{config.name}: the PTX entry has {declared} parameters; the launcher passes "
            f"{len(params)} and {len(scratch)} scratch pointers (Triton {triton.__version__})"
        )
    kernel = precompiled.PrecompiledKernel(
        key=precompiled.kernel_key(config.kernel, config.launch, target),
        kernel_name=md.name,
        function=precompiled.qualified_name(config.kernel),
        fingerprint=precompiled.kernel_fingerprint(config.kernel),
        target=target,
        triton_version=triton.__version__,
        constexprs=constexprs,
        options=options,
        params=params,
        divisible_by_16=aligned,
        threads=threads,
        shared=md.shared,
        scratch=scratch,
        cubin=compiled.asm["cubin"],
    )
    return kernel, ptx


def build(configs: list[Configuration], target: str, out: Path, ptx: bool = False) -> None:
    """Compile ``configs`` for ``target`` into the package ``out``, printing a line a kernel
    (name, key, seconds, cubin bytes) and the total."""
    start = time.perf_counter()
    for config in configs:
        began = time.perf_counter()
        kernel, text = compile_configuration(config, target)
        kernel.save(out)
        if ptx:
            (out / f"{kernel.key}.ptx").write_text(text)
        seconds = time.perf_counter() - began
        print(f"{config.name} {kernel.key} {seconds:.1f} s {len(kernel.cubin)} B", flush=True)
    print(f"{len(configs)} kernels for {target} in {time.perf_counter() - start:.0f} s -> {out}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="sm_90a", help="sm_90a (default) or sm_100a")
    parser.add_argument("--out", type=Path, help="package directory (needed unless --list)")
    parser.add_argument("--list", action="store_true", help="print the configurations only")
    parser.add_argument("--ptx", action="store_true", help="also write <key>.ptx")
    parser.add_argument("only", nargs="*", help="configuration name substrings (default: all)")
    opts = parser.parse_args(argv)
    try:
        configs = configurations(opts.target)
    except ValueError as exc:
        parser.error(str(exc))
    configs = [c for c in configs if not opts.only or any(o in c.name for o in opts.only)]
    if opts.list:
        for config in configs:
            print(config.name, precompiled.kernel_key(config.kernel, config.launch, opts.target))
        return
    if opts.out is None:
        parser.error("--out is needed to compile")
    if not configs:
        parser.error(f"no configuration matches {opts.only}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: run with TRITON_INTERPRET=0 to compile")
    missing = wa.missing_gluon_apis()
    if missing:
        parser.error(f"this Triton lacks {', '.join(missing)}: the ws kernels need Triton 3.8")
    build(configs, opts.target, opts.out, opts.ptx)


if __name__ == "__main__":
    main(sys.argv[1:])
