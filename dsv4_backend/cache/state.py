"""Everything the attention keeps between forwards: the caches, the compressor state rings and
the RoPE table of the compressed layers. Kernels update it in place; it holds no logic beyond
allocation and resets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dsv4_backend.cache.pools import DSV4CachePools
from dsv4_backend.cache.token_cache import CacheFormat
from dsv4_backend.config import DSV4AttentionConfig, compress_overlap
from dsv4_backend.errors import ConfigError, ContractError
from dsv4_backend.ops.rope import RopeTable, rope_for_ratio


class ArrivalCounters:
    """Zeroed int32 counters, one per plan record, for kernels whose programs meet at a record
    in one launch (the compressor's channel splits, ``kernels/compressor/fused.py``): each program
    adds 1 to its record's counter and the last to arrive sets it back to 0, so the counters
    are all zero between launches, graph replays included.

    Buffers grow to the next power of two and are never freed: a CUDA graph keeps the buffer
    it captured, and a later, larger forward must not free it under the graph.
    """

    def __init__(self, device: torch.device) -> None:
        self._buffers = [torch.zeros(0, dtype=torch.int32, device=device)]

    def at_least(self, records: int) -> torch.Tensor:
        """``[>= records]`` int32 zero counters (allocated here, outside a CUDA-graph capture)."""
        counters = self._buffers[-1]
        if counters.numel() >= records:
            return counters
        if counters.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ContractError(
                f"compressor arrival counters: {records} records in a CUDA-graph capture, but "
                f"only {counters.numel()} counters were allocated; run the same batch once "
                "before capturing it (warm-up)"
            )
        size = 1 << max(records - 1, 0).bit_length()
        self._buffers.append(torch.zeros(size, dtype=torch.int32, device=counters.device))
        return self._buffers[-1]


@dataclass(frozen=True, eq=False)
class CompressorState:
    """Compressor state rings of one layer (or of the indexer's compressor).

    Attributes
    ----------
    ratio : 4 or 128; 2 for a DeepSeek-V4.1 ratio-2 kv source's pair ring.
    head_dim : ``D`` of the compressed entries.
    ring : ``[num_slots, R, 2 * c * D]`` float32 rows ``[kv | score + ape]`` (the pair ring:
        ``[kv | score]``), indexed by ring slot and ``position % R``. Slots, like sglang's
        ``CompressStatePool``: c128 and c2, a request's pool index (``req_pool_indices``); c4,
        a window page (``window_slot // window_page``).
    window_page : window slots per ring slot of a page-scoped (c4) state (the KV page size,
        256); 0 for a request-scoped (c128) state.
    arrivals : the kernels' per-record arrival counters (:class:`ArrivalCounters`).
    """

    ratio: int
    head_dim: int
    ring: torch.Tensor
    window_page: int = 0
    arrivals: ArrivalCounters = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.ratio == 4) != (self.window_page > 0):
            raise ConfigError(
                f"compressor state of ratio {self.ratio} with window_page={self.window_page}; "
                "c4 state is page-scoped (window_page > 0), c128 state request-scoped (0)"
            )
        object.__setattr__(self, "arrivals", ArrivalCounters(self.ring.device))

    @classmethod
    def allocate(
        cls,
        config: DSV4AttentionConfig,
        ratio: int,
        head_dim: int,
        num_slots: int,
        device: torch.device | str = "cpu",
    ) -> CompressorState:
        """Reset rings for ``num_slots`` ring slots (c4: window pages of ``config.page_size``
        slots; c128 and c2: request pool rows); ``R = config.ring_rows(ratio)``."""
        width = 2 * (1 if ratio == 2 else compress_overlap(ratio)) * head_dim
        ring = torch.empty(num_slots, config.ring_rows(ratio), width, device=device)
        window_page = config.page_size if ratio == 4 else 0
        state = cls(ratio=ratio, head_dim=head_dim, ring=ring, window_page=window_page)
        state.reset()
        return state

    @property
    def ring_rows(self) -> int:
        return self.ring.shape[1]

    def reset(self) -> None:
        """kv 0 and score -inf in every ring (no forward reads a row it did not write: the
        pooling reads ring rows only for positions before a request's first new row, which an
        earlier forward of the request, or of the one that cached its prefix, wrote)."""
        half = self.ring.shape[-1] // 2
        self.ring[..., :half] = 0.0
        self.ring[..., half:] = float("-inf")


@dataclass(frozen=True, eq=False)
class AttentionState:
    """Everything a model's attention keeps between forwards.

    Attributes
    ----------
    pools : per-layer window, compressed and indexer caches of ``pools.layers`` (every layer,
        or a pipeline stage's).
    compressor_states : compressor state rings of each compressed layer (DeepSeek-V4.1: the
        pair rings of its ratio-2 kv sources).
    indexer_states : the indexer compressor's rings of each ratio-4 layer.
    rope : cos/sin of the compressed layers' RoPE (compressed entries, indexer queries) for
        every position a request can reach.

    Everything but the c128 rings is addressed by cache slot (full page, window slot or window
    page), never by request: a request that starts from another request's cached, page-aligned
    prefix (a radix-cache hit) finds the prefix's keys, entries and c4 state where that request
    left them. A c128 entry never spans a page boundary, so nothing of the c128 ring is pending
    at such a prefix; the rings are request-scoped like sglang's.
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
        layers: range | None = None,
    ) -> AttentionState:
        """Zeroed caches and reset rings of ``layers`` (default: every layer): c4 rings for
        every window page of ``num_swa_slots``, c128 rings for ``num_request_slots`` request
        pool rows.

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
            layers=layers,
        )
        slots = ring_slots(config, num_swa_slots=num_swa_slots, num_request_slots=num_request_slots)
        core, index = {}, {}
        for layer in pools.layers:
            ratio = config.compress_ratios[layer]
            if ratio in (4, 128) or (ratio == 2 and layer in pools.compressed_caches):
                core[layer] = CompressorState.allocate(
                    config, ratio, config.head_dim, slots[ratio], device
                )
            if ratio == 4:
                index[layer] = CompressorState.allocate(
                    config, 4, config.index_head_dim, slots[4], device
                )
        return cls(
            config=config,
            pools=pools,
            compressor_states=core,
            indexer_states=index,
            rope=compressed_rope(config, max_positions or num_full_slots, device),
        )

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """``name -> tensor`` of every cache storage and compressor ring (``window3``,
        ``c1``, ``indexer1``, ``index_keys2``, ``ring1``, ``indexer_ring1``: the model's layer
        ids)."""
        pools = self.pools
        out = {f"window{i}": c.storage for i, c in pools.windows.items()}
        out |= {f"c{i}": c.storage for i, c in pools.compressed_caches.items()}
        out |= {f"indexer{i}": c.storage for i, c in pools.indexer_caches.items()}
        out |= {f"index_keys{i}": c.storage for i, c in pools.index_key_caches.items()}
        out |= {f"ring{i}": s.ring for i, s in self.compressor_states.items()}
        out |= {f"indexer_ring{i}": s.ring for i, s in self.indexer_states.items()}
        return out

    def reserve_rows(self, max_rows: int) -> None:
        """Allocate what a forward of up to ``max_rows`` rows needs beyond the caches (the
        compressors' arrival counters), so that no CUDA-graph capture allocates it."""
        for state in (*self.compressor_states.values(), *self.indexer_states.values()):
            state.arrivals.at_least(max_rows)


def ring_slots(
    config: DSV4AttentionConfig, *, num_swa_slots: int, num_request_slots: int
) -> dict[int, int]:
    """Ring slots of each ratio's compressor states: c4 rings are page-scoped (one per window
    page of ``config.page_size`` slots), c128 and c2 rings request-scoped (one per pool row)."""
    return {
        4: math.ceil(num_swa_slots / config.page_size),
        128: num_request_slots,
        2: num_request_slots,
    }


def compressed_rope(
    config: DSV4AttentionConfig, max_positions: int, device: torch.device | str
) -> RopeTable:
    """The RoPE table of the compressed layers (ratios 4 and 128 share one RoPE)."""
    return RopeTable(rope_for_ratio(config, 4), max_positions, device)
