"""A model of random attention layers served through the planner and kernels, with the
reference rows every output must equal."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from dsv4_backend.compute import AttentionState, forward_layer
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.planning import AttentionMetadata, BatchView, plan
from dsv4_backend.reference.layer import (
    LayerInputs,
    LayerParams,
    make_random_layer,
    reference_layer,
)
from dsv4_backend.simulation.pool import PagedRequestPool

Planner = Callable[[DSV4AttentionConfig, BatchView], AttentionMetadata]


@dataclass(frozen=True)
class ForwardResult:
    """Outputs of one batch: ``rows[i] = (request, position)`` of output row ``i``.

    Attributes
    ----------
    metadata : the plan the forward used.
    outputs : per layer, ``[T, H, D]`` float32.
    """

    metadata: AttentionMetadata
    rows: list[tuple[int, int]]
    outputs: list[torch.Tensor]


def _select_rows(inputs: Sequence[LayerInputs], rows: Sequence[tuple[int, int]]) -> LayerInputs:
    """Concatenate the rows ``(request, position)`` of per-request inputs into ragged inputs."""
    picked = {}
    for f in fields(LayerInputs):
        parts = [getattr(inputs[r], f.name) for r, _ in rows[:1]]
        if not parts or parts[0] is None:
            picked[f.name] = None
            continue
        picked[f.name] = torch.stack([getattr(inputs[r], f.name)[p] for r, p in rows])
    return LayerInputs(**picked)


class RandomModel:
    """Random layers (one per ``config.compress_ratios``) over the requests of a pool.

    Every request has its own random token data of length ``pool.max_lens[i]``; parameters are
    shared across requests. ``expected(layer, rows)`` gives the full causal pass's rows.
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
        self.inputs: list[list[LayerInputs]] = []  # [layer][request]
        for ratio in config.compress_ratios:
            per_request = [make_random_layer(config, ratio, n, generator) for n in pool.max_lens]
            self.params.append(_to(per_request[0][1], self.device))
            self.inputs.append([_to(inputs, self.device) for inputs, _ in per_request])
        self._expected: dict[tuple[int, int], torch.Tensor] = {}
        self.state = AttentionState.allocate(
            config,
            num_full_slots=pool.num_full_slots,
            num_swa_slots=pool.num_full_slots,
            num_request_slots=pool.num_requests + 1,
            fmt=fmt,  # type: ignore[arg-type]
            device=self.device,
        )

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
        self, batch: BatchView, *, layers: Sequence[int] | None = None, planner: Planner = plan
    ) -> ForwardResult:
        """Plan ``batch`` and run ``layers`` (default: every layer the plan serves)."""
        metadata = planner(self.config, batch)
        requests = [int(i) - 1 for i in batch.req_pool_indices.tolist()]
        rows = [
            (requests[b], p)
            for b, p in zip(
                metadata.row_batch_ids.tolist(), metadata.positions_causal.tolist(), strict=True
            )
        ]
        if layers is None:
            layers = self.layers_served(metadata)
        outputs = []
        for layer in layers:
            inputs = _select_rows(self.inputs[layer], rows) if rows else None
            if inputs is None:
                outputs.append(torch.zeros(0, self.config.num_heads, self.config.head_dim))
                continue
            outputs.append(
                forward_layer(
                    self.state, layer, metadata, batch.req_pool_indices, inputs, self.params[layer]
                )
            )
        return ForwardResult(metadata=metadata, rows=rows, outputs=outputs)

    def layers_served(self, metadata: AttentionMetadata) -> list[int]:
        """Layers a plan can serve: all, or the window-only ones for a window-only plan."""
        ratios = self.config.compress_ratios
        return [i for i, r in enumerate(ratios) if r == 0 or metadata.compressed(r) is not None]


def _to(obj, device: torch.device):
    values = {
        f.name: None if getattr(obj, f.name) is None else getattr(obj, f.name).to(device)
        for f in fields(obj)
    }
    return type(obj)(**values)
