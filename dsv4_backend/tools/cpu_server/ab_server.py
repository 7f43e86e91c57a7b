"""``python -m dsv4_backend ab --server``: the same prompts through two server configurations.

What users do with backends: swap them on the same prompts and compare what the server
answers. Each side is sglang's own ``Engine`` (scheduler, radix cache, chunked prefill, the
model) with one attention backend; the prompts go to A, then to B, greedily with the top-2
logprobs of every step. The report (``report.md``, ``report.json`` in ``--out``, the verdict
line and one table row per request, as the trace A/B writes them) gives per request: how many
steps were compared (before the first step either side decided by less than ``--margin``),
whether the tokens agree there, the largest logprob difference, and each side's latency; and
each side's output tokens per second. Exit status 0 when every request agrees, 1 otherwise,
2 for bad input.

Backends: ``dsv4`` (this package with its default kernels: on the CPU torch, or Triton's
interpreter under ``TRITON_INTERPRET=1``), ``dsv4-torch`` (CPU: the torch kernels), and on a
GPU ``sglang:<name>`` (an attention backend sglang registers, e.g. ``sglang:dsv4_builtin``).
On the CPU the servers run through the CPU serving kit (``standins.py``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from dsv4_backend.errors import ConfigError
from dsv4_backend.tools.cpu_server import runs
from dsv4_backend.tools.cpu_server.serve import EAGLE_ARGS, TINY_CACHE

SERVER_BACKENDS = ("dsv4", "dsv4-torch", "sglang:<name>")


def server_config(name: str, device: str, eagle: bool) -> runs.ServerConfig:
    """The server configuration of backend ``name`` on ``device`` (``cpu`` or ``cuda``)."""
    if name not in ("dsv4", "dsv4-torch") and not name.startswith("sglang:"):
        raise ConfigError(f"--a / --b {name!r}: expected one of {SERVER_BACKENDS}")
    spec = EAGLE_ARGS if eagle else {}
    if device == "cpu":
        if name.startswith("sglang:"):
            raise ConfigError(
                f"--a / --b {name}: sglang's own attention backends run CUDA kernels; on the "
                "CPU compare dsv4 and dsv4-torch (on a GPU: --a dsv4 --b sglang:dsv4_builtin)"
            )
        triton = name == "dsv4" and os.environ.get("TRITON_INTERPRET") == "1"
        return runs.cpu_config(name, triton=triton, log_level="error", **spec)
    if name == "dsv4-torch":
        raise ConfigError(
            "--a / --b dsv4-torch: on a GPU the server runs the kernels it chooses; compare "
            "dsv4 with sglang:<name> there"
        )
    backend = name.removeprefix("sglang:")
    return runs.ServerConfig(name, {"attention_backend": backend, "log_level": "error", **spec})


def prompt_ids(requests: int, max_len: int, seed: int, vocab: int) -> list[list[int]]:
    """``requests`` prompts of random token ids below ``vocab``, of lengths spread over
    ``[1, max_len]`` by ``seed``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (requests,), generator=generator).tolist()
    return runs.random_prompts(lengths, seed, vocab)


