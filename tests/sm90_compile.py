"""Compile the Triton kernels ahead of time for sm_90a (Hopper) or sm_100a (Blackwell) on the
CPU and report them.

Run as a script (``python tests/sm90_compile.py [--target sm_100a] [NAME ...]``; the tests run
it, and ``benchmarks/sass_report.py`` on top of it, in a subprocess because the test
session's ``TRITON_INTERPRET=1`` turns every ``@triton.jit`` function into an interpreted
one). Each configuration is a launch the backend
makes at DeepSeek-V4-Flash shapes (H = 64, and 16 / 32 heads a rank under attention TP;
D = 512 = 448 nope + 64 rope), with the block sizes
and warps the launcher picks: sparse attention, then the indexer, compressor and planner
kernels (``fused_configurations``). It prints one JSON object per configuration:

* ``mma``: the PTX matrix instructions, e.g. ``wgmma.mma_async.sp...bf16.bf16`` opcodes with
  their operand types (``tf32`` shows up here if a dot fell back to fp32 operands); Blackwell's
  ``tcgen05.mma`` carries its shape and types in an instruction descriptor, decoded into
  ``mma_shapes`` (``m64n16k16.bf16``, for wgmma from the opcode);
* ``registers``, ``spill_stores``, ``spill_loads``, ``stack``: from ``ptxas -v`` (Triton's
  bundled ptxas for the target, the same call Triton makes);
* ``cp_async``: asynchronous global -> shared copies in the PTX (a software-pipelined gather);
* ``shared``: the shared memory Triton allocates (bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from dsv4_backend.config import WINDOW_PAGE_TOKENS
from dsv4_backend.kernels import key_union as ku
from dsv4_backend.kernels import sparse_attention as sa
from dsv4_backend.kernels.cache_store import STORE_FP8_INDEXER, STORE_FP8_TOKEN
from dsv4_backend.testing import sass

#: Hopper (H100 / H200) and Blackwell datacenter parts (B200 / B300 / GB200 / GB300).
TARGETS = {"sm_90a": GPUTarget("cuda", 90, 32), "sm_100a": GPUTarget("cuda", 100, 32)}
HEADS, DIM, ROPE = 64, 512, 64
#: fp8 page sizes of the window, c4 and c128 caches.
PAGE_TOKENS = {0: WINDOW_PAGE_TOKENS, 4: 64, 128: 2}


def _aligned(signature: dict[str, str]) -> dict[tuple[int, ...], list[list]]:
    """16-byte divisibility of every pointer and stride, as the launcher's tensors have."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, (name, kind) in enumerate(signature.items())
        if kind.startswith("*") or (name.startswith("stride") and kind == "i32")
    }


def argument_kinds(fn, kinds: dict[str, str], constexprs: dict) -> dict[str, str]:
    """``fn``'s signature: ``constexpr`` for the names in ``constexprs``, the pointer / float
    kinds of ``kinds``, ``i32`` for every other argument."""
    return {n: "constexpr" if n in constexprs else kinds.get(n, "i32") for n in fn.arg_names}


