"""``scripts/gpu_check.sh``'s runner (``tools/gpu_check.py``) on the CPU: the dry run lists
every step within the budget and writes the JSON skeleton; a run writes each verdict as its
step ends, times steps out, skips what the budget no longer holds and gates on the right steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4_backend.tools import gpu_check as gc

REPO = Path(__file__).resolve().parents[2]
FIELDS = {"step", "verdict", "reason", "seconds", "figures", "budget_s", "gates", "log"}


def test_dry_run_lists_every_step_within_the_budget(tmp_path: Path) -> None:
    command = [
        "bash",
        "scripts/gpu_check.sh",
        "--dry-run",
        "--budget",
        "420",
        "--out",
        str(tmp_path),
    ]
    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}  # no GPU, no OUT
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["dry_run"] and report["budget_s"] == 420
    steps = report["steps"]
    assert [s["step"] for s in steps] == [s.name for s in gc.STEPS]
    assert all(set(s) == FIELDS and s["verdict"] == "skip" for s in steps)
    assert all(s["budget_s"] > 0 for s in steps)
    assert sum(s["budget_s"] for s in steps) <= 420 + 0.1 * len(steps)  # rounded to 0.1 s
    for step in gc.STEPS:
        assert step.name in run.stdout
    assert steps[1]["step"] == "self-check" and steps[1]["gates"]  # first, before the verdicts
    assert steps[2]["step"] == "default-kernels-fp8" and steps[2]["gates"]
    ab = next(s for s in gc.STEPS if s.name == "sglang-ab")
    assert "past c128 boundaries" in ab.description
    assert all(n % 4 == 3 and n % 128 == 3 for n in gc.AB_PROMPT_LENS[1:])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message path")
def test_the_self_check_step_is_skipped_without_a_gpu(tmp_path: Path, capsys) -> None:
    assert gc.main(["self-check", str(tmp_path / "figures.json")]) == gc.SKIPPED
    assert "self-check: no CUDA device" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message path")
def test_without_a_gpu_nothing_runs(tmp_path: Path) -> None:
    command = ["bash", "scripts/gpu_check.sh", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    assert run.returncode == gc.SKIPPED and "no CUDA device" in run.stderr
    assert not (tmp_path / "gpu-check.json").exists()


def _step(name: str, code: str, *, weight: float = 1, gates: bool = True) -> gc.Step:
    return gc.Step(name, weight, ("{python}", "-c", code, "{figures}"), gates, name)


def test_a_run_records_each_step_as_it_ends(tmp_path: Path) -> None:
    """Pass, fail, skip, figures; the fourth step reads the report written after the third."""
    peek = (
        "import json, sys, pathlib; r = json.loads(pathlib.Path(sys.argv[1]).parent.parent"
        ".joinpath('gpu-check.json').read_text()); print([s['verdict'] for s in r['steps']])"
    )
    steps = [
        _step("ok", "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'x': 1}))"),
        _step("broken", "import sys; print('bad kernel'); sys.exit(1)", gates=False),
        _step("lacking", "import sys; print('no flash_mla here'); sys.exit(3)"),
        _step("peek", peek),
    ]
    report = gc.run_check(steps, 100, tmp_path, sys.executable)
    records = {r.step: r for r in report.records}
    assert records["ok"].verdict == "pass" and records["ok"].figures == {"x": 1}
    assert (
        records["broken"].verdict == "fail"
        and "exit status 1: bad kernel" in records["broken"].reason
    )
    assert records["lacking"].verdict == "skip" and records["lacking"].reason == "no flash_mla here"
    assert records["peek"].reason == "['pass', 'fail', 'skip']"
    assert gc.passed(report)  # the failure does not gate, the skip is what the machine lacks
    saved = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["verdict"] for s in saved["steps"]] == ["pass", "fail", "skip", "pass"]
    assert "bad kernel" in Path(records["broken"].log).read_text()


def test_a_step_past_its_budget_times_out_and_the_rest_is_skipped(tmp_path: Path) -> None:
    steps = [
        _step("slow", "import time; print('started'); time.sleep(60)", weight=11),
        _step("after", "print('never')", weight=1),
    ]
    report = gc.run_check(steps, 12, tmp_path, sys.executable)
    slow, after = report.records
    assert slow.verdict == "fail" and slow.reason.startswith("timed out after 11 s")
    assert 10 < slow.seconds < 30
    assert after.verdict == "skip" and after.reason.startswith("budget spent")
    assert not gc.passed(report)


def test_budgets_follow_the_weights() -> None:
    shares = gc.budgets(gc.STEPS, 420)
    assert sum(shares.values()) == pytest.approx(420)
    weight = {s.name: s.weight for s in gc.STEPS}
    assert shares["default-kernels-fp8"] / shares["versions"] == pytest.approx(
        weight["default-kernels-fp8"] / weight["versions"]
    )
