"""The Triton kernels compiled ahead of time for sm_90a (H200) on the CPU: sparse attention,
then the indexer, compressor and planner kernels (``test_nothing_spills`` covers all).

``tests/sm90_compile.py`` compiles every launch configuration the backend makes at
DeepSeek-V4-Flash shapes (H = 64, D = 512; window-only, c4 and c128 layers; dense bf16 and fp8
caches; one split and several; the merge kernel; the c4 layer at 16 and 32 heads a rank) with
Triton's sm_90a backend and its bundled ptxas. No GPU is needed; a GPU machine runs the same check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {r["name"]: r for r in map(json.loads, done.stdout.splitlines())}


def test_every_configuration_compiled(reports: dict[str, dict]) -> None:
    names = set(reports)
    for fmt in ("dense", "fp8"):
        for layer in ("r0", "r4", "r128"):
            assert any(n.startswith(f"attention-{fmt}-{layer}-") for n in names), (fmt, layer)
    assert any(n.endswith("-s1") for n in names) and any(not n.endswith("-s1") for n in names)
    assert any(n.startswith("merge-") for n in names)
    assert any("-g-" in n for n in names) and "key-union-g4" in names


def _one_row_at_tp(name: str) -> bool:
    """An attention launch of one row a program with fewer than 64 heads (``-h`` without
    ``-g-``)."""
    return "-h" in name and "-g-" not in name


def test_attention_dots_are_bf16_wgmma(reports: dict[str, dict]) -> None:
    """Both dots (q k^T and p v) on Hopper tensor cores with bf16 operands and fp32
    accumulation: wgmma ``.f32.bf16.bf16``; no tf32 and no pre-Hopper ``mma.sync``. Also at
    16 and 32 heads a rank when a program takes the rows of a verify request together
    (``-g-``: 64 M lines)."""
    for name, report in reports.items():
        if not name.startswith("attention-") or _one_row_at_tp(name):
            continue
        mma = report["mma"]
        assert mma, f"{name}: no tensor-core instruction"
        for op in mma:
            assert op.startswith("wgmma.mma_async") and op.endswith(".f32.bf16.bf16"), (name, op)
        # the [64, 512] accumulator: one m64n256 per warpgroup, both warpgroups busy
        assert any(".m64n256k16." in op for op in mma), (name, mma)


def test_attention_tp_dots_are_bf16(reports: dict[str, dict]) -> None:
    """16 and 32 heads a rank, one row a program (decode): the M side is below the 64 rows of a
    warpgroup's wgmma, so Triton emits ``mma.sync`` -- still bf16 operands with fp32
    accumulation, never tf32."""
    tp = [name for name in reports if name.startswith("attention-") and _one_row_at_tp(name)]
    assert {n.rsplit("-", 1)[1] for n in tp} == {"h16", "h32"}, tp
    for name in tp:
        mma = reports[name]["mma"]
        assert mma, f"{name}: no tensor-core instruction"
        for op in mma:
            assert op.endswith(".f32.bf16.bf16.f32") or op.endswith(".f32.bf16.bf16"), (name, op)


def test_nothing_spills(reports: dict[str, dict]) -> None:
    """ptxas -v: no spill stores/loads and no stack frame, every configuration; shared memory
    within one H200 SM's 227 KiB."""
    for name, report in reports.items():
        assert report["spill_stores"] == report["spill_loads"] == 0, (name, report)
        assert report["stack"] == 0, (name, report)
        assert report["registers"] <= 255, (name, report)
        assert report["shared"] <= 227 * 1024, (name, report)


def test_dense_key_gather_is_pipelined(reports: dict[str, dict]) -> None:
    """Dense keys stream through cp.async stages (bf16 rows go to shared memory untouched);
    fp8 keys are dequantised in registers, which Triton does not pipeline."""
    for name, report in reports.items():
        if name.startswith("attention-dense-"):
            assert report["cp_async"] > 0, (name, report)


# ------------------------------------------------------------- indexer, compressor, planner
def test_fused_kernels_compiled(reports: dict[str, dict]) -> None:
    names = set(reports)
    assert {"indexer-scores-fp8", "indexer-slots-k512", "compress-entry-c4"} <= names
    assert {"compress-entry-c128"} <= names
    assert sum(n.startswith("plan-fields-") for n in names) == 4


def test_indexer_scores_are_bf16_wgmma(reports: dict[str, dict]) -> None:
    """The lightning indexer's [BLOCK_N, 128] x [128, 64 heads] dot on Hopper tensor cores with
    bf16 operands (FP8 keys dequantised in registers): wgmma ``.f32.bf16.bf16``, no tf32."""
    mma = reports["indexer-scores-fp8"]["mma"]
    assert mma, "no tensor-core instruction in the indexer's scores"
    for op in mma:
        assert op.startswith("wgmma.mma_async") and op.endswith(".f32.bf16.bf16"), op
