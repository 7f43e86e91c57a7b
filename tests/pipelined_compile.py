"""Compile the pipelined FP8 attention kernel ahead of time (sm_90a and sm_100a) and read its SASS.

Run as a script (``python tests/pipelined_compile.py [--target 90|100] [NAME ...]``;
``tests/test_sparse_attention_pipelined_sm90.py`` runs it in a subprocess, as
``tests/sm90_compile.py``). :func:`pipelined_attention_configurations` lists the launches the
backend makes at DeepSeek-V4-Flash shapes (H = 64, D = 512 = 448 e4m3 + 64 bf16 channels,
584-byte tokens, window-only / c4 / c128 layers, one split and several; 16 heads a rank with
a verify request's 4 rows a program). One JSON object per configuration:

* ``registers``, ``stack``, ``local``, ``shared`` from ``cuobjdump --dump-resource-usage``
  (``local`` / ``stack`` > 0: spills);
* ``loop_instructions``, ``loop_ldgsts``, ``loop_mma``: the key loop (the backward branch
  around the most matrix instructions): its static instruction count (one iteration, one
  warp), its asynchronous global -> shared copies (``LDGSTS``) and its matrix instructions
  (``HGMMA.64xNx16`` on sm_90a, ``UTC*MMA`` on sm_100a) with their counts;
* ``setmaxnreg``: the register counts warp-specialised partitions set (empty: one partition);
* ``num_warps``: warps (of the default partition), for instructions per key.

:func:`ws_attention_configurations` lists the Gluon ``ws`` kernel's launches (sm_90a only: its
dots are wgmma).
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import tempfile

import sm90_compile as sc  # first: sets TRITON_INTERPRET=0 before triton is imported
import triton
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from dsv4_backend.kernels import sparse_attention as sa
from dsv4_backend.kernels import sparse_attention_pipelined as pa
from dsv4_backend.kernels import sparse_attention_ws as wa

TARGETS = {90: sc.TARGETS["sm_90a"], 100: sc.TARGETS["sm_100a"]}
INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
BRANCH = re.compile(r"^\s*(0x[0-9a-f]+)")
#: Register counts a warp-specialised kernel's partitions set (``setmaxnreg``).
SETMAXNREG = re.compile(r"USETMAXREG[^;]*?(0x[0-9a-f]+)\s*;")
#: Argument kinds of both attention kernels (every other argument is i32 or constexpr).
KINDS = dict(
    q_ptr="*bf16", win_ptr="*u8", win_idx_ptr="*i32", win_len_ptr="*i32", ext_ptr="*u8",
    ext_idx_ptr="*i32", ext_len_ptr="*i32", sink_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32",
    ml_ptr="*fp32", count_ptr="*i32", qk_scale="fp32",
)  # fmt: skip
MMA = re.compile(r"^(HGMMA\.\d+x\d+x\d+|UTC\w*MMA)")


def pipelined_attention_source(
    ratio: int, splits: int, heads: int = sc.HEADS, rows_per_group: int = 1
) -> tuple[ASTSource, dict]:
    """The kernel as launched for a layer of compress ``ratio`` (0: window only) with
    ``heads`` heads a rank, up to ``rows_per_group`` rows a program and ``splits`` splits."""
    group = sa.group_rows(heads, rows_per_group)
    block_h = sa._block_h(heads) if group == 1 else triton.next_power_of_2(heads)
    constexprs = dict(
        D=sc.DIM, NOPE_DIM=sc.DIM - sc.ROPE, BLOCK_H=block_h, GROUP=group,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_N=pa._block_n(sc.DIM),
        BLOCK_S=triton.next_power_of_2(splits), HAS_EXTRA=ratio != 0,
        NUM_STAGES=pa.NUM_STAGES, MERGE_D=pa.MERGE_D, INTERPRETER=False,
    )  # fmt: skip
    names = pa._pipelined_attention_kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else KINDS.get(n, "i32") for n in names}
    src = ASTSource(pa._pipelined_attention_kernel, signature, constexprs, _aligned(signature))
    return src, dict(num_warps=pa.NUM_WARPS)


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


def ws_attention_source(ratio: int, splits: int) -> tuple[ASTSource, dict]:
    """The Gluon ws kernel as launched for a layer of compress ``ratio`` at 64 heads."""
    constexprs = dict(
        D=sc.DIM, NOPE_DIM=sc.DIM - sc.ROPE, BLOCK_N=wa.BLOCK_N,
        BLOCK_S=triton.next_power_of_2(splits), HAS_EXTRA=ratio != 0, NUM_BUF=wa.NUM_BUF,
        PRODUCER_WARPS=wa.PRODUCER_WARPS, PRODUCER_REGS=wa.PRODUCER_REGS,
    )  # fmt: skip
    names = wa._ws_attention_kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else KINDS.get(n, "i32") for n in names}
    src = GluonASTSource(wa._ws_attention_kernel, signature, constexprs, _aligned(signature))
    return src, dict(num_warps=wa.CONSUMER_WARPS)


def ws_attention_configurations() -> list[tuple[str, ASTSource, dict]]:
    """The ws kernel (sm_90a only: wgmma) at 64 heads: window-only, c4 (8 splits), c128."""
    return [
        (f"ws-r{ratio}-s{splits}", *ws_attention_source(ratio, splits))
        for ratio, splits in ((0, 1), (4, 8), (128, 4))
    ]


def _aligned(signature: dict[str, str]) -> dict[tuple[int, ...], list[list]]:
    """16-byte divisibility of pointers and strides, and of the page sizes and scale regions
    (multiples of 16 bytes, as Triton specialises them)."""
    aligned = sc._aligned(signature)
    for i, name in enumerate(signature):
        if name.endswith(("_page_bytes", "_scale_region")):
            aligned[(i,)] = [["tt.divisibility", 16]]
    return aligned


def _tool(name: str) -> str:
    return sc.get_ptxas(90).path.rsplit("/", 1)[0] + "/" + name


def _key_loop(sass: str) -> list[str]:
    """Opcodes of the loop (a backward branch) around the most matrix instructions."""
    insns = [(int(a, 16), op, rest) for a, op, rest in INSN.findall(sass)]
    best: list[str] = []
    for addr, op, rest in insns:
        target = BRANCH.match(rest)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            body = [o for a, o, _ in insns if lo <= a <= addr]
            if sum(map(_is_mma, body)) > sum(map(_is_mma, best)):
                best = body
    return best


def _is_mma(op: str) -> bool:
    return MMA.match(op) is not None


def sass_report(name: str, src: ASTSource, options: dict, arch: int) -> dict:
    """Compile for ``sm_{arch}a`` and read registers, spills, shared memory and the key loop."""
    kernel = triton.compile(src, target=TARGETS[arch], options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", f.name],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", f.name], check=True, capture_output=True, text=True
        ).stdout
    resources = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    loop = _key_loop(sass)
    mma = collections.Counter(m.group(1) for m in map(MMA.match, loop) if m)
    return dict(
        name=name,
        arch=f"sm_{arch}a",
        registers=resources["reg"],
        stack=resources["stack"],
        local=resources["local"],
        shared=kernel.metadata.shared,
        loop_instructions=len(loop),
        loop_ldgsts=sum(op.startswith("LDGSTS") for op in loop),
        loop_mma=dict(sorted(mma.items())),
        setmaxnreg=sorted({int(v, 16) for v in SETMAXNREG.findall(sass)}),
        num_warps=options["num_warps"],
    )


def main(argv: list[str]) -> None:
    archs = [90, 100]
    if argv[:1] == ["--target"]:
        archs, argv = [int(argv[1])], argv[2:]
    for name, src, options in pipelined_attention_configurations() + ws_attention_configurations():
        if not argv or any(o in name for o in argv):
            for arch in archs if name.startswith("pipelined") else [a for a in archs if a == 90]:
                print(json.dumps(sass_report(name, src, options, arch)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
