"""The launches compiled ahead of time: each a configuration ``(name, source, options)`` as the
backend's launcher makes it at DeepSeek-V4-Flash shapes (H = 64, and 16 / 32 heads a rank
under attention TP; D = 512 = 448 nope + 64 rope), with the block sizes and warps it picks.

* :func:`default_configurations`: the default Triton kernels: sparse attention, its merge and
  key union, then the indexer, compressor and planner kernels (:func:`fused_configurations`);
* :func:`opt_in_configurations`: the opt-in FP8 attention kernels: ``pipelined`` (584-byte
  tokens, 448 e4m3 + 64 bf16 channels) and the Gluon ``ws`` kernels (Hopper's for sm_90a:
  wgmma; Blackwell's for sm_100a: tcgen05).

:func:`targets_of` says which targets a configuration compiles for, :func:`selected` picks them
by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from dsv4_backend.cache.fp4_format import C4_ROUNDING
from dsv4_backend.config import WINDOW_PAGE_TOKENS
from dsv4_backend.kernels.attention import common as ac
from dsv4_backend.kernels.attention import key_union as ku
from dsv4_backend.kernels.attention import pipelined as pa
from dsv4_backend.kernels.attention import triton as sa
from dsv4_backend.kernels.attention import ws as wa
from dsv4_backend.kernels.cache_store import triton as cache_store_triton
from dsv4_backend.kernels.compressor import entries as compressor_entries
from dsv4_backend.kernels.compressor import fused as compressor_fused
from dsv4_backend.kernels.device.cache_rows import STORE_FP8_INDEXER, STORE_FP8_TOKEN
from dsv4_backend.kernels.indexer import bounded as indexer_bounded
from dsv4_backend.kernels.indexer import device as indexer_device
from dsv4_backend.kernels.indexer import slots as indexer_slots
from dsv4_backend.kernels.indexer import triton as indexer_triton
from dsv4_backend.kernels.indexer.common import BLOCK_N as INDEXER_BLOCK_N
from dsv4_backend.kernels.low_ratio import triton as low_ratio_triton
from dsv4_backend.planning.kernels import plan_fields
from dsv4_backend.tools.aot_compile.toolchain import TARGETS
from dsv4_backend.tools.precompile import DIM, ROPE

#: A launch: its name, the kernel's source (signature, constexprs, alignment) and its options.
Configuration = tuple[str, ASTSource, dict]
#: Query heads at Flash's width (one rank).
HEADS = 64
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
    group = ac.group_rows(heads, rows_per_group)
    block_h = ac.program_heads(heads, group)
    block_g = triton.next_power_of_2(group)
    block_n, num_warps, num_stages = sa._launch_config(DIM, fp8, block_h * block_g)
    cache = "*u8" if fp8 else "*bf16"
    kinds = dict(
        q_ptr="*bf16",
        win_ptr=cache,
        win_idx_ptr="*i32",
        win_len_ptr="*i32",
        ext_ptr=cache,
        ext_idx_ptr="*i32",
        ext_len_ptr="*i32",
        sink_ptr="*fp32",
        out_ptr="*bf16",
        m_ptr="*fp32",
        l_ptr="*fp32",
        qk_scale="fp32",
    )
    constexprs = dict(
        D=DIM,
        BLOCK_D=DIM,
        BLOCK_H=block_h,
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        HAS_EXTRA=ratio != 0,
        NOPE_DIM=DIM - ROPE,
        WIN_FP8=fp8,
        WIN_PAGE_TOKENS=PAGE_TOKENS[0],
        EXT_FP8=fp8,
        EXT_PAGE_TOKENS=PAGE_TOKENS[ratio],
        ONE_GATHER=not fp8,
        INTERPRETER=False,
    )
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


def default_configurations() -> list[Configuration]:
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


def _indexer_source(
    kernel, queries: str, key: str, heads: int, per_page: int, **constexprs: Any
) -> tuple[ASTSource, dict]:
    """An indexer scores kernel over ``heads`` x 128 ``queries`` and ``key`` index keys of
    ``per_page`` entries a page, with the kernel's own ``constexprs``."""
    kinds = dict(q_ptr=queries, w_ptr="*fp32", key_ptr=key, page_table_ptr="*i32")
    shape = dict(HI=heads, DIM=128, PAGE_TOKENS=64, E=per_page, BLOCK_H=heads, BLOCK_D=128)
    return _source(
        kernel,
        dict(kinds, num_ptr="*i32", out_ptr="*fp32"),
        dict(shape, BLOCK_N=INDEXER_BLOCK_N, **constexprs),
    )


