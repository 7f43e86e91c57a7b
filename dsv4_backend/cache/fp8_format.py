"""FP8 byte layouts of the DeepSeek-V4 caches (sglang's ``DeepSeekV4TokenToKVPool``, layout V4).

Token caches (window, c4, c128), one page = ``PT`` tokens::

    [PT x TB] data region: per token NOPE e4m3 bytes, then ROPE bf16 values (TB = NOPE + 2*ROPE)
    [PT x 8]  scale region: per token NOPE/64 ue8m0 exponents, zero padding to 8 bytes
    zero padding up to a multiple of TB                  (Flash: TB 576, 584 B per token)

Indexer key cache (c4 layers), one page = 64 entries::

    [64 x DI] e4m3 bytes, then [64 x 4] bytes of fp32 scales     (132 B per entry for DI 128)

Quantisation (exact, so the torch and Triton encoders produce identical bytes):

* token caches, per 64-channel group: ``scale = 2^ceil(log2(amax / 448))`` computed exactly from
  the bits of ``amax`` (no float log/div), stored as the biased exponent ``e = log2(scale) + 127``
  (ue8m0), clamped to ``e >= 0``; ``amax == 0`` stores ``e = 127``. Values are
  ``e4m3(x * 2^(127 - e))`` (multiplication by a power of two is exact).
* indexer: ``scale = amax / 448`` (1.0 when ``amax == 0``), values ``e4m3(x / scale)`` with
  correctly rounded fp32 division on both paths.
* e4m3 is ``torch.float8_e4m3fn``: round to nearest even, saturate to +-448, no infinities.

Error bound: a value ``v = x / scale`` with ``|v| >= 2^-6`` (e4m3 normal) is rounded to 3
mantissa bits, so ``|v - e4m3(v)| <= 2^-4 * 2^floor(log2|v|)``; below that the absolute error is
at most ``2^-10`` (half the smallest subnormal, ``2^-9``). Dequantising multiplies by the scale.

The device-side readers and encoders of these layouts (``@triton.jit``) are in
:mod:`dsv4_backend.kernels.device.fp8`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_backend.config import entries_per_page
from dsv4_backend.errors import BatchError, ConfigError

E4M3_MAX = 448.0
#: Nope channels sharing one ue8m0 scale.
SCALE_GROUP = 64
#: Scale bytes per token in a token-cache page (7 scales + 1 pad byte for Flash).
SCALE_BYTES_PER_TOKEN = 8
#: Entries per indexer-cache page (the c4 entries of one full page).
INDEXER_PAGE_TOKENS = entries_per_page(4)
#: Bytes of one indexer scale (fp32).
INDEXER_SCALE_BYTES = 4


# --------------------------------------------------------------------------- torch bit helpers
def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 ``v`` (any shape) -> e4m3fn bit patterns (uint8, same shape); saturates to +-448."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bit patterns (any shape) -> fp32 values (0x7F / 0xFF decode to NaN)."""
    return bits.view(torch.float8_e4m3fn).to(torch.float32)


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Biased exponent (int32) of ``2^ceil(log2(amax / 448))`` for fp32 ``amax >= 0``.

    448 = 1.75 * 2^8, so for ``amax = m * 2^E`` (m in [1, 2)) the exponent is ``E - 8``, plus one
    when ``m > 1.75``. Clamped to ``[0, 255)``; ``amax == 0`` gives 127 (scale 1).
    """
    bits = amax.float().contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    e = biased - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    e = e.clamp(min=0)
    return torch.where(amax == 0, torch.full_like(e, 127), e)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """``2^(biased - 127)`` as fp32 for int32 ``biased`` in [0, 254] (0 gives 2^-127)."""
    bits = torch.where(biased > 0, biased << 23, torch.full_like(biased, 0x400000))
    return bits.view(torch.float32)


def bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[N, R]`` float -> ``[N, 2R]`` uint8: bf16 values (round to nearest even), little endian."""
    return x.to(torch.bfloat16).contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------ layouts
