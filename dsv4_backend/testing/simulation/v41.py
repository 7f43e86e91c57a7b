"""A DeepSeek-V4.1 model for the serving tests: random per-request layer inputs
(``V41LayerInputs``, what the reference ``reference_v41`` takes) and one forward of a planned
batch through the package's steps, layer by layer, in the model's order (the window key, the
low-ratio sources: compressor then indexer, then attention).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dsv4_backend.cache import CacheFormat
from dsv4_backend.cache.state import AttentionState
from dsv4_backend.compute.layer import attend, store_window_keys
from dsv4_backend.compute.low_ratio import compress_low_ratio, select_low_ratio_entries
from dsv4_backend.config import DSV4AttentionConfig, V41Sources
from dsv4_backend.planning import BatchView, ForwardKind, late_layer_tail
from dsv4_backend.planning.metadata import AttentionMetadata
from dsv4_backend.self_check.requests import PagedRequestPool
from dsv4_backend.testing.reference.low_ratio import index_head_weights
from dsv4_backend.testing.reference.v41_model import V41LayerInputs
from dsv4_backend.testing.simulation.model import timed

#: A query row: ``(request, position)``.
Row = tuple[int, int]


#: The tiny DeepSeek-V4.1 layers: 0 window only; 1 c2 kv + index source; 2 shares 1; 3 c1 kv
#: + index + candidate source; 4 shares 3 (reuses 3's selection); 5 candidate consumer.
TINY_V41_RATIOS = (0, 2, 2, 1, 1, 1)
TINY_V41_SOURCES = V41Sources(
    kv_source_layers=(1, 3),
    index_source_layers=(1, 3, 5),
    candidate_source_layer=3,
    candidate_topk_blocks=2,
    candidate_block_size=8,
)
#: The model's parameters among ``V41LayerInputs``' fields (shared by every request).
PARAMETERS = ("sink", "norm_weight", "wk", "k_norm_weight")


def tiny_v41(**overrides: Any) -> DSV4AttentionConfig:
    """A small DeepSeek-V4.1 configuration of every layer role (``TINY_V41_RATIOS``)."""
    v41: dict[str, Any] = dict(
        compress_ratios=TINY_V41_RATIOS, num_heads=4, index_n_heads=2, v41=TINY_V41_SOURCES
    )
    return DSV4AttentionConfig.tiny(**(v41 | overrides))


def v41_inputs(config: DSV4AttentionConfig, length: int, seed: int) -> list[V41LayerInputs]:
    """Random bf16-valued inputs of every layer for one request of ``length`` tokens: each
    layer's queries, window keys and sink; a kv source's projections and norm weights; an index
    source's indexer projections."""
    v41 = config.v41
    assert v41 is not None, "a DeepSeek-V4.1 config"
    g = torch.Generator().manual_seed(seed)
    d, di, hi = config.head_dim, config.index_head_dim, config.index_n_heads

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).bfloat16().float()

    layers = []
    for layer, ratio in enumerate(config.compress_ratios):
        extra: dict = {}
        if layer in v41.kv_source_layers:
            extra.update(
                kv_proj=rand(length, d),
                norm_weight=1 + 0.1 * rand(d),
                wk=rand(di, d) * d**-0.5,
                k_norm_weight=1 + 0.1 * rand(di),
                score_proj=rand(length, d) if ratio == 2 else None,
            )
        if layer in v41.index_source_layers:
            extra.update(index_q_proj=rand(length, hi, di), index_weights_raw=rand(length, hi))
        inputs = dict(
            q=rand(length, config.num_heads, d),
            window_kv=rand(length, d),
            sink=rand(config.num_heads),
        )
        layers.append(V41LayerInputs(**inputs, **extra))
    return layers


