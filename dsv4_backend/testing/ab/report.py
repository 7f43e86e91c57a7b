"""The A/B report: a JSON-ready dict, its markdown rendering and a PNG plot of the timings.

Timings are per step in milliseconds, summarised per ``mode/path`` by the median and the 90th
percentile (linear interpolation); the A/B ratio divides the medians (None when B's is 0,
e.g. the reference's planning time).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np

from dsv4_backend.testing.ab.runner import ABResult, ModeStats

REPORT_MD = "report.md"
REPORT_JSON = "report.json"
PLOT_PNG = "times.png"
SIDES = ("a", "b")
KINDS = ("plan", "kernel")


def _summary(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"median": None, "p90": None}
    ms = np.asarray(seconds) * 1e3
    return {"median": float(np.median(ms)), "p90": float(np.percentile(ms, 90))}


def _finite(value: float) -> float | None:
    """JSON has no inf / NaN: a non-finite error (NaN outputs) becomes null."""
    return value if np.isfinite(value) else None


def _mode_dict(stats: ModeStats) -> dict[str, Any]:
    timing: dict[str, Any] = {
        side: {f"{kind}_ms": _summary(stats.times[side][kind]) for kind in KINDS} for side in SIDES
    }
    ratio = {}
    for kind in KINDS:
        a, b = (timing[side][f"{kind}_ms"]["median"] for side in SIDES)
        ratio[kind] = a / b if a is not None and b else None
    timing["ratio_a_over_b"] = ratio
    return {
        "label": stats.label,
        "mode": stats.mode,
        "path": stats.path,
        "steps": stats.steps,
        "rows": stats.rows,
        "max_abs_error": _finite(stats.max_abs_error),
        "max_rel_error": _finite(stats.max_rel_error),
        "min_cosine": _finite(stats.min_cosine),
        "atol": stats.atol,
        "passed": stats.passed,
        "error": stats.error,
        "timing": timing,
    }


def build_report(result: ABResult) -> dict[str, Any]:
    """The whole report as plain JSON types (what ``--json`` prints)."""
    trace, config = result.trace, result.trace.config
    return {
        "passed": result.passed,
        "failed": result.failed,
        "a": {"name": result.a.name, "kernels": result.a.kernel_path},
        "b": {"name": result.b.name, "kernels": result.b.kernel_path},
        "device": str(result.device),
        "config": {
            "compress_ratios": list(config.compress_ratios),
            "num_heads": config.num_heads,
            "head_dim": config.head_dim,
            "index_topk": config.index_topk,
            "index_n_heads": config.index_n_heads,
            "index_head_dim": config.index_head_dim,
        },
        "trace": {
            "requests": len(trace.max_lens),
            "max_lens": list(trace.max_lens),
            "steps": len(trace.steps),
            "seed": trace.seed,
            "dp_pad": trace.dp_pad,
            "prefix_hits": [
                {"request": r, "owner": owner, "tokens": pages * config.page_size}
                for r, (owner, pages) in trace.shared_pages
            ],
        },
        "wall_s": result.wall_s,
        "warmup_s": dict(result.warmup_s),
        "modes": [_mode_dict(stats) for stats in result.modes.values()],
    }


def _hits(hits: list[dict[str, int]]) -> str:
    return "".join(
        f"; request {h['request']} starts from request {h['owner']}'s cached {h['tokens']} tokens"
        for h in hits
    )


def _num(value: float | None, missing: str = "-", fmt: str = ".3g") -> str:
    return missing if value is None else format(value, fmt)


def _times(timing: dict[str, Any], side: str, kind: str) -> str:
    t = timing[side][f"{kind}_ms"]
    return f"{_num(t['median'])} / {_num(t['p90'])}"


def _warmup_line(warmup_s: dict[str, float]) -> str:
    if not warmup_s:
        return "- no warm-up pass: the first steps' times include kernel compilation"
    return (
        f"- warm-up pass before timing (kernel compilation): A {warmup_s['a']:.2f} s, "
        f"B {warmup_s['b']:.2f} s; not in the step times"
    )


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a markdown page: verdict, setup, one table row per ``mode/path``."""
    a, b = report["a"], report["b"]
    verdict = (
        "**PASSED**: every mode within tolerance"
        if report["passed"]
        else f"**FAILED**: {', '.join(report['failed'])}"
    )
    config, trace = report["config"], report["trace"]
    lines = [
        f"# A/B: {a['name']} (A) vs {b['name']} (B)",
        "",
        verdict,
        "",
        f"- device: {report['device']}; A kernels: {a['kernels']}; B kernels: {b['kernels']}",
        f"- config: compress ratios {config['compress_ratios']}, {config['num_heads']} heads, "
        f"head_dim {config['head_dim']}, index_topk {config['index_topk']}",
        f"- trace: {trace['requests']} requests (lengths {trace['max_lens']}), "
        f"{trace['steps']} steps, seed {trace['seed']}, DP padding {trace['dp_pad']} "
        f"requests{_hits(trace['prefix_hits'])}; wall time {report['wall_s']:.1f} s",
        "- errors over accepted rows; rel = max|A-B| / max|B|; cos = smallest row cosine",
        "- times in ms per step, median / p90; A/B = ratio of the medians",
        _warmup_line(report["warmup_s"]),
        "",
        "| mode | steps | rows | max abs err | rel err | min cos | atol | ok "
        "| A plan | B plan | A/B | A kernel | B kernel | A/B |",
        "|---|---:|---:|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in report["modes"]:
        t = m["timing"]
        ok = "yes" if m["passed"] else "**NO**"
        lines.append(
            f"| {m['label']} | {m['steps']} | {m['rows']} | {_num(m['max_abs_error'], 'nan')} "
            f"| {_num(m['max_rel_error'], 'nan')} | {_num(m['min_cosine'], 'nan', '.6f')} "
            f"| {m['atol']:.3g} | {ok} "
            f"| {_times(t, 'a', 'plan')} | {_times(t, 'b', 'plan')} "
            f"| {_num(t['ratio_a_over_b']['plan'])} "
            f"| {_times(t, 'a', 'kernel')} | {_times(t, 'b', 'kernel')} "
            f"| {_num(t['ratio_a_over_b']['kernel'])} |"
        )
    errors = [f"- {m['label']}: {m['error']}" for m in report["modes"] if m["error"]]
    if errors:
        lines += ["", "Errors:", "", *errors]
    lines += ["", f"![time per mode]({PLOT_PNG})", ""]
    return "\n".join(lines)


def plot_times(report: dict[str, Any], path: Path) -> None:
    """Bars of the median planning and kernel time per ``mode/path``, A beside B (p90 as
    error bars), written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = report["modes"]
    x = np.arange(len(modes))
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.9 * len(modes) + 2), 7), sharex=True)
    for ax, kind in zip(axes, KINDS, strict=True):
        values = []
        for offset, side in ((-0.2, "a"), (0.2, "b")):
            stats = [m["timing"][side][f"{kind}_ms"] for m in modes]
            med = np.array([s["median"] or 0.0 for s in stats])
            p90 = np.array([s["p90"] or 0.0 for s in stats])
            ax.bar(
                x + offset, med, width=0.4, yerr=[np.zeros_like(med), p90 - med], capsize=2,
                label=f"{side.upper()}: {report[side]['name']}",
            )  # fmt: skip
            values.append(med)
        if all((v > 0).all() for v in values):
            ax.set_yscale("log")
        ax.set_ylabel(f"{'planning' if kind == 'plan' else 'kernels'} ms / step")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(x, [m["label"] for m in modes], rotation=45, ha="right")
    fig.suptitle(f"{report['a']['name']} vs {report['b']['name']} on {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(report: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write the markdown, JSON and PNG files into ``out`` (created); return their paths.

    Without matplotlib (the ``report`` extra) the plot is left out of the returned paths.
    """
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / REPORT_MD, "json": out / REPORT_JSON, "plot": out / PLOT_PNG}
    paths["markdown"].write_text(render_markdown(report))
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    if importlib.util.find_spec("matplotlib") is None:
        del paths["plot"]
    else:
        plot_times(report, paths["plot"])
    return paths
