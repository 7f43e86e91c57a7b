"""The attention's persistent data: paged DeepSeek-V4 caches (window, c4, c128, indexer keys),
per-layer pools, the compressor state rings and the RoPE table (:class:`AttentionState`).

Byte layouts: :mod:`.fp8_format`; the kernels that write and read them are in
:mod:`dsv4_backend.kernels`.
"""

from dsv4_backend.cache.fp8_format import Fp8IndexerLayout, Fp8TokenLayout
from dsv4_backend.cache.indexer_cache import IndexerKeyCache
from dsv4_backend.cache.pools import DSV4CachePools, stage_layers
from dsv4_backend.cache.state import AttentionState, CompressorState
from dsv4_backend.cache.token_cache import CacheFormat, SlotCache, TokenCache

__all__ = [
    "AttentionState",
    "CacheFormat",
    "CompressorState",
    "DSV4CachePools",
    "Fp8IndexerLayout",
    "Fp8TokenLayout",
    "IndexerKeyCache",
    "SlotCache",
    "TokenCache",
    "stage_layers",
]
