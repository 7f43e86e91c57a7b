"""Paged DeepSeek-V4 caches: token caches (window, c4, c128), indexer keys, per-layer pools.

Formats: ``.notes/cache-format.md``; byte layouts and Triton loaders: :mod:`.fp8_format`.
"""

from dsv4_backend.cache.fp8_format import Fp8IndexerLayout, Fp8TokenLayout
from dsv4_backend.cache.indexer_cache import IndexerKeyCache
from dsv4_backend.cache.pools import DSV4CachePools
from dsv4_backend.cache.token_cache import CacheFormat, SlotCache, TokenCache

__all__ = [
    "CacheFormat",
    "DSV4CachePools",
    "Fp8IndexerLayout",
    "Fp8TokenLayout",
    "IndexerKeyCache",
    "SlotCache",
    "TokenCache",
]
