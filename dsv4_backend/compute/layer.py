"""Run one attention layer of a planned batch (host-agnostic). The sglang adapter calls the
steps one by one, as sglang's model calls it; the serving simulator calls ``forward_layer``.

Order inside a layer (docs/design.md §3): the window key is written; on ratio-4
layers the indexer compressor writes its keys and the indexer selects each row's top-k c4
entries into ``metadata.c4.page_indices``; the layer's compressor writes completed c4 / c128
entries; then sparse attention with sink reads the window plus the compressed set. Entries
completed earlier in the same forward are therefore visible to later rows.
"""

from __future__ import annotations

import torch

from dsv4_backend.cache.state import AttentionState
from dsv4_backend.config import LOW_RATIOS, QUANTISED_SELECTIONS, DSV4AttentionConfig
from dsv4_backend.errors import ContractError
from dsv4_backend.kernels.attention.common import AttentionCall
from dsv4_backend.kernels.attention.table import sparse_attention_with_sink
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.kernels.compressor.table import compress_forward
from dsv4_backend.kernels.indexer.fp4 import fp4_key_rows
from dsv4_backend.kernels.indexer.fp8 import quantised_view
from dsv4_backend.kernels.indexer.table import run_indexer, selection_queries
from dsv4_backend.ops.layer_types import LayerInputs, LayerParams
from dsv4_backend.planning.metadata import (
    AttentionMetadata,
    CompressedMetadata,
    LowRatioMetadata,
)
from dsv4_backend.planning.planner import GRAPH_KINDS


def layer_ratio(config: DSV4AttentionConfig, layer: int, where: str) -> int:
    """The compress ratio of ``layer``; ``ContractError`` naming a layer id out of range."""
    ratios = config.compress_ratios
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(ratios):
        raise ContractError(
            f"{where}: layer_id={layer!r}; expected an integer in [0, {len(ratios)}) (the "
            "attention layers of the model config)"
        )
    return ratios[layer]


def _compressed(metadata: AttentionMetadata, ratio: int, where: str) -> CompressedMetadata:
    comp = metadata.compressed(ratio)
    if comp is None:
        raise ContractError(
            f"{where}: compress ratio {ratio} but the metadata has no c{ratio} fields "
            f"(planned for {metadata.kind.name})"
        )
    return comp


def store_window_keys(
    state: AttentionState, layer: int, metadata: AttentionMetadata, kv: torch.Tensor
) -> None:
    """Write this forward's window keys ``kv`` ``[T, D]`` (normed, roped) of ``layer``."""
    store_rows(state.pools.window(layer), kv, metadata.swa_out_loc)


def compress_and_store(
    state: AttentionState,
    layer: int,
    metadata: AttentionMetadata,
    req_pool_indices: torch.Tensor,
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    indexer: bool = False,
    norm_eps: float | None = None,
) -> torch.Tensor:
    """Run ``layer``'s compressor (or its indexer's, ``indexer=True``) over this forward.

    ``kv_proj`` / ``score_proj`` ``[T, c*D]`` (scores without ``ape``); the rings are updated
    and the entries completed by this forward are stored in the layer's compressed cache (or
    indexer key cache) at ``out_loc``. ``norm_eps``: the RMSNorm epsilon (default
    ``config.rms_norm_eps``). Returns the ``[T, D]`` float32 entries completed by each row
    (zeros for rows that complete none), before any fp8 rounding of the store.
    """
    ratio = layer_ratio(state.config, layer, f"compressor of layer {layer}")
    ratio = 4 if indexer else ratio
    comp = _compressed(metadata, ratio, f"compressor of layer {layer}")
    rings = (state.indexer_states if indexer else state.compressor_states)[layer]
    cache = state.pools.indexer(layer) if indexer else state.pools.compressed(layer)
    selection = state.config.indexer_selection if indexer else "exact"
    quantised = selection in QUANTISED_SELECTIONS
    entries = compress_forward(
        rings,
        kv_proj,
        score_proj,
        ape,
        norm_weight,
        state.rope,
        req_pool_indices,
        metadata.swa_page_indices,
        metadata.positions_causal,
        comp.compress_plan,
        comp.write_plan,
        norm_eps=state.config.rms_norm_eps if norm_eps is None else norm_eps,
        store=None if quantised else (cache, comp.out_loc),
        max_rows_per_request=metadata.max_request_rows if metadata.kind in GRAPH_KINDS else None,
    )
    if quantised:  # sglang's rotated e4m3 / fp4 keys (rows completing no entry stay 0)
        rows = quantised_view(entries) if selection == "fp8" else fp4_key_rows(entries)
        store_rows(cache, rows, comp.out_loc)
    return entries


