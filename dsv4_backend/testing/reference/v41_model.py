"""DeepSeek-V4.1's attention over a whole model, one request at a time (docs/design.md §8):
what each layer reads of the layers before it.

Layers run in order over one request (positions ``0 ... S-1``). A kv source compresses its
entries (``low_ratio.low_ratio_entries``) and, from their latents before RoPE, the index keys
(``low_ratio.index_keys``); an index source scores its kv source's keys with its own queries
and weights and replaces the selection of its ratio: the candidate source and the layers
without candidates by the full top-k (the candidate source also publishing its candidate
blocks), a candidate consumer among the candidate blocks only. Every ratio-1 / ratio-2 layer
attends to its window keys plus the current selection of its ratio in its kv source's
entries (``attention.reference_attention``); a window-only layer to its window keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError, ContractError
from dsv4_backend.testing.reference.attention import reference_attention, visible_entries
from dsv4_backend.testing.reference.low_ratio import (
    candidate_blocks,
    index_head_weights,
    index_keys,
    index_queries,
    index_scores,
    low_ratio_entries,
    low_ratio_latents,
    select_entries,
    select_from_candidates,
)
from dsv4_backend.testing.reference.rope import rope_for_ratio


@dataclass(frozen=True, kw_only=True)
class V41LayerInputs:
    """One layer's inputs for one request of ``S`` tokens.

    Every layer: ``q`` ``[S, H, D]`` (normed, roped), ``window_kv`` ``[S, D]`` (normed, roped)
    and ``sink`` ``[H]``. A kv source also: ``kv_proj`` / ``score_proj`` (ratio 2) ``[S, D]``,
    its compressor's ``norm_weight`` ``[D]``, and the indexer's ``wk`` ``[DI, D]`` and
    ``k_norm_weight`` ``[DI]``. An index source also: ``index_q_proj`` ``[S, HI, DI]``
    (``wq_b q_lora``) and ``index_weights_raw`` ``[S, HI]`` (``weights_proj x``). Tensors
    float32 (bf16 values where the model's are bf16).
    """

    q: torch.Tensor
    window_kv: torch.Tensor
    sink: torch.Tensor
    kv_proj: torch.Tensor | None = None
    score_proj: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    wk: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    index_q_proj: torch.Tensor | None = None
    index_weights_raw: torch.Tensor | None = None


@dataclass(frozen=True)
class V41Result:
    """Per layer: its output ``[S, H, D]`` float32, and the selection it attended with
    (``[S, index_topk]`` entry ids, -1 = none; None for a window-only layer)."""

    outputs: list[torch.Tensor]
    selections: list[torch.Tensor | None]


def _needed(layer: int, inputs: V41LayerInputs, *names: str) -> list[torch.Tensor]:
    values = [getattr(inputs, name) for name in names]
    missing = [name for name, value in zip(names, values, strict=True) if value is None]
    if missing:
        raise ContractError(f"layer {layer} needs {missing} (its role in config.v41)")
    return values


def reference_v41(
    config: DSV4AttentionConfig,
    layers: Sequence[V41LayerInputs],
    late_window_floor: torch.Tensor | None = None,
) -> V41Result:
    """Run every layer of a DeepSeek-V4.1 ``config`` over one request (module docstring).

    ``late_window_floor`` ``[S]`` int: the decoder SWA bounded replay's late layers
    (``config.late_layer_start`` on) read no window key of position ``t`` before
    ``late_window_floor[t]``, the floor of the forward that computed row ``t``
    (``planning/tail.py``); their other rows are never computed, and this reference's
    outputs there mean nothing."""
    v41 = config.v41
    if v41 is None or len(layers) != len(config.compress_ratios):
        raise ConfigError(
            f"reference_v41 needs a DeepSeek-V4.1 config and one input per layer; got v41="
            f"{v41} and {len(layers)} inputs for {len(config.compress_ratios)} layers"
        )
    entries: dict[int, torch.Tensor] = {}
    keys: dict[int, torch.Tensor] = {}
    selection: dict[int, torch.Tensor] = {}
    blocks: list[list[int]] | None = None
    result = V41Result([], [])
    late = config.late_layer_start if late_window_floor is not None else len(layers)
    for layer, (ratio, inputs) in enumerate(zip(config.compress_ratios, layers, strict=True)):
        floor = late_window_floor if layer >= late else None
        s = inputs.q.shape[0]
        positions = torch.arange(s)
        if layer in v41.kv_source_layers:
            kv_proj, norm, wk, k_norm = _needed(
                layer, inputs, "kv_proj", "norm_weight", "wk", "k_norm_weight"
            )
            rope = rope_for_ratio(config, ratio)
            eps = config.rms_norm_eps
            entries[layer] = low_ratio_entries(kv_proj, inputs.score_proj, norm, ratio, rope, eps)
            latents = low_ratio_latents(kv_proj, inputs.score_proj, norm, ratio, eps)
            k_proj = (latents @ wk.float().T).bfloat16()
            keys[layer] = index_keys(k_proj, k_norm, rope, positions[: len(latents)] * ratio, eps)
        if layer in v41.index_source_layers:
            q_proj, raw = _needed(layer, inputs, "index_q_proj", "index_weights_raw")
            queries = index_queries(q_proj, rope_for_ratio(config, ratio), positions)
            weights = index_head_weights(raw, config.index_head_dim)
            scores = index_scores(queries, keys[config.kv_source_of(layer)], weights)
            visible = visible_entries(ratio, positions)
            if layer in config.candidate_consumers:
                assert blocks is not None  # the candidate source runs first
                chosen = select_from_candidates(
                    scores, visible, blocks, v41.candidate_block_size, config.index_topk
                )
            else:
                chosen = select_entries(scores, visible, config.index_topk)
            if layer == v41.candidate_source_layer:
                blocks = candidate_blocks(
                    scores, visible, v41.candidate_block_size, v41.candidate_topk_blocks
                )
            selection[ratio] = chosen
        if ratio == 0:
            out = reference_attention(
                config, 0, inputs.q, inputs.window_kv, None, None, inputs.sink, floor
            )
            result.selections.append(None)
        else:
            if ratio not in selection:
                raise ConfigError(
                    f"layer {layer} (ratio {ratio}) attends before any index source of its ratio"
                )
            source = entries[config.kv_source_of(layer)]
            out = reference_attention(
                config,
                ratio,
                inputs.q,
                inputs.window_kv,
                source,
                selection[ratio],
                inputs.sink,
                floor,
            )
            result.selections.append(selection[ratio])
        result.outputs.append(out)
    return result
