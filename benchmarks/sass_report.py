"""The compiled code of every kernel, read for a roofline model (a script; no GPU needed).

    python benchmarks/sass_report.py [--json] [--target sm_90a] [--target sm_100a] [NAME ...]

Compiles each configuration of :mod:`dsv4_backend.tools.aot_compile` (every attention launch
at DeepSeek-V4-Flash shapes, the indexer, compressor and planner kernels, then the opt-in
pipelined and ws attention kernels) ahead of time for sm_90a (H200) and sm_100a (B200) with
Triton's bundled ptxas, disassembles it with cuobjdump and reads its main loop
(``aot_compile.roofline``: the figures and the criteria). One row per kernel and target:
registers, spills (bytes stored), shared memory (KiB), warps, the main loop's instructions an
iteration and warp-instructions a key, its asynchronous copies, the MMA shapes, issue and HBM
ns a key, and the criteria met (``--json``: the whole report, one JSON object a line, as
``python -m dsv4_backend.tools.aot_compile`` prints it).

The figures come from compiled code only; nothing here is timed on a device.
"""

from __future__ import annotations

import argparse
import json
import sys

from dsv4_backend.tools.aot_compile.roofline import DEVICES, reports


def _row(r: dict) -> str:
    loop = r["main_loop"] or {}
    copies = ",".join(f"{op.split('.')[0]}x{n}" for op, n in loop.get("async_copies", {}).items())
    met = ",".join(k for k, v in r["criteria"].items() if v and k != "no-spills") or "-"

    def fig(key: str) -> str:
        return f"{loop[key]:g}" if key in loop else "-"

    return (f"{r['name']:<32} {r['target']:<7} {r['registers']:>4} {r['spill_stores']:>5} "
            f"{r['shared'] / 1024:>6.1f} {r['num_warps']:>2} {fig('instructions'):>6} "
            f"{fig('warp_instructions_per_key'):>7} {copies or '-':<12} "
            f"{' '.join(r['mma_shapes']) or '-':<34} {fig('issue_ns_per_key'):>6} "
            f"{fig('hbm_ns_per_key'):>5}  {met}")  # fmt: skip


HEADER = (f"{'kernel':<32} {'target':<7} {'regs':>4} {'spill':>5} {'smemKB':>6} {'w':>2} "
          f"{'insn/i':>6} {'insn/key':>7} {'async':<12} {'mma shapes':<34} {'issue':>6} "
          f"{'HBM':>5}  criteria (issue / HBM: ns a key)")  # fmt: skip


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object a line")
    parser.add_argument("--target", action="append", choices=list(DEVICES),
                        help="repeatable (default: every target)")  # fmt: skip
    parser.add_argument("only", nargs="*", help="configuration name substrings, TARGET:NAME "
                        "for one target only (default: all)")  # fmt: skip
    opts = parser.parse_args(argv)
    opts.target = opts.target or list(DEVICES)
    if not opts.json:
        for target in opts.target:
            d = DEVICES[target]
            print(f"{target}: {d.name}, {d.sms} SMs, {d.hbm_bytes_per_s / 1e12:g} TB/s, "
                  f"{d.clock_hz / 1e9:g} GHz, {d.schedulers} schedulers an SM")  # fmt: skip
        print(HEADER)
    for report in reports(opts.only, opts.target):
        print(json.dumps(report) if opts.json else _row(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
