"""Run one attention layer of a planned batch (host-agnostic; the sglang adapter and the
serving simulator both call ``forward_layer``).

Order inside a layer (dsv4-attention.md section 3): the window key is written; on ratio-4
layers the indexer compressor writes its keys and the indexer selects each row's top-k c4
entries into ``metadata.c4.page_indices``; the layer's compressor writes completed c4 / c128
entries; then sparse attention with sink reads the window plus the compressed set. Entries
completed earlier in the same forward are therefore visible to later rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_backend.cache import DSV4CachePools
from dsv4_backend.cache.token_cache import CacheFormat
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ContractError
from dsv4_backend.kernels.compressor import CompressorState, compress_forward
from dsv4_backend.kernels.indexer import run_indexer
from dsv4_backend.kernels.sparse_attention import sparse_attention_with_sink
from dsv4_backend.planning.metadata import AttentionMetadata
from dsv4_backend.reference.layer import LayerInputs, LayerParams
from dsv4_backend.reference.rope import rope_for_ratio


@dataclass(frozen=True, eq=False)
class AttentionState:
    """Everything a model's attention keeps between forwards.

    Attributes
    ----------
    pools : per-layer window, compressed and indexer caches.
    compressor_states : compressor state rings of each compressed layer.
    indexer_states : the indexer compressor's rings of each ratio-4 layer.
    """

    config: DSV4AttentionConfig
    pools: DSV4CachePools
    compressor_states: dict[int, CompressorState]
    indexer_states: dict[int, CompressorState]

    @classmethod
    def allocate(
        cls,
        config: DSV4AttentionConfig,
        *,
        num_full_slots: int,
        num_swa_slots: int,
        num_request_slots: int,
        fmt: CacheFormat = "dense",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> AttentionState:
        """Zeroed caches and reset rings for ``num_request_slots`` request pool rows."""
        pools = DSV4CachePools.build(
            config,
            num_full_slots=num_full_slots,
            num_swa_slots=num_swa_slots,
            fmt=fmt,
            dtype=dtype,
            device=device,
        )
        core, index = {}, {}
        for layer, ratio in enumerate(config.compress_ratios):
            if ratio:
                core[layer] = CompressorState.allocate(
                    config, ratio, config.head_dim, num_request_slots, device
                )
            if ratio == 4:
                index[layer] = CompressorState.allocate(
                    config, 4, config.index_head_dim, num_request_slots, device
                )
        return cls(config=config, pools=pools, compressor_states=core, indexer_states=index)

    def reset_requests(self, pool_indices: torch.Tensor) -> None:
        """Reset the rings of requests that (re)start at position 0 in these pool rows."""
        for state in (*self.compressor_states.values(), *self.indexer_states.values()):
            state.reset(pool_indices)


def _required(value: torch.Tensor | None, name: str, layer: int, ratio: int) -> torch.Tensor:
    if value is None:
        raise ContractError(f"layer {layer} (compress ratio {ratio}) needs {name}, got None")
    return value


def forward_layer(
    state: AttentionState,
    layer: int,
    metadata: AttentionMetadata,
    req_pool_indices: torch.Tensor,
    inputs: LayerInputs,
    params: LayerParams,
) -> torch.Tensor:
    """Write this forward's keys and compressor state, then attend.

    Parameters
    ----------
    state : caches and rings, updated in place.
    layer : layer id; its ratio is ``config.compress_ratios[layer]``.
    metadata : the plan of this batch (``metadata.num_rows == T``).
    req_pool_indices : ``[B]`` int — ring row of each request of the batch.
    inputs : this forward's ``T`` rows (``LayerInputs`` fields with ``T`` in place of ``S``).
    params : the layer's parameters.

    Returns ``[T, H, D]`` float32 attention output (before the inverse RoPE and ``wo``).
    """
    config = state.config
    ratio = config.compress_ratios[layer]
    metadata.check_matches(
        batch_size=req_pool_indices.numel(), num_rows=inputs.q.shape[0], where=f"layer {layer}"
    )
    window = state.pools.window(layer)
    window.store(inputs.kv, metadata.swa_out_loc)
    comp = metadata.compressed(ratio)
    extra = None
    if ratio and comp is None:
        raise ContractError(
            f"layer {layer} has compress ratio {ratio} but the metadata has no c{ratio} fields "
            f"(planned for {metadata.kind.name})"
        )
    if comp is not None:
        rope = rope_for_ratio(config, ratio)
        positions = metadata.positions_causal
        if ratio == 4:
            index_entries = compress_forward(
                state.indexer_states[layer],
                _required(inputs.index_kv_proj, "index_kv_proj", layer, ratio),
                _required(inputs.index_score_proj, "index_score_proj", layer, ratio),
                _required(params.index_ape, "index_ape", layer, ratio),
                _required(params.index_norm_weight, "index_norm_weight", layer, ratio),
                rope,
                req_pool_indices,
                positions,
                comp.compress_plan,
                comp.write_plan,
            )
            keys = state.pools.indexer(layer)
            keys.store(index_entries, comp.out_loc)
            run_indexer(
                _required(inputs.index_q, "index_q", layer, ratio),
                _required(inputs.index_weights, "index_weights", layer, ratio),
                keys,
                metadata.page_table,
                comp.topk_lengths_raw,
                config.index_topk,
                comp.page_indices,
            )
        entries = compress_forward(
            state.compressor_states[layer],
            _required(inputs.kv_proj, "kv_proj", layer, ratio),
            _required(inputs.score_proj, "score_proj", layer, ratio),
            _required(params.ape, "ape", layer, ratio),
            _required(params.norm_weight, "norm_weight", layer, ratio),
            rope,
            req_pool_indices,
            positions,
            comp.compress_plan,
            comp.write_plan,
        )
        extra = state.pools.compressed(layer)
        extra.store(entries, comp.out_loc)
    return sparse_attention_with_sink(
        inputs.q,
        window,
        metadata.swa_page_indices,
        metadata.swa_topk_lengths,
        extra,
        None if comp is None else comp.page_indices,
        None if comp is None else comp.sparse_topk_lengths,
        params.sink,
        config.softmax_scale,
    )
