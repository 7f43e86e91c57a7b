"""HiCache's host tier of a ``DeepSeekV4TokenToKVPool``, with sglang's own host-pool classes.

sglang's ``build_deepseek_v4_hicache_stack`` mirrors a DeepSeek-V4 pool on the host with one
``DeepSeekV4PagedHostPool`` per page region and one ``DeepSeekV4StateHostPool`` per
page-scoped compressor state:

==========================  =====================================  =========================
host pool                   device buffers                         indices (tokens, paged)
==========================  =====================================  =========================
SWA                         ``swa_kv_pool.kv_buffer``              window slots
c4, c4 indexer, c128        the compressed KV / indexer buffers    full slots
                            (``_dsv4_compressed_region_buffers``,
                            ``_dsv4_indexer_regions``)
c1, c2 and their indexers   DeepSeek-V4.1's kv-source entries and  full slots
                            fp4 index keys
                            (``_dsv4_low_ratio_regions``)
c4 state, c4 indexer state  ``compress_state_pools`` /             the SWA host and device
                            ``indexer_compress_state_pools`` of    indices (no allocator of
                            the c4 layers                          their own)
==========================  =====================================  =========================

The c128 state and DeepSeek-V4.1's c2 pair ring are not mirrored: the radix tree holds whole
256-token pages, where no c128 block or pair is pending. :class:`HostTier` builds those pools
(layout ``layer_first``, io backend ``direct``) and moves whole pages of a request through them,
as the cache controller does on write-through and on a load before a radix hit; the tree and
the controller's threads are not modelled. sglang's ``direct`` copy op
(``sgl_kernel.kvcacheio.transfer_kv_direct``, a CUDA build) is not installed on a CPU machine;
:func:`cpu_kvcacheio` binds its torch twin there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache import memory_pool_host
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
    _dsv4_compressed_region_buffers,
    _dsv4_indexer_regions,
    _dsv4_low_ratio_regions,
)
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool

from dsv4_backend.errors import ContractError
from dsv4_backend.self_check.requests import PagedRequestPool

IO_BACKEND = "direct"
LAYOUT = "layer_first"


def transfer_kv_direct_twin(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Torch twin of ``sgl_kernel.kvcacheio.transfer_kv_direct``: for every layer, the
    ``page_size`` rows from each ``src_indices[i * page_size]`` to ``dst_indices[i * page_size]``
    (rows of the layer's first dimension)."""
    starts = torch.arange(0, len(src_indices), page_size)
    offsets = torch.arange(page_size)
    src = (src_indices.long()[starts][:, None] + offsets).reshape(-1)
    dst = (dst_indices.long()[starts][:, None] + offsets).reshape(-1)
    for source, target in zip(src_layers, dst_layers, strict=True):
        target[dst.to(target.device)] = source[src.to(source.device)].to(target.device)


@contextlib.contextmanager
def cpu_kvcacheio() -> Iterator[None]:
    """Bind :func:`transfer_kv_direct_twin` as sglang's host pools' ``transfer_kv_direct``
    where no CUDA build provides it (restored on exit)."""
    if hasattr(memory_pool_host, "transfer_kv_direct"):
        yield
        return
    memory_pool_host.transfer_kv_direct = transfer_kv_direct_twin
    try:
        yield
    finally:
        del memory_pool_host.transfer_kv_direct


def page_slots(paged: PagedRequestPool, request: int, tokens: int, swa: bool) -> torch.Tensor:
    """The slots of ``request``'s first ``tokens`` tokens (whole pages) in ``paged``: full
    slots, or window slots, what a backup or a load moves."""
    full = paged.req_to_token[paged.pool_index(request), :tokens].long()
    return paged.full_to_swa[full] if swa else full


@dataclass(frozen=True)
class HostCopy:
    """Where a backup lives: host token indices of its full pages and of its window pages."""

    full: torch.Tensor
    swa: torch.Tensor


