"""The GPU check as one time-boxed run: steps ordered by value, each under its own timeout, each
verdict written to ``OUT/gpu-check.json`` as the step ends (a run cut short keeps what came
before the cut). ``scripts/gpu_check.sh`` runs ``python -m dsv4_backend.tools.gpu_check``.

    scripts/gpu_check.sh [--budget SECONDS] [--out DIR] [--only STEP ...] [--dry-run]

``--budget`` (default 420 s) is shared by the steps in proportion to their weights
(:data:`STEPS`), so the step budgets sum to it; a step gets at most what is left of the total,
and none starts with under :data:`MIN_STEP_SECONDS` left. ``--out`` defaults to ``$OUT`` (the
device tool's folder) or ``gpu-check/``; each step's output goes to ``OUT/logs/STEP.log`` and,
where the step writes figures (``--json`` of :mod:`dsv4_backend.tools.gpu_verdict`), they go
into its record. ``--dry-run`` prints the steps and their budgets and writes the JSON skeleton
without a GPU.

A record: ``{"step", "verdict": "pass" | "fail" | "skip", "reason", "seconds", "figures",
"budget_s", "gates", "log"}``. A step exiting 0 passes, 3 is skipped (it says what it lacks),
anything else or its timeout fails. The exit status is 0 when every gating step (``gates``:
the default kernels, their CUDA-graph loop, the sglang A/B) passed or was skipped for a reason
other than the budget, 1 otherwise, 3 without a CUDA device. The steps that do not gate report
the kernels that are not yet the default: their pass is the evidence that makes them one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: Exit status of a step (and of this check) that cannot run here.
SKIPPED = 3
#: A step does not start with less than this left of the budget.
MIN_STEP_SECONDS = 10.0
DEFAULT_BUDGET = 420.0


@dataclass(frozen=True)
class Step:
    """One command of the check. ``weight``: its share of the budget; ``gates``: its failure
    fails the check; ``env``: added variables; ``{figures}`` in ``command`` is replaced by the
    path its figures go to, ``{python}`` by the interpreter."""

    name: str
    weight: float
    command: tuple[str, ...]
    gates: bool
    description: str
    env: dict[str, str] = field(default_factory=dict)


def _verdict(*options: str) -> tuple[str, ...]:
    return ("{python}", "-m", "dsv4_backend.tools.gpu_verdict", "--json", "{figures}", *options)


def _gpu_tests(*files: str) -> tuple[str, ...]:
    """The command running the ``gpu``-marked tests of ``files``."""
    return ("{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files)


UNVERIFIED = {"DSV4_UNVERIFIED_KERNELS": "1"}
_AB_CONFIG = json.dumps(
    {
        "num_hidden_layers": 3,
        "compress_ratios": [0, 4, 128, 0],
        "num_attention_heads": 64,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "index_topk": 512,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "sliding_window": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
    }
)

#: The A/B's prompts: one drawn length, and lengths of 3 (mod 4) just past c128 boundaries
#: (a public wrong-token report on DeepSeek-V4 serving stacks at such lengths).
AB_PROMPT_LENS = (97, 131, 259, 387)

#: The steps, most valuable first.
STEPS: tuple[Step, ...] = (
    Step(
        "versions",
        4,
        ("{python}", "-m", "dsv4_backend.tools.gpu_check", "versions", "{figures}"),
        True,
        "the device, torch, triton, flash_mla, deep_gemm, flashinfer",
    ),
    Step(
        "self-check",
        30,
        ("{python}", "-m", "dsv4_backend.tools.gpu_check", "self-check", "{figures}"),
        True,
        "the start-up self-check at DeepSeek-V4-Flash's widths (fp8 caches): each op's "
        "preferred variant against its torch twin, its verdicts, its cost cold and cached",
    ),
    Step(
        "default-kernels-fp8",
        70,
        _verdict("--fmt", "fp8", "--query-dtype", "bfloat16"),
        True,
        "the CUDA default kernels, every serving mode, fp8 caches, bf16 queries (tie-aware)",
    ),
    Step(
        "default-kernels-dense",
        40,
        _verdict("--fmt", "dense", "--query-dtype", "float32"),
        True,
        "the same with dense fp32 caches, and against the full causal pass",
    ),
    Step(
        "default-kernels-flash-fp8",
        50,
        _verdict("--fmt", "fp8", "--config", "flash"),
        True,
        "Flash's widths (64 heads of 512, top-512 over 530 candidates), fp8 caches",
    ),
    Step(
        "cuda-graph-loop",
        40,
        ("{python}", "benchmarks/gpu_eagle_loop.py"),
        True,
        "the EAGLE loop captured in CUDA graphs and replayed, against eager",
    ),
    Step(
        "unverified-kernels-fp8",
        40,
        _verdict("--fmt", "fp8"),
        False,
        "the one-launch compressor and length-bounded indexer, every mode",
        UNVERIFIED,
    ),
    Step(
        "unverified-graph-loop",
        30,
        ("{python}", "benchmarks/gpu_eagle_loop.py"),
        False,
        "their CUDA-graph capture and replay",
        UNVERIFIED,
    ),
    Step(
        "opt-in-attention",
        45,
        _gpu_tests("tests/kernels/test_attention_kernels_cuda.py"),
        False,
        "the pipelined, ws, flashmla and flashmla_prefill attention kernels against the torch "
        "path on fp8 bytes",
    ),
    Step(
        "v41-kernels",
        10,
        _gpu_tests("tests/kernels/test_low_ratio.py", "tests/planning/test_graph_buffers.py"),
        False,
        "DeepSeek-V4.1's rows, pair pooling and index scores kernels (fp4 pages) against the "
        "torch twins, and its plan fields and tail floors in the fused planner's launch",
    ),
    Step(
        "ragged-and-fp4",
        10,
        _gpu_tests("tests/serving/test_ragged_verify.py", "tests/kernels/test_indexer_fp4.py"),
        False,
        "DSpark's compact ragged verify in the fused planner (eager and graph buffers) and the "
        "fp4 indexer's store, scores and selections against the torch twins (DeepGEMM's "
        "fp8_fp4_paged_mqa_logits where it runs: sm_100 / sm_120)",
    ),
    Step(
        "timings",
        75,
        (
            "{python}",
            "benchmarks/bench_attention.py",
            "--kernel",
            "all",
            "--against",
            "flashmla",
            "--batch",
            "8",
            "64",
            "128",
        ),
        False,
        "attention at bs 8 / 64 / 128, every kernel and FlashMLA on the same bytes",
    ),
    Step(
        "sglang-ab",
        26,
        ("{python}", "-m", "dsv4_backend.tools.gpu_check", "ab", "{out}"),
        True,
        "this backend against sglang's built-in (Flash's attention widths, one layer "
        "of each ratio; prompts of 3 (mod 4) past c128 boundaries) where the built-in starts",
    ),
)


def budgets(steps: Sequence[Step], total: float) -> dict[str, float]:
    """Each step's share of ``total`` seconds by weight (they sum to ``total``)."""
    weight = sum(s.weight for s in steps)
    return {s.name: total * s.weight / weight for s in steps}


