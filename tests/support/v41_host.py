"""A DeepSeek-V4.1 model on the sglang side of the backend, for the adapter tests: sglang
0.5.23's own ``DeepseekV41Compressor`` / ``DeepseekV41Indexer`` modules (their torch paths,
random bf16 weights) per layer, per-request activations, and the layer calls of sglang's
``MQALayer.forward`` on a ratio-1 / ratio-2 layer (``store_cache``, ``forward_low_ratio_sources``,
``forward``). The reference ``reference_v41`` is fed the modules' own projections of the same
activations, so a backend's output is compared with the math of what sglang's model computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from configured_pool import configured_kv_pool
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from tail_graphs import LayerCall, TailGraphs

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.self_check.requests import PagedRequestPool
from dsv4_backend.testing.harness import Step, tiny_hf_config
from dsv4_backend.testing.reference.v41_model import V41LayerInputs, reference_v41

HIDDEN, Q_LORA = 96, 48
#: A request's query row: ``(request, position)``; None is a graph bucket's padding row.
Row = tuple[int, int] | None


def v41_hf_config(config: DSV4AttentionConfig, **overrides: Any) -> dict[str, Any]:
    """A DeepSeek-V4.1 ``config.json`` mapping of ``config`` (its sources)."""
    v41 = config.v41
    assert v41 is not None, "a DeepSeek-V4.1 config"
    return tiny_hf_config(
        config,
        model_type="deepseek_v41",
        kv_source_layer_ids=list(v41.kv_source_layers),
        index_source_layer_ids=list(v41.index_source_layers),
        candidate_source_layer_id=v41.candidate_source_layer,
        candidate_topk_blocks=v41.candidate_topk_blocks,
        candidate_block_size=v41.candidate_block_size,
        **overrides,
    )


def v41_sglang_pool(
    config: DSV4AttentionConfig,
    paged: PagedRequestPool,
    num_draft_tokens: int = 0,
) -> DeepSeekV4TokenToKVPool:
    """sglang's V4.1 ``DeepSeekV4TokenToKVPool`` (the V4 layout, fp8) over ``paged``'s slots,
    as its configurator builds it (``num_draft_tokens`` > 0: under DSpark, whose pair rings
    hold the block). sglang's pool hard-codes the Flash widths: ``config`` has
    ``head_dim`` 512 and ``index_head_dim`` 128."""
    assert config.v41 is not None and config.head_dim == 512, "a V4.1 config of Flash widths"
    full, slots = paged.num_full_slots, paged.num_requests + 1
    spec: dict[str, Any] = (
        dict(speculative_algorithm="DSPARK", speculative_num_draft_tokens=num_draft_tokens)
        if num_draft_tokens
        else {}
    )
    pool = configured_kv_pool(
        v41_hf_config(config), full_size=full, swa_size=full, num_req_slots=slots,
        c4_state_pool_size=16, c128_state_pool_size=512, **spec,
    )  # fmt: skip
    pool.register_mapping(paged.full_to_swa)
    return pool


@dataclass
class V41Feed:
    """One layer's inputs of some rows: ``x`` ``[T, HIDDEN]``, ``q_lora`` ``[T, Q_LORA]``,
    ``q`` ``[T, H, D]``, ``kv`` ``[T, D]`` (window keys), bf16."""

    x: torch.Tensor
    q_lora: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor


class SglangV41Model:
    """sglang's V4.1 modules of every layer of ``config`` and the activations of requests of
    ``lengths`` tokens (module docstring); ``expected[r]``: the reference of request ``r``."""

    def __init__(self, config: DSV4AttentionConfig, lengths: Sequence[int], seed: int = 0):
        self.config = config
        self.layers = _modules(config, seed)
        self.sinks = torch.linspace(-1, 1, config.num_heads)
        self.activations: list[list[dict[str, torch.Tensor]]] = []
        self.inputs: list[list[V41LayerInputs]] = []
        self.expected = []
        for r, length in enumerate(lengths):
            acts, inputs = self._request(length, seed=seed * 1000 + 10 + r)
            self.activations.append(acts)
            self.inputs.append(inputs)
            self.expected.append(reference_v41(config, inputs))

    def replay_late_layers(self, floors: Sequence[torch.Tensor]) -> None:
        """The references under the decoder SWA bounded replay: request ``r``'s late layers
        read no window key of position ``t`` before ``floors[r][t]`` (``reference_v41``)."""
        self.expected = [
            reference_v41(self.config, inputs, floor)
            for inputs, floor in zip(self.inputs, floors, strict=True)
        ]

    def _request(
        self, length: int, seed: int
    ) -> tuple[list[dict[str, torch.Tensor]], list[V41LayerInputs]]:
        config = self.config
        g = torch.Generator().manual_seed(seed)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).bfloat16()

        acts, inputs = [], []
        for spec in self.layers:
            act = dict(
                x=rand(length, HIDDEN), q_lora=rand(length, Q_LORA),
                q=rand(length, config.num_heads, config.head_dim),
                kv=rand(length, config.head_dim),
            )  # fmt: skip
            extra: dict[str, Any] = {}
            with torch.no_grad():
                if spec.compressor is not None:
                    kv, score = spec.compressor.project(act["x"])
                    extra.update(
                        kv_proj=kv.float(), score_proj=None if score is None else score.float(),
                        norm_weight=spec.compressor.norm.weight.detach().float(),
                    )  # fmt: skip
                    if spec.indexer is not None:
                        extra.update(
                            wk=spec.indexer.wk.weight.detach().float(),
                            k_norm_weight=spec.indexer.k_norm.weight.detach().float(),
                        )
                if spec.indexer is not None:
                    q_proj = spec.indexer.wq_b(act["q_lora"])[0]
                    extra.update(
                        index_q_proj=q_proj.view(length, config.index_n_heads, -1).float(),
                        index_weights_raw=spec.indexer.head_weights_raw(act["x"]).float(),
                    )
            acts.append(act)
            inputs.append(
                V41LayerInputs(
                    q=act["q"].float(), window_kv=act["kv"].float(), sink=self.sinks, **extra
                )
            )
        return acts, inputs

    def feed(self, rows: Sequence[Row], layer: int) -> V41Feed:
        """The activations of ``rows`` at ``layer`` (ones for padding rows)."""
        first = self.activations[0][layer]

        def take(name: str) -> torch.Tensor:
            pad = torch.ones_like(first[name][0])
            values = [pad if r is None else self.activations[r[0]][layer][name][r[1]] for r in rows]
            if not values:
                return first[name][:0]
            return torch.stack(values)

        return V41Feed(x=take("x"), q_lora=take("q_lora"), q=take("q"), kv=take("kv"))

    def run_feed(
        self,
        backend: Any,
        fb: Any,
        layer: int,
        feed: V41Feed,
        positions: torch.Tensor | None = None,
        window_keys: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The backend calls of one layer on ``feed`` (rows at ``positions``, default the
        batch's): ``[T, H, D]`` in bf16. ``window_keys``: the keys written instead of
        ``feed.kv`` (a prefill CP rank's: every row of the batch, all-gathered by the model)."""
        spec = self.layers[layer]
        keys = feed.kv if window_keys is None else window_keys
        backend.store_cache(layer_id=layer, swa_k=keys, forward_batch=fb)
        if spec.compressor is not None or spec.indexer is not None:
            with torch.no_grad():
                backend.forward_low_ratio_sources(
                    layer=spec, x=feed.x, q_lora=feed.q_lora,
                    positions=fb.positions if positions is None else positions, forward_batch=fb,
                )  # fmt: skip
        attn_layer = SimpleNamespace(layer_id=layer, tp_q_head_num=self.config.num_heads)
        return backend.forward(
            q=feed.q, k=feed.q, v=feed.q, layer=attn_layer, forward_batch=fb,
            compress_ratio=spec.compress_ratio, attn_sink=self.sinks, save_kv_cache=False,
        )  # fmt: skip

    def layer(self, backend: Any, step: Step, layer: int) -> torch.Tensor:
        """``run_feed`` of ``step``'s rows."""
        return self.run_feed(backend, step.batch, layer, self.feed(step.rows, layer))

    def forward(
        self, backend: Any, step: Step, tail_graphs: TailGraphs | None = None
    ) -> list[tuple[list[Row], torch.Tensor]]:
        """Every layer of planned ``step`` as sglang's model runs them (``DeepseekV4Model.
        forward``): under the decoder SWA bounded replay an extend runs the layers from
        ``late_layer_start`` on over its late-layer tail only, after ``write_tail_source_kv``
        (the kv source's compressor over every row) and ``enter_late_layer_tail``, then
        ``exit_late_layer_tail``; from ``tail_graphs``' bucket when one serves the tail rows
        (``DecoderReplayTail.plan``), else eagerly. Returns each layer's rows and output."""
        tail = getattr(backend, "tail_forward_metadata", None)
        late = self.config.late_layer_start if tail is not None else len(self.layers)
        rows, fb = list(step.rows), step.batch
        outputs = [
            (rows, self.run_feed(backend, fb, layer, self.feed(rows, layer)))
            for layer in range(min(late, len(self.layers)))
        ]
        if late == len(self.layers):
            return outputs
        source = self.feed(rows, late)
        with torch.no_grad():
            backend.write_tail_source_kv(
                layer=self.layers[late], x=source.x, positions=fb.positions, forward_batch=fb
            )
        saved = backend.enter_late_layer_tail(fb)
        late_tail = backend.tail_forward_metadata.late_layer_tail
        rows = [rows[i] for i in late_tail.token_indices.tolist()]
        positions = late_tail.positions
        late_layers = range(late, len(self.layers))
        if tail_graphs is not None and tail_graphs.bucket_rows(len(rows)) is not None:
            calls = [
                LayerCall(spec=self.layers[layer], **vars(self.feed(rows, layer)))
                for layer in late_layers
            ]
            outputs += [(rows, out) for out in tail_graphs.run(backend, fb, positions, calls)]
        else:
            outputs += [
                (rows, self.run_feed(backend, fb, layer, self.feed(rows, layer), positions))
                for layer in late_layers
            ]
        backend.exit_late_layer_tail(saved, fb)
        return outputs

    def tail_graphs(self, max_rows: int) -> TailGraphs:
        """sglang's decoder tail graphs of this model (``DecoderReplayTail.maybe_create``:
        ``SWA_WINDOW``-row buckets up to ``max_rows``), their CPU twin."""
        return TailGraphs(
            row_step=self.config.window_size, max_rows=max_rows, sinks=self.sinks,
            num_heads=self.config.num_heads,
        )  # fmt: skip

    def max_error(self, rows: Sequence[Row], layer: int, out: torch.Tensor) -> float:
        """Largest difference to the reference over the real rows."""
        keep = [i for i, row in enumerate(rows) if row is not None]
        if not keep:
            return 0.0
        want = torch.stack(
            [self.expected[row[0]].outputs[layer][row[1]] for row in rows if row is not None]
        )
        return float((out[keep].float() - want).abs().max())


