"""The pipelined FP8 attention kernel compiled ahead of time for sm_90a and sm_100a on the CPU.

``tests/pipelined_compile.py`` compiles a window-only decode layer (one split), a c4 decode
layer (8 splits: the last one merges) and a c128 verify layer at 16 heads a rank (4 rows a
program, 4 splits) at DeepSeek-V4-Flash shapes and reads the SASS. No GPU is needed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("pipelined_compile.py")
CHECKED = ("pipelined-r0-s1", "pipelined-r4-s8", "pipelined-r128-s4-g-h16")


@pytest.fixture(scope="module")
def reports() -> dict[tuple[str, str], dict]:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *CHECKED],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return {(r["name"], r["arch"]): r for r in map(json.loads, done.stdout.splitlines())}


def _sm90(reports: dict[tuple[str, str], dict]) -> list[dict]:
    return [r for (_, arch), r in reports.items() if arch == "sm_90a"]


def test_every_layer_kind_compiles_for_both_targets(reports) -> None:
    assert set(reports) == {(n, a) for n in CHECKED for a in ("sm_90a", "sm_100a")}


def test_no_spills_on_sm90(reports) -> None:
    for r in _sm90(reports):
        assert r["stack"] == r["local"] == 0 and r["registers"] <= 255, r
        assert r["shared"] <= 227 * 1024, r


def test_fp8_gather_is_asynchronous(reports) -> None:
    """The key loop copies the gathered bytes global -> shared asynchronously (LDGSTS), on
    both targets."""
    for r in reports.values():
        assert r["loop_ldgsts"] > 0, r


def test_dots_are_bf16_tensor_core_instructions(reports) -> None:
    """sm_90a: both dots are wgmma in the key loop, ``p k`` as m64n256 (each warpgroup half of
    D = 512); sm_100a: tcgen05 MMAs."""
    for (_, arch), r in reports.items():
        ops = r["loop_mma"]
        if arch == "sm_90a":
            assert ops.get("HGMMA.64x256x16", 0) >= 1 and all(o.startswith("HGMMA") for o in ops)
        else:
            assert ops and all(o.startswith("UTC") for o in ops), r


@pytest.mark.xfail(
    strict=True,
    reason="plain Triton: 16-key blocks at D = 512 (more spill) and a dot feeding a dot puts "
    "all 8 warps along M, so both warpgroups compute q k^T at N = 8",
)
def test_qk_mma_n_is_at_least_64(reports) -> None:
    for r in _sm90(reports):
        for op in r["loop_mma"]:
            assert int(re.match(r"HGMMA\.64x(\d+)x16", op).group(1)) >= 64, r


@pytest.mark.xfail(strict=True, reason="sm_100a: the dequantised block and the rescale spill")
def test_no_spills_on_sm100(reports) -> None:
    for (_, arch), r in reports.items():
        if arch == "sm_100a":
            assert r["stack"] == r["local"] == 0, r
