"""Ahead-of-time compilation for Hopper (sm_90a) on a CPU machine: the kernels build, and the
indexer's scores run on bf16 tensor cores (wgmma / mma with bf16 operands, never tf32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("aot_sm90.py")


@pytest.fixture(scope="module")
def report() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(SCRIPT.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_indexer_scores_use_bf16_tensor_cores(report: dict) -> None:
    scores = report["indexer_scores"]
    assert scores["mma"], "no tensor-core instruction in the indexer's PTX"
    assert all(".bf16.bf16" in mma for mma in scores["mma"]), scores["mma"]
    assert not scores["tf32"]


@pytest.mark.parametrize(
    "kernel",
    ["indexer_selected_slots", "compress_entry_c4", "compress_entry_c128", "plan_fields"],
)
def test_fused_kernels_compile_for_sm90a(report: dict, kernel: str) -> None:
    assert report[kernel]["num_warps"] >= 1
    assert report[kernel]["shared"] < 228 * 1024  # H100 / H200 shared memory per block