def select_c4_entries(
    state: AttentionState,
    layer: int,
    metadata: AttentionMetadata,
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
) -> None:
    """The lightning indexer: each row's top-k c4 slots into ``metadata.c4.page_indices``.

    ``index_q`` ``[T, HI, DI]`` (roped), ``index_weights`` ``[T, HI]`` (scaled). With
    ``config.indexer_selection`` ``"fp8"`` / ``"fp4"`` the queries (and, in
    ``compress_and_store``, the keys) are sglang's rotated e4m3 / fp4 values
    (``kernels.indexer.fp8`` / ``kernels.indexer.fp4``).
    """
    comp = _compressed(metadata, 4, f"indexer of layer {layer}")
    run_indexer(
        selection_queries(state.config.indexer_selection, index_q),
        index_weights,
        state.pools.indexer(layer),
        metadata.page_table,
        comp.topk_lengths_raw,
        state.config.index_topk,
        comp.page_indices,
    )


def attend(
    state: AttentionState,
    layer: int,
    metadata: AttentionMetadata,
    q: torch.Tensor,
    sink: torch.Tensor,
) -> torch.Tensor:
    """Sparse attention with sink of ``layer``: ``q`` ``[T, H, D]`` -> ``[T, H, D]`` (float32;
    bf16 for bf16 ``q`` on a GPU: ``attention.common.output_dtype``).

    Keys: the window plus, on compressed layers, the c4 top-k (selected earlier in this
    forward) or every visible c128 entry; on a DeepSeek-V4.1 ratio-1 / ratio-2 layer, its kv
    source's entries of the ratio's current selection (``compute.low_ratio``).
    """
    ratio = layer_ratio(state.config, layer, "attention")
    where = f"attention of layer {layer}"
    comp: CompressedMetadata | LowRatioMetadata | None = None
    if ratio in LOW_RATIOS:
        comp = metadata.low_ratio(ratio)
        if comp is None:
            raise ContractError(f"{where}: compress ratio {ratio} but the metadata has no c{ratio}")
    elif ratio:
        comp = _compressed(metadata, ratio, where)
    call = AttentionCall.of(
        q,
        state.pools.window(layer),
        metadata.swa_page_indices,
        metadata.swa_topk_lengths,
        None if comp is None else state.pools.compressed(layer),
        None if comp is None else comp.page_indices,
        None if comp is None else comp.sparse_topk_lengths,
        sink,
        state.config.softmax_scale,
        rows_per_group=_rows_per_request(metadata),
    )
    return sparse_attention_with_sink(call)


def _rows_per_request(metadata: AttentionMetadata) -> int:
    """Query rows per request, rounded up (1 for decode): a request's rows share most of their
    keys, so attention may take that many rows a program and gather their keys once."""
    return max(1, -(-metadata.num_rows // max(1, metadata.batch_size)))


def _required(value: torch.Tensor | None, name: str, layer: int) -> torch.Tensor:
    if value is None:
        raise ContractError(f"layer {layer} needs {name}, got None")
    return value


def forward_layer(
    state: AttentionState,
    layer: int,
    metadata: AttentionMetadata,
    req_pool_indices: torch.Tensor,
    inputs: LayerInputs,
    params: LayerParams,
) -> torch.Tensor:
    """Write this forward's keys and compressor state, then attend (the steps above, in order).

    Parameters
    ----------
    state : caches and rings, updated in place.
    layer : layer id; its ratio is ``config.compress_ratios[layer]``.
    metadata : the plan of this batch (``metadata.num_rows == T``).
    req_pool_indices : ``[B]`` int — ring row of each request of the batch: the tensor the
        plan was made from (``ContractError`` for a plan of another batch).
    inputs : this forward's ``T`` rows (``LayerInputs`` fields with ``T`` in place of ``S``).
    params : the layer's parameters.

    Returns ``[T, H, D]`` attention output (before the inverse RoPE and ``wo``), in
    ``attention.common.output_dtype``.
    """
    ratio = layer_ratio(state.config, layer, "forward_layer")
    where = f"layer {layer}"
    metadata.check_matches(
        batch_size=req_pool_indices.numel(), num_rows=inputs.q.shape[0], where=where
    )
    metadata.check_batch(where, req_pool_indices=req_pool_indices)

    def need(value: torch.Tensor | None, name: str) -> torch.Tensor:
        return _required(value, name, layer)

    store_window_keys(state, layer, metadata, inputs.kv)
    if ratio == 4:
        compress_and_store(
            state,
            layer,
            metadata,
            req_pool_indices,
            need(inputs.index_kv_proj, "index_kv_proj"),
            need(inputs.index_score_proj, "index_score_proj"),
            need(params.index_ape, "index_ape"),
            need(params.index_norm_weight, "index_norm_weight"),
            indexer=True,
        )
        select_c4_entries(
            state,
            layer,
            metadata,
            need(inputs.index_q, "index_q"),
            need(inputs.index_weights, "index_weights"),
        )
    if ratio:
        compress_and_store(
            state,
            layer,
            metadata,
            req_pool_indices,
            need(inputs.kv_proj, "kv_proj"),
            need(inputs.score_proj, "score_proj"),
            need(params.ape, "ape"),
            need(params.norm_weight, "norm_weight"),
        )
    return attend(state, layer, metadata, inputs.q, params.sink)