def fused_configurations() -> list[Configuration]:
    """The lightning indexer (bf16 dots, fp8 keys, 64 heads x 128; DeepSeek-V4.1's fp4 keys,
    32 heads), its slot selection (top-k 512), the length-bounded indexer, the compressors (c4
    and c128, D = 512) and the fused planner."""
    scores = indexer_triton._indexer_scores_kernel
    fp8, fp4 = dict(KEYS=1, DOT_BF16=True), dict(KEYS=2, DOT_BF16=True)
    slots = _source(
        indexer_slots._selected_slots_kernel,
        dict(picked_ptr="*i64", num_ptr="*i32", page_table_ptr="*i32", out_ptr="*i32"),
        dict(E=64, HAS_PICKED=True, BLOCK_K=512),
    )
    out = [
        ("indexer-scores-fp8", *_indexer_source(scores, "*bf16", "*u8", 64, 64, **fp8)),
        # DeepSeek-V4.1's index scores: fp4 pages, 32 heads x 128, c1 (256 entries a page)
        ("indexer-scores-fp4-c1", *_indexer_source(scores, "*fp32", "*u8", 32, 256, **fp4)),
        # sglang's fp4 indexer (--enable-deepseek-v4-fp4-indexer): fp4 c4 pages, 64 heads x 128
        ("fp4-indexer-scores-c4", *_indexer_source(scores, "*fp32", "*u8", 64, 64, **fp4)),
        ("indexer-slots-k512", *slots),
    ]
    return out + _bounded_indexer() + _compressors() + _low_ratio_rows() + _planner()


def _low_ratio_rows() -> list[Configuration]:
    """DeepSeek-V4.1's fp4 rows: a kv source's entries (D = 512, e4m3 scales, the compressor's
    norm) and its index keys (DI = 128, ue8m0 scales, k_norm, packed into the fp4 pages); a
    ratio-2 source's pair pooling and ring write (D = 512, 2 ring rows)."""
    kinds = dict(
        x_ptr="*fp32",
        weight_ptr="*fp32",
        cos_ptr="*fp32",
        sin_ptr="*fp32",
        out_ptr="*fp32",
        normed_ptr="*fp32",
        pages_ptr="*u8",
        slots_ptr="*i64",
        eps="fp32",
        num_rows="i32",
    )

    def fp4_rows(dim: int, block: int, ue8m0: bool, page_tokens: int) -> tuple[ASTSource, dict]:
        """The rows kernel (normed) of ``dim`` channels in ``block``-value scale blocks, ue8m0
        (else e4m3) scales; ``page_tokens`` > 1: stored into the fp4 pages."""
        constexprs = dict(
            D=dim,
            ROPE=ROPE,
            HEADS=1,
            BLOCK=block,
            UE8M0=ue8m0,
            NORM=True,
            STORE=page_tokens > 1,
            PAGE_TOKENS=page_tokens,
            ROWS=low_ratio_triton.ROWS_PER_PROGRAM["cuda"],
        )
        return _source(low_ratio_triton._fp4_rows_kernel, kinds, constexprs)

    entries = fp4_rows(DIM, 16, ue8m0=False, page_tokens=1)
    keys = fp4_rows(128, 32, ue8m0=True, page_tokens=64)
    pair_kinds = dict(
        kv_ptr="*fp32",
        score_ptr="*fp32",
        ring_ptr="*fp32",
        req_ptr="*i64",
        pos_ptr="*i64",
        valid_ptr="*i1",
        out_ptr="*fp32",
    )
    pair_constants = dict(
        D=DIM,
        R=2,
        BLOCK_D=low_ratio_triton.PAIR_BLOCK_D,
        ROWS=low_ratio_triton.ROWS_PER_PROGRAM["cuda"],
    )
    pool = _source(low_ratio_triton._pair_pool_kernel, pair_kinds, pair_constants)
    write = _source(low_ratio_triton._pair_ring_write_kernel, pair_kinds, pair_constants)
    return [
        ("compress-low-ratio-entries", *entries),
        ("compress-low-ratio-pairs", *pool),
        ("compress-low-ratio-ring-write", *write),
        ("indexer-low-ratio-keys", *keys),
    ]


