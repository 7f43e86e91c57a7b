"""Everything the attention keeps between forwards: the caches, the compressor state rings and
the RoPE table of the compressed layers. Kernels update it in place; it holds no logic beyond
allocation and resets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_backend.cache.pools import DSV4CachePools
from dsv4_backend.cache.token_cache import CacheFormat
from dsv4_backend.config import DSV4AttentionConfig, compress_overlap
from dsv4_backend.ops.rope import RopeTable, rope_for_ratio


@dataclass(frozen=True, eq=False)
class CompressorState:
    """Compressor state rings of one layer (or of the indexer's compressor).

    Attributes
    ----------
    ratio : 4 or 128.
    head_dim : ``D`` of the compressed entries.
    ring : ``[num_slots, R, 2 * c * D]`` float32 rows ``[kv | score + ape]``, indexed by a
        request's pool index (``req_pool_indices``) and ``position % R``.
    """

    ratio: int
    head_dim: int
    ring: torch.Tensor

    @classmethod
    def allocate(
        cls,
        config: DSV4AttentionConfig,
        ratio: int,
        head_dim: int,
        num_slots: int,
        device: torch.device | str = "cpu",
    ) -> CompressorState:
        """Reset rings for ``num_slots`` request slots; ``R = config.ring_rows(ratio)``."""
        width = 2 * compress_overlap(ratio) * head_dim
        ring = torch.empty(num_slots, config.ring_rows(ratio), width, device=device)
        state = cls(ratio=ratio, head_dim=head_dim, ring=ring)
        state.reset()
        return state

    @property
    def ring_rows(self) -> int:
        return self.ring.shape[1]

    def reset(self, pool_indices: torch.Tensor | None = None) -> None:
        """kv 0 and score -inf in the rings of ``pool_indices`` ``[n]`` (all when None)."""
        slots = slice(None) if pool_indices is None else pool_indices.long()
        half = self.ring.shape[-1] // 2
        self.ring[slots, :, :half] = 0.0
        self.ring[slots, :, half:] = float("-inf")


@dataclass(frozen=True, eq=False)
class AttentionState:
    """Everything a model's attention keeps between forwards.

    Attributes
    ----------
    pools : per-layer window, compressed and indexer caches.
    compressor_states : compressor state rings of each compressed layer.
    indexer_states : the indexer compressor's rings of each ratio-4 layer.
    rope : cos/sin of the compressed layers' RoPE (compressed entries, indexer queries) for
        every position a request can reach.
    """

    config: DSV4AttentionConfig
    pools: DSV4CachePools
    compressor_states: dict[int, CompressorState]
    indexer_states: dict[int, CompressorState]
    rope: RopeTable

    @classmethod
    def allocate(
        cls,
        config: DSV4AttentionConfig,
        *,
        num_full_slots: int,
        num_swa_slots: int,
        num_request_slots: int,
        max_positions: int | None = None,
        fmt: CacheFormat = "dense",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> AttentionState:
        """Zeroed caches and reset rings for ``num_request_slots`` request pool rows.

        ``max_positions``: the longest request (the RoPE table's rows); default
        ``num_full_slots``, which no request can outgrow.
        """
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
        return cls(
            config=config,
            pools=pools,
            compressor_states=core,
            indexer_states=index,
            rope=compressed_rope(config, max_positions or num_full_slots, device),
        )

    def reset_requests(self, pool_indices: torch.Tensor) -> None:
        """Reset the rings of requests that (re)start at position 0 in these pool rows."""
        for state in (*self.compressor_states.values(), *self.indexer_states.values()):
            state.reset(pool_indices)


def compressed_rope(
    config: DSV4AttentionConfig, max_positions: int, device: torch.device | str
) -> RopeTable:
    """The RoPE table of the compressed layers (ratios 4 and 128 share one RoPE)."""
    return RopeTable(rope_for_ratio(config, 4), max_positions, device)
