"""Run a trace through backends A and B and compare their outputs step by step.

Per ``mode/path`` (e.g. ``"verify/graph"``) the runner collects, over the rows both backends
were fed the right tokens (rows at or after a rejected draft are left out):

* ``max_abs_error``: ``max |A - B|``;
* ``max_rel_error``: ``max |A - B| / max |B|``;
* ``min_cosine``: the smallest cosine similarity of one row of one layer (``H * D`` values);
* ``median_row_error``: the median over rows and layers of ``||a - b|| / ||b||`` (one row of one
  layer), what a dense-vs-FP8 comparison is judged by (:mod:`.tolerance`);
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

from dsv4_backend.tools.ab.backends import Backend, StepOutput
from dsv4_backend.tools.ab.tolerance import Tolerance, default_tolerance
from dsv4_backend.tools.ab.trace import MODES, PATHS, Step, Trace


@dataclass
class ModeStats:
    """Everything the report says about one ``mode/path``."""

    label: str
    atol: float
    #: Bound of :attr:`median_row_error`; None: not checked (same cache format on both sides).
    median_row_rtol: float | None = None
    steps: int = 0
    rows: int = 0
    max_abs_error: float = 0.0
    max_ref: float = 0.0
    min_cosine: float = 1.0
    #: ``||a - b|| / ||b||`` of every compared row of every layer.
    row_errors: list[float] = field(default_factory=list)
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
    def median_row_error(self) -> float:
        return float(torch.tensor(self.row_errors).median()) if self.row_errors else 0.0

    @property
    def passed(self) -> bool:
        if self.error is not None or not self.max_abs_error <= self.atol:
            return False
        return self.median_row_rtol is None or self.median_row_error <= self.median_row_rtol


@dataclass
class ABResult:
    """The outcome of one A/B run."""

    trace: Trace
    a: Backend
    b: Backend
    device: torch.device
    modes: dict[str, ModeStats]
    wall_s: float
    #: The default tolerance of this pair of backends and its derivation (before ``--atol``).
    tolerance: Tolerance
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
    labels: list[str], default: float, overrides: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Tolerance per label: ``default``, then ``overrides`` keyed ``"*"`` (all), a mode
    (``"verify"``) or a label (``"verify/graph"``), the most specific winning."""
    overrides = dict(overrides or {})
    base = overrides.get("*", default)
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

    The default tolerance follows from the device and both sides' cache formats
    (:func:`~.tolerance.default_tolerance`); ``atol`` overrides its element-wise bound (see
    :func:`resolve_atol`); ``progress`` shows a tqdm bar on
    stderr. ``warmup`` (default: on CUDA) first runs the whole trace once through each backend,
    untimed, so that every kernel of every path is compiled before the timed run; each backend
    is then prepared afresh, so the timed run starts from the same state.
    """
    device = torch.device(device)
    start = time.perf_counter()
    tolerance = default_tolerance(device, a.cache_format, b.cache_format)
    tolerances = resolve_atol(trace.labels, tolerance.atol, atol)
    modes = {
        label: ModeStats(label, tolerances[label], tolerance.median_row_rtol)
        for label in trace.labels
    }
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
        tolerance=tolerance,
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
    if out_a.layers:
        stats.rows += sum(step.accepted(row) for row in out_a.rows)
    for layer, (got, want) in enumerate(zip(out_a.outputs, out_b.outputs, strict=True)):
        layer_a, layer_b = out_a.rows_of(layer), out_b.rows_of(layer)
        if sorted(layer_a) != sorted(layer_b):
            raise ValueError(
                f"layer {out_a.layers[layer]}: A returned rows {layer_a}, B returned {layer_b}"
            )
        index_b = {row: i for i, row in enumerate(layer_b)}
        keep = [(i, index_b[row]) for i, row in enumerate(layer_a) if step.accepted(row)]
        if not keep:
            continue
        rows_a = torch.tensor([i for i, _ in keep])
        rows_b = torch.tensor([j for _, j in keep])
        got, want = got[rows_a].flatten(1), want[rows_b].flatten(1)
        # NaN anywhere must fail, not vanish in max().
        diff = torch.nan_to_num((got - want).abs(), nan=float("inf"))
        stats.max_abs_error = max(stats.max_abs_error, diff.max().item())
        stats.max_ref = max(stats.max_ref, want.abs().max().item())
        stats.min_cosine = min(stats.min_cosine, _min_cosine(got, want))
        stats.row_errors += _row_errors(diff, want).tolist()


def _row_errors(diff: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``||a - b|| / ||b||`` per row of ``[N, F]`` tensors (``diff = |a - b|``, NaN already
    inf); 0 for two zero rows, inf for a zero ``b`` row with a nonzero ``a``."""
    norm, ref = diff.norm(dim=1), want.norm(dim=1)
    return torch.where(norm == 0, torch.zeros_like(norm), norm / ref)


def _min_cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    """Smallest row cosine similarity of ``[N, F]`` tensors; two zero rows count as 1."""
    norms = got.norm(dim=1) * want.norm(dim=1)
    cosine = (got * want).sum(dim=1) / norms.clamp_min(1e-30)
    both_zero = (got.norm(dim=1) == 0) & (want.norm(dim=1) == 0)
    cosine = torch.where(both_zero, torch.ones_like(cosine), cosine)
    return torch.nan_to_num(cosine, nan=-1.0).min().item()