def _bounded_indexer() -> list[Configuration]:
    """The length-bounded indexer: row scores (fp8, bf16 dense and, sglang's fp4 indexer, fp4
    keys) and its top-k (the chunks' and the merge's kernels, top-k 512); the cache store of
    the fp4 indexer's keys (sglang's c4 rounding)."""
    out = []
    kernel = indexer_bounded._row_scores_kernel
    formats = (
        ("fp8", "*u8", indexer_device.FP8_KEYS),
        ("dense", "*bf16", indexer_device.DENSE_KEYS),
        ("fp4", "*u8", indexer_device.FP4_KEYS),
    )
    for fmt, key, keys in formats:
        rows = _indexer_source(kernel, "*bf16", key, 64, 64, KEYS=keys.value, GPU=True)
        if fmt == "fp4":  # launched with more warps (bounded.FP4_ROW_WARPS)
            rows = rows[0], dict(num_warps=indexer_bounded.FP4_ROW_WARPS)
        # sglang's fp4 indexer runs on SM100 / SM120 only (targets_of)
        out.append(("fp4-indexer-rows" if fmt == "fp4" else f"indexer-rows-{fmt}", *rows))
    rounding = C4_ROUNDING
    store = _source(
        cache_store_triton._store_fp4_index_kernel,
        dict(storage_ptr="*u8", rows_ptr="*fp32", slots_ptr="*i64"),
        dict(
            DIM=128,
            PAGE_TOKENS=64,
            FLOOR=rounding.amax_floor,
            EXACT=rounding.exact_exponent,
            TIES_EVEN=rounding.ties_even,
        ),
    )
    out.append(("fp4-indexer-store-c4", *store))
    chunks = _source(
        indexer_bounded._topk_chunks_kernel,
        dict(scores_ptr="*fp32", num_ptr="*i32", cand_scores_ptr="*fp32", cand_cols_ptr="*i32"),
        dict(BLOCK_C=indexer_bounded.TOPK_BLOCK_C),
    )
    out.append(("indexer-topk-chunks", *chunks))
    merge = _source(
        indexer_bounded._merge_topk_slots_kernel,
        dict(
            cand_scores_ptr="*fp32",
            cand_cols_ptr="*i32",
            num_ptr="*i32",
            page_table_ptr="*i32",
            out_ptr="*i32",
        ),
        dict(E=64, BLOCK_K=512, BLOCK_C=indexer_bounded.TOPK_BLOCK_C),
    )
    out.append(("indexer-topk-merge-k512", *merge))
    return out


