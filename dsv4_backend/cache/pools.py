"""Per-layer caches of a DeepSeek-V4 model, sized like sglang's ``DeepSeekV4TokenToKVPool``.

==========  ===============================  ============  =========================
cache       layers                           page tokens   slots
==========  ===============================  ============  =========================
window      every layer                      128           ``num_swa_slots``
c4          ratio-4 layers                   64            ``num_full_slots // 4``
indexer     ratio-4 layers                   64            ``num_full_slots // 4``
c128        ratio-128 layers                 2             ``num_full_slots // 128``
==========  ===============================  ============  =========================

Compressed caches reuse the full page table (256 tokens per page), so ``num_full_slots`` must be
a multiple of 256. Compressor state rings live in ``kernels/compressor.py``, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_backend.cache.indexer_cache import IndexerKeyCache
from dsv4_backend.cache.token_cache import CacheFormat, TokenCache
from dsv4_backend.config import SWA_PAGE_SIZE, DSV4AttentionConfig
from dsv4_backend.errors import ConfigError, ContractError


@dataclass(frozen=True)
class DSV4CachePools:
    """Window caches for every layer; compressed and indexer caches keyed by layer id."""

    config: DSV4AttentionConfig
    windows: tuple[TokenCache, ...]
    compressed_caches: dict[int, TokenCache]
    indexer_caches: dict[int, IndexerKeyCache]

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
    ) -> DSV4CachePools:
        """Allocate every layer's caches (zero filled) in format ``fmt`` (``dense`` or ``fp8``)."""
        if num_full_slots <= 0 or num_full_slots % config.page_size:
            raise ConfigError(
                f"num_full_slots={num_full_slots}; expected a positive multiple of the page size "
                f"{config.page_size} (compressed caches reuse the full page table)"
            )
        if num_swa_slots <= 0:
            raise ConfigError(f"num_swa_slots={num_swa_slots}; expected a positive integer")

        def token_cache(num_slots: int, page_tokens: int) -> TokenCache:
            return TokenCache(
                num_slots, config.head_dim, config.rope_dim, page_tokens, fmt, dtype, device
            )

        windows = tuple(token_cache(num_swa_slots, SWA_PAGE_SIZE) for _ in config.compress_ratios)
        compressed, indexers = {}, {}
        for layer, ratio in enumerate(config.compress_ratios):
            if not ratio:
                continue
            compressed[layer] = token_cache(num_full_slots // ratio, config.entries_per_page(ratio))
            if ratio == 4:
                indexers[layer] = IndexerKeyCache(
                    num_full_slots // ratio, config.index_head_dim, fmt, dtype, device
                )
        return cls(
            config=config, windows=windows, compressed_caches=compressed, indexer_caches=indexers
        )

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    def window(self, layer: int) -> TokenCache:
        """The window (SWA) cache of ``layer``, indexed by window slots."""
        self._check_layer(layer)
        return self.windows[layer]

    def compressed(self, layer: int) -> TokenCache:
        """The c4 or c128 cache of a compressed ``layer`` (ratio 4 or 128)."""
        self._check_layer(layer)
        if layer not in self.compressed_caches:
            raise ContractError(
                f"layer {layer} has compress ratio 0 (window only) and no compressed cache; "
                f"compressed layers are {sorted(self.compressed_caches)}"
            )
        return self.compressed_caches[layer]

    def indexer(self, layer: int) -> IndexerKeyCache:
        """The indexer key cache of a ratio-4 ``layer``."""
        self._check_layer(layer)
        if layer not in self.indexer_caches:
            raise ContractError(
                f"layer {layer} has compress ratio {self.config.compress_ratios[layer]} and no "
                f"indexer cache; ratio-4 layers are {sorted(self.indexer_caches)}"
            )
        return self.indexer_caches[layer]

    @property
    def nbytes(self) -> int:
        """Bytes of all storage tensors together."""
        caches = [*self.windows, *self.compressed_caches.values(), *self.indexer_caches.values()]
        return sum(c.nbytes for c in caches)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ContractError(f"layer={layer}; expected 0 <= layer < {self.num_layers}")
