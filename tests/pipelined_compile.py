"""Compile the opt-in FP8 attention kernels ahead of time (sm_90a and sm_100a) and report them.

Run as a script (``python tests/pipelined_compile.py [--target sm_90a] [NAME ...]``;
``tests/test_sparse_attention_pipelined_sm90.py`` runs it in a subprocess, as
``tests/sm90_compile.py``). :func:`pipelined_attention_configurations` lists the pipelined
kernel's launches at DeepSeek-V4-Flash shapes (H = 64, D = 512 = 448 e4m3 + 64 bf16 channels,
584-byte tokens, window-only / c4 / c128 layers, one split and several; 16 heads a rank with
a verify request's 4 rows a program), :func:`ws_attention_configurations` the Gluon ``ws``
kernels' (Hopper's for sm_90a: wgmma; Blackwell's for sm_100a: tcgen05). One JSON object per
configuration and target:
``benchmarks/sass_report.py``'s report (registers, spills, shared memory, the register counts
of warp-specialised partitions, the main loop's instructions, asynchronous copies and MMAs,
the MMA shapes, and the criteria with the claims of ``sass_report.SPECS``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sm90_compile as sc  # first: sets TRITON_INTERPRET=0 before triton is imported
import triton
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sass_report

from dsv4_backend.kernels import sparse_attention as sa
from dsv4_backend.kernels import sparse_attention_pipelined as pa
from dsv4_backend.kernels import sparse_attention_ws as wa

#: Argument kinds of both attention kernels (every other argument is i32 or constexpr).
KINDS = dict(
    q_ptr="*bf16", win_ptr="*u8", win_idx_ptr="*i32", win_len_ptr="*i32", ext_ptr="*u8",
    ext_idx_ptr="*i32", ext_len_ptr="*i32", sink_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32",
    ml_ptr="*fp32", count_ptr="*i32", qk_scale="fp32",
)  # fmt: skip


def _source(
    fn, constexprs: dict, source: type[ASTSource] = ASTSource, kinds: dict[str, str] = KINDS
) -> ASTSource:
    """``fn`` (an opt-in attention kernel) with the launcher's argument ``kinds``, 16-byte
    aligned pointers and strides, and page sizes and scale regions that are multiples of 16
    bytes (as Triton specialises them)."""
    signature = sc.argument_kinds(fn, kinds, constexprs)
    aligned = sc._aligned(signature)
    for i, name in enumerate(signature):
        if name.endswith(("_page_bytes", "_scale_region")):
            aligned[(i,)] = [["tt.divisibility", 16]]
    return source(fn, signature, constexprs, aligned)


def pipelined_attention_source(
    ratio: int, splits: int, heads: int = sc.HEADS, rows_per_group: int = 1
) -> tuple[ASTSource, dict]:
    """The kernel as launched for a layer of compress ``ratio`` (0: window only) with
    ``heads`` heads a rank, up to ``rows_per_group`` rows a program and ``splits`` splits."""
    group = sa.group_rows(heads, rows_per_group)
    constexprs = dict(
        D=sc.DIM, NOPE_DIM=sc.DIM - sc.ROPE, BLOCK_H=sa.program_heads(heads, group), GROUP=group,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_N=pa._block_n(sc.DIM),
        BLOCK_S=triton.next_power_of_2(splits), HAS_EXTRA=ratio != 0,
        NUM_STAGES=pa.NUM_STAGES, MERGE_D=pa.MERGE_D, INTERPRETER=False,
    )  # fmt: skip
    return _source(pa._pipelined_attention_kernel, constexprs), dict(num_warps=pa.NUM_WARPS)


def pipelined_attention_configurations() -> list[tuple[str, ASTSource, dict]]:
    """Decode at 64 heads: window-only, c4 (one split and 8) and c128 (4 splits); 16 heads a
    rank with a 4-token verify request a program (c4, c128)."""
    out = []
    for ratio, splits in ((0, 1), (4, 1), (4, 8), (128, 4)):
        out.append((f"pipelined-r{ratio}-s{splits}", *pipelined_attention_source(ratio, splits)))
    for ratio, splits in ((4, 1), (128, 4)):
        src = pipelined_attention_source(ratio, splits, heads=16, rows_per_group=4)
        out.append((f"pipelined-r{ratio}-s{splits}-g-h16", *src))
    return out


def ws_attention_source(
    ratio: int, splits: int, fp8: bool = True, major: int = 9
) -> tuple[ASTSource, dict]:
    """The Gluon ws kernel as launched for a layer of compress ``ratio`` at 64 heads (fp8
    caches, or dense bf16 ones) on a device of compute capability ``major`` (9: Hopper's
    kernel, 10: Blackwell's)."""
    kernel, constexprs = wa.ws_kernel(major, sc.DIM, sc.DIM - sc.ROPE, splits, ratio != 0, fp8)
    options = dict(num_warps=constexprs.pop("num_warps"))
    caches = {} if fp8 else dict(win_ptr="*bf16", ext_ptr="*bf16")  # [slots, D] rows
    return _source(kernel, constexprs, GluonASTSource, {**KINDS, **caches}), options


def ws_attention_configurations() -> list[tuple[str, ASTSource, dict]]:
    """The ws kernels at 64 heads: Hopper's (``ws-``, sm_90a only: wgmma) for fp8 window-only,
    c4 (8 splits) and c128 (4 splits) layers and dense bf16 c4; Blackwell's (``ws-sm100-``,
    sm_100a only: tcgen05) for fp8 c4 and dense c4."""
    out = [
        (f"ws-r{ratio}-s{splits}", *ws_attention_source(ratio, splits))
        for ratio, splits in ((0, 1), (4, 8), (128, 4))
    ]
    out.append(("ws-dense-r4-s8", *ws_attention_source(4, 8, fp8=False)))
    out.append(("ws-sm100-r4-s8", *ws_attention_source(4, 8, major=10)))
    out.append(("ws-sm100-dense-r4-s8", *ws_attention_source(4, 8, fp8=False, major=10)))
    return out


def targets_of(name: str) -> tuple[str, ...]:
    """The targets a configuration compiles for: the pipelined kernel both, each ws kernel its
    own architecture's."""
    if name.startswith("pipelined"):
        return tuple(sc.TARGETS)
    return ("sm_100a",) if name.startswith("ws-sm100") else ("sm_90a",)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", choices=list(sc.TARGETS),
                        help="repeatable (default: each configuration's own)")  # fmt: skip
    parser.add_argument("only", nargs="*", help="configuration name substrings (default: all)")
    opts = parser.parse_args(argv)
    for name, src, options in pipelined_attention_configurations() + ws_attention_configurations():
        if opts.only and not any(o in name for o in opts.only):
            continue
        for target in targets_of(name):
            if not opts.target or target in opts.target:
                report = sass_report.kernel_report(name, src, options, target)
                print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
