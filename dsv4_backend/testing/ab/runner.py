"""Run a trace through backends A and B and compare their outputs step by step.

Per ``mode/path`` (e.g. ``"verify/graph"``) the runner collects, over the rows both backends
were fed the right tokens (rows at or after a rejected draft are left out):

* ``max_abs_error``: ``max |A - B|``;
* ``max_rel_error``: ``max |A - B| / max |B|``;
* ``min_cosine``: the smallest cosine similarity of one row of one layer (``H * D`` values);
* the planning and kernel seconds of every step, per backend.

A step that raises in either backend (or whose rows or layers differ between them) stops the
run, since the two caches may no longer match; the error is recorded against that step's
``mode/path``.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from dsv4_backend.kernels.sparse_attention import attention_tolerance
from dsv4_backend.testing.ab.backends import Backend, StepOutput
from dsv4_backend.testing.ab.trace import MODES, PATHS, Step, Trace

#: Default absolute tolerance per device type: float32 dense caches on the CPU differ from the
#: reference by summation order only; on CUDA the attention dots take bf16 operands, so the
#: tolerance is derived from that dtype (``attention_tolerance``).
DEFAULT_ATOL = {"cpu": 1e-4, "cuda": attention_tolerance(torch.device("cuda"))}


@dataclass
class ModeStats:
    """Everything the report says about one ``mode/path``."""

    label: str
    atol: float
    steps: int = 0
    rows: int = 0
    max_abs_error: float = 0.0
    max_ref: float = 0.0
    min_cosine: float = 1.0
    #: ``times[side][kind]``: seconds per step, side ``"a"`` / ``"b"``, kind ``"plan"`` /
    #: ``"kernel"``.
    times: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: {s: {"plan": [], "kernel": []} for s in ("a", "b")}
    )
    error: str | None = None

    @property
    def mode(self) -> str:
        return self.label.split("/")[0]

    @property
    def path(self) -> str:
        return self.label.split("/")[1]

    @property
    def max_rel_error(self) -> float:
        return self.max_abs_error / self.max_ref if self.max_ref > 0 else 0.0

    @property
    def passed(self) -> bool:
        return self.error is None and self.max_abs_error <= self.atol


@dataclass
class ABResult:
    """The outcome of one A/B run."""

    trace: Trace
    a: Backend
    b: Backend
    device: torch.device
    modes: dict[str, ModeStats]
    wall_s: float
    #: Seconds of the untimed warm-up pass per side (``"a"`` / ``"b"``): kernel compilation
    #: and autotuning show up here, not in the step times. Empty when there was no warm-up.
    warmup_s: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> list[str]:
        """``mode/path`` labels over tolerance or with an error, in trace order."""
        return [label for label, stats in self.modes.items() if not stats.passed]

    @property
    def passed(self) -> bool:
        return not self.failed


def resolve_atol(
    labels: list[str], device: torch.device, overrides: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Tolerance per label: the device default, then ``overrides`` keyed ``"*"`` (all),
    a mode (``"verify"``) or a label (``"verify/graph"``), the most specific winning."""
    overrides = dict(overrides or {})
    base = overrides.get("*", DEFAULT_ATOL.get(device.type, DEFAULT_ATOL["cuda"]))
    return {
        label: overrides.get(label, overrides.get(label.split("/")[0], base)) for label in labels
    }


def check_atol_keys(overrides: Mapping[str, float]) -> list[str]:
    """Keys of ``overrides`` that name no mode or label (for the CLI's error message)."""
    known = {"*", *MODES} | {f"{m}/{p}" for m in MODES for p in PATHS}
    return [key for key in overrides if key not in known]