def _modules(config: DSV4AttentionConfig, seed: int) -> list[SimpleNamespace]:
    """sglang's V4.1 modules of every layer, random bf16 weights: the ``MQALayer`` attributes
    the backend reads (``layer_id``, ``compress_ratio``, ``compressor``, ``indexer``)."""
    from sglang.srt.layers.attention.dsv4.dsv41_sparse import (
        DeepseekV41Compressor,
        DeepseekV41Indexer,
    )

    hf = SimpleNamespace(
        **{k: v for k, v in v41_hf_config(config).items() if k != "compress_ratios"},
        q_lora_rank=Q_LORA, hidden_size=HIDDEN,
    )  # fmt: skip
    v41 = config.v41
    assert v41 is not None
    g = torch.Generator().manual_seed(seed)
    layers = []
    for layer, ratio in enumerate(config.compress_ratios):
        compressor = indexer = None
        if layer in v41.kv_source_layers:
            compressor = DeepseekV41Compressor(
                HIDDEN, config.head_dim, ratio, config.rms_norm_eps, fused_compress=False
            )
        if layer in v41.index_source_layers:
            indexer = DeepseekV41Indexer(hf, layer, config.head_dim, None, "indexer")
        for module in (compressor, indexer):
            if module is not None:
                with torch.no_grad():
                    for parameter in module.parameters():
                        parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.2)
        layers.append(
            SimpleNamespace(
                layer_id=layer, compress_ratio=ratio, compressor=compressor, indexer=indexer
            )
        )
    return layers