def attention_source(
    fmt: str, ratio: int, splits: int, heads: int = HEADS, rows_per_group: int = 1
) -> tuple[ASTSource, dict]:
    """The attention kernel as launched for a layer of compress ``ratio`` (0: window only) with
    ``heads`` heads a rank (fewer than 64 under attention TP), packing up to ``rows_per_group``
    rows a program (verify / draft extend)."""
    fp8 = fmt == "fp8"
    group = sa.group_rows(heads, rows_per_group)
    block_h = sa.program_heads(heads, group)
    block_g = triton.next_power_of_2(group)
    block_n, num_warps, num_stages = sa._launch_config(DIM, fp8, block_h * block_g)
    cache = "*u8" if fp8 else "*bf16"
    kinds = dict(
        q_ptr="*bf16", win_ptr=cache, win_idx_ptr="*i32", win_len_ptr="*i32", ext_ptr=cache,
        ext_idx_ptr="*i32", ext_len_ptr="*i32", sink_ptr="*fp32", out_ptr="*bf16",
        m_ptr="*fp32", l_ptr="*fp32", qk_scale="fp32",
    )  # fmt: skip
    constexprs = dict(
        D=DIM, BLOCK_D=DIM, BLOCK_H=block_h, GROUP=group, BLOCK_G=block_g, BLOCK_N=block_n,
        NUM_SPLITS=splits,
        HAS_EXTRA=ratio != 0, NOPE_DIM=DIM - ROPE, WIN_FP8=fp8, WIN_PAGE_TOKENS=PAGE_TOKENS[0],
        EXT_FP8=fp8, EXT_PAGE_TOKENS=PAGE_TOKENS[ratio], ONE_GATHER=not fp8,
        INTERPRETER=False,
    )  # fmt: skip
    signature = argument_kinds(sa._sparse_attention_kernel, kinds, constexprs)
    src = ASTSource(sa._sparse_attention_kernel, signature, constexprs, _aligned(signature))
    return src, dict(num_warps=num_warps, num_stages=num_stages)


def union_source(group: int) -> tuple[ASTSource, dict]:
    """The key-union kernel for groups of ``group`` rows."""
    names = ku._key_union_kernel.arg_names
    constexprs = dict(GROUP=group, BLOCK_G=triton.next_power_of_2(group), BLOCK_N=ku.BLOCK_N)
    signature = {
        n: "constexpr" if n in constexprs else ("*i32" if n.endswith("_ptr") else "i32")
        for n in names
    }
    src = ASTSource(ku._key_union_kernel, signature, constexprs, _aligned(signature))
    return src, dict(num_warps=4)


def merge_source(splits: int) -> tuple[ASTSource, dict]:
    """The merge of ``splits`` partials into the output (both bf16, as on a GPU)."""
    names = sa._merge_splits_kernel.arg_names
    constexprs = dict(
        D=DIM,
        BLOCK_D=DIM,
        NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits),
        HEADS_PER_PROGRAM=sa.merge_heads_per_program(64, torch.device("cuda")),
    )
    signature = {
        n: "constexpr" if n in constexprs else ("*fp32" if n.endswith("_ptr") else "i32")
        for n in names
    }
    signature.update(part_ptr="*bf16", out_ptr="*bf16")
    src = ASTSource(sa._merge_splits_kernel, signature, constexprs, _aligned(signature))
    return src, dict(num_warps=sa.MERGE_WARPS)


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
            [get_ptxas(TARGETS[target].arch).path, "-v", "--regAllocOptLevel=2",
             f"--gpu-name={target}", src, "-o", src + ".o"],
            check=True, capture_output=True, text=True,
        ).stderr  # fmt: skip
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
        for m in re.finditer(r"\b(?:wgmma\.mma_async|mma\.sync)[\w.]*?\.(m\d+n\d+k\d+)"
                             r"[\w.]*?\.f32\.(\w+)\.", ptx)
    }  # fmt: skip
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
    hardware fp8 conversion) and ``main_loop_calls`` (subroutine calls in the body of the
    main loop, ``testing.sass.main_loop``: a 64-bit division or modulo is one)."""
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[.\s;]", listing)
    loop = sass.main_loop(listing)
    calls = sum(i.op.startswith("CALL") for i in loop.instructions) if loop else 0
    return dict(
        instructions=len(opcodes),
        integer_ops=sum(op in INTEGER_OPCODES for op in opcodes),
        e4m3_converts=len(re.findall(r"\bF2FP\.[\w.]*E4M3[\w.]*", listing)),
        main_loop_calls=calls,
    )


def compile_report(
    name: str, src: ASTSource, options: dict, target: str = "sm_90a", kernel=None,
    listing: str | None = None,
) -> dict:  # fmt: skip
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


def configurations() -> list[tuple[str, ASTSource, dict]]:
    """Every launch shape of the Flash layers: window-only / c4 / c128, dense bf16 / fp8, one
    split (finalising) and several (partials), and the merge kernel; then the c4 layer with
    16 and 32 heads a rank (attention TP 4 and 2), one row a program (decode) and the rows of
    a 4-token verify together (``-g``: 64 M lines, as at H = 64), and the key union."""
    out = []
    for fmt in ("dense", "fp8"):
        for ratio, splits in ((0, 1), (4, 1), (4, 8), (128, 4)):
            out.append(
                (f"attention-{fmt}-r{ratio}-s{splits}", *attention_source(fmt, ratio, splits))
            )
        for heads in (16, 32):
            src = attention_source(fmt, 4, 4, heads)
            out.append((f"attention-{fmt}-r4-s4-h{heads}", *src))
            for ratio, splits in ((4, 1), (128, 4)):
                src = attention_source(fmt, ratio, splits, heads, rows_per_group=4)
                out.append((f"attention-{fmt}-r{ratio}-s{splits}-g-h{heads}", *src))
    out.append(("merge-s8", *merge_source(8)))
    out.append(("key-union-g4", *union_source(4)))
    return out + fused_configurations()


# ------------------------------------------------------------- indexer, compressor, planner
def _pointer_aligned(signature: dict[str, str]) -> dict[tuple[int, ...], list[list]]:
    """16-byte alignment of the pointers only (these kernels' strides need not be multiples
    of 16: plan records are 4 wide)."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, kind in enumerate(signature.values())
        if kind.startswith("*")
    }


