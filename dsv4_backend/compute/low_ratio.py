"""DeepSeek-V4.1's low-ratio steps of a layer (host-agnostic; docs/design.md §8), run before
its attention (``layer.attend``, which reads the kv source's cache with the ratio's current
selection):

* a kv source compresses this forward's tokens (:func:`compress_low_ratio`): its c1 / c2
  entries, and, when it is an index source too, the index keys its ratio's index sources score;
* an index source selects (:func:`select_low_ratio_entries`) each row's top-k entries of its
  kv source into ``metadata.c{r}.page_indices``: the full top-k, or, for a candidate consumer,
  the top-k among the blocks the candidate source published into
  ``metadata.c{r}.candidate_blocks``.
"""

from __future__ import annotations

import torch

from dsv4_backend.cache.state import AttentionState
from dsv4_backend.config import LOW_RATIOS
from dsv4_backend.errors import ContractError
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.kernels.low_ratio.selection import select_entries
from dsv4_backend.kernels.low_ratio.table import low_ratio_call, low_ratio_pairs, low_ratio_rows
from dsv4_backend.planning.metadata import AttentionMetadata, LowRatioMetadata


def _low_ratio(
    state: AttentionState, layer: int, metadata: AttentionMetadata, where: str
) -> tuple[int, LowRatioMetadata]:
    ratio = state.config.compress_ratios[layer]
    fields = metadata.low_ratio(ratio) if ratio in LOW_RATIOS else None
    if fields is None:
        raise ContractError(
            f"{where}: layer {layer} has compress ratio {ratio} but the metadata has no "
            f"DeepSeek-V4.1 low-ratio fields for it (planned for {metadata.kind.name})"
        )
    return ratio, fields


def compress_low_ratio(
    state: AttentionState,
    layer: int,
    metadata: AttentionMetadata,
    req_pool_indices: torch.Tensor,
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor | None,
    norm_weight: torch.Tensor,
    norm_eps: float,
    *,
    index_key_params: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """Run kv source ``layer``'s compressor over this forward's rows.

    ``kv_proj`` ``[T, D]`` float32 (``wkv x``), ``score_proj`` ``[T, D]`` float32 (``wgate
    x``, ratio 2; None for ratio 1); ``norm_weight`` ``[D]`` and ``norm_eps``: the compressor's
    RMSNorm. ``index_key_params`` ``(wk [DI, D], k_norm_weight [DI], eps)``: the layer's
    indexer (an index source), which writes the index keys; None writes none. Rows completing
    an entry (``c{r}.out_loc >= 0``) store it; a ratio-2 source keeps its pair ring.
    """
    where = f"low-ratio compressor of layer {layer}"
    ratio, fields = _low_ratio(state, layer, metadata, where)
    if layer not in state.pools.compressed_caches:
        raise ContractError(
            f"{where}: layer {layer} is not a kv source (kv_source_layers="
            f"{list(state.config.v41.kv_source_layers) if state.config.v41 else []}); only a "
            "kv source compresses"
        )
    if (score_proj is None) != (ratio == 1):
        raise ContractError(
            f"{where}: ratio {ratio} with score_proj {'None' if score_proj is None else 'given'}"
            "; ratio 1 has no gate, ratio 2 needs its scores"
        )
    positions = metadata.positions_causal.long()
    if score_proj is None:
        pooled, entry_positions = kv_proj.float(), positions
    else:
        req_rows = req_pool_indices.long()[metadata.row_batch_ids.long()]
        rings = state.compressor_states[layer]
        valid = metadata.swa_out_loc >= 0  # every row of a batch writes its window key
        pooled = low_ratio_pairs(
            rings, kv_proj.float(), score_proj.float(), req_rows, positions, valid
        )
        entry_positions = (positions - 1).clamp(min=0)
    cos, sin = state.rope.cos_sin(entry_positions)
    entries, latent = low_ratio_rows(pooled, cos, sin, "e4m3", norm=(norm_weight, norm_eps))
    if index_key_params is not None:
        assert latent is not None  # normed above
        wk, k_norm_weight, k_eps = index_key_params
        store = (state.pools.index_keys(layer), fields.out_loc)
        projected = latent @ wk.float().T  # [T, DI]; rounded to bf16 by the rows op
        low_ratio_rows(projected, cos, sin, "ue8m0", norm=(k_norm_weight, k_eps), store=store)
    store_rows(state.pools.compressed(layer), entries, fields.out_loc)


def select_low_ratio_entries(
    state: AttentionState,
    layer: int,
    metadata: AttentionMetadata,
    index_q_proj: torch.Tensor,
    index_weights: torch.Tensor,
) -> None:
    """Index source ``layer``'s selection into ``metadata.c{r}.page_indices``.

    ``index_q_proj`` ``[T, HI, DI]`` (``wq_b q_lora``, bf16 values; roped and rounded to fp4
    here), ``index_weights`` ``[T, HI]`` float32 (``weights_proj x`` times ``DI^-1/2 HI^-1/2``).
    """
    where = f"low-ratio indexer of layer {layer}"
    ratio, fields = _low_ratio(state, layer, metadata, where)
    config = state.config
    v41 = config.v41
    if v41 is None or layer not in v41.index_source_layers:
        raise ContractError(
            f"{where}: layer {layer} is not an index source (index_source_layers="
            f"{list(v41.index_source_layers) if v41 else []})"
        )
    cos, sin = state.rope.cos_sin(metadata.positions_causal)
    queries, _ = low_ratio_rows(index_q_proj, cos, sin, "ue8m0")
    blocks = fields.candidate_blocks
    among = publish = None
    if layer == v41.candidate_source_layer:
        assert blocks is not None  # planned for the candidate source's ratio
        publish = (blocks, v41.candidate_block_size)
    elif layer in config.candidate_consumers:
        assert blocks is not None
        among = (blocks, v41.candidate_block_size)
    keys = state.pools.index_keys(layer)
    call = low_ratio_call(
        queries, index_weights, keys, metadata.page_table, fields.topk_lengths_raw, ratio
    )
    select_entries(
        call, config.index_topk, fields.page_indices, among_blocks=among, publish=publish
    )
