"""This package's caches as views over sglang's ``DeepSeekV4TokenToKVPool`` buffers.

With the dsv4 backend, sglang never writes its pool's KV buffers on the default path (window
keys reach ``store_cache`` because the backend sets ``SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE``;
the compressors and the indexer run through the backend), so the backend's fp8 caches use those
buffers' bytes instead of allocating a second copy:

* window cache of layer ``l``: ``get_swa_raw_buffer(l)`` (``[pages, 149760]`` uint8: sglang's
  256-token SWA page, the 576 data bytes of all its tokens, then their 8 scale bytes each; our
  window pages are the same pages, so sglang's writers (``set_swa_key_buffer_radix``) and ours
  put a token's bytes in the same place);
* c4 / c128 cache: ``get_extra_key_buffer(l)`` (fp8 view of ``[pages, 37440]`` / ``[pages,
  1728]`` bytes), read as uint8;
* indexer keys: ``get_index_k_with_scale_buffer(l)`` (``[pages, 64 * 132]`` uint8; with
  ``--enable-deepseek-v4-fp4-indexer``, ``indexer_selection="fp4"``, sglang's fp4 pages
  ``[pages, 64 * 68]``: 64 keys' 64-byte payloads, then their four ue8m0 exponents each);
* DeepSeek-V4.1's kv sources: the c1 / c2 cache ``get_extra_key_buffer(l)`` (pages of 256 /
  128 entries in the V4 layout), the fp4 index keys ``get_index_k_with_scale_buffer(l)``
  (``[pages, 64 * 68]`` uint8) and a ratio-2 source's pair ring
  ``get_attention_compress_states(l)`` (request-scoped, 2 rows of ``[kv | score]``);
* compressor rings: ``get_attention_compress_states(l)`` (c4 and c128) and
  ``get_indexer_compress_states(l)`` (c4) when fp32 ``[rows, 2 * c * D]`` with our ring length
  and scope. Both address row ``slot * R + pos % R`` as our rings do: c128 request-scoped (slot
  = request pool row), c4 page-scoped (slot = ``swa_loc // 256``; sglang's ``swa_loc % R``
  equals ``pos % R`` because its allocator keeps a token's offset inside its 256-slot page).

Not aliased: a state pool of another layout (online c128, bf16 state, other ring length) and
anything of a pool whose layout this package does not serve (the reasons in
:func:`unaliasable_reason`); those are allocated as before.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import torch
from sglang.srt.mem_cache.deepseek_v4_compress_state import CompressStatePool
from sglang.srt.mem_cache.deepseek_v4_memory_pool import (
    DeepSeekV4SingleKVPool,
    DeepSeekV4TokenToKVPool,
)

from dsv4_backend.cache import AttentionState, CompressorState, DSV4CachePools, stage_layers
from dsv4_backend.cache.fp4_format import FP4_INDEX_PAGE_TOKENS
from dsv4_backend.cache.fp8_format import INDEXER_PAGE_TOKENS
from dsv4_backend.cache.state import compressed_rope, ring_slots
from dsv4_backend.cache.token_cache import CacheFormat
from dsv4_backend.config import LOW_RATIOS, DSV4AttentionConfig
from dsv4_backend.errors import ConfigError

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)
#: Attribute of the runner's ``token_to_kv_pool`` holding the shared ``AttentionState``.
_STATE_ATTR = "_dsv4_backend_attention_state"


def shared_state(
    runner: ModelRunner,
    config: DSV4AttentionConfig,
    fmt: CacheFormat,
    region_copying: Sequence[str] = (),
    layers: range | None = None,
) -> AttentionState:
    """The runner's ``AttentionState`` of ``layers`` (a pipeline stage's; None: every layer),
    built on first use and kept on its KV pool.

    Sizes (``state_sizes``): full and window slots as sglang sizes its own buffers, c4 rings
    one per window page of 256 slots, c128 rings one per ``req_to_token`` row. Slot 0 is
    sglang's padding slot and stays addressable. With an fp8 format and an sglang
    ``DeepSeekV4TokenToKVPool`` the caches are views of that pool's buffers (``pool_alias``;
    ``ConfigError`` when one is too small), otherwise allocated; one INFO line says which.
    ``region_copying`` (the ``REGION_COPYING_OPTIONS`` set): ``ConfigError`` unless every
    cache and ring is such a view, naming what sglang's regions would not carry.
    """
    pool = runner.token_to_kv_pool
    state = getattr(pool, _STATE_ATTR, None)
    layers = stage_layers(config, layers)
    if state is not None:
        if state.config != config or state.pools.layers != layers:
            raise ConfigError(
                "backends of one runner disagree on the attention configuration: "
                f"{state.config} of layers {state.pools.layers} vs {config} of {layers}"
            )
        return state
    sizes = state_sizes(runner, config)
    reason = unaliasable_reason(pool, config, fmt, layers)
    if reason is None:
        state = aliased_state(pool, config, **sizes, layers=layers)
    else:
        state = AttentionState.allocate(
            config, **sizes, fmt=fmt, device=runner.device, layers=layers
        )
    log_state_memory(state, pool, reason)
    unmovable = unmovable_reason(state, pool, reason)
    if region_copying and unmovable:
        raise ConfigError(
            f"{', '.join(region_copying)}: sglang copies its DeepSeekV4TokenToKVPool's regions "
            f"between pools (or to host memory) or writes into them, and they would not hold the "
            f"dsv4 backend's state: {unmovable}. Serve these with fp8 caches over sglang's pool "
            "(V4 layout, paged window, offline fp32 c128 state), or leave the options unset"
        )
    setattr(pool, _STATE_ATTR, state)
    return state


class StateSizes(TypedDict):
    """The sizes ``AttentionState.allocate`` and ``aliased_state`` take."""

    num_full_slots: int
    num_swa_slots: int
    num_request_slots: int
    max_positions: int


def state_sizes(runner: ModelRunner, config: DSV4AttentionConfig) -> StateSizes:
    """``AttentionState`` sizes of ``runner``, as sglang sizes its pool's buffers.

    sglang's paged allocators hand out pages ``1 ... size / 256`` (page 0 is the padding page,
    ``PagedTokenToKVPoolAllocator.clear``), so slots reach ``size + 255`` on both sides (full
    ``full_size``, window ``swa_size``; ``size`` where a pool has no split) and sglang's buffers
    hold ``size + 256`` slots (``deepseek_v4_memory_pool._num_dsv4_physical_kv_pages``). Both
    are sized that way here, rounded up to whole pages; the c4 rings follow the window slots
    (``ring_slots``).
    """
    pool = runner.token_to_kv_pool
    page = config.page_size
    full = getattr(pool, "full_size", None) or pool.size
    swa = getattr(pool, "swa_size", None) or pool.size
    return StateSizes(
        num_full_slots=math.ceil((full + page) / page) * page,
        num_swa_slots=math.ceil((swa + page) / page) * page,
        num_request_slots=runner.req_to_token_pool.req_to_token.shape[0],
        max_positions=runner.req_to_token_pool.req_to_token.shape[1],
    )


def unaliasable_reason(
    pool: object, config: DSV4AttentionConfig, fmt: CacheFormat, layers: range
) -> str | None:
    """Why this package's caches of ``layers`` (every layer, or a pipeline stage's) cannot be
    views of ``pool``'s buffers, or None when they can."""
    if fmt != "fp8":
        return f"cache format {fmt!r} (only fp8 caches alias sglang's pool)"
    if not isinstance(pool, DeepSeekV4TokenToKVPool):
        return f"token_to_kv_pool is a {type(pool).__name__}, not a DeepSeekV4TokenToKVPool"
    fp4_indexer = config.indexer_selection == "fp4"
    checks = (
        (getattr(pool.kv_layout, "value", pool.kv_layout) == "v4", "its KV layout is not V4"),
        (not pool.uniform_fp8, "it keeps the uniform fp8 layout (trtllm)"),
        (not pool._unified_kv, "it keeps the unified KV layout"),
        (pool.request_window is None, "its window lives in a per-request window"),
        (pool.swa_kv_pool is not None, "it has no paged window pool"),
        (
            _model_layers_of(pool, len(config.compress_ratios))
            == (list(config.compress_ratios), layers),
            f"its layers (ratios {list(pool.compression_ratios)}, stage "
            f"[{pool._stage_start}, {pool._stage_end})) are not the model's "
            f"{list(config.compress_ratios)} at [{layers.start}, {layers.stop})",
        ),
        (
            pool.qk_nope_head_dim + pool.qk_rope_head_dim == config.head_dim
            and pool.qk_rope_head_dim == config.rope_dim,
            f"its head dims ({pool.qk_nope_head_dim} + {pool.qk_rope_head_dim}) are not "
            f"{config.head_dim - config.rope_dim} + {config.rope_dim}",
        ),
        (
            all(type(p) is DeepSeekV4SingleKVPool for p in pool.kv_pools.values() if p),
            "a compressed pool is not a plain DeepSeekV4SingleKVPool (HiSparse?)",
        ),
        (
            all(
                p.use_fp4_indexer == fp4_indexer
                and not p.uses_aiter_fp4_layout
                and p.page_size == INDEXER_PAGE_TOKENS
                and p.index_head_dim == config.index_head_dim
                for ratio, p in pool.index_pools.items()
                if ratio == 4
            ),
            f"its c4 indexer pool is not {'fp4' if fp4_indexer else 'fp8'} in pages of "
            f"{INDEXER_PAGE_TOKENS} of the model's index head dim (indexer_selection="
            f"{config.indexer_selection!r})",
        ),
        (
            all(
                p.use_fp4_indexer
                and p.page_size == FP4_INDEX_PAGE_TOKENS
                and p.index_head_dim == config.index_head_dim
                for ratio, p in pool.index_pools.items()
                if ratio in LOW_RATIOS
            ),
            "its DeepSeek-V4.1 index-K pool is not fp4 in pages of "
            f"{FP4_INDEX_PAGE_TOKENS} of the model's index head dim",
        ),
    )
    failed = [why for ok, why in checks if not ok]
    return "sglang's pool: " + "; ".join(failed) if failed else None