@dataclass
class Record:
    step: str
    verdict: str
    reason: str
    seconds: float
    figures: object
    budget_s: float
    gates: bool
    log: str

    def as_json(self) -> dict[str, object]:
        return dict(vars(self))


class Report:
    """``OUT/gpu-check.json``, rewritten whole after every step (atomically)."""

    def __init__(self, out: Path, budget: float, dry_run: bool) -> None:
        self.path = out / "gpu-check.json"
        self.head = {
            "budget_s": budget,
            "dry_run": dry_run,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        self.records: list[Record] = []

    def add(self, record: Record) -> None:
        self.records.append(record)
        self.write()

    def write(self) -> None:
        body = {**self.head, "steps": [r.as_json() for r in self.records]}
        partial = self.path.with_suffix(".json.partial")
        partial.write_text(json.dumps(body, indent=1) + "\n")
        partial.replace(self.path)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def run_step(step: Step, seconds: float, out: Path, python: str) -> Record:
    """Run ``step`` under a ``seconds`` timeout; its output in ``OUT/logs/NAME.log``."""
    logs, figures = out / "logs", out / "figures"
    logs.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    log, figure_file = logs / f"{step.name}.log", figures / f"{step.name}.json"
    figure_file.unlink(missing_ok=True)
    fills = {"python": python, "figures": str(figure_file), "out": str(out)}
    command = list(step.command)
    for key, value in fills.items():  # (not str.format: a command may hold braces)
        command = [part.replace("{" + key + "}", value) for part in command]
    env = {**os.environ, **step.env}
    start = time.monotonic()
    with open(log, "w") as sink:
        try:
            status = subprocess.run(
                command, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=seconds
            ).returncode
        except subprocess.TimeoutExpired:
            status = None
    elapsed = time.monotonic() - start
    text = log.read_text(errors="replace")
    if status is None:
        verdict, reason = "fail", f"timed out after {seconds:.0f} s: {_last_line(text)}"
    elif status == 0:
        verdict, reason = "pass", _last_line(text)
    elif status == SKIPPED:
        verdict, reason = "skip", _last_line(text)
    else:
        verdict, reason = "fail", f"exit status {status}: {_last_line(text)}"
    loaded = json.loads(figure_file.read_text()) if figure_file.exists() else None
    return Record(
        step.name,
        verdict,
        reason,
        round(elapsed, 1),
        loaded,
        round(seconds, 1),
        step.gates,
        str(log),
    )


def run_check(
    steps: Sequence[Step], budget: float, out: Path, python: str, *, dry_run: bool = False
) -> Report:
    """Run ``steps`` in order within ``budget`` seconds (``dry_run``: list them only)."""
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, budget, dry_run)
    shares = budgets(steps, budget)
    report.write()
    start = time.monotonic()
    for step in steps:
        left = budget - (time.monotonic() - start)
        if dry_run:
            print(
                f"{step.name:28} {shares[step.name]:6.0f} s  "
                f"{'gates' if step.gates else 'reports'}  {step.description}"
            )
            record = Record(
                step.name, "skip", "dry run", 0.0, None, round(shares[step.name], 1), step.gates, ""
            )
        elif left < MIN_STEP_SECONDS:
            reason = f"budget spent ({left:.0f} s of {budget:.0f} s left)"
            record = Record(
                step.name, "skip", reason, 0.0, None, round(shares[step.name], 1), step.gates, ""
            )
        else:
            record = run_step(step, min(shares[step.name], left), out, python)
            print(
                f"gpu_check: {step.name}: {record.verdict.upper()} in {record.seconds:.0f} s "
                f"({record.reason})",
                flush=True,
            )
        report.add(record)
    return report


