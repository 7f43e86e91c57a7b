"""The cache store's torch path: :func:`store_rows_torch`."""

from __future__ import annotations

import torch

from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache
from dsv4_backend.cache.token_cache import SlotCache


def store_rows_torch(cache: SlotCache, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Torch implementation of the store (same bytes as the kernels); fp4 index keys are
    quantised by their cache's rounding (``Fp4IndexKeyCache.store``)."""
    keep = slots >= 0
    rows, slots = rows[keep], slots[keep]
    if isinstance(cache, Fp4IndexKeyCache):
        cache.store(rows, slots)
    elif cache.layout is None:
        cache.storage[slots] = rows.to(cache.storage.dtype)
    else:
        cache.layout.write_tokens(cache.storage, slots, *cache.layout.pack_tokens(rows))
