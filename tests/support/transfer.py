"""A PD transfer driver: moves one request between two ``DeepSeekV4TokenToKVPool``s the way
sglang's transfer backends (mooncake, nixl) do, from the regions the pool lists itself.

sglang registers three region lists of a DeepSeek-V4 pool (``disaggregation.utils``), each a
``(data_ptrs, data_lens, item_lens)`` triple, one entry per buffer:

==================  ===============================  ===========================================
state type          region list                      item, and the request's indices
==================  ===============================  ===========================================
KV (pages)          ``get_contiguous_buf_infos``     one full page of the c4 / c128 caches and the
                                                     indexer keys; the request's full pages of
                                                     tokens ``[0, seq_len)``
``SWA``             ``get_state_buf_infos``          one SWA page of the window cache, and the c4
                                                     (attention, indexer) state rows of that page;
                                                     the SWA pages of tokens ``[window_start,
                                                     seq_len)``, ``window_start`` the page floor
                                                     of ``seq_len - sliding_window``
``DSV4_REQUEST_``   ``get_request_state_buf_infos``  one c128 ring page (128 rows); the page that
``STATE``                                            holds the pending block
                                                     (``request_state_transfer_indices``)
==================  ===============================  ===========================================

The prefill side computes its indices from its own request row, the decode side from its own;
the engine pairs them positionally, merges runs contiguous on both sides
(``group_concurrent_contiguous``) and, for every buffer of the list, copies ``item_len`` bytes
per index from ``src_ptr + src_index * item_len`` to ``dst_ptr + dst_index * item_len``. Here the
copy is a ``memmove`` between the two pools' host buffers (the CPU twin of the RDMA write),
bounds-checked against ``data_lens``. Before the copy the decode side resets the request's
c128 state (``clear_request_scoped_state``), as sglang's decode does.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous
from sglang.srt.mem_cache.common import kv_to_page_indices
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

from dsv4_backend.errors import ContractError

#: The region lists in sglang's registration order.
REGION_KINDS = ("kv", "swa", "request_state")


@dataclass(frozen=True)
class Regions:
    """One of a pool's region lists: per buffer its address, bytes and item bytes."""

    ptrs: Sequence[int]
    lens: Sequence[int]
    item_lens: Sequence[int]


@dataclass(frozen=True)
class RequestSide:
    """One side of a transfer: a pool, the full -> SWA slot map of its allocator, and the
    request's ``req_to_token`` row and pool row index."""

    pool: DeepSeekV4TokenToKVPool
    full_to_swa: torch.Tensor
    req_to_token_row: torch.Tensor
    req_pool_idx: int


def pool_regions(pool: DeepSeekV4TokenToKVPool) -> dict[str, Regions]:
    """The three region lists sglang registers for ``pool`` (``REGION_KINDS``)."""
    return {
        "kv": Regions(*pool.get_contiguous_buf_infos()),
        "swa": Regions(*pool.get_state_buf_infos()),
        "request_state": Regions(*pool.get_request_state_buf_infos()),
    }


def request_indices(side: RequestSide, seq_len: int, sliding_window: int) -> dict[str, np.ndarray]:
    """Item indices of the request's ``seq_len`` tokens in each region list, as sglang's
    prefill and decode compute them (their ``_full_kv_pages_payload``, ``_swa_payload`` and
    ``_request_state_payload``)."""
    page = side.pool.page_size
    tokens = side.req_to_token_row[:seq_len].long()
    window_start = max(0, seq_len - sliding_window) // page * page
    swa_slots = side.full_to_swa[side.req_to_token_row[window_start:seq_len].long()]
    return {
        "kv": kv_to_page_indices(tokens, page),
        "swa": kv_to_page_indices(swa_slots, side.pool.swa_page_size),
        "request_state": side.pool.request_state_transfer_indices(side.req_pool_idx, seq_len),
    }


def copy_items(
    src: Regions, dst: Regions, src_indices: np.ndarray, dst_indices: np.ndarray, kind: str
) -> int:
    """Copy items ``src_indices`` of every ``src`` buffer to items ``dst_indices`` of the
    matching ``dst`` buffer (the engine's ``_send_kvcache_generic``); returns bytes copied.

    ``ContractError`` when the lists differ in buffers or item sizes, the index lists in
    length, or an item lies outside its buffer.
    """
    if list(src.item_lens) != list(dst.item_lens):
        raise ContractError(
            f"{kind}: the pools' item sizes differ ({list(src.item_lens)} vs "
            f"{list(dst.item_lens)}); PD peers must share one layout"
        )
    if len(src_indices) != len(dst_indices):
        raise ContractError(
            f"{kind}: {len(src_indices)} source items but {len(dst_indices)} destination items"
        )
    if not len(src_indices):
        return 0
    src_blocks, dst_blocks = group_concurrent_contiguous(
        np.asarray(src_indices, dtype=np.int32), np.asarray(dst_indices, dtype=np.int32)
    )
    copied = 0
    for buffer, item in enumerate(src.item_lens):
        for src_run, dst_run in zip(src_blocks, dst_blocks, strict=True):
            length = item * len(src_run)
            src_at, dst_at = int(src_run[0]) * item, int(dst_run[0]) * item
            if src_at + length > src.lens[buffer] or dst_at + length > dst.lens[buffer]:
                raise ContractError(
                    f"{kind} buffer {buffer}: items {int(src_run[0])} / {int(dst_run[0])} + "
                    f"{len(src_run)} of {item} B lie outside {src.lens[buffer]} / "
                    f"{dst.lens[buffer]} B"
                )
            ctypes.memmove(dst.ptrs[buffer] + dst_at, src.ptrs[buffer] + src_at, length)
            copied += length
    return copied


def transfer_request(
    prefill: RequestSide, decode: RequestSide, seq_len: int, sliding_window: int
) -> dict[str, int]:
    """Move the request's first ``seq_len`` tokens from ``prefill`` to ``decode`` (both on the
    CPU); returns the bytes copied per region list."""
    for side in (prefill, decode):
        if torch.device(side.pool.device).type != "cpu":
            raise ContractError(f"the driver copies host memory; a pool is on {side.pool.device}")
    decode.pool.clear_request_scoped_state(decode.req_pool_idx)
    src_regions, dst_regions = pool_regions(prefill.pool), pool_regions(decode.pool)
    src_idx = request_indices(prefill, seq_len, sliding_window)
    dst_idx = request_indices(decode, seq_len, sliding_window)
    return {
        kind: copy_items(src_regions[kind], dst_regions[kind], src_idx[kind], dst_idx[kind], kind)
        for kind in REGION_KINDS
    }
