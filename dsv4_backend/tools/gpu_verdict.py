"""The GPU check's verdict: the kernels of one path judged step by step against the torch path
on the inputs of a reference model (``self_check/judge.py``, the steps and bounds), plus the
window-only and c128 layers of dense caches against the full causal pass:

=================  ===========================================  ===============================
step               compared                                     bound
=================  ===========================================  ===============================
reference          window-only and c128 layers of dense caches  ``attention_tolerance``
                   against the full causal pass
=================  ===========================================  ===============================

``python -m dsv4_backend.tools.gpu_verdict --device cuda --fmt fp8`` runs every serving mode
(:func:`judge_serving_modes`) and the stores, prints one line a finding and writes them as JSON
(``--json``); exit status 0 when every finding passed, 1 otherwise, 3 without the device. On a
GPU it first runs (or reads) the start-up self-check at the run's widths, so the kernels judged
are those a backend would choose (``DSV4_SELF_CHECK=0``: the rule without verdicts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Mapping
from typing import Any

import torch

from dsv4_backend.config import INDEXER_SELECTIONS, DSV4AttentionConfig
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention.common import attention_tolerance
from dsv4_backend.self_check.bounds import BF16_OUTPUT_RTOL, excess
from dsv4_backend.self_check.check import CheckWidths, runs_on, self_check
from dsv4_backend.self_check.judge import (
    FLASH_CONFIG,
    FLASH_SCHEDULE,
    FULL_SCHEDULE,
    Schedule,
    StepwiseJudge,
    judge_stores,
)
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel


class ReferenceJudge(StepwiseJudge):
    """A :class:`StepwiseJudge` of a :class:`RandomModel` that also judges each layer's output
    against the reference's full causal pass (``reference`` above)."""

    model: RandomModel

    def after_layer(
        self,
        mode: str,
        layer: int,
        rows: list[tuple[int, int]],
        rejected: Mapping[int, int],
        out: torch.Tensor,
    ) -> None:
        """The output under test ``out`` against the full causal pass (layers without a
        selection, dense caches: the reference knows no fp8 rounding)."""
        model = self.model
        if model.config.compress_ratios[layer] == 4 or model.state.pools.window(0).fmt != "dense":
            return
        keep = [i for i, (r, p) in enumerate(rows) if p < rejected.get(r, p + 1)]
        if not keep:
            return
        expected = model.expected(layer, [rows[i] for i in keep])
        bound: torch.Tensor | float = attention_tolerance(out.device)
        if out.dtype == torch.bfloat16:
            bound = bound + BF16_OUTPUT_RTOL * expected.abs()
        error = (out[keep].float().cpu() - expected).abs()
        self._add(mode, layer, "reference", excess(error, bound), f"max |diff| {_max(error):.3g}")


def _max(x: torch.Tensor) -> float:
    return float(x.max()) if x.numel() else 0.0


#: ``--config`` of the command line.
CONFIGS = {
    "tiny": (DSV4AttentionConfig.tiny(speculative=True), FULL_SCHEDULE),
    "flash": (FLASH_CONFIG, FLASH_SCHEDULE),
}


def make_judge(
    device: torch.device | str,
    path: str,
    *,
    schedule: Schedule = FULL_SCHEDULE,
    fmt: str = "dense",
    query_dtype: torch.dtype | None = None,
    operand_dtype: torch.dtype | None = None,
    seed: int = 0,
    config: DSV4AttentionConfig | None = None,
) -> ReferenceJudge:
    """A judge of ``path`` over a fresh random model whose requests fit ``schedule`` (the tiny
    configuration by default; ``fmt`` its caches' format)."""
    config = config or DSV4AttentionConfig.tiny(speculative=True)
    generator = torch.Generator().manual_seed(seed)
    pool = PagedRequestPool(config, list(schedule.max_lens), generator=generator, device=device)
    model = RandomModel(config, pool, generator=generator, fmt=fmt, device=device)
    return ReferenceJudge(model, path, query_dtype=query_dtype, operand_dtype=operand_dtype)


def judge_serving_modes(
    device: torch.device | str,
    path: str,
    *,
    schedule: Schedule = FULL_SCHEDULE,
    **options: Any,
) -> ReferenceJudge:
    """Every serving mode of ``schedule`` on ``path``; ``options`` as in :func:`make_judge`."""
    judge = make_judge(device, path, schedule=schedule, **options)
    for mode, batch in schedule.batches(judge.model.pool):
        judge.forward(batch, mode)
    return judge


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--fmt", choices=("dense", "fp8"), default="fp8")
    parser.add_argument(
        "--query-dtype",
        choices=("float32", "bfloat16"),
        default="bfloat16",
        help="the attention queries' dtype (a deployment's: bfloat16)",
    )
    parser.add_argument("--config", choices=tuple(CONFIGS), default="tiny")
    parser.add_argument(
        "--indexer-selection",
        choices=INDEXER_SELECTIONS,
        default="exact",
        help="exact scores, or sglang's fp8 ones (DSV4_BACKEND_INDEXER_SELECTION)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the findings to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_verdict: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 3
    path = dispatch.select_path(device)
    config, schedule = CONFIGS[args.config]
    config = dataclasses.replace(config, indexer_selection=args.indexer_selection)
    if runs_on(device):  # judge the kernels a backend would run
        widths = CheckWidths.of_model(config, args.fmt, config.num_heads)
        print("\n".join(self_check(widths, device).lines()))
    judge = judge_serving_modes(
        device,
        path,
        schedule=schedule,
        config=config,
        fmt=args.fmt,
        query_dtype=getattr(torch, args.query_dtype),
        seed=args.seed,
    )
    findings = judge.findings + judge_stores(device, path, seed=args.seed)
    for f in findings:
        if not f.passed:
            print(f"FAIL {f.mode} layer {f.layer} {f.step}: excess {f.excess:.3g} {f.detail}")
    worst: dict[str, float] = {}
    for f in findings:
        worst[f.step] = max(worst.get(f.step, 0.0), f.excess)
    for step, figure in worst.items():
        print(f"{step}: worst excess {figure:.3g} of its bound")
    failed = sum(not f.passed for f in findings)
    print(
        f"gpu_verdict ({path}, {args.config}, {args.fmt} caches, {args.query_dtype} queries): "
        f"{len(findings) - failed} of {len(findings)} findings pass"
    )
    if args.json:
        with open(args.json, "w") as out:
            summary = {
                "path": path,
                "config": args.config,
                "fmt": args.fmt,
                "query_dtype": args.query_dtype,
                "worst_excess": {k: v if math.isfinite(v) else None for k, v in worst.items()},
                "findings": [f.as_json() for f in findings],
            }
            json.dump(summary, out, indent=1)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