def _source(fn, kinds: dict[str, str], constexprs: dict) -> tuple[ASTSource, dict]:
    """``fn`` with pointer / float kinds from ``kinds``, every other argument i32."""
    signature = argument_kinds(fn, kinds, constexprs)
    return ASTSource(fn, signature, constexprs, _pointer_aligned(signature)), dict(num_warps=4)


def fused_configurations() -> list[tuple[str, ASTSource, dict]]:
    """The lightning indexer (bf16 dots, fp8 keys, 64 heads x 128), its slot selection
    (top-k 512), the length-bounded indexer, the compressors (c4 and c128, D = 512) and the
    fused planner."""
    from dsv4_backend.kernels import indexer

    scores = _source(
        indexer._indexer_scores_kernel,
        dict(q_ptr="*bf16", w_ptr="*fp32", key_ptr="*u8", page_table_ptr="*i32",
             num_ptr="*i32", out_ptr="*fp32"),
        dict(HI=64, DIM=128, PAGE_TOKENS=64, E=64, BLOCK_H=64, BLOCK_D=128,
             BLOCK_N=indexer.BLOCK_N, FP8=True, DOT_BF16=True),
    )  # fmt: skip
    slots = _source(
        indexer._selected_slots_kernel,
        dict(picked_ptr="*i64", num_ptr="*i32", page_table_ptr="*i32", out_ptr="*i32"),
        dict(E=64, HAS_PICKED=True, BLOCK_K=512),
    )
    out = [("indexer-scores-fp8", *scores), ("indexer-slots-k512", *slots)]
    return out + _bounded_indexer() + _compressors() + _planner()


def _bounded_indexer() -> list[tuple[str, ASTSource, dict]]:
    """The length-bounded indexer: row scores (fp8 and bf16 dense keys) and its top-k (the
    chunks' and the merge's kernels, top-k 512)."""
    from dsv4_backend.kernels import indexer

    out = []
    for fmt, key in (("fp8", "*u8"), ("dense", "*bf16")):
        rows = _source(
            indexer._row_scores_kernel,
            dict(q_ptr="*bf16", w_ptr="*fp32", key_ptr=key, page_table_ptr="*i32",
                 num_ptr="*i32", out_ptr="*fp32"),
            dict(HI=64, DIM=128, PAGE_TOKENS=64, E=64, BLOCK_H=64, BLOCK_D=128,
                 BLOCK_N=indexer.BLOCK_N, FP8=fmt == "fp8", GPU=True),
        )  # fmt: skip
        out.append((f"indexer-rows-{fmt}", *rows))
    chunks = _source(
        indexer._topk_chunks_kernel,
        dict(scores_ptr="*fp32", num_ptr="*i32", cand_scores_ptr="*fp32", cand_cols_ptr="*i32"),
        dict(BLOCK_C=indexer.TOPK_BLOCK_C),
    )
    out.append(("indexer-topk-chunks", *chunks))
    merge = _source(
        indexer._merge_topk_slots_kernel,
        dict(cand_scores_ptr="*fp32", cand_cols_ptr="*i32", num_ptr="*i32",
             page_table_ptr="*i32", out_ptr="*i32"),
        dict(E=64, BLOCK_K=512, BLOCK_C=indexer.TOPK_BLOCK_C),
    )  # fmt: skip
    out.append(("indexer-topk-merge-k512", *merge))
    return out


