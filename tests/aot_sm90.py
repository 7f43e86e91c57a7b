"""Compile Triton kernels ahead of time for sm_90a (no GPU needed) and print what the tests check.

Run as a script without ``TRITON_INTERPRET`` (``tests/test_aot_sm90.py`` does): prints one JSON
object ``{kernel: {"mma": [...], "tf32": bool, "shared": bytes, "spills": ...}}`` where ``mma``
lists the distinct tensor-core instruction shapes found in the PTX.
"""

from __future__ import annotations

import json
import os
import re
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("aot_sm90.py compiles real kernels: run it without TRITON_INTERPRET=1")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4_backend.kernels import compressor, indexer, plan_fields

HOPPER = GPUTarget("cuda", 90, 32)
MMA = re.compile(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)")


def _signature(pointers: dict[str, str], ints: list[str], constexprs: dict) -> dict[str, str]:
    sig = {name: f"*{dtype}" for name, dtype in pointers.items()}
    sig.update({name: "i32" for name in ints})
    sig.update({name: "constexpr" for name in constexprs})
    return sig


def _compile(fn: object, pointers: dict, ints: list[str], constexprs: dict, floats=()) -> dict:
    sig = _signature(pointers, ints, constexprs)
    for name in floats:
        sig[name] = "fp32"
    ordered = {name: sig[name] for name in fn.arg_names}  # type: ignore[attr-defined]
    kernel = triton.compile(ASTSource(fn, ordered, constexprs), target=HOPPER)
    ptx = kernel.asm["ptx"]
    return {
        "mma": sorted(set(MMA.findall(ptx))),
        "tf32": "tf32" in ptx,
        "shared": kernel.metadata.shared,
        "num_warps": kernel.metadata.num_warps,
    }


def main() -> None:
    flash_indexer = dict(HI=64, DIM=128, PAGE_TOKENS=64, E=64, BLOCK_H=64, BLOCK_D=128)
    strides = "stride_qt stride_qh stride_qd stride_wt stride_wh stride_key_slot stride_pt_t"
    strides += " stride_pt_p stride_out_t num_cols"
    report = {
        "indexer_scores": _compile(
            indexer._indexer_scores_kernel,
            dict(
                q_ptr="bf16",
                w_ptr="fp32",
                key_ptr="u8",
                page_table_ptr="i32",
                num_ptr="i32",
                out_ptr="fp32",
            ),
            strides.split(),
            dict(flash_indexer, BLOCK_N=indexer.BLOCK_N, FP8=True, DOT_BF16=True),
        ),
        "indexer_selected_slots": _compile(
            indexer._selected_slots_kernel,
            dict(picked_ptr="i64", num_ptr="i32", page_table_ptr="i32", out_ptr="i32"),
            ["stride_picked_t", "stride_pt_t", "stride_pt_p", "stride_out_t", "num_cols", "K"],
            dict(E=64, HAS_PICKED=True, BLOCK_K=512),
        ),
    }
    for ratio, span, ovl in ((4, 8, 2), (128, 128, 1)):
        report[f"compress_entry_c{ratio}"] = _compile(
            compressor._compress_entry_kernel,
            dict(
                kv_ptr="fp32",
                score_ptr="fp32",
                ape_ptr="fp32",
                ring_ptr="fp32",
                pool_ptr="i64",
                plan_ptr="i32",
                norm_ptr="fp32",
                cos_ptr="fp32",
                sin_ptr="fp32",
                out_ptr="fp32",
            ),
            [
                "num_rows",
                "D",
                "ring_rows",
                "stride_kv",
                "stride_score",
                "stride_ape",
                "stride_ring_slot",
                "stride_ring_row",
                "stride_plan",
                "stride_out",
                "stride_rope",
            ],
            dict(
                RATIO=ratio,
                SPAN=span,
                OVERLAP=ovl,
                ROPE_PAIRS=32,
                ROPE_BY_ROW=False,
                BLOCK_P=256,
                BLOCK_S=8,
            ),
            floats=("eps",),
        )
    outputs = "batch_ids_ptr positions_ptr raw_out_loc_ptr swa_out_loc_ptr seq_lens_ptr"
    outputs += " swa_lengths_ptr page_table_ptr swa_indices_ptr"
    ratio_outputs = "out_loc_ptr raw_ptr clamp1_ptr sparse_ptr indices_ptr compress_ptr write_ptr"
    pointers = dict(seq_ptr="i32", host_ptr="i64", req_pool_ptr="i64", out_cache_loc_ptr="i64",
                    req_to_token_ptr="i32", full_to_swa_ptr="i64")  # fmt: skip
    pointers.update({name: "i32" for name in outputs.split()})
    for ratio in (4, 128):
        pointers.update({f"c{ratio}_{name}": "i32" for name in ratio_outputs.split()})
    for name in ("positions_ptr", "raw_out_loc_ptr", "swa_out_loc_ptr", "c4_out_loc_ptr",
                 "c128_out_loc_ptr"):  # fmt: skip
        pointers[name] = "i64"
    scalars = "num_rows padded_rows batch_size context stride_rt page_width swa_width index_topk"
    scalars += " c128_width rows_per_request pos_shift loc_stride loc_offset window"
    report["plan_fields"] = _compile(
        plan_fields._plan_kernel,
        pointers,
        scalars.split(),
        dict(
            EXTEND=False,
            HAS_SWA_MAP=True,
            HAS_C4=True,
            HAS_C128=True,
            PAGE=256,
            SPAN4=8,
            SPAN128=128,
            BLOCK_T=16,
            BLOCK_B=256,
            BLOCK_C=plan_fields.BLOCK_C,
        ),
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
