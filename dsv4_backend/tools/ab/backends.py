"""The backends an A/B run compares, by name (``--a`` / ``--b``).

=================  =========================================================================
name               what runs a step
=================  =========================================================================
``dsv4``           this package: the planner and the kernels of the default dispatch
                   (Triton on CUDA, the interpreter with ``TRITON_INTERPRET=1``, else torch)
``dsv4-torch``     the same with the torch kernel path forced
``dsv4-fp8``       ``dsv4`` with sglang's FP8 cache format (dense float32 otherwise)
``reference``      the plain float32 torch reference (``reference_layer``) on the CPU: each
                   request's full causal pass over its tokens ``0 ... p`` (``p`` its last
                   position in the step), whose rows are the step's rows
``sglang:<name>``  the sglang attention backend registered as ``<name>`` (after this
                   package's plugin registered; ``dsv4`` is then this package's adapter and
                   ``dsv4_builtin`` sglang's own), driven by the simulated sglang host of
                   ``dsv4_backend.testing.harness``; CUDA only
=================  =========================================================================

Every backend builds its own :class:`~dsv4_backend.testing.simulation.RandomModel` from the trace's
seed, so both sides of a run see the same inputs and caches. On the graph path the ``dsv4``
backends plan with fixed ``PlanWidths`` and load the plan into ``GraphMetadataBuffers`` padded
to a graph bucket of rows (the next power of two), as a CUDA-graph replay does. A trace's DP
padding (``--dp-pad``) is planned and run by the ``dsv4`` backends (padding rows dropped from
their output); the reference and ``sglang:<name>`` serve the real requests only. A DSpark
trace's ``dspark`` steps run the draft head (``Trace.build_draft``): the ``dsv4`` backends through
``plan_dspark_block`` and the kernels, the reference through ``reference_dspark_block``.

Tests perturb a backend through the Python API: ``DSV4Backend(planner=...)`` takes any
function with ``plan``'s signature.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable
from dataclasses import fields

import torch

from dsv4_backend.compute.kernel_choice import kernel_choice
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels.dispatch import force_path, select_path
from dsv4_backend.planning import (
    AttentionMetadata,
    BatchView,
    GraphMetadataBuffers,
    PlanWidths,
    plan,
)
from dsv4_backend.testing.reference.layer import LayerInputs, reference_layer
from dsv4_backend.testing.reference.v41_model import V41Result, reference_v41
from dsv4_backend.testing.simulation import DSparkDraft, RandomModel
from dsv4_backend.testing.simulation.v41 import V41Served
from dsv4_backend.tools.ab.base import Backend, StepOutput
from dsv4_backend.tools.ab.trace import Step, Trace

#: ``plan``'s signature: ``planner(config, batch, widths=None) -> AttentionMetadata``.
Planner = Callable[..., AttentionMetadata]
#: Names accepted by :func:`make_backend` besides ``sglang:<name>``.
BACKEND_NAMES = ("dsv4", "dsv4-torch", "dsv4-fp8", "reference")
SGLANG_PREFIX = "sglang:"


def graph_rows(num_rows: int) -> int:
    """The graph bucket of a batch of ``num_rows`` rows: the next power of two."""
    return 1 << max(num_rows - 1, 0).bit_length()


class _ModelBackend(Backend):
    """A backend over a trace's model: a DSpark step, a DeepSeek-V4.1 trace's step (``v41``
    set by ``prepare``) or a DeepSeek-V4 step, each its own method."""

    v41: object | None

    def run(self, step: Step) -> StepOutput:
        if step.mode == "dspark":
            return self._run_dspark(step)
        if self.v41 is not None:
            return self._run_v41(step)
        return self._run_v4(step)

    @abc.abstractmethod
    def _run_v4(self, step: Step) -> StepOutput: ...

    @abc.abstractmethod
    def _run_v41(self, step: Step) -> StepOutput: ...

    @abc.abstractmethod
    def _run_dspark(self, step: Step) -> StepOutput: ...


class DSV4Backend(_ModelBackend):
    """This package's planner and kernels over a ``RandomModel`` (module docstring).

    Parameters
    ----------
    name : the report's name.
    path : a kernel path to force (``"torch"``, ...); None for the default dispatch.
    planner : the planner to run (``plan``, or a perturbed one in tests).
    fmt : cache format, ``"dense"`` (float32) or ``"fp8"`` (sglang's layout).
    """

    def __init__(
        self,
        name: str = "dsv4",
        *,
        path: str | None = None,
        planner: Planner = plan,
        fmt: str = "dense",
    ) -> None:
        self.name = name
        self.path = path
        self.planner = planner
        self.cache_format = fmt
        self.model: RandomModel | None = None
        self.trace: Trace | None = None
        self.buffers: GraphMetadataBuffers | None = None
        self.draft: DSparkDraft | None = None
        #: A DeepSeek-V4.1 trace's model (``model`` is None then).
        self.v41: V41Served | None = None
        self.device = torch.device("cpu")

    @property
    def kernel_path(self) -> str:
        return self.path or select_path(self.device)

    def _paths(self) -> contextlib.AbstractContextManager:
        return force_path(self.path) if self.path else contextlib.nullcontext()

    def prepare(self, trace: Trace, device: torch.device) -> None:
        """Build the model and the graph buffers; warm up planning and kernels.

        The warm-up plans the first step of every ``mode/path`` (planning changes no state)
        and runs a short extend and decode on a scratch model, so JIT compilation (TVM
        plans, Triton kernels) is not timed.
        """
        self.device = device
        self.trace = trace
        if trace.config.v41 is not None:
            self._prepare_v41(trace, device)
            return
        self.model = trace.build_model(device, fmt=self.cache_format)
        pool = self.model.pool
        self.draft = (
            trace.build_draft(pool, device, self.cache_format) if trace.spec == "dspark" else None
        )
        self.buffers = GraphMetadataBuffers(
            trace.config,
            max_batch_size=pool.num_requests + trace.dp_pad,
            max_rows=graph_rows(trace.max_rows),
            widths=PlanWidths.for_max_len(pool.max_context, trace.config.page_size),
            device=device,
        )
        firsts = {step.label: step for step in trace.steps}
        scratch_trace = Trace(trace.config, (8,), (), trace.seed)
        scratch = scratch_trace.build_model(device, fmt=self.cache_format)
        with self._paths():
            for step in firsts.values():
                # A planner that raises here raises again in its step, where the runner
                # records the error against the step's mode.
                with contextlib.suppress(Exception):
                    self._planner(step)(trace.config, trace.batch(step, pool))
            scratch.forward(scratch.pool.extend([0], [0], [6]))
            scratch.forward(scratch.pool.decode([0], [7]))

    def _prepare_v41(self, trace: Trace, device: torch.device) -> None:
        """``prepare`` of a DeepSeek-V4.1 trace: its model, graph buffers, a warm-up extend
        and decode on a scratch model."""
        self.v41 = trace.build_v41(device, fmt=self.cache_format)
        pool = self.v41.pool
        self.buffers = GraphMetadataBuffers(
            trace.config,
            max_batch_size=pool.num_requests,
            max_rows=graph_rows(trace.max_rows),
            widths=PlanWidths.for_max_len(pool.max_context, trace.config.page_size),
            device=device,
        )
        scratch = Trace(trace.config, (8,), (), trace.seed).build_v41(device, self.cache_format)
        with self._paths():
            scratch.forward(
                scratch.pool.extend([0], [0], [6]), [(0, p) for p in range(6)], planner=self.planner
            )
            scratch.forward(scratch.pool.decode([0], [7]), [(0, 6)], planner=self.planner)

    def _planner(self, step: Step) -> Callable[[DSV4AttentionConfig, BatchView], AttentionMetadata]:
        if step.path == "eager":
            return self.planner
        buffers = self.buffers

        def graph_plan(config: DSV4AttentionConfig, batch: BatchView) -> AttentionMetadata:
            metadata = self.planner(config, batch, widths=buffers.widths)
            return buffers.load(metadata, num_rows=graph_rows(metadata.num_rows))

        return graph_plan

    def _run_v4(self, step: Step) -> StepOutput:
        model = self.model
        batch = self.trace.batch(step, model.pool)
        timings: dict[str, float] = {}
        with self._paths():
            result = model.forward(
                batch,
                layers=step.layers(model.config),
                planner=self._planner(step),
                rejected=step.rejected_map,
                timings=timings,
            )
        n = len(step.rows())  # rows past it are DP or graph padding
        return StepOutput(
            rows=result.rows[:n],
            layers=result.layers,
            outputs=[out[:n].float().cpu() for out in result.outputs],
            plan_s=timings.get("plan", 0.0),
            kernel_s=timings.get("kernels", 0.0),
        )

    def _run_v41(self, step: Step) -> StepOutput:
        """A DeepSeek-V4.1 step through the package's steps (``V41Served.forward``; the tail
        planned eagerly, as sglang plans it)."""
        served, trace = self.v41, self.trace
        rows = step.rows()
        timings: dict[str, float] = {}
        with self._paths():
            layer_rows, outputs = served.forward(
                trace.batch(step, served.pool),
                rows,
                planner=self._planner(step),
                tail_planner=self.planner,
                bounded_replay=trace.bounded_replay,
                timings=timings,
            )
        # Rows past a layer's own are graph padding.
        kept = [out[: len(r)].float().cpu() for out, r in zip(outputs, layer_rows, strict=True)]
        return StepOutput(
            rows=rows,
            layers=step.layers(trace.config),
            outputs=kept,
            plan_s=timings.get("plan", 0.0),
            kernel_s=timings.get("kernels", 0.0),
            layer_rows=layer_rows,
        )

    def _run_dspark(self, step: Step) -> StepOutput:
        """A DSpark draft block: the committed keys injected, then the block's stages."""
        draft, trace = self.draft, self.trace
        draft.commit(step.requests, step.lens)
        timings: dict[str, float] = {}
        with self._paths():
            result = draft.block(
                step.requests,
                step.lens,
                seed=trace.block_seed(step),
                graph=step.path == "graph",
                dp_pad=trace.dp_pad,
                timings=timings,
            )
        return StepOutput(
            rows=result.rows,
            layers=step.layers(trace.config),
            outputs=result.outputs,
            plan_s=timings.get("plan", 0.0),
            kernel_s=timings.get("kernels", 0.0),
        )


