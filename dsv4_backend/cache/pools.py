"""Per-layer caches of a DeepSeek-V4 model, sized like sglang's ``DeepSeekV4TokenToKVPool``.

==========  ===============================  ============  =========================
cache       layers                           page tokens   slots
==========  ===============================  ============  =========================
window      every layer                      256           ``num_swa_slots``
c4          ratio-4 layers                   64            ``num_full_slots // 4``
indexer     ratio-4 layers                   64            ``num_full_slots // 4``
c128        ratio-128 layers                 2             ``num_full_slots // 128``
c1 / c2     DeepSeek-V4.1's kv sources       256 / 128     ``num_full_slots // r``
index keys  DeepSeek-V4.1's kv sources       64            ``num_full_slots // r``
==========  ===============================  ============  =========================

DeepSeek-V4.1's ratio-1 / ratio-2 layers read the compressed cache and index keys of their
kv source (``config.kv_source_of``); the fp4 index keys are ``fp4_format.Fp4IndexKeyCache``,
and so are the c4 indexer caches under ``indexer_selection="fp4"`` (sglang's
``--enable-deepseek-v4-fp4-indexer`` pool: 68 B an entry for ``DI = 128``, not 132).

Compressed caches reuse the full page table (256 tokens per page), so ``num_full_slots`` must be
a multiple of 256. Window pages are sglang's SWA pages (``WINDOW_PAGE_TOKENS``, 256 tokens:
149,760 bytes in the Flash fp8 layout). ``build`` allocates; ``over`` builds fp8 caches over given
per-layer storages (e.g. a host's KV pool buffers). Compressor state rings live in
``kernels/compressor/``.

A pipeline-parallel stage holds the caches of its own layers only (``layers``, a range of the
model's layer ids, as sglang's stage pool holds ``[start_layer, end_layer)``); every accessor
takes the model's (global) layer id and refuses one outside the stage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

from dsv4_backend.cache.fp4_format import C4_ROUNDING, Fp4IndexKeyCache
from dsv4_backend.cache.indexer_cache import IndexerKeyCache
from dsv4_backend.cache.token_cache import CacheFormat, TokenCache
from dsv4_backend.config import (
    LOW_RATIOS,
    WINDOW_PAGE_TOKENS,
    DSV4AttentionConfig,
    entries_per_page,
)
from dsv4_backend.errors import ConfigError, ContractError

_Cache = TypeVar("_Cache")


def stage_layers(config: DSV4AttentionConfig, layers: range | None) -> range:
    """``layers`` (a pipeline stage's), checked to be a non-empty step-1 range of the model's
    layer ids; None: every layer."""
    every = range(len(config.compress_ratios))
    if layers is None:
        return every
    if not (
        layers.step == 1 and 0 <= layers.start < layers.stop <= every.stop
    ):  # a stage is a contiguous, non-empty slice
        raise ConfigError(
            f"layers={layers}; expected a non-empty range(start, stop) within the model's "
            f"{every.stop} layers (a pipeline stage's [start_layer, end_layer))"
        )
    return layers


class _CacheMakers(NamedTuple):
    """How :class:`DSV4CachePools` makes a layer's caches (allocated by ``build``, views of
    given storage by ``over``): ``token_cache(kind, layer, num_slots, page_tokens)`` (kind
    ``window`` / ``compressed``), ``indexer_cache(layer, num_slots)`` and
    ``index_key_cache(layer, num_slots)``."""

    token_cache: Callable[[str, int, int, int], TokenCache]
    indexer_cache: Callable[[int, int], IndexerKeyCache | Fp4IndexKeyCache]
    index_key_cache: Callable[[int, int], Fp4IndexKeyCache]


@dataclass(frozen=True)
class DSV4CachePools:
    """Window caches of every layer of ``layers``; compressed and indexer caches of its
    compressed / ratio-4 layers (DeepSeek-V4.1: compressed caches and index keys of its kv
    sources); all keyed by the model's layer id."""

    config: DSV4AttentionConfig
    layers: range
    windows: dict[int, TokenCache]
    compressed_caches: dict[int, TokenCache]
    indexer_caches: dict[int, IndexerKeyCache | Fp4IndexKeyCache]
    index_key_caches: dict[int, Fp4IndexKeyCache]

    @classmethod
    def build(
        cls,
        config: DSV4AttentionConfig,
        *,
        num_full_slots: int,
        num_swa_slots: int,
        fmt: CacheFormat,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layers: range | None = None,
    ) -> DSV4CachePools:
        """Allocate the caches (zero filled) of ``layers`` (default: every layer) in format
        ``fmt`` (``dense`` or ``fp8``)."""

        def token_cache(kind: str, layer: int, num_slots: int, page_tokens: int) -> TokenCache:
            return TokenCache(
                num_slots, config.head_dim, config.rope_dim, page_tokens, fmt, dtype, device
            )

        def indexer_cache(layer: int, num_slots: int) -> IndexerKeyCache | Fp4IndexKeyCache:
            if config.indexer_selection == "fp4":
                return Fp4IndexKeyCache(
                    num_slots, config.index_head_dim, fmt, device, rounding=C4_ROUNDING
                )
            return IndexerKeyCache(num_slots, config.index_head_dim, fmt, dtype, device)

        def index_key_cache(layer: int, num_slots: int) -> Fp4IndexKeyCache:
            return Fp4IndexKeyCache(num_slots, config.index_head_dim, fmt, device)

        makers = _CacheMakers(token_cache, indexer_cache, index_key_cache)
        return cls._assemble(config, num_full_slots, num_swa_slots, makers, layers)

    @classmethod
    def over(
        cls,
        config: DSV4AttentionConfig,
        *,
        num_full_slots: int,
        num_swa_slots: int,
        windows: Mapping[int, torch.Tensor],
        compressed: Mapping[int, torch.Tensor],
        indexers: Mapping[int, torch.Tensor],
        index_keys: Mapping[int, torch.Tensor] | None = None,
        name: str = "storage",
        layers: range | None = None,
    ) -> DSV4CachePools:
        """fp8 caches built over given per-layer uint8 storages (views, nothing allocated).

        For each layer of ``layers`` (default: every layer): ``windows[layer]``,
        ``compressed[layer]`` for ratio-4 / 128 layers and DeepSeek-V4.1's kv sources,
        ``indexers[layer]`` for ratio-4 layers, ``index_keys[layer]`` for kv sources; each
        contiguous and at least as large as the layout of its slot count (slot counts as
        in :meth:`build`). ``ConfigError`` names the missing or too small storage
        (``f"{name} window[3]"`` etc.) and both byte counts.
        """

        def given(kind: str, storages: Mapping[int, torch.Tensor], layer: int) -> torch.Tensor:
            if layer not in storages:
                raise ConfigError(f"{name}: no {kind} storage for layer {layer}")
            return storages[layer]

        def token_cache(kind: str, layer: int, num_slots: int, page_tokens: int) -> TokenCache:
            storages = windows if kind == "window" else compressed
            return TokenCache.over(
                given(kind, storages, layer),
                num_slots,
                config.head_dim,
                config.rope_dim,
                page_tokens,
                name=f"{name} {kind}[{layer}]",
            )

        def indexer_cache(layer: int, num_slots: int) -> IndexerKeyCache | Fp4IndexKeyCache:
            storage, where = given("indexer", indexers, layer), f"{name} indexer[{layer}]"
            if config.indexer_selection == "fp4":
                return Fp4IndexKeyCache.over(
                    storage, num_slots, config.index_head_dim, rounding=C4_ROUNDING, name=where
                )
            return IndexerKeyCache.over(storage, num_slots, config.index_head_dim, name=where)

        def index_key_cache(layer: int, num_slots: int) -> Fp4IndexKeyCache:
            return Fp4IndexKeyCache.over(
                given("index key", index_keys or {}, layer),
                num_slots,
                config.index_head_dim,
                name=f"{name} index_keys[{layer}]",
            )

        makers = _CacheMakers(token_cache, indexer_cache, index_key_cache)
        return cls._assemble(config, num_full_slots, num_swa_slots, makers, layers)

    @classmethod
    def _assemble(
        cls,
        config: DSV4AttentionConfig,
        num_full_slots: int,
        num_swa_slots: int,
        makers: _CacheMakers,
        layers: range | None,
    ) -> DSV4CachePools:
        """Check the slot counts and make the caches of ``layers`` with ``makers``."""
        token_cache, indexer_cache, index_key_cache = makers
        if num_full_slots <= 0 or num_full_slots % config.page_size:
            raise ConfigError(
                f"num_full_slots={num_full_slots}; expected a positive multiple of the page size "
                f"{config.page_size} (compressed caches reuse the full page table)"
            )
        if num_swa_slots <= 0:
            raise ConfigError(f"num_swa_slots={num_swa_slots}; expected a positive integer")
        stage = stage_layers(config, layers)
        windows = {
            layer: token_cache("window", layer, num_swa_slots, WINDOW_PAGE_TOKENS)
            for layer in stage
        }
        compressed, indexers, index_keys = {}, {}, {}
        sources = config.v41.kv_source_layers if config.v41 is not None else ()
        for layer in stage:
            ratio = config.compress_ratios[layer]
            if not ratio or (ratio in LOW_RATIOS and layer not in sources):
                continue  # window only, or a layer reading its kv source's caches
            compressed[layer] = token_cache(
                "compressed", layer, num_full_slots // ratio, entries_per_page(ratio)
            )
            if ratio == 4:
                indexers[layer] = indexer_cache(layer, num_full_slots // ratio)
            if ratio in LOW_RATIOS:
                index_keys[layer] = index_key_cache(layer, num_full_slots // ratio)
        return cls(
            config=config,
            layers=stage,
            windows=windows,
            compressed_caches=compressed,
            indexer_caches=indexers,
            index_key_caches=index_keys,
        )

    def window(self, layer: int) -> TokenCache:
        """The window (SWA) cache of ``layer``, indexed by window slots."""
        self._check_layer(layer)
        return self.windows[layer]

    def compressed(self, layer: int) -> TokenCache:
        """The c4 or c128 cache of a compressed ``layer`` (ratio 4 or 128); the c1 / c2 cache
        of a DeepSeek-V4.1 low-ratio layer's kv source."""
        return self._held(self.compressed_caches, layer, "no compressed cache; compressed layers")

    def indexer(self, layer: int) -> IndexerKeyCache | Fp4IndexKeyCache:
        """The indexer key cache of a ratio-4 ``layer`` (fp4 under ``indexer_selection="fp4"``)."""
        return self._held(self.indexer_caches, layer, "no indexer cache; ratio-4 layers")

    def index_keys(self, layer: int) -> Fp4IndexKeyCache:
        """The fp4 index keys a DeepSeek-V4.1 low-ratio ``layer`` scores: its kv source's."""
        return self._held(self.index_key_caches, layer, "no index keys; V4.1's kv sources")

    def _held(self, caches: Mapping[int, _Cache], layer: int, missing: str) -> _Cache:
        """The cache of ``layer`` in ``caches`` (a DeepSeek-V4.1 layer's: its kv source's);
        ``ContractError`` saying it has ``missing`` (and which layers have one) otherwise."""
        self._check_layer(layer)
        owner = self._owner(layer)
        if owner not in caches:
            raise ContractError(
                f"layer {layer} has compress ratio {self.config.compress_ratios[layer]} and "
                f"{missing} are {sorted(caches)}"
            )
        return caches[owner]

    def _owner(self, layer: int) -> int:
        """The layer whose compressed caches ``layer`` reads: its kv source for a V4.1
        low-ratio layer, else itself. A kv source outside this stage is a ``ContractError``."""
        if self.config.compress_ratios[layer] not in LOW_RATIOS:
            return layer
        owner = self.config.kv_source_of(layer)
        if owner not in self.layers:
            raise ContractError(
                f"layer {layer} reads the caches of kv source {owner}, which is outside this "
                f"stage's layers [{self.layers.start}, {self.layers.stop})"
            )
        return owner

    def caches(self) -> list[TokenCache | IndexerKeyCache | Fp4IndexKeyCache]:
        """Every cache: the windows, then the compressed caches, then the indexer caches, then
        DeepSeek-V4.1's index keys."""
        return [
            *self.windows.values(),
            *self.compressed_caches.values(),
            *self.indexer_caches.values(),
            *self.index_key_caches.values(),
        ]

    @property
    def nbytes(self) -> int:
        """Bytes of all storage tensors together."""
        return sum(c.nbytes for c in self.caches())

    def _check_layer(self, layer: int) -> None:
        if layer not in self.layers:
            raise ContractError(
                f"layer={layer}; these caches hold layers [{self.layers.start}, "
                f"{self.layers.stop}) (every layer of the model, or a pipeline stage's)"
            )