def passed(report: Report) -> bool:
    """Every gating step passed, or was skipped for what the machine lacks (not the budget)."""
    return all(
        r.verdict == "pass" or (r.verdict == "skip" and not r.reason.startswith("budget"))
        for r in report.records
        if r.gates
    )


def versions(figures: str) -> int:
    """The ``versions`` step: what this machine runs, printed and written to ``figures``."""
    import importlib.metadata

    import torch

    found: dict[str, object] = {"python": sys.version.split()[0]}
    for dist in (
        "torch",
        "triton",
        "sgl-flash-mla",
        "sgl-deep-gemm",
        "flashinfer-python",
        "apache-tvm",
        "apache-tvm-ffi",
        "sglang",
        "dsv4-backend",
    ):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    if torch.cuda.is_available():
        found["device"] = torch.cuda.get_device_name()
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        found["cuda"] = torch.version.cuda
    Path(figures).write_text(json.dumps(found, indent=1) + "\n")
    for name, value in found.items():
        print(f"{name}: {value}")
    if not torch.cuda.is_available():
        print("versions: no CUDA device (torch.cuda.is_available() is False)")
        return SKIPPED
    return 0


def self_check_step(figures: str) -> int:
    """The ``self-check`` step: the start-up self-check at DeepSeek-V4-Flash's widths, cold
    (the cache ignored) then cached, its verdicts and both times written to ``figures``.
    Passes when it ran; a variant that failed is reported (its op runs the next one)."""
    import torch

    from dsv4_backend.self_check.check import PRESETS, self_check

    if not torch.cuda.is_available():
        print("self-check: no CUDA device (torch.cuda.is_available() is False)")
        return SKIPPED
    cold = self_check(PRESETS["flash"], "cuda", use_cache=False)
    warm = self_check(PRESETS["flash"], "cuda")
    body = {**cold.as_json(), "cached_seconds": round(warm.seconds, 4)}
    Path(figures).write_text(json.dumps(body, indent=1) + "\n")
    print("\n".join(cold.lines()))
    print(
        f"self-check: {cold.seconds:.1f} s cold, {warm.seconds * 1000:.1f} ms cached; "
        f"{len(cold.failed)} variant(s) failed; defaults {cold.chosen}"
    )
    return 0