def _compressors() -> list[tuple[str, ASTSource, dict]]:
    """The compressors of c4 and c128 layers (D = 512)."""
    from dsv4_backend.kernels import compressor

    out = []
    for ratio, span, ovl in ((4, 8, 2), (128, 128, 1)):
        entry = _source(
            compressor._compress_entry_kernel,
            dict(kv_ptr="*fp32", score_ptr="*fp32", ape_ptr="*fp32", ring_ptr="*fp32",
                 pool_ptr="*i64", window_ptr="*i32", plan_ptr="*i32", norm_ptr="*fp32",
                 cos_ptr="*fp32", sin_ptr="*fp32", out_ptr="*fp32", eps="fp32"),
            dict(RATIO=ratio, SPAN=span, OVERLAP=ovl, WINDOW_PAGE=256 if ratio == 4 else 0,
                 ROPE_PAIRS=ROPE // 2, ROPE_BY_ROW=False, BLOCK_P=DIM // 2, BLOCK_S=8),
        )  # fmt: skip
        out.append((f"compress-entry-c{ratio}", *entry))
        # The one-launch compressor: fp8 token cache store, ring write (decode / verify), and
        # with the writes that wait for the ring reads (extend).
        store = dict(STORE=STORE_FP8_TOKEN, NOPE_DIM=DIM - ROPE, ROPE_DIM=ROPE,
                     PAGE_TOKENS=PAGE_TOKENS[ratio], BLOCK_R=ROPE)  # fmt: skip
        out.append((f"compress-fused-c{ratio}", *_fused_compressor(ratio, DIM, store, False)))
        extend = _fused_compressor(ratio, DIM, store, True)
        out.append((f"compress-fused-c{ratio}-extend", *extend))
    for ratio in (4, 128):  # the ring write of the replaced kernels
        write = _source(
            compressor._ring_write_kernel,
            dict(kv_ptr="*fp32", score_ptr="*fp32", ape_ptr="*fp32", ring_ptr="*fp32",
                 pool_ptr="*i64", window_ptr="*i32", plan_ptr="*i32"),
            dict(RATIO=ratio, WINDOW_PAGE=256 if ratio == 4 else 0, BLOCK=compressor.WRITE_BLOCK),
        )  # fmt: skip
        out.append((f"compress-ring-write-c{ratio}", *write))
    # The indexer's compressor (DI = 128) storing fp8 indexer keys.
    store = dict(STORE=STORE_FP8_INDEXER, NOPE_DIM=0, ROPE_DIM=0, PAGE_TOKENS=64, BLOCK_R=1)
    out.append(("compress-fused-indexer", *_fused_compressor(4, 128, store, False)))
    out.append(("compress-fused-indexer-extend", *_fused_compressor(4, 128, store, True)))
    return out


def _fused_compressor(
    ratio: int, dim: int, store: dict, defer_writes: bool
) -> tuple[ASTSource, dict]:
    """``_compress_fused_kernel`` of ``ratio`` and head dim ``dim`` storing with ``store``
    (``cache_store.store_row``'s constexprs), ``DEFER_WRITES`` (extend), warps as launched."""
    from dsv4_backend.kernels import compressor

    span = 8 if ratio == 4 else 128
    splits = compressor.channel_splits(dim, span, torch.device("cuda"))  # as a GPU launches
    src, _ = _source(
        compressor._compress_fused_kernel,
        dict(kv_ptr="*fp32", score_ptr="*fp32", ape_ptr="*fp32", ring_ptr="*fp32",
             pool_ptr="*i64", window_ptr="*i32", plan_ptr="*i32", write_plan_ptr="*i32",
             norm_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", out_ptr="*fp32",
             out_loc_ptr="*i64", cache_ptr="*u8", arrivals_ptr="*i32", eps="fp32"),
        dict(RATIO=ratio, SPAN=span, OVERLAP=2 if ratio == 4 else 1,
             WINDOW_PAGE=256 if ratio == 4 else 0, ROPE_PAIRS=ROPE // 2, ROPE_BY_ROW=False,
             BLOCK_D=dim, **compressor.fused_tiles(dim, span, splits), DEFER_WRITES=defer_writes,
             BF16_BITS=False, **store),
    )  # fmt: skip
    return src, dict(num_warps=compressor.fused_warps(dim))


def _planner() -> list[tuple[str, ASTSource, dict]]:
    """The fused planner's fields and checks kernels."""
    from dsv4_backend.kernels import plan_fields

    out = []
    # Planner pointers: int32 unless listed as int64.
    int64 = "host_ptr req_pool_ptr out_cache_loc_ptr full_to_swa_ptr positions_ptr"
    int64 += " swa_out_loc_ptr c4_out_loc_ptr c128_out_loc_ptr"
    int64 += " record_ptr"
    kinds = {
        n: "*i64" if n in int64.split() else "*i32"
        for fn in (plan_fields._plan_kernel, plan_fields._check_kernel)
        for n in fn.arg_names
        if n.endswith("_ptr")
    }
    kinds["failed_ptr"] = "*i8"
    # Row blocks as the launcher sizes them: a small batch (8) and a large one (256).
    for extend, batch in ((False, 8), (False, 256), (True, 8), (True, 256)):
        tiles = plan_fields.GPU_TILES
        block_t = plan_fields.row_block(tiles, tiles.rows, batch)
        plan = _source(
            plan_fields._plan_kernel,
            kinds,
            dict(EXTEND=extend, HAS_SWA_MAP=True, HAS_C4=True, HAS_C128=True, PAGE=256,
                 SPAN4=8, SPAN128=128, BLOCK_T=block_t, BLOCK_B=batch,
                 BLOCK_C=tiles.columns),
        )  # fmt: skip
        out.append((f"plan-fields-{'extend' if extend else 'uniform'}-b{batch}", *plan))
        block_t = plan_fields.row_block(tiles, tiles.check_rows, batch)
        check = _source(
            plan_fields._check_kernel,
            kinds,
            dict(
                EXTEND=extend,
                HAS_SWA_MAP=True,
                PAGE=256,
                BLOCK_T=block_t,
                BLOCK_B=batch,
                BLOCK_E=plan_fields.check_block_e(tiles, 128, batch),
            ),
        )
        out.append((f"plan-checks-{'extend' if extend else 'uniform'}-b{batch}", *check))
    return out


def selected(only: list[str], target: str) -> list[tuple[str, ASTSource, dict]]:
    """The configurations for ``target`` whose names contain one of ``only`` (all when empty);
    an entry ``TARGET:NAME`` selects for that target only."""
    if not only:
        return configurations()
    names = [o.split(":", 1)[-1] for o in only if ":" not in o or o.startswith(f"{target}:")]
    return [c for c in configurations() if any(n in c[0] for n in names)]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help="repeatable (default: sm_90a)")  # fmt: skip
    parser.add_argument("only", nargs="*", help="configuration name substrings, TARGET:NAME "
                        "for one target only (default: all)")  # fmt: skip
    opts = parser.parse_args(argv)
    for target in opts.target or ["sm_90a"]:
        for name, src, options in selected(opts.only, target):
            print(json.dumps(compile_report(name, src, options, target)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