def run_trace(
    trace: Trace,
    a: Backend,
    b: Backend,
    *,
    device: torch.device | str = "cpu",
    atol: Mapping[str, float] | None = None,
    progress: bool = False,
    warmup: bool | None = None,
) -> ABResult:
    """Replay ``trace`` through ``a`` and ``b`` on ``device`` and compare every step.

    ``atol`` overrides tolerances (see :func:`resolve_atol`); ``progress`` shows a tqdm bar on
    stderr. ``warmup`` (default: on CUDA) first runs the whole trace once through each backend,
    untimed, so that every kernel of every path is compiled before the timed run; each backend
    is then prepared afresh, so the timed run starts from the same state.
    """
    device = torch.device(device)
    start = time.perf_counter()
    tolerances = resolve_atol(trace.labels, device, atol)
    modes = {label: ModeStats(label, tolerances[label]) for label in trace.labels}
    warmup_s = {}
    if device.type == "cuda" if warmup is None else warmup:
        warmup_s = {
            side: _warm_up(backend, trace, device) for side, backend in (("a", a), ("b", b))
        }
    a.prepare(trace, device)
    b.prepare(trace, device)
    for index, step in enumerate(_progress(trace.steps, progress)):
        stats = modes[step.label]
        try:
            out_a, out_b = _run(a, step), _run(b, step)
            _compare(stats, step, out_a, out_b)
        except Exception as exc:
            stats.error = f"step {index}: {exc}"
            break
        stats.steps += 1
        for side, out in (("a", out_a), ("b", out_b)):
            stats.times[side]["plan"].append(out.plan_s)
            stats.times[side]["kernel"].append(out.kernel_s)
    return ABResult(
        trace=trace,
        a=a,
        b=b,
        device=device,
        modes=modes,
        wall_s=time.perf_counter() - start,
        warmup_s=warmup_s,
    )


def _warm_up(backend: Backend, trace: Trace, device: torch.device) -> float:
    """Seconds to prepare ``backend`` and run every step of ``trace`` once (outputs dropped).

    A step that raises ends the warm-up quietly: the timed run meets the same error and reports
    it against its step.
    """
    start = time.perf_counter()
    backend.prepare(trace, device)
    try:
        for step in trace.steps:
            backend.run(step)
    except Exception:
        pass
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _run(backend: Backend, step: Step) -> StepOutput:
    """``backend.run(step)``; whatever it raises is re-raised naming the backend."""
    try:
        return backend.run(step)
    except Exception as exc:
        raise RuntimeError(f"{backend.name} raised {type(exc).__name__}: {exc}") from exc


def _progress(steps: tuple[Step, ...], enabled: bool) -> Iterable[Step]:
    """``steps``, behind a tqdm bar on stderr when enabled, tqdm is installed and stderr is a
    terminal."""
    if not enabled or importlib.util.find_spec("tqdm") is None:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc="ab", unit="step", file=sys.stderr, disable=not sys.stderr.isatty())


def _compare(stats: ModeStats, step: Step, out_a: StepOutput, out_b: StepOutput) -> None:
    """Fold the accepted rows of one step into ``stats``."""
    if out_a.layers != out_b.layers:
        raise ValueError(f"A ran layers {out_a.layers}, B ran {out_b.layers}")
    if sorted(out_a.rows) != sorted(out_b.rows):
        raise ValueError(f"A returned rows {out_a.rows}, B returned {out_b.rows}")
    index_b = {row: i for i, row in enumerate(out_b.rows)}
    keep = [(i, index_b[row]) for i, row in enumerate(out_a.rows) if step.accepted(row)]
    if not keep or not out_a.layers:
        return
    rows_a = torch.tensor([i for i, _ in keep])
    rows_b = torch.tensor([j for _, j in keep])
    stats.rows += len(keep)
    for got, want in zip(out_a.outputs, out_b.outputs, strict=True):
        got, want = got[rows_a].flatten(1), want[rows_b].flatten(1)
        # NaN anywhere must fail, not vanish in max().
        diff = torch.nan_to_num((got - want).abs(), nan=float("inf"))
        stats.max_abs_error = max(stats.max_abs_error, diff.max().item())
        stats.max_ref = max(stats.max_ref, want.abs().max().item())
        stats.min_cosine = min(stats.min_cosine, _min_cosine(got, want))


def _min_cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    """Smallest row cosine similarity of ``[N, F]`` tensors; two zero rows count as 1."""
    norms = got.norm(dim=1) * want.norm(dim=1)
    cosine = (got * want).sum(dim=1) / norms.clamp_min(1e-30)
    both_zero = (got.norm(dim=1) == 0) & (want.norm(dim=1) == 0)
    cosine = torch.where(both_zero, torch.ones_like(cosine), cosine)
    return torch.nan_to_num(cosine, nan=-1.0).min().item()
