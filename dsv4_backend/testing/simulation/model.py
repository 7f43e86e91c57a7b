"""A model of random attention layers served through the planner and kernels, with the
reference rows every output must equal."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from dsv4_backend import ops
from dsv4_backend.compute import forward_layer
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.planning import AttentionMetadata, BatchView, plan
from dsv4_backend.self_check.judge import plan_rows, pool_state, served_layers
from dsv4_backend.self_check.requests import PagedRequestPool
from dsv4_backend.testing.reference.layer import (
    LayerInputs,
    LayerParams,
    make_random_layer,
    reference_layer,
)

Planner = Callable[[DSV4AttentionConfig, BatchView], AttentionMetadata]


@dataclass(frozen=True)
class ForwardResult:
    """Outputs of one batch: ``rows[i] = (request, position)`` of output row ``i``.

    Attributes
    ----------
    metadata : the plan the forward used.
    outputs : ``[T, H, D]`` float32 of each of ``layers``.
    rejected : request -> first position fed a wrong draft (those rows match nothing).
    """

    metadata: AttentionMetadata
    rows: list[tuple[int, int]]
    outputs: list[torch.Tensor]
    layers: list[int]
    rejected: dict[int, int]


def _select_rows(
    inputs: Sequence[LayerInputs], rows: Sequence[tuple[int, int]], rejected: Mapping[int, int]
) -> ops.LayerInputs:
    """Concatenate the rows ``(request, position)`` of per-request inputs (the reference's) into
    the runtime's ragged inputs.

    Rows at or past ``rejected[request]`` get negated inputs: a draft token the target will
    reject, whose keys and compressor state later forwards must not see.
    """
    picked: dict[str, torch.Tensor | None] = {}
    for f in fields(LayerInputs):
        if getattr(inputs[rows[0][0]], f.name) is None:
            picked[f.name] = None
            continue
        picked[f.name] = torch.stack(
            [
                getattr(inputs[r], f.name)[p] * (-1.0 if p >= rejected.get(r, p + 1) else 1.0)
                for r, p in rows
            ]
        )
    return ops.LayerInputs(**picked)


class RandomModel:
    """Random layers (one per ``config.compress_ratios``) over the requests of a pool.

    Every request has its own random token data of length ``pool.max_lens[i]``, except the
    prefixes ``pool.same_tokens`` declares shared (a shared prompt); parameters are shared across
    requests. ``expected(layer, rows)`` gives the full causal pass's rows.
    """

    def __init__(
        self,
        config: DSV4AttentionConfig,
        pool: PagedRequestPool,
        *,
        generator: torch.Generator,
        fmt: str = "dense",
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.pool = pool
        self.device = torch.device(device)
        self.params: list[LayerParams] = []
        self.runtime_params: list[ops.LayerParams] = []  # the same values, for forward_layer
        self.inputs: list[list[LayerInputs]] = []  # [layer][request]
        for ratio in config.compress_ratios:
            per_request = [make_random_layer(config, ratio, n, generator) for n in pool.max_lens]
            inputs = [inputs for inputs, _ in per_request]
            for i, (j, n) in pool.same_tokens.items():
                inputs[i] = _with_prefix(inputs[i], inputs[j], n)
            self.params.append(_to(per_request[0][1], self.device))
            self.runtime_params.append(_to(per_request[0][1], self.device, ops.LayerParams))
            self.inputs.append([_to(x, self.device) for x in inputs])
        self._expected: dict[tuple[int, int], torch.Tensor] = {}
        self.state = pool_state(config, pool, fmt, self.device)

    def expected(self, layer: int, rows: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``[T, H, D]`` rows of the full causal pass (computed once per request)."""
        ratio = self.config.compress_ratios[layer]
        out = []
        for request, position in rows:
            key = (layer, request)
            if key not in self._expected:
                inputs = _to(self.inputs[layer][request], torch.device("cpu"))
                params = _to(self.params[layer], torch.device("cpu"))
                self._expected[key] = reference_layer(self.config, ratio, inputs, params).out
            out.append(self._expected[key][position])
        if not out:
            return torch.zeros(0, self.config.num_heads, self.config.head_dim)
        return torch.stack(out)

    def forward(
        self,
        batch: BatchView,
        *,
        layers: Sequence[int] | None = None,
        planner: Planner = plan,
        rejected: Mapping[int, int] | None = None,
        timings: dict[str, float] | None = None,
    ) -> ForwardResult:
        """Plan ``batch`` and run ``layers`` (default: every layer the plan serves).

        ``rejected`` maps a request to the first position whose token is a wrong draft: its
        rows see other inputs than the reference, so ``assert_matches_reference`` skips them.
        ``timings``, when given, gains the seconds spent planning (``"plan"``) and in the
        layers (``"kernels"``, gathering their inputs excluded), timed between device syncs.
        """
        with timed(timings, "plan", self.device):
            metadata = planner(self.config, batch)
        rows = self.rows(metadata, batch)
        if layers is None:
            layers = self.layers_served(metadata)
        outputs = []
        for layer in layers:
            inputs = self.layer_inputs(layer, rows, rejected)
            if inputs is None:
                outputs.append(torch.zeros(0, self.config.num_heads, self.config.head_dim))
                continue
            with timed(timings, "kernels", self.device):
                out = forward_layer(
                    self.state,
                    layer,
                    metadata,
                    batch.req_pool_indices,
                    inputs,
                    self.runtime_params[layer],
                )
            outputs.append(out)
        return ForwardResult(
            metadata=metadata,
            rows=rows,
            outputs=outputs,
            layers=list(layers),
            rejected=dict(rejected or {}),
        )

    #: ``(request, position)`` of every row of a plan of a batch (``judge.plan_rows``).
    rows = staticmethod(plan_rows)

    def layer_inputs(
        self,
        layer: int,
        rows: Sequence[tuple[int, int]],
        rejected: Mapping[int, int] | None = None,
    ) -> ops.LayerInputs | None:
        """``layer``'s runtime inputs of ``rows`` (None for no row); ``rejected`` as in
        :meth:`forward`."""
        return _select_rows(self.inputs[layer], rows, rejected or {}) if rows else None

    def max_error(self, result: ForwardResult) -> float:
        """Largest absolute difference to the reference over the accepted rows of ``result``."""
        keep = [i for i, (r, p) in enumerate(result.rows) if p < result.rejected.get(r, p + 1)]
        rows = [result.rows[i] for i in keep]
        worst = 0.0
        for layer, out in zip(result.layers, result.outputs, strict=True):
            if rows:
                diff = out[keep].cpu() - self.expected(layer, rows)
                worst = max(worst, diff.abs().max().item())
        return worst

    def layers_served(self, metadata: AttentionMetadata) -> list[int]:
        """Layers a plan can serve: all, or the window-only ones for a window-only plan."""
        return served_layers(self.config, metadata)


@contextlib.contextmanager
def timed(timings: dict[str, float] | None, key: str, device: torch.device) -> Iterator[None]:
    """Add the block's wall time to ``timings[key]`` (no-op, and no sync, when None)."""
    if timings is None:
        yield
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def _to(obj, device: torch.device, cls=None):
    """``obj`` (a dataclass of optional tensors) on ``device``, as a ``cls`` (default its type)."""
    values = {
        f.name: None if getattr(obj, f.name) is None else getattr(obj, f.name).to(device)
        for f in fields(obj)
    }
    return (cls or type(obj))(**values)


def _with_prefix(inputs: LayerInputs, source: LayerInputs, n: int) -> LayerInputs:
    """``inputs`` with its first ``n`` tokens' rows taken from ``source``."""
    values = {}
    for f in fields(inputs):
        value = getattr(inputs, f.name)
        if value is not None:
            value = torch.cat([getattr(source, f.name)[:n], value[n:]])
        values[f.name] = value
    return LayerInputs(**values)
