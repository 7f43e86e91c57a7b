"""The A/B report: a JSON-ready dict, its markdown rendering and a PNG plot of correctness and
timings.

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

from dsv4_backend.tools.ab.runner import ABResult, ModeStats

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
        "median_row_error": _finite(stats.median_row_error),
        "atol": stats.atol,
        "median_row_rtol": stats.median_row_rtol,
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
        "cache_formats": {"a": result.a.cache_format, "b": result.b.cache_format},
        "tolerance": {
            "atol": result.tolerance.atol,
            "median_row_rtol": result.tolerance.median_row_rtol,
            "derivation": result.tolerance.derivation,
        },
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
            "model": "DeepSeek-V4.1" if config.v41 is not None else "DeepSeek-V4",
            "bounded_replay": trace.bounded_replay,
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


def _verdict(mode: dict[str, Any]) -> str:
    """``ok``, ``FAIL`` (over tolerance) or ``ERROR`` (a backend raised) for one mode."""
    if mode["error"]:
        return "ERROR"
    return "ok" if mode["passed"] else "FAIL"


def _tolerance_line(report: dict[str, Any]) -> str:
    tolerance = report["tolerance"]
    return (
        f"- default tolerance (A {report['cache_formats']['a']}, B "
        f"{report['cache_formats']['b']} caches on {report['device']}): {tolerance['derivation']}"
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
        f"- trace: {trace['model']}, {trace['requests']} requests (lengths {trace['max_lens']}), "
        f"{trace['steps']} steps, seed {trace['seed']}, DP padding {trace['dp_pad']} "
        f"requests{_hits(trace['prefix_hits'])}"
        f"{'; the late-layer tail on both sides' if trace['bounded_replay'] else ''}; "
        f"wall time {report['wall_s']:.1f} s",
        "- errors over accepted rows; rel = max|A-B| / max|B|; row = median over rows of "
        "||a-b|| / ||b|| (checked where a bound is given); cos = smallest row cosine",
        _tolerance_line(report),
        "- times in ms per step, median / p90; A/B = ratio of the medians",
        _warmup_line(report["warmup_s"]),
        "",
        "| mode | ok | steps | rows | max abs err | atol | row err | row bound | rel err "
        "| min cos | A plan | B plan | A/B | A kernel | B kernel | A/B |",
        "|---|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in report["modes"]:
        t = m["timing"]
        verdict = _verdict(m)
        ok = verdict if verdict == "ok" else f"**{verdict}**"
        lines.append(
            f"| {m['label']} | {ok} | {m['steps']} | {m['rows']} "
            f"| {_num(m['max_abs_error'], 'inf')} | {m['atol']:.3g} "
            f"| {_num(m['median_row_error'], 'inf')} | {_num(m['median_row_rtol'])} "
            f"| {_num(m['max_rel_error'], 'inf')} | {_num(m['min_cosine'], 'nan', '.6f')} "
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


#: Fixed log-scale limits of the plot, the same every run: error / tolerance, and ms per step.
ERROR_RATIO_LIMITS = (1e-4, 1e2)
TIME_MS_LIMITS = (1e-3, 1e5)
PASS_COLOUR, FAIL_COLOUR = "tab:green", "tab:red"


def _label_bottom(ax: Any, x: float, text: str, bottom: float) -> None:
    """Write ``text`` (``0``, ``n/a``, ...) where a bar too small for the log axis would be."""
    ax.text(x, bottom * 1.5, text, ha="center", va="bottom", fontsize=7, rotation=90)


def _ratio(error: float | None, bound: float) -> float:
    """``error / bound``; inf for a non-finite error (None in the JSON) or a zero bound."""
    if error is None:
        return float("inf")
    if error == 0:
        return 0.0
    return error / bound if bound > 0 else float("inf")


def plot_errors(ax: Any, modes: list[dict[str, Any]]) -> None:
    """Per mode: max |A-B| / atol and, where bounded, median row error / its bound; green
    within tolerance, red over it; a mode whose backend raised gets a red ERROR bar."""
    low, high = ERROR_RATIO_LIMITS
    bounded = any(m["median_row_rtol"] is not None for m in modes)
    width = 0.4 if bounded else 0.8
    for i, m in enumerate(modes):
        ratios = [(m["max_abs_error"], m["atol"])]
        if bounded:
            ratios.append((m["median_row_error"], m["median_row_rtol"]))
        for j, (error, bound) in enumerate(ratios):
            x = i + (j - 0.5) * width if bounded else i
            if m["error"]:
                ax.bar(x, high, width=width, color=FAIL_COLOUR, hatch="//", alpha=0.6)
                ax.text(x, low * 3, "ERROR", ha="center", va="bottom", rotation=90, fontsize=8)
                continue
            if bound is None:
                _label_bottom(ax, x, "not checked", low)
                continue
            ratio = _ratio(error, bound)
            if ratio == 0:
                _label_bottom(ax, x, "0", low)
                continue
            colour = PASS_COLOUR if ratio <= 1 else FAIL_COLOUR
            ax.bar(x, min(ratio, high), width=width, color=colour, hatch=None if j == 0 else "..")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.text(len(modes) - 0.5, 1.1, "tolerance", ha="right", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    kinds = "max|A-B| / atol" + (" (plain), median row err / bound (dotted)" if bounded else "")
    ax.set_ylabel("error / tolerance")
    ax.set_title(kinds, fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def plot_step_times(ax: Any, report: dict[str, Any], kind: str) -> None:
    """Median ms per step of ``kind`` (plan / kernel), A beside B, p90 as error bars; a zero
    median (the reference does not plan) is labelled ``0``, a mode that never ran ``n/a``."""
    low, high = TIME_MS_LIMITS
    modes = report["modes"]
    for offset, side in ((-0.2, "a"), (0.2, "b")):
        stats = [m["timing"][side][f"{kind}_ms"] for m in modes]
        med = np.array([s["median"] or 0.0 for s in stats])
        p90 = np.array([s["p90"] or 0.0 for s in stats])
        x = np.arange(len(modes)) + offset
        ax.bar(
            x,
            med,
            width=0.4,
            yerr=[np.zeros_like(med), p90 - med],
            capsize=2,
            color="tab:blue" if side == "a" else "tab:orange",
            label=f"{side.upper()}: {report[side]['name']}",
        )
        for xi, s in zip(x, stats, strict=True):
            if s["median"] is None:
                _label_bottom(ax, xi, "n/a", low)
            elif s["median"] <= low:
                _label_bottom(ax, xi, "0", low)
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    ax.set_ylabel(f"{'planning' if kind == 'plan' else 'kernels'} ms / step")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)


def plot_times(report: dict[str, Any], path: Path) -> None:
    """Correctness above time, per ``mode/path``, written as a PNG: the error against its
    tolerance (pass green, fail red; the verdict in the title, a failed run framed in red),
    then the median planning and kernel time of A beside B. Every axis is log scale with fixed
    limits (:data:`ERROR_RATIO_LIMITS`, :data:`TIME_MS_LIMITS`), so runs compare by eye."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = report["modes"]
    fig, axes = plt.subplots(3, 1, figsize=(max(6.0, 0.9 * len(modes) + 2), 10), sharex=True)
    plot_errors(axes[0], modes)
    for ax, kind in zip(axes[1:], KINDS, strict=True):
        plot_step_times(ax, report, kind)
    axes[-1].set_xticks(np.arange(len(modes)), [m["label"] for m in modes], rotation=45, ha="right")
    axes[-1].set_xlim(-0.6, len(modes) - 0.4)
    passed = report["passed"]
    verdict = "PASSED" if passed else f"FAILED: {len(report['failed'])} of {len(modes)} modes"
    fig.suptitle(
        f"{verdict}\n{report['a']['name']} (A) vs {report['b']['name']} (B) on {report['device']}",
        color=PASS_COLOUR if passed else FAIL_COLOUR,
        fontweight="bold",
    )
    if not passed:
        fig.patch.set_edgecolor(FAIL_COLOUR)
        fig.patch.set_linewidth(8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, edgecolor=fig.get_edgecolor())
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
