"""One DeepSeek-V4 attention layer over a planned batch: caches, compressors, indexer, attention.

``forward_layer`` runs a whole layer; the steps it is made of are public too, for hosts (the
sglang model) that call them separately.
"""

from dsv4_backend.cache.state import AttentionState
from dsv4_backend.compute.layer import (
    attend,
    compress_and_store,
    forward_layer,
    layer_ratio,
    select_c4_entries,
    store_window_keys,
)

__all__ = [
    "AttentionState",
    "attend",
    "compress_and_store",
    "forward_layer",
    "layer_ratio",
    "select_c4_entries",
    "store_window_keys",
]
