"""One DeepSeek-V4 attention layer over a planned batch: caches, compressors, indexer, attention.

``forward_layer`` runs a whole layer; the steps it is made of are public too, for hosts (the
sglang model) that call them separately. DeepSeek-V4.1's low-ratio steps run before a ratio-1 /
ratio-2 layer's ``attend`` (``low_ratio.py``).
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
from dsv4_backend.compute.low_ratio import compress_low_ratio, select_low_ratio_entries

__all__ = [
    "AttentionState",
    "attend",
    "compress_and_store",
    "compress_low_ratio",
    "forward_layer",
    "layer_ratio",
    "select_c4_entries",
    "select_low_ratio_entries",
    "store_window_keys",
]