def _compressors() -> list[Configuration]:
    """The compressors of c4 and c128 layers (D = 512)."""
    out = []
    for ratio, span, ovl in ((4, 8, 2), (128, 128, 1)):
        entry = _source(
            compressor_entries._compress_entry_kernel,
            dict(
                kv_ptr="*fp32",
                score_ptr="*fp32",
                ape_ptr="*fp32",
                ring_ptr="*fp32",
                pool_ptr="*i64",
                window_ptr="*i32",
                plan_ptr="*i32",
                norm_ptr="*fp32",
                cos_ptr="*fp32",
                sin_ptr="*fp32",
                out_ptr="*fp32",
                eps="fp32",
            ),
            dict(
                RATIO=ratio,
                SPAN=span,
                OVERLAP=ovl,
                WINDOW_PAGE=256 if ratio == 4 else 0,
                ROPE_PAIRS=ROPE // 2,
                ROPE_BY_ROW=False,
                BLOCK_P=DIM // 2,
                BLOCK_S=8,
            ),
        )
        out.append((f"compress-entry-c{ratio}", *entry))
        # The one-launch compressor: fp8 token cache store, ring write (decode / verify), and
        # with the writes that wait for the ring reads (extend).
        store = dict(
            STORE=STORE_FP8_TOKEN,
            NOPE_DIM=DIM - ROPE,
            ROPE_DIM=ROPE,
            PAGE_TOKENS=PAGE_TOKENS[ratio],
            BLOCK_R=ROPE,
        )
        out.append((f"compress-fused-c{ratio}", *_fused_compressor(ratio, DIM, store, False)))
        extend = _fused_compressor(ratio, DIM, store, True)
        out.append((f"compress-fused-c{ratio}-extend", *extend))
    for ratio in (4, 128):  # the ring write of the replaced kernels
        write = _source(
            compressor_entries._ring_write_kernel,
            dict(
                kv_ptr="*fp32",
                score_ptr="*fp32",
                ape_ptr="*fp32",
                ring_ptr="*fp32",
                pool_ptr="*i64",
                window_ptr="*i32",
                plan_ptr="*i32",
            ),
            dict(
                RATIO=ratio,
                WINDOW_PAGE=256 if ratio == 4 else 0,
                BLOCK=compressor_entries.WRITE_BLOCK,
            ),
        )
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
    (``cache_rows.store_row``'s constexprs), ``DEFER_WRITES`` (extend), warps as launched."""
    span = 8 if ratio == 4 else 128
    splits = compressor_fused.channel_splits(dim, span, torch.device("cuda"))  # as a GPU launches
    src, _ = _source(
        compressor_fused._compress_fused_kernel,
        dict(
            kv_ptr="*fp32",
            score_ptr="*fp32",
            ape_ptr="*fp32",
            ring_ptr="*fp32",
            pool_ptr="*i64",
            window_ptr="*i32",
            plan_ptr="*i32",
            write_plan_ptr="*i32",
            norm_ptr="*fp32",
            cos_ptr="*fp32",
            sin_ptr="*fp32",
            out_ptr="*fp32",
            out_loc_ptr="*i64",
            cache_ptr="*u8",
            arrivals_ptr="*i32",
            eps="fp32",
        ),
        dict(
            RATIO=ratio,
            SPAN=span,
            OVERLAP=2 if ratio == 4 else 1,
            WINDOW_PAGE=256 if ratio == 4 else 0,
            ROPE_PAIRS=ROPE // 2,
            ROPE_BY_ROW=False,
            BLOCK_D=dim,
            **compressor_fused.fused_tiles(dim, span, splits),
            DEFER_WRITES=defer_writes,
            BF16_BITS=False,
            **store,
        ),
    )
    return src, dict(num_warps=compressor_fused.fused_warps(dim))


def _planner() -> list[Configuration]:
    """The fused planner's fields (DeepSeek-V4's and V4.1's ratios) and checks kernels."""
    out = []
    # Planner pointers: int32 unless listed as int64.
    int64 = "host_ptr req_pool_ptr out_cache_loc_ptr full_to_swa_ptr positions_ptr"
    int64 += " swa_out_loc_ptr c4_out_loc_ptr c128_out_loc_ptr c1_out_loc_ptr c2_out_loc_ptr"
    int64 += " record_ptr"
    kinds = {
        n: "*i64" if n in int64.split() else "*i32"
        for fn in (plan_fields._plan_kernel, plan_fields._check_kernel)
        for n in fn.arg_names
        if n.endswith("_ptr")
    }
    kinds["failed_ptr"] = "*i8"
    # DeepSeek-V4 (c4, c128) and DeepSeek-V4.1 (c1, c2 with c1 candidate blocks) plans.
    v4 = dict(HAS_C4=True, HAS_C128=True, HAS_C1=False, HAS_C2=False, CANDIDATE_RATIO=0)
    v41 = dict(HAS_C4=False, HAS_C128=False, HAS_C1=True, HAS_C2=True, CANDIDATE_RATIO=1)
    models = {"": v4, "v41-": v41, "v41-tail-": v41}  # the tail: an extend with window floors
    # Row blocks as the launcher sizes them: a small batch (8) and a large one (256).
    for extend, batch in ((False, 8), (False, 256), (True, 8), (True, 256)):
        tiles = plan_fields.GPU_TILES
        block_t = plan_fields.row_block(tiles, tiles.rows, batch)
        kind = "extend" if extend else "uniform"
        for model, ratios in models.items():
            floors = model == "v41-tail-"
            if floors and not extend:
                continue
            plan = _source(
                plan_fields._plan_kernel,
                kinds,
                dict(
                    EXTEND=extend,
                    HAS_FLOORS=floors,
                    HAS_SWA_MAP=True,
                    **ratios,
                    PAGE=256,
                    SPAN4=8,
                    SPAN128=128,
                    BLOCK_T=block_t,
                    BLOCK_B=batch,
                    BLOCK_C=tiles.columns,
                ),
            )
            out.append((f"plan-fields-{model}{kind}-b{batch}", *plan))
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


# ------------------------------------------------------------- opt-in attention kernels
#: Argument kinds of both opt-in attention kernels (every other argument is i32 or constexpr).
KINDS = dict(
    q_ptr="*bf16",
    win_ptr="*u8",
    win_idx_ptr="*i32",
    win_len_ptr="*i32",
    ext_ptr="*u8",
    ext_idx_ptr="*i32",
    ext_len_ptr="*i32",
    sink_ptr="*fp32",
    out_ptr="*bf16",
    part_ptr="*fp32",
    ml_ptr="*fp32",
    count_ptr="*i32",
    qk_scale="fp32",
)


def _opt_in_source(
    fn, constexprs: dict, source: type[ASTSource] = ASTSource, kinds: dict[str, str] = KINDS
) -> ASTSource:
    """``fn`` (an opt-in attention kernel) with the launcher's argument ``kinds``, 16-byte
    aligned pointers and strides, and page sizes and scale regions that are multiples of 16
    bytes (as Triton specialises them)."""
    signature = argument_kinds(fn, kinds, constexprs)
    aligned = _aligned(signature)
    for i, name in enumerate(signature):
        if name.endswith(("_page_bytes", "_scale_region")):
            aligned[(i,)] = [["tt.divisibility", 16]]
    return source(fn, signature, constexprs, aligned)


def pipelined_attention_source(
    ratio: int, splits: int, heads: int = HEADS, rows_per_group: int = 1
) -> tuple[ASTSource, dict]:
    """The kernel as launched for a layer of compress ``ratio`` (0: window only) with
    ``heads`` heads a rank, up to ``rows_per_group`` rows a program and ``splits`` splits."""
    group = ac.group_rows(heads, rows_per_group)
    constexprs = dict(
        D=DIM,
        NOPE_DIM=DIM - ROPE,
        BLOCK_H=ac.program_heads(heads, group),
        GROUP=group,
        BLOCK_G=triton.next_power_of_2(group),
        BLOCK_N=pa._block_n(DIM),
        BLOCK_S=triton.next_power_of_2(splits),
        HAS_EXTRA=ratio != 0,
        NUM_STAGES=pa.NUM_STAGES,
        MERGE_D=pa.MERGE_D,
        INTERPRETER=False,
    )
    return _opt_in_source(pa._pipelined_attention_kernel, constexprs), dict(num_warps=pa.NUM_WARPS)


def pipelined_attention_configurations() -> list[Configuration]:
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
    kernel, constexprs = wa.ws_kernel(major, DIM, DIM - ROPE, splits, ratio != 0, fp8)
    options = dict(num_warps=constexprs.pop("num_warps"))
    caches = {} if fp8 else dict(win_ptr="*bf16", ext_ptr="*bf16")  # [slots, D] rows
    return _opt_in_source(kernel, constexprs, GluonASTSource, {**KINDS, **caches}), options


def ws_attention_configurations() -> list[Configuration]:
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


def opt_in_configurations() -> list[Configuration]:
    """The opt-in attention kernels: :func:`pipelined_attention_configurations`, then
    :func:`ws_attention_configurations`."""
    return pipelined_attention_configurations() + ws_attention_configurations()


def configurations() -> list[Configuration]:
    """Every configuration: the default kernels', then the opt-in attention kernels'."""
    return default_configurations() + opt_in_configurations()


def targets_of(name: str) -> tuple[str, ...]:
    """The targets a configuration compiles for: each ws kernel its own architecture's
    (``ws-sm100-``: sm_100a, other ``ws-``: sm_90a), sglang's fp4 indexer's (``fp4-indexer-``,
    served on SM100 / SM120 only) sm_100a, every other kernel both."""
    if name.startswith("ws-"):
        return ("sm_100a",) if name.startswith("ws-sm100") else ("sm_90a",)
    if name.startswith("fp4-indexer-"):
        return ("sm_100a",)
    return tuple(TARGETS)


def selected(only: Sequence[str], target: str) -> list[Configuration]:
    """The configurations compiled for ``target`` whose names contain one of ``only`` (all
    when empty); an entry ``TARGET:NAME`` selects for that target only."""
    names = [o.split(":", 1)[-1] for o in only if ":" not in o or o.startswith(f"{target}:")]
    return [
        c
        for c in configurations()
        if target in targets_of(c[0]) and (not only or any(n in c[0] for n in names))
    ]