class PagedLayout:
    """Slot addressing shared by the paged layouts (the fp8 ones here, the fp4 index keys of
    ``fp4_format``): ``page = slot // page_tokens``,
    ``t = slot % page_tokens``; token t's data at ``t * token_bytes`` of its page, its scales at
    ``scale_base + t * scale_bytes``. Storage is ``[num_pages, page_bytes]`` uint8."""

    page_tokens: int

    # Each layout defines these (as properties of its fields).
    @property
    def token_bytes(self) -> int:
        raise NotImplementedError

    @property
    def scale_bytes(self) -> int:
        raise NotImplementedError

    @property
    def bytes_per_token(self) -> int:
        """Data plus scale bytes per token, before page padding."""
        return self.token_bytes + self.scale_bytes

    @property
    def scale_base(self) -> int:
        """Byte offset of the scale region inside a page: after every token's data."""
        return self.page_tokens * self.token_bytes

    @property
    def page_bytes(self) -> int:
        """``page_tokens * bytes_per_token`` (a layout that pads its pages overrides it)."""
        return self.page_tokens * self.bytes_per_token

    def pack_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, dim]`` float -> ``(data [N, token_bytes], scales [N, scale_bytes])``."""
        raise NotImplementedError

    def unpack_tokens(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """:meth:`pack_tokens`' inverse: ``[N, dim]`` float32."""
        raise NotImplementedError

    def num_pages(self, num_slots: int) -> int:
        return -(-num_slots // self.page_tokens)

    def data_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 byte offsets (into the flat storage) of each slot's data; same shape as slots."""
        slots = slots.long()
        page, t = slots // self.page_tokens, slots % self.page_tokens
        return page * self.page_bytes + t * self.token_bytes

    def scale_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 byte offsets (into the flat storage) of each slot's scale bytes."""
        slots = slots.long()
        page, t = slots // self.page_tokens, slots % self.page_tokens
        return page * self.page_bytes + self.scale_base + t * self.scale_bytes

    def read_tokens(
        self, storage: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bytes of ``slots`` ``[N]`` (all valid) from ``storage``.

        Returns ``(data [N, token_bytes], scales [N, scale_bytes])`` uint8.
        """
        flat = storage.view(-1)
        data = flat[self.data_offsets(slots)[:, None] + _arange(self.token_bytes, storage)]
        scales = flat[self.scale_offsets(slots)[:, None] + _arange(self.scale_bytes, storage)]
        return data, scales

    def write_tokens(
        self, storage: torch.Tensor, slots: torch.Tensor, data: torch.Tensor, scales: torch.Tensor
    ) -> None:
        """Write packed tokens (as ``pack_tokens`` returns them) at valid ``slots`` ``[N]``."""
        flat = storage.view(-1)
        flat[self.data_offsets(slots)[:, None] + _arange(self.token_bytes, storage)] = data
        flat[self.scale_offsets(slots)[:, None] + _arange(self.scale_bytes, storage)] = scales


@dataclass(frozen=True)
class Fp8TokenLayout(PagedLayout):
    """Byte layout of an fp8 token cache page: ``nope_dim`` e4m3 + ``rope_dim`` bf16 per token.

    ``nope_dim`` must be a positive multiple of 64 with at most 8 groups (one scale byte each).
    """

    nope_dim: int
    rope_dim: int
    page_tokens: int

    def __post_init__(self) -> None:
        if self.nope_dim <= 0 or self.nope_dim % SCALE_GROUP:
            raise ConfigError(
                f"nope_dim={self.nope_dim}; the fp8 token format needs a positive multiple of "
                f"{SCALE_GROUP} (one ue8m0 scale per {SCALE_GROUP} channels)"
            )
        if self.num_scales > SCALE_BYTES_PER_TOKEN:
            raise ConfigError(
                f"nope_dim={self.nope_dim} needs {self.num_scales} scales; a token has "
                f"{SCALE_BYTES_PER_TOKEN} scale bytes (nope_dim <= {8 * SCALE_GROUP})"
            )
        if self.rope_dim < 0 or self.page_tokens <= 0:
            raise ConfigError(
                f"rope_dim={self.rope_dim}, page_tokens={self.page_tokens}; expected "
                "rope_dim >= 0 and page_tokens > 0"
            )

    @property
    def head_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def num_scales(self) -> int:
        return self.nope_dim // SCALE_GROUP

    @property
    def token_bytes(self) -> int:
        """Data bytes per token: ``nope_dim + 2 * rope_dim`` (576 for Flash)."""
        return self.nope_dim + 2 * self.rope_dim

    @property
    def scale_bytes(self) -> int:
        """Scale bytes per token (``bytes_per_token``: 584 for Flash)."""
        return SCALE_BYTES_PER_TOKEN

    @property
    def page_bytes(self) -> int:
        """``page_tokens * bytes_per_token`` rounded up to a multiple of ``token_bytes``."""
        return -(-self.page_tokens * self.bytes_per_token // self.token_bytes) * self.token_bytes

    def pack_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise ``x`` ``[N, head_dim]`` (any float dtype).

        Returns ``data`` ``[N, token_bytes]`` uint8 (e4m3 nope bytes, then bf16 rope bytes) and
        ``scales`` ``[N, 8]`` uint8 (ue8m0 exponents, zero padded).
        """
        check_width(x, self.head_dim, "x")
        n = x.shape[0]
        groups = x[:, : self.nope_dim].float().reshape(n, self.num_scales, SCALE_GROUP)
        e = ue8m0_exponent(groups.abs().amax(dim=-1))  # [N, G]
        codes = e4m3_encode(groups * _pow2(254 - e)[..., None])
        data = torch.cat([codes.reshape(n, self.nope_dim), bf16_bytes(x[:, self.nope_dim :])], 1)
        scales = torch.zeros(n, SCALE_BYTES_PER_TOKEN, dtype=torch.uint8, device=x.device)
        scales[:, : self.num_scales] = e.to(torch.uint8)
        return data, scales

    def unpack_tokens(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pack_tokens`: ``[N, token_bytes]``, ``[N, 8]`` uint8 -> ``[N, D]``
        fp32."""
        n = data.shape[0]
        codes = data[:, : self.nope_dim].reshape(n, self.num_scales, SCALE_GROUP)
        scale = _pow2(scales[:, : self.num_scales].to(torch.int32))
        nope = (e4m3_decode(codes) * scale[..., None]).reshape(n, self.nope_dim)
        rope = data[:, self.nope_dim :].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope, rope], dim=1)


@dataclass(frozen=True)
class Fp8IndexerLayout(PagedLayout):
    """Byte layout of an fp8 indexer-key page: ``page_tokens`` x ``dim`` e4m3, then fp32 scales."""

    dim: int
    page_tokens: int = INDEXER_PAGE_TOKENS

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 4 or self.page_tokens <= 0:
            raise ConfigError(
                f"dim={self.dim}, page_tokens={self.page_tokens}; expected a positive multiple "
                "of 4 (keeps the fp32 scales aligned) and page_tokens > 0"
            )

    @property
    def token_bytes(self) -> int:
        return self.dim

    @property
    def scale_bytes(self) -> int:
        """One fp32 scale (``bytes_per_token``: 132 for ``dim`` 128)."""
        return INDEXER_SCALE_BYTES

    def pack_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, dim]`` float -> ``(data [N, dim] uint8, scales [N, 4] uint8)``.

        ``scales`` holds the bytes of the fp32 scale.
        """
        check_width(x, self.dim, "x")
        x = x.float()
        amax = x.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / E4M3_MAX)
        return e4m3_encode(x / scale), scale.contiguous().view(torch.uint8)

    def unpack_tokens(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``[N, dim]``, ``[N, 4]`` uint8 -> ``[N, dim]`` fp32."""
        return e4m3_decode(data) * scales.contiguous().view(torch.float32)


def _arange(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(n, device=like.device)


def check_width(x: torch.Tensor, width: int, name: str) -> None:
    if x.dim() != 2 or x.shape[1] != width or not x.is_floating_point():
        raise BatchError(
            f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}; expected a float tensor "
            f"[N, {width}]"
        )
