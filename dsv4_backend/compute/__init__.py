"""One DeepSeek-V4 attention layer over a planned batch: caches, compressors, indexer, attention."""

from dsv4_backend.compute.layer import AttentionState, forward_layer

__all__ = ["AttentionState", "forward_layer"]