class ReferenceBackend(_ModelBackend):
    """The plain torch reference (module docstring); planning time is 0."""

    def __init__(self, name: str = "reference") -> None:
        self.name = name
        self.model: RandomModel | None = None
        self.trace: Trace | None = None
        self.draft: DSparkDraft | None = None
        #: A DeepSeek-V4.1 trace's ``reference_v41`` of each request, its whole length.
        self.v41: list[V41Result] | None = None

    @property
    def kernel_path(self) -> str:
        return "torch reference (cpu)"

    def prepare(self, trace: Trace, device: torch.device) -> None:
        self.trace = trace
        if trace.config.v41 is not None:
            # Each request's whole pass; under the bounded replay with the window floors its
            # prefills' late-layer tails give (trace.late_window_floors).
            model = trace.build_v41("cpu").model
            floors = trace.late_window_floors()
            self.v41 = [
                reference_v41(trace.config, inputs, floor)
                for inputs, floor in zip(model.requests, floors, strict=True)
            ]
            return
        self.model = trace.build_model("cpu")
        self.draft = trace.build_draft(self.model.pool) if trace.spec == "dspark" else None

    def _run_v4(self, step: Step) -> StepOutput:
        model = self.model
        config = model.config
        rows = step.rows()
        layers = step.layers(config)
        outputs, elapsed = [], 0.0
        for layer in layers:
            ratio = config.compress_ratios[layer]
            out = []
            for i, request in enumerate(step.requests):
                positions = step.positions(i)
                inputs = _truncate(model.inputs[layer][request], positions[-1] + 1)
                start = time.perf_counter()
                full = reference_layer(config, ratio, inputs, model.params[layer]).out
                elapsed += time.perf_counter() - start
                out.append(full[positions.start : positions.stop])
            outputs.append(torch.cat(out))
        return StepOutput(rows=rows, layers=layers, outputs=outputs, plan_s=0.0, kernel_s=elapsed)

    def _run_v41(self, step: Step) -> StepOutput:
        """The rows of ``step`` of each request's ``reference_v41`` pass; under the bounded
        replay a prefill's late layers give its late-layer tail's rows only."""
        trace = self.trace
        config = trace.config
        rows = step.rows()
        late = len(config.compress_ratios)
        if trace.bounded_replay and step.mode == "prefill":
            late = config.late_layer_start
        tail = trace.tail_rows(step) if late < len(config.compress_ratios) else rows
        layer_rows = [
            rows if layer < late else tail for layer in range(len(config.compress_ratios))
        ]
        outputs = [
            torch.stack([self.v41[r].outputs[layer][p] for r, p in of])
            for layer, of in enumerate(layer_rows)
        ]
        return StepOutput(
            rows=rows,
            layers=step.layers(config),
            outputs=outputs,
            plan_s=0.0,
            kernel_s=0.0,
            layer_rows=layer_rows,
        )

    def _run_dspark(self, step: Step) -> StepOutput:
        """``reference_dspark_block`` over each request's committed keys and block."""
        trace = self.trace
        start = time.perf_counter()
        stages = self.draft.block_inputs(step.requests, step.lens, seed=trace.block_seed(step))
        return StepOutput(
            rows=step.rows(),
            layers=step.layers(trace.config),
            outputs=[inputs.expected for inputs in stages],
            plan_s=0.0,
            kernel_s=time.perf_counter() - start,
        )