def _model_layers_of(pool: DeepSeekV4TokenToKVPool, num_layers: int) -> tuple[list[int], range]:
    """The ratios of the pool's first ``num_layers`` layers (the model's) and its stage within
    them. sglang's pool keeps the checkpoint's whole ``compress_ratios``, whose entries past
    ``num_hidden_layers`` are the draft layers' slots (V4's MTP layer, DSpark's stages: their
    draft workers have pools of their own); a stage ends at ``num_hidden_layers`` at most, and
    a pool whose stage is the whole list (no layer range given) holds the model's layers too.
    """
    ratios = list(pool.compression_ratios)
    return ratios[:num_layers], range(pool._stage_start, min(pool._stage_end, num_layers))


def aliased_state(
    pool: DeepSeekV4TokenToKVPool,
    config: DSV4AttentionConfig,
    *,
    num_full_slots: int,
    num_swa_slots: int,
    num_request_slots: int,
    max_positions: int,
    layers: range,
) -> AttentionState:
    """``AttentionState`` of ``layers`` whose caches (and fitting rings) are views of
    ``pool``'s buffers (sglang's getters take the model's layer ids, also in a stage's pool).

    Call only when :func:`unaliasable_reason` is None. The views are not zeroed (every slot is
    written before it is read); aliased rings are reset. Raises ``ConfigError`` naming a buffer
    too small for its slot count.
    """
    sources = config.v41.kv_source_layers if config.v41 is not None else ()
    compressed = [
        layer for layer in layers if config.compress_ratios[layer] in (4, 128) or layer in sources
    ]
    pools = DSV4CachePools.over(
        config,
        num_full_slots=num_full_slots,
        num_swa_slots=num_swa_slots,
        windows={layer: pool.get_swa_raw_buffer(layer) for layer in layers},
        compressed={
            layer: pool.get_extra_key_buffer(layer).view(torch.uint8) for layer in compressed
        },
        indexers={
            layer: pool.get_index_k_with_scale_buffer(layer)
            for layer in compressed
            if config.compress_ratios[layer] == 4
        },
        index_keys={layer: pool.get_index_k_with_scale_buffer(layer) for layer in sources},
        name="sglang DeepSeekV4TokenToKVPool",
        layers=layers,
    )
    device = pool.get_swa_raw_buffer(layers.start).device
    slots = ring_slots(config, num_swa_slots=num_swa_slots, num_request_slots=num_request_slots)

    def rings(states: CompressStatePool, ratio: int, head_dim: int) -> CompressorState:
        state = CompressorState.allocate(config, ratio, head_dim, 0, device)  # empty: layout only
        view = _ring_view(states, state, slots[ratio])
        if view is None:
            return CompressorState.allocate(config, ratio, head_dim, slots[ratio], device)
        state = dataclasses.replace(state, ring=view)
        state.reset()
        return state

    core, index = {}, {}
    for layer in compressed:
        ratio = config.compress_ratios[layer]
        if ratio == 1:  # a c1 source pools nothing: no state
            continue
        core[layer] = rings(pool.get_attention_compress_states(layer), ratio, config.head_dim)
        if ratio == 4:
            index[layer] = rings(pool.get_indexer_compress_states(layer), 4, config.index_head_dim)
    return AttentionState(
        config=config,
        pools=pools,
        compressor_states=core,
        indexer_states=index,
        rope=compressed_rope(config, max_positions, device),
    )