def build_report(a: runs.Run, b: runs.Run, margin: float, setup: dict[str, Any]) -> dict:
    """The report of two runs of the same prompts."""
    found = runs.compare(a, b, margin)
    rows = [
        {
            "request": i,
            "ok": agreement.equal,
            "steps": agreement.steps,
            "compared": agreement.compared,
            "first_difference": agreement.first_difference,
            "max_logprob_difference": agreement.max_logprob_difference,
            "latency_s": {"a": ra.latency_s, "b": rb.latency_s},
        }
        for i, (agreement, ra, rb) in enumerate(zip(found, a.results, b.results, strict=True))
    ]
    return {
        "a": {"name": a.config.name, "output_tokens_per_s": a.output_tokens_per_s},
        "b": {"name": b.config.name, "output_tokens_per_s": b.output_tokens_per_s},
        "passed": all(row["ok"] for row in rows),
        "margin": margin,
        **setup,
        "requests": rows,
    }


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a markdown page: verdict, setup, one table row per request."""
    a, b = report["a"], report["b"]
    failed = [str(r["request"]) for r in report["requests"] if not r["ok"]]
    verdict = (
        "**PASSED**: every request's greedy tokens agree"
        if report["passed"]
        else f"**FAILED**: requests {', '.join(failed)}"
    )
    lines = [
        f"# Server A/B: {a['name']} (A) vs {b['name']} (B)",
        "",
        verdict,
        "",
        f"- model: {report['model']}; device {report['device']}; EAGLE {report['eagle']}",
        f"- {len(report['requests'])} requests (prompt lengths {report['prompt_lengths']}), "
        f"{report['new_tokens']} greedy tokens each, seed {report['seed']}",
        f"- tokens compared before the first step either side decided by less than "
        f"{report['margin']} (top-1 minus top-2 logprob)",
        f"- output tokens per second: A {a['output_tokens_per_s']:.3g}, "
        f"B {b['output_tokens_per_s']:.3g}",
        "",
        "| request | ok | steps | compared | first difference | max logprob diff | A latency s "
        "| B latency s |",
        "|---:|:-:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["requests"]:
        ok = "ok" if r["ok"] else "**FAIL**"
        first = "-" if r["first_difference"] is None else str(r["first_difference"])
        lines.append(
            f"| {r['request']} | {ok} | {r['steps']} | {r['compared']} | {first} "
            f"| {r['max_logprob_difference']:.3g} | {r['latency_s']['a']:.3g} "
            f"| {r['latency_s']['b']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``ab --server`` (the trace A/B's ``--a`` / ``--b`` / ``--requests`` /
    ``--max-len`` / ``--seed`` / ``--device`` / ``--out`` / ``--json`` apply too)."""
    server = parser.add_argument_group("server (--server)")
    server.add_argument(
        "--server",
        action="store_true",
        help="compare two sglang servers (Engines) on the same prompts instead of a trace",
    )
    server.add_argument(
        "--model-path",
        type=Path,
        help="the checkpoint the servers load (default: the tiny DeepSeek-V4 checkpoint)",
    )
    server.add_argument("--new-tokens", type=int, default=16, help="greedy tokens (default 16)")
    server.add_argument(
        "--eagle", action="store_true", help="both servers with EAGLE (the MTP layer drafts)"
    )
    server.add_argument(
        "--margin",
        type=float,
        default=runs.MARGIN_BOUND,
        help="compare tokens before the first step decided by less than this top-1 minus "
        f"top-2 logprob (default {runs.MARGIN_BOUND})",
    )


def run_server_ab(args: argparse.Namespace, device: str) -> tuple[dict[str, Any], int]:
    """Run ``ab --server`` from parsed arguments: the report and the exit status."""
    if args.new_tokens < 1 or args.requests < 1 or args.max_len < 1:
        raise ConfigError("--new-tokens, --requests and --max-len must be at least 1")
    if not 0 <= args.margin < float("inf"):
        raise ConfigError(f"--margin {args.margin}: expected a finite number >= 0")
    a = server_config(args.a, device, args.eagle)
    b = server_config(args.b, device, args.eagle)
    model = args.model_path
    if model is None:
        from dsv4_backend.tools.cpu_server.checkpoint import write_tiny_checkpoint

        model = write_tiny_checkpoint(TINY_CACHE / "tiny-v4", variant="v4")
    try:
        vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--model-path {model}: no config.json with a vocab_size ({exc})"
        ) from None
    prompts = prompt_ids(args.requests, args.max_len, args.seed, vocab)
    run_a = runs.run(model, a, prompts, args.new_tokens)
    run_b = runs.run(model, b, prompts, args.new_tokens)
    setup = {
        "model": str(model),
        "device": device,
        "eagle": args.eagle,
        "prompt_lengths": [len(p) for p in prompts],
        "new_tokens": args.new_tokens,
        "seed": args.seed,
    }
    report = build_report(run_a, run_b, args.margin, setup)
    return report, 0 if report["passed"] else 1


def write_report(report: dict[str, Any], out: Path) -> list[Path]:
    """Write ``report.md`` and ``report.json`` into ``out`` (created); return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    markdown, data = out / "report.md", out / "report.json"
    markdown.write_text(render_markdown(report))
    data.write_text(json.dumps(report, indent=2) + "\n")
    return [markdown, data]
