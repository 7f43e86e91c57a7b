"""The indexer and compressor kernels compiled ahead of time for sm_90a (H200) and sm_100a
(B200) on the CPU (``python -m dsv4_backend.tools.aot_compile --target``; no GPU needed).

Checks what the SASS says: every kernel compiles for both targets without spills; the
length-bounded indexer's FP8 keys go through the hardware e4m3 conversion (``F2FP`` unpacks,
two elements each), not the arithmetic decode the interpreter needs, which leaves it far fewer
integer instructions than the kernel it replaces; its dots run on tensor cores.
"""

from __future__ import annotations

import pytest
from aot_reports import AOT_COMPILE, compiled_reports
from stress import STRESS

pytestmark = pytest.mark.compiled

TARGETS = ("sm_90a", "sm_100a")
#: Configurations of this file (name substrings of ``aot_compile.configurations``; they take
#: sglang's fp4 indexer's ``fp4-indexer-`` kernels too, compiled for sm_100a only).
KERNELS = ("indexer-", "compress-")
NEW_KERNELS = (
    "indexer-scores-fp4-c1",  # DeepSeek-V4.1's index scores over fp4 pages
    "indexer-low-ratio-keys",  # DeepSeek-V4.1's index keys, packed into the fp4 pages
    "compress-low-ratio-entries",  # DeepSeek-V4.1's c1 / c2 entries
    "compress-low-ratio-pairs",  # its ratio-2 pair pooling
    "compress-low-ratio-ring-write",
    "indexer-rows-fp8",
    "indexer-rows-dense",
    "fp4-indexer-scores-c4",  # sglang's fp4 indexer (SM100 / SM120 only): the CUDA baseline,
    "fp4-indexer-rows",  # the length-bounded scores
    "fp4-indexer-store-c4",  # and the keys' store (sglang's c4 rounding)
    "indexer-topk-chunks",
    "indexer-topk-merge-k512",
    "compress-fused-c4",
    "compress-fused-c128",
    "compress-fused-indexer",
    "compress-fused-c4-extend",
    "compress-fused-c128-extend",
    "compress-fused-indexer-extend",
    "compress-ring-write-c4",
)
#: DeepSeek-V4.1's fp4 rows kernel (``kernels/low_ratio/triton.py``).
LOW_RATIO_ROWS = ("compress-low-ratio-", "indexer-low-ratio-")
#: sm_100a in the default suite: the indexer's score kernels (compared below), the new top-k
#: and the extend compressors (the most registers of the new kernels there).
BLACKWELL = ("indexer-rows-", "indexer-scores-fp8", "indexer-scores-fp4-c1", "indexer-topk-chunks",
             "indexer-topk-merge-", "indexer-low-ratio-", "compress-low-ratio-",
             "compress-fused-c4-extend", "compress-fused-c128-extend",
             "compress-fused-indexer-extend", "fp4-indexer-")  # fmt: skip
#: sm_90a in the default suite: every kernel but the one-launch compressors' decode / verify
#: variants (their extend variants hold the same code and more).
HOPPER = ("indexer-", "compress-entry-", "compress-ring-write-", "compress-low-ratio-",
          "compress-fused-c4-extend",
          "compress-fused-c128-extend", "compress-fused-indexer-extend")  # fmt: skip
#: What each target compiles: :data:`HOPPER` on sm_90a, :data:`BLACKWELL` on sm_100a (every
#: kernel under ``DSV4_STRESS=1``: a cold compile costs 2-3 s of CPU a kernel).
COMPILED = {"sm_90a": KERNELS if STRESS else HOPPER, "sm_100a": KERNELS if STRESS else BLACKWELL}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, dict]]:
    """``target -> name -> report``; both targets compile in one process."""
    selection = [f"{target}:{name}" for target in TARGETS for name in COMPILED[target]]
    targets = [arg for target in TARGETS for arg in ("--target", target)]
    out: dict[str, dict[str, dict]] = {target: {} for target in TARGETS}
    for r in compiled_reports([*AOT_COMPILE, *targets, *selection], timeout=900):
        out[r["target"]][r["name"]] = r
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_compiles_without_spills(reports: dict, target: str) -> None:
    got = reports[target]
    assert all(any(n.startswith(k) for n in got) for k in COMPILED[target]), sorted(got)
    # the new kernels and the CUDA default's, where the target's selection takes them
    named = (*NEW_KERNELS, "indexer-scores-fp8", "indexer-slots-k512", "compress-entry-c4",
             "compress-entry-c128")  # fmt: skip
    selected = {n for n in named if any(n.startswith(k) for k in COMPILED[target])}
    assert selected <= set(got), sorted(got)
    for report in got.values():
        assert report["target"] == target
        assert report["spill_stores"] == report["spill_loads"] == report["local_ops"] == 0, report
        # A stack frame only where ptxas reserves one the code never touches (the fp4 rows:
        # 8 bytes, no LDL / STL).
        assert report["stack"] == 0 or report["name"].startswith(LOW_RATIO_ROWS), report
        assert report["registers"] <= 255, report


@pytest.mark.parametrize("target", TARGETS)
def test_indexer_keys_use_the_hardware_e4m3_conversion(reports: dict, target: str) -> None:
    """[64 entries, 128 channels] of e4m3 codes a step over 128 threads: 64 codes a thread,
    2 per ``F2FP`` unpack. The replaced kernel decodes arithmetically (no ``F2FP`` of e4m3,
    about 25 integer instructions an element)."""
    new, replaced = reports[target]["indexer-rows-fp8"], reports[target]["indexer-scores-fp8"]
    assert new["e4m3_converts"] * 2 >= 64 * 128 // 128, new
    assert replaced["e4m3_converts"] == 0, replaced
    assert new["integer_ops"] < 0.7 * replaced["integer_ops"], (new, replaced)
    for name in ("indexer-rows-fp8", "indexer-rows-dense"):
        mma = reports[target][name]["mma"]
        assert mma, (name, target)
        if target == "sm_90a":
            assert all(op.endswith(".f32.bf16.bf16") for op in mma), mma
        else:
            assert all(op.startswith("tcgen05.mma") for op in mma), mma


def test_indexer_scores_are_bf16_wgmma(reports: dict) -> None:
    """The lightning indexer's [BLOCK_N, 128] x [128, 64 heads] dot on Hopper tensor cores with
    bf16 operands (FP8 keys dequantised in registers): wgmma ``.f32.bf16.bf16``, no tf32."""
    mma = reports["sm_90a"]["indexer-scores-fp8"]["mma"]
    assert mma, "no tensor-core instruction in the indexer's scores"
    for op in mma:
        assert op.startswith("wgmma.mma_async") and op.endswith(".f32.bf16.bf16"), op


@pytest.mark.parametrize("target", TARGETS)
def test_compressor_pooling_loops_are_pipelined_without_calls(reports: dict, target: str) -> None:
    """A 64-bit modulo is a subroutine call on the GPU: the ring row of each span slot
    (``q % R``) was 8 calls an iteration of a c128 entry's pooling loop; it is one scalar
    modulo before the loop now. The one-launch kernel's c128 pooling loads through cp.async
    (the loop is pipelined)."""
    pooling = {n: r for n, r in reports[target].items()
               if n.startswith(("compress-entry-", "compress-fused-c128"))}  # fmt: skip
    assert pooling, sorted(reports[target])
    for report in pooling.values():
        assert report["main_loop_calls"] == 0, report
    assert reports[target]["compress-fused-c128-extend"]["cp_async"] > 0