def _ring_view(
    states: CompressStatePool, layout: CompressorState, num_slots: int
) -> torch.Tensor | None:
    """``[num_slots, R, 2 * c * D]`` fp32 view of sglang's state pool ``states``, or None.

    Fits when sglang addresses the rows as ``layout`` does: an offline (ring, not online
    max/sum) fp32 state with our ring length and width, of the same scope (c128
    request-scoped, so its own resets of rejected draft rows, ``clear_unaccepted_c128_draft_
    states``, hit the rows we would reset too; c4 page-scoped by window pages of our page
    size), with rows for ``num_slots`` ring slots.
    """
    buf = states.kv_score_buffer.kv_score
    rows, width = layout.ring_rows, layout.ring.shape[-1]
    scope_ok = (
        not states.request_scoped and states.swa_page_size == layout.window_page
        if layout.window_page
        else states.request_scoped
    )
    fits = (
        scope_ok
        and states.ratio == layout.ratio
        and not states.online
        and states.ring_size == rows
        and buf.dtype == torch.float32
        and buf.is_contiguous()
        and buf.shape[-1] == width
        and buf.shape[0] >= num_slots * rows
    )
    return buf[: num_slots * rows].view(num_slots, rows, width) if fits else None


def unmovable_reason(state: AttentionState, pool: object, reason: str | None) -> str | None:
    """What of ``state`` sglang's region lists (PD transfer, HiCache host pools) would not
    carry, or None when they carry all of it. ``reason``: :func:`unaliasable_reason`'s answer
    for ``pool``. The RoPE table is the same on every pool and travels with none."""
    if reason is not None:
        return f"its caches are allocated by the backend, not views of the pool ({reason})"
    owned = _owned_ranges(pool)
    rings = [
        *(f"layer {layer} compressor" for layer in state.compressor_states),
        *(f"layer {layer} indexer compressor" for layer in state.indexer_states),
    ]
    states = [*state.compressor_states.values(), *state.indexer_states.values()]
    missing = [
        name for name, ring in zip(rings, states, strict=True) if not _inside(ring.ring, owned)
    ]
    if missing:
        return (
            f"the {', '.join(missing)} state rings are the backend's own (sglang's state pool "
            "has another layout: online c128, another dtype or ring length)"
        )
    return None