def sglang_ab(out: str) -> int:
    """The ``sglang-ab`` step: ``dsv4 ab`` of this backend against sglang's built-in in the
    simulated host; skipped (with the first thing the built-in lacks) where it cannot start
    or run here, else its verdict. The report goes to ``OUT/ab-report``."""
    config = Path(out) / "ab-config.json"
    config.write_text(_AB_CONFIG)
    report = Path(out) / "ab-report"
    command = [
        sys.executable,
        "-m",
        "dsv4_backend",
        "ab",
        "--device",
        "cuda",
        "--a",
        "sglang:dsv4",
        "--b",
        "sglang:dsv4_builtin",
        "--config",
        str(config),
        "--out",
        str(report),
        "--quiet",
        "--max-len",
        "440",
        "--prompt-lens",
        *map(str, AB_PROMPT_LENS),
    ]
    run = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(run.stderr)
    if run.returncode == 2:  # refused before the run: the line names what is missing
        print(f"skipped: sglang:dsv4_builtin cannot start here: {_last_line(run.stderr)}")
        return SKIPPED
    if not (report / "report.json").exists():
        print(f"fail: no report (ab exited {run.returncode})")
        return 1
    modes = json.loads((report / "report.json").read_text())["modes"]
    errors = [m["error"] for m in modes if m["error"]]
    if errors and "sglang:dsv4_builtin raised" in errors[0]:
        print(f"skipped: sglang:dsv4_builtin cannot run here; first thing it lacks: {errors[0]}")
        return SKIPPED
    failed = [m["label"] for m in modes if not m["passed"]]
    print("pass" if run.returncode == 0 else f"fail: {', '.join(failed)}")
    return run.returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["versions"]:
        return versions(argv[1])
    if argv[:1] == ["ab"]:
        return sglang_ab(argv[1])
    if argv[:1] == ["self-check"]:
        return self_check_step(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds in all")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check"))
    parser.add_argument("--only", nargs="+", choices=[s.name for s in STEPS], help="these steps")
    parser.add_argument("--dry-run", action="store_true", help="list the steps; run nothing")
    parser.add_argument("--python", default=sys.executable, help="the steps' interpreter")
    opts = parser.parse_args(argv)
    if opts.budget < MIN_STEP_SECONDS:
        parser.error(f"--budget {opts.budget:g}; expected at least {MIN_STEP_SECONDS:g} seconds")
    steps = [s for s in STEPS if not opts.only or s.name in opts.only]
    if not opts.dry_run:
        import torch

        if not torch.cuda.is_available():
            print(
                "gpu_check: no CUDA device (torch.cuda.is_available() is False); this check "
                "needs a GPU. Nothing was run (--dry-run lists the steps).",
                file=sys.stderr,
            )
            return SKIPPED
    report = run_check(steps, opts.budget, opts.out, opts.python, dry_run=opts.dry_run)
    print(f"gpu_check: report in {report.path}")
    if opts.dry_run:
        return 0
    summary = ", ".join(f"{r.step} {r.verdict.upper()}" for r in report.records)
    print(f"gpu_check summary: {summary}")
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