class HostTier:
    """sglang's DeepSeek-V4 host pools over ``pool`` (``num_host_pages`` pages each)."""

    def __init__(self, pool: DeepSeekV4TokenToKVPool, num_host_pages: int) -> None:
        page = pool.page_size

        def paged(name: str, buffers: list[torch.Tensor], item: int) -> DeepSeekV4PagedHostPool:
            return DeepSeekV4PagedHostPool(
                pool_name=name, device_buffers=buffers, item_bytes=item,
                num_host_pages=num_host_pages, slot_page_size=page, layout=LAYOUT,
                pin_memory=False,
            )  # fmt: skip

        self.pool = pool
        ratios = set(pool.compression_ratios)
        self.full_pools = [
            paged(f"c{r}", *_dsv4_compressed_region_buffers(pool, r))
            for r in (4, 128)
            if r in ratios
        ]
        if 4 in ratios:
            self.full_pools += [
                paged(str(region.name), region.device_buffers, region.item_bytes)
                for region in _dsv4_indexer_regions(pool, page)
            ]
        self.full_pools += [  # DeepSeek-V4.1's kv sources: c1 / c2 entries, fp4 index keys
            paged(str(name), buffers, buffers[0].shape[1] * buffers[0].element_size())
            for name, _, buffers, _ in _dsv4_low_ratio_regions(pool, page)
        ]
        self.swa_pool = paged(
            "swa", pool.swa_kv_pool.kv_buffer, pool.swa_kv_pool.bytes_per_page_padded
        )
        c4_layers = [i for i, r in enumerate(pool.compression_ratios) if r == 4]
        state_lists = (
            ("c4 state", pool.compress_state_pools),
            ("c4 indexer state", pool.indexer_compress_state_pools),
        )
        self.state_pools = [
            DeepSeekV4StateHostPool(
                pool_name=name,
                state_pools=[states[i] for i in c4_layers],
                num_host_pages=num_host_pages,
                swa_page_size=pool.swa_page_size,
                layout=LAYOUT,
                pin_memory=False,
            )
            for name, states in state_lists
            if c4_layers
        ]

    def backup(self, full_slots: torch.Tensor, swa_slots: torch.Tensor) -> HostCopy:
        """Write whole pages (``full_slots`` / ``swa_slots``: the token slots of whole pages,
        in order) to freshly allocated host pages of every pool."""
        full = self._alloc(self.full_pools[0], len(full_slots))
        swa = self._alloc(self.swa_pool, len(swa_slots))
        for host_pool in self.full_pools[1:]:
            if not torch.equal(self._alloc(host_pool, len(full_slots)), full):
                raise ContractError("the full-page host pools handed out different pages")
        for host_pool in self.full_pools:
            host_pool.backup_from_device_all_layer(self.pool, full, full_slots, IO_BACKEND)
        for host_pool in (self.swa_pool, *self.state_pools):
            host_pool.backup_from_device_all_layer(self.pool, swa, swa_slots, IO_BACKEND)
        return HostCopy(full=full, swa=swa)

    def load(
        self,
        copy: HostCopy,
        full_slots: torch.Tensor,
        swa_slots: torch.Tensor,
        *,
        with_states: bool = True,
    ) -> None:
        """Load ``copy`` into the device pages of ``full_slots`` / ``swa_slots`` layer by
        layer (``with_states=False`` leaves the compressor states out, to show they matter)."""
        pools: list[tuple[object, torch.Tensor, torch.Tensor]] = [
            *((p, copy.full, full_slots) for p in self.full_pools),
            (self.swa_pool, copy.swa, swa_slots),
            *((p, copy.swa, swa_slots) for p in (self.state_pools if with_states else [])),
        ]
        for host_pool, host, device in pools:
            for layer in range(host_pool.layer_num):  # type: ignore[attr-defined]
                host_pool.load_to_device_per_layer(  # type: ignore[attr-defined]
                    self.pool, host, device, layer, IO_BACKEND
                )

    @staticmethod
    def _alloc(host_pool: DeepSeekV4PagedHostPool, n: int) -> torch.Tensor:
        host = host_pool.alloc(n)
        if host is None:
            raise ContractError(f"host pool {host_pool.pool_name} has no room for {n} tokens")
        return host