def log_state_memory(state: AttentionState, pool: object, reason: str | None) -> None:
    """One INFO line: bytes aliased from sglang's pool and bytes this package allocated."""
    rings = [*state.compressor_states.values(), *state.indexer_states.values()]
    tensors = [c.storage for c in state.pools.caches()] + [r.ring for r in rings]
    tensors += [state.rope.cos, state.rope.sin]
    owned = _owned_ranges(pool) if reason is None else []
    aliased = sum(t.nbytes for t in tensors if _inside(t, owned))
    allocated = sum(t.nbytes for t in tensors) - aliased
    if reason is None:
        logger.info(
            "dsv4 backend: aliased %d bytes of sglang's DeepSeekV4TokenToKVPool (caches, %d of "
            "%d compressor rings); allocated %d bytes (the other rings, RoPE table)",
            aliased,
            sum(_inside(r.ring, owned) for r in rings),
            len(rings),
            allocated,
        )
    else:
        logger.info(
            "dsv4 backend: allocated %d bytes of caches, rings and RoPE table (%s)",
            allocated,
            reason,
        )


def _owned_ranges(pool: DeepSeekV4TokenToKVPool) -> list[tuple[int, int]]:
    """``[start, end)`` addresses of the pool's KV buffers and compress states."""
    bufs = list(pool.swa_kv_pool.kv_buffer)
    for kv_pool in pool.kv_pools.values():
        bufs += kv_pool.kv_buffer if kv_pool is not None else []
    for index_pool in pool.index_pools.values():
        bufs += index_pool.index_k_with_scale_buffer or []
    for states in (*pool.compress_state_pools, *pool.indexer_compress_state_pools):
        if states is not None:
            bufs.append(states.kv_score_buffer.kv_score)
    return [(b.data_ptr(), b.data_ptr() + b.nbytes) for b in bufs]


def _inside(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in ranges)
