"""The cache store's variants (:data:`CACHE_STORE`, ``kernels/variants.py``) and its entry point
:func:`store_rows`, which checks the rows and slots, then runs the Triton kernels
(``triton.py``) or the torch implementation (``torch.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4_backend.cache.token_cache import SlotCache
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.cache_store.torch import store_rows_torch
from dsv4_backend.kernels.cache_store.triton import launch_store
from dsv4_backend.kernels.variants import TRITON_PATHS, OpTable, Variant, resolve

#: The variants: each entry writes ``rows`` into a cache at ``slots`` (:func:`store_rows`).
CACHE_STORE: OpTable[Callable[[SlotCache, torch.Tensor, torch.Tensor], None]] = OpTable(
    "cache_store",
    "rows written into a dense, fp8 token, fp8 indexer or fp4 index-key cache at their slots",
    (
        Variant(
            "triton", launch_store, (TRITON_PATHS,), "every cache format; one launch", baseline=True
        ),
        Variant("torch", store_rows_torch, (), "every cache format", baseline=True),
    ),
)


def store_rows(cache: SlotCache, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``rows`` into ``cache`` at ``slots``, skipping slot -1.

    Parameters
    ----------
    cache : TokenCache, IndexerKeyCache or Fp4IndexKeyCache (rows quantised by its rounding)
    rows : ``[N, cache.dim]`` float (fp32, bf16 or fp16), on the cache's device.
    slots : ``[N]`` integer slot ids in ``[0, num_slots)`` or -1 (skip). With duplicate slots,
        which row ends up stored is unspecified.
    """
    cache.check_slots(slots)
    slots = slots.long()
    if (
        not isinstance(rows, torch.Tensor)
        or rows.dim() != 2
        or rows.shape[1] != cache.dim
        or not rows.is_floating_point()
    ):
        got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, torch.Tensor) else rows
        raise BatchError(f"rows is {got}; expected a float tensor [N, {cache.dim}]")
    if slots.shape != (rows.shape[0],):
        raise BatchError(
            f"slots has shape {tuple(slots.shape)}; expected ({rows.shape[0]},), one per row"
        )
    if rows.device != cache.device:
        raise BatchError(f"rows is on {rows.device}; the cache is on {cache.device}")
    if rows.shape[0] == 0:
        return
    resolve(CACHE_STORE, cache.device).variant.entry(cache, rows, slots)