class V41Model:
    """Per-request inputs of every layer: ``requests[i]`` is request ``i``'s ``v41_inputs``
    with the model's parameters (``PARAMETERS``: request 0's, shared by every request), what
    ``reference_v41`` takes for that request."""

    def __init__(self, config: DSV4AttentionConfig, requests: Sequence[list[V41LayerInputs]]):
        self.config = config
        first = requests[0]
        self.requests = [
            [
                dataclasses.replace(mine, **{n: getattr(shared, n) for n in PARAMETERS})
                for mine, shared in zip(layers, first, strict=True)
            ]
            for layers in requests
        ]

    def diverging(self, other: V41Model, first: Sequence[int]) -> V41Model:
        """This model's inputs before position ``first[r]`` of request ``r`` and ``other``'s
        from there on (drafts a verify rejects: their rows are computed, not committed); the
        parameters stay this model's."""
        requests = []
        for r, (mine, theirs) in enumerate(zip(self.requests, other.requests, strict=True)):
            layers = []
            for a, b in zip(mine, theirs, strict=True):
                changed = {}
                for f in dataclasses.fields(a):
                    value, alt = getattr(a, f.name), getattr(b, f.name)
                    if f.name in PARAMETERS or value is None:
                        continue
                    late = torch.arange(value.shape[0]) >= first[r]
                    changed[f.name] = torch.where(
                        late.view(-1, *[1] * (value.dim() - 1)), alt, value
                    )
                layers.append(dataclasses.replace(a, **changed))
            requests.append(layers)
        model = V41Model(self.config, [requests[0]])
        model.requests = requests
        return model

    def _take(self, rows: Sequence[Row | None], layer: int, name: str) -> torch.Tensor:
        """``name`` of ``layer`` at each row; a padding row (None) reads ones."""
        sample = getattr(self.requests[0][layer], name)[0]
        values = [
            torch.ones_like(sample)
            if row is None
            else getattr(self.requests[row[0]][layer], name)[row[1]]
            for row in rows
        ]
        return torch.stack(values)

    def _param(self, layer: int, name: str) -> torch.Tensor:
        value = getattr(self.requests[0][layer], name)
        assert value is not None
        return value

    def forward(
        self,
        state: AttentionState,
        metadata: AttentionMetadata,
        req_pool_indices: torch.Tensor,
        rows: Sequence[Row | None],
    ) -> list[torch.Tensor]:
        """Every layer's attention output ``[T, H, D]`` of ``rows`` (the batch's query rows, in
        its row order; None: a graph bucket's padding row)."""
        return [
            self.layer(state, metadata, req_pool_indices, rows, layer)
            for layer in range(len(self.config.compress_ratios))
        ]

    def layer(
        self,
        state: AttentionState,
        metadata: AttentionMetadata,
        req_pool_indices: torch.Tensor,
        rows: Sequence[Row | None],
        layer: int,
        *,
        compress: bool = True,
    ) -> torch.Tensor:
        """Layer ``layer`` of ``rows`` in the model's order: the window keys, a kv source's
        compressor (unless ``compress`` is False: ``compress`` ran it already), an index
        source's selection, the attention; its output ``[T, H, D]``."""
        config = self.config
        v41 = config.v41
        assert v41 is not None
        store_window_keys(state, layer, metadata, self._take(rows, layer, "window_kv"))
        if compress and layer in v41.kv_source_layers:
            self.compress(state, metadata, req_pool_indices, rows, layer)
        if layer in v41.index_source_layers:
            weights = index_head_weights(
                self._take(rows, layer, "index_weights_raw"), config.index_head_dim
            )
            select_low_ratio_entries(
                state, layer, metadata, self._take(rows, layer, "index_q_proj"), weights
            )
        q = self._take(rows, layer, "q")
        return attend(state, layer, metadata, q, self._param(layer, "sink"))

    def compress(
        self,
        state: AttentionState,
        metadata: AttentionMetadata,
        req_pool_indices: torch.Tensor,
        rows: Sequence[Row | None],
        layer: int,
    ) -> None:
        """Kv source ``layer``'s compressor over ``rows`` (and its index keys when it is an
        index source)."""
        config = self.config
        assert config.v41 is not None
        ratio = config.compress_ratios[layer]
        index = None
        if layer in config.v41.index_source_layers:
            index = (
                self._param(layer, "wk"),
                self._param(layer, "k_norm_weight"),
                config.rms_norm_eps,
            )
        compress_low_ratio(
            state,
            layer,
            metadata,
            req_pool_indices,
            self._take(rows, layer, "kv_proj"),
            self._take(rows, layer, "score_proj") if ratio == 2 else None,
            self._param(layer, "norm_weight"),
            config.rms_norm_eps,
            index_key_params=index,
        )


