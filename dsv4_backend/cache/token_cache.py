"""Slot-addressed caches: the token cache of one layer (window, c4 or c128 keys, K = V).

A cache holds ``num_slots`` rows of ``dim`` channels, addressed by int64 slot ids (-1: none):

* ``dense``: ``storage`` is ``[num_slots, dim]`` of a float dtype; slot = row.
* ``fp8``: ``storage`` is ``[num_pages, page_bytes]`` uint8 in the layout of
  :mod:`dsv4_backend.cache.fp8_format` (sglang's DeepSeek-V4 pool format). An fp8 cache can be
  built over given bytes instead of allocating (``over``: a view, e.g. of a host's KV buffer).

A cache only holds data: kernels read and write ``storage`` directly (writes:
:func:`dsv4_backend.kernels.cache_store.table.store_rows`; device helpers:
:mod:`dsv4_backend.kernels.device.fp8`); ``gather`` is the torch reader used by torch paths
and tests.
"""

from __future__ import annotations

from typing import Literal

import torch

from dsv4_backend.cache.fp8_format import Fp8TokenLayout, PagedLayout
from dsv4_backend.errors import BatchError, ConfigError
from dsv4_backend.ops.launches import uncounted

CacheFormat = Literal["dense", "fp8"]
FORMATS = ("dense", "fp8")
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class SlotCache:
    """Storage plus slot addressing shared by :class:`TokenCache` and ``IndexerKeyCache``.

    ``layout`` is the fp8 byte layout, or None for a dense cache. ``storage`` (fp8 only): build
    over these bytes (see :func:`fp8_pages_over`, ``storage_name`` names them in errors)
    instead of allocating zeroed pages.
    """

    def __init__(
        self,
        num_slots: int,
        dim: int,
        fmt: CacheFormat,
        layout: PagedLayout | None,
        dtype: torch.dtype,
        device: torch.device | str,
        storage: torch.Tensor | None = None,
        storage_name: str = "storage",
    ) -> None:
        if fmt not in FORMATS:
            raise ConfigError(f"fmt={fmt!r}; expected one of {FORMATS}")
        if num_slots <= 0:
            raise ConfigError(f"num_slots={num_slots}; expected a positive integer")
        self.num_slots = num_slots
        self.dim = dim
        self.fmt: CacheFormat = fmt
        if layout is None:
            if not dtype.is_floating_point:
                raise ConfigError(f"dtype={dtype}; a dense cache needs a float dtype")
            self.layout: PagedLayout | None = None
            if storage is not None:
                raise ConfigError(f"{storage_name}: only an fp8 cache can be built over storage")
            self.storage = torch.zeros(num_slots, dim, dtype=dtype, device=device)
        else:
            self.layout = layout
            if storage is None:
                self.storage = torch.zeros(
                    layout.num_pages(num_slots), layout.page_bytes, dtype=torch.uint8, device=device
                )
            else:
                self.storage = fp8_pages_over(storage, layout, num_slots, storage_name)

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def check_slots(self, slots: torch.Tensor, name: str = "slots") -> None:
        """Validate slot ids (int tensor on the cache's device); no device work (callers that
        need int64 ids convert them, attention reads int32 ones as they are).

        On the CPU the range ``[-1, num_slots)`` is checked too; on a GPU that would need a
        host sync, so it is not.
        """
        if not isinstance(slots, torch.Tensor) or slots.dtype not in _INT_DTYPES:
            raise BatchError(f"{name} must be an integer tensor, got {_describe(slots)}")
        if slots.device != self.device:
            raise BatchError(f"{name} is on {slots.device}; the cache is on {self.device}")
        if slots.device.type == "cpu" and slots.numel():
            with uncounted():  # a CPU-only check: no launch on a GPU
                lo, hi = int(slots.min()), int(slots.max())
            if lo < -1 or hi >= self.num_slots:
                raise BatchError(
                    f"{name} spans [{lo}, {hi}]; expected slot ids in [0, {self.num_slots}) "
                    "or -1 (no slot)"
                )

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows at ``slots`` (int, any shape ``[...]``) as ``[..., dim]`` fp32; -1 gives zeros."""
        self.check_slots(slots)
        flat = slots.long().reshape(-1)
        valid = flat >= 0
        safe = flat.clamp(min=0)
        if self.layout is None:
            out = self.storage[safe].float()
        elif safe.device.type == "cpu":
            # Rows of a batch read overlapping windows: decode each distinct slot once (on a
            # GPU the data-dependent size would sync, and graphs cannot capture it).
            distinct, where = torch.unique(safe, return_inverse=True)
            out = self.layout.unpack_tokens(*self.layout.read_tokens(self.storage, distinct))
            out = out[where]
        else:
            out = self.layout.unpack_tokens(*self.layout.read_tokens(self.storage, safe))
        out = torch.where(valid[:, None], out, torch.zeros((), device=out.device))
        return out.reshape(*slots.shape, self.dim)

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_slots={self.num_slots}, dim={self.dim}, "
            f"fmt={self.fmt!r}, storage={tuple(self.storage.shape)} {self.storage.dtype})"
        )


class TokenCache(SlotCache):
    """Keys (= values) of one layer: ``head_dim`` channels, the last ``rope_dim`` of them RoPE.

    ``page_tokens`` is the page size of the fp8 layout (window 256, c4 64, c128 2) and
    ``dtype`` the storage dtype of a dense cache; each format ignores the other's parameter.
    """

    def __init__(
        self,
        num_slots: int,
        head_dim: int,
        rope_dim: int,
        page_tokens: int,
        fmt: CacheFormat,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        storage: torch.Tensor | None = None,
        storage_name: str = "storage",
    ) -> None:
        if not 0 <= rope_dim <= head_dim:
            raise ConfigError(f"rope_dim={rope_dim}; expected 0 <= rope_dim <= head_dim={head_dim}")
        layout = None
        if fmt == "fp8":
            layout = Fp8TokenLayout(head_dim - rope_dim, rope_dim, page_tokens)
        super().__init__(num_slots, head_dim, fmt, layout, dtype, device, storage, storage_name)
        self.rope_dim = rope_dim
        self.page_tokens = page_tokens

    @classmethod
    def over(
        cls,
        storage: torch.Tensor,
        num_slots: int,
        head_dim: int,
        rope_dim: int,
        page_tokens: int,
        *,
        name: str = "storage",
    ) -> TokenCache:
        """An fp8 cache whose pages are the first bytes of ``storage`` (no allocation, not
        zeroed); ``ConfigError`` naming ``name`` when the bytes do not fit."""
        return cls(
            num_slots,
            head_dim,
            rope_dim,
            page_tokens,
            "fp8",
            device=storage.device,
            storage=storage,
            storage_name=name,
        )


def fp8_pages_over(
    storage: torch.Tensor,
    layout: PagedLayout,
    num_slots: int,
    name: str = "storage",
) -> torch.Tensor:
    """``[num_pages, page_bytes]`` uint8 view of the first bytes of ``storage`` for ``num_slots``.

    ``storage``: a contiguous uint8 tensor of any shape holding at least
    ``layout.num_pages(num_slots) * layout.page_bytes`` bytes; the view shares its memory.
    Raises ``ConfigError`` naming ``name`` (dtype, layout, or both byte counts).
    """
    if not isinstance(storage, torch.Tensor) or storage.dtype != torch.uint8:
        raise ConfigError(f"{name} is {_describe(storage)}; expected a uint8 tensor")
    if not storage.is_contiguous():
        raise ConfigError(f"{name} (shape {tuple(storage.shape)}) is not contiguous")
    pages = layout.num_pages(num_slots)
    need = pages * layout.page_bytes
    if storage.numel() < need:
        raise ConfigError(
            f"{name} holds {storage.numel()} bytes; {num_slots} slots need {need} "
            f"({pages} pages of {layout.page_bytes} B)"
        )
    return storage.view(-1)[:need].view(pages, layout.page_bytes)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