def _truncate(inputs: LayerInputs, length: int) -> LayerInputs:
    """The first ``length`` tokens of a request's inputs."""
    values = {f.name: getattr(inputs, f.name) for f in fields(LayerInputs)}
    return LayerInputs(**{k: None if v is None else v[:length] for k, v in values.items()})


def make_backend(name: str, device: torch.device) -> Backend:
    """The backend called ``name`` (module table) for tensors on ``device``.

    Raises ``ConfigError`` naming the problem for an unknown name, for a kernel variant named
    in the environment that cannot run here (``compute/kernel_choice.py``), and for an sglang
    backend that cannot run here (no CUDA device, not registered).
    """
    dsv4 = {"dsv4": (None, "dense"), "dsv4-torch": ("torch", "dense"), "dsv4-fp8": (None, "fp8")}
    if name in dsv4:
        path, fmt = dsv4[name]
        backend = DSV4Backend(name, path=path, fmt=fmt)
        with backend._paths():
            kernel_choice(device)  # ConfigError for an explicit kernel that cannot run here
        return backend
    if name == "reference":
        return ReferenceBackend(name)
    if name.startswith(SGLANG_PREFIX) and name != SGLANG_PREFIX:
        if device.type != "cuda":
            raise ConfigError(
                f"backend {name!r} needs a CUDA device (sglang's attention backends run on "
                f"GPUs), got device {device}; on the CPU compare dsv4, dsv4-torch, dsv4-fp8 "
                "and reference"
            )
        # Imported here: it imports sglang, which the other backends never need.
        from dsv4_backend.tools.ab.sglang_backend import SglangBackend

        return SglangBackend(name[len(SGLANG_PREFIX) :])
    raise ConfigError(
        f"unknown backend {name!r}; expected one of {', '.join(BACKEND_NAMES)} or "
        f"{SGLANG_PREFIX}<name> (an sglang attention backend, CUDA only)"
    )
