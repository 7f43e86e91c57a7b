"""The lightning indexer's key cache of one c4 layer (one key of ``DI`` channels per c4 entry).

Same slot addressing and API as :class:`~dsv4_backend.cache.token_cache.TokenCache`; the fp8
format is :class:`~dsv4_backend.cache.fp8_format.Fp8IndexerLayout` (64 entries per page, e4m3
keys then one fp32 scale per key; 132 B per entry for DI = 128).
"""

from __future__ import annotations

import torch

from dsv4_backend.cache.fp8_format import INDEXER_PAGE_TOKENS, Fp8IndexerLayout
from dsv4_backend.cache.token_cache import CacheFormat, SlotCache


class IndexerKeyCache(SlotCache):
    """``num_slots`` indexer keys of ``dim`` channels (c4 slots: ``full slot // 4``)."""

    def __init__(
        self,
        num_slots: int,
        dim: int,
        fmt: CacheFormat,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        storage: torch.Tensor | None = None,
        storage_name: str = "storage",
    ) -> None:
        layout = Fp8IndexerLayout(dim, INDEXER_PAGE_TOKENS) if fmt == "fp8" else None
        super().__init__(num_slots, dim, fmt, layout, dtype, device, storage, storage_name)
        self.page_tokens = INDEXER_PAGE_TOKENS

    @classmethod
    def over(
        cls, storage: torch.Tensor, num_slots: int, dim: int, *, name: str = "storage"
    ) -> IndexerKeyCache:
        """An fp8 cache whose pages are the first bytes of ``storage`` (no allocation, not
        zeroed); ``ConfigError`` naming ``name`` when the bytes do not fit."""
        return cls(num_slots, dim, "fp8", device=storage.device, storage=storage, storage_name=name)