#: ``plan``'s signature: ``planner(config, batch) -> AttentionMetadata``.
Planner = Callable[[DSV4AttentionConfig, BatchView], AttentionMetadata]


@dataclass
class V41Served:
    """A DeepSeek-V4.1 ``model`` served by the package's steps over ``pool`` and ``state``
    (``V41Served.build``), batch by batch (``forward``)."""

    config: DSV4AttentionConfig
    pool: PagedRequestPool
    state: AttentionState
    model: V41Model

    @classmethod
    def build(
        cls,
        config: DSV4AttentionConfig,
        lengths: Sequence[int],
        seed: int,
        *,
        fmt: CacheFormat = "dense",
        device: torch.device | str = "cpu",
    ) -> V41Served:
        """Requests of ``lengths`` over a fresh pool and caches; the pool's pages and the
        model's data from ``seed`` (equal seeds, equal data)."""
        pool = PagedRequestPool(
            config, lengths, generator=torch.Generator().manual_seed(seed), device=device
        )
        model = V41Model(
            config, [v41_inputs(config, n, seed=seed * 1009 + r) for r, n in enumerate(lengths)]
        )
        state = AttentionState.allocate(
            config,
            num_full_slots=pool.num_full_slots,
            num_swa_slots=pool.num_full_slots,
            num_request_slots=pool.num_requests + 1,
            fmt=fmt,
            device=device,
        )
        return cls(config, pool, state, model)

    def forward(
        self,
        batch: BatchView,
        rows: Sequence[Row],
        *,
        planner: Planner,
        tail_planner: Planner | None = None,
        bounded_replay: bool = False,
        timings: dict[str, float] | None = None,
    ) -> tuple[list[list[Row]], list[torch.Tensor]]:
        """Plan ``batch`` with ``planner`` (query rows ``rows``; a plan of more rows pads them)
        and run every layer: each layer's rows and ``[T, H, D]`` output. With
        ``bounded_replay`` an extend's late layers run over its late-layer tail
        (``planning.late_layer_tail``, planned eagerly by ``tail_planner``, default
        ``planner``): the tail's kv source compresses every row first, then the late layers
        attend the tail rows with their window floors (docs/design.md §8)."""
        config, device = self.config, self.pool.device
        with timed(timings, "plan", device):
            metadata = planner(config, batch)
        padded: list[Row | None] = [*rows, *[None] * (metadata.num_rows - len(rows))]
        req = batch.req_pool_indices
        num_layers = len(config.compress_ratios)
        late = num_layers
        if bounded_replay and batch.kind is ForwardKind.EXTEND:
            late = config.late_layer_start
        layer_rows: list[list[Row]] = [list(rows)] * late
        outputs = []
        with timed(timings, "kernels", device):
            outputs = [self.model.layer(self.state, metadata, req, padded, i) for i in range(late)]
        if late == num_layers:
            return layer_rows, outputs
        with timed(timings, "kernels", device):
            self.model.compress(self.state, metadata, req, padded, late)
        tail = late_layer_tail(batch, config.window_size)
        with timed(timings, "plan", device):
            tail_metadata = (tail_planner or planner)(config, tail.batch)
        tail_rows = [rows[i] for i in tail.token_indices.tolist()]
        with timed(timings, "kernels", device):
            outputs += [
                self.model.layer(self.state, tail_metadata, req, tail_rows, i, compress=False)
                for i in range(late, num_layers)
            ]
        return [*layer_rows, *[tail_rows] * (num_layers - late)], outputs
