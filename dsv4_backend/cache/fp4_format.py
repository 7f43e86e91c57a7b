"""DeepSeek-V4.1's FP4 (e2m1) format (docs/design.md §8): the compressed entries' fake
quantisation (one e4m3 scale per 16 values), the index keys' (one ue8m0 scale per 32 values),
and the fp4 index-key cache of a kv-source layer (sglang's ``DeepSeekV4IndexerPool`` fp4 pages:
64 entries a page, ``DI / 2`` payload bytes each, then ``DI / 32`` exponent bytes each; 68 B
per entry for ``DI = 128``).

An e2m1 code is a sign (bit 3) and a magnitude code 0-7 (0, 0.5, 1, 1.5, 2, 3, 4, 6). A
scaled value rounds to the nearest magnitude, a tie to the even code, and saturates at 6: the
magnitude code counts the thresholds (the midpoints of neighbouring magnitudes) below the value,
a threshold counting at equality when the code above it is the even one. Every step is
elementwise and exact in float32, so a kernel gives the same codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dsv4_backend.cache.fp8_format import PagedLayout, check_width
from dsv4_backend.cache.token_cache import CacheFormat, SlotCache
from dsv4_backend.errors import ConfigError, ContractError

#: The block scales of an fp4 rounding: one e4m3 scale per 16 values (compressed entries) or
#: one ue8m0 scale per 32 (index keys and queries).
Fp4Scale = Literal["e4m3", "ue8m0"]

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
#: Blocks sharing one scale: index keys and queries (ue8m0), compressed entries (e4m3).
UE8M0_BLOCK = 32
E4M3_BLOCK = 16
#: e4m3 scales are clamped to its smallest subnormal and its largest finite value.
E4M3_SCALE_MIN, E4M3_SCALE_MAX = 2.0**-9, 448.0
#: A block's ``amax`` counts as at least ``6 * 2^-126`` (fp32's smallest normal times 6), so
#: an all-zero block keeps the finite scale ``2^-126``.
UE8M0_AMAX_FLOOR = E2M1_MAX * 2.0**-126


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ContractError(
            f"fp4 rounding of shape {tuple(x.shape)}: the last dim must be a multiple of the "
            f"block size {block}"
        )
    return x.float().unflatten(-1, (-1, block))


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, sign in bit 3) of float32 ``scaled`` (any shape), nearest, ties to
    even, saturating at 6."""
    magnitude = scaled.abs()
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for below in range(len(E2M1_MAGNITUDES) - 1):
        threshold = (E2M1_MAGNITUDES[below] + E2M1_MAGNITUDES[below + 1]) / 2
        up = magnitude >= threshold if below % 2 else magnitude > threshold
        code += up.to(torch.uint8)
    return code | ((scaled < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of e2m1 ``codes`` (uint8, sign in bit 3)."""
    table = torch.tensor(E2M1_MAGNITUDES, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -magnitude, magnitude)


def ue8m0_exponents(x: torch.Tensor, block: int = UE8M0_BLOCK) -> torch.Tensor:
    """``[..., N / block]`` int32 ``e``: per block of ``x`` ``[..., N]`` the smallest ``e``
    with ``6 * 2^e >= max(amax, UE8M0_AMAX_FLOOR)``. Found from float32 ``frexp`` (``amax / 6``
    in ``[2^(e-1), 2^e)`` up to the division's rounding) and settled by exact comparisons
    against ``6 * 2^e``."""
    amax = _blocks(x, block).abs().amax(dim=-1).clamp(min=UE8M0_AMAX_FLOOR)
    _, exponent = torch.frexp(amax / E2M1_MAX)
    six = torch.full_like(amax, E2M1_MAX)
    exponent = exponent - (torch.ldexp(six, exponent - 1) >= amax).to(exponent.dtype)
    exponent = exponent + (torch.ldexp(six, exponent) < amax).to(exponent.dtype)
    return exponent.int()


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """float32 ``2^exponent`` of an int tensor (exact)."""
    return torch.ldexp(torch.ones(exponent.shape, device=exponent.device), exponent)


def e4m3_scales(x: torch.Tensor, block: int = E4M3_BLOCK) -> torch.Tensor:
    """``[..., N / block]`` float32 per-block scales ``amax / 6``, clamped to the e4m3 range and
    rounded to e4m3."""
    amax = _blocks(x, block).abs().amax(dim=-1)
    scale = (amax / E2M1_MAX).clamp(E4M3_SCALE_MIN, E4M3_SCALE_MAX)
    return scale.to(torch.float8_e4m3fn).float()


def _round_with(x: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    blocks = _blocks(x, block)
    codes = e2m1_codes((blocks / scale[..., None]).clamp(-E2M1_MAX, E2M1_MAX))
    return (e2m1_values(codes) * scale[..., None]).flatten(-2)


def fp4_round_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., N]`` rounded to fp4 with one ue8m0 scale per 32 values (index keys and
    queries); float32."""
    scale = _pow2(ue8m0_exponents(x))
    return _round_with(x, scale, UE8M0_BLOCK)


def fp4_round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., N]`` rounded to fp4 with one e4m3 scale per 16 values (compressed
    entries); float32."""
    return _round_with(x, e4m3_scales(x), E4M3_BLOCK)


def pack_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4 index keys ``x`` ``[n, DI]`` as sglang's index-K cache stores them: ``[n, DI / 2]``
    uint8 payload (element ``2i`` in the low nibble, ``2i + 1`` in the high one) and ``[n, DI /
    32]`` uint8 biased exponents (``e + 127``)."""
    exponent = ue8m0_exponents(x)
    scale = _pow2(exponent)
    blocks = _blocks(x, UE8M0_BLOCK)
    codes = e2m1_codes((blocks / scale[..., None]).clamp(-E2M1_MAX, E2M1_MAX)).flatten(-2)
    pairs = codes.unflatten(-1, (-1, 2))
    payload = pairs[..., 0] | (pairs[..., 1] << 4)
    return payload, (exponent + 127).to(torch.uint8)


def unpack_ue8m0(payload: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """:func:`pack_ue8m0`'s inverse: ``[n, DI]`` float32."""
    codes = torch.stack((payload & 0x0F, payload >> 4), dim=-1).flatten(-2)
    scale = _pow2(exponents.int() - 127)
    values = e2m1_values(codes).unflatten(-1, (-1, UE8M0_BLOCK)) * scale[..., None]
    return values.flatten(-2)


#: Entries per page of the fp4 index-key cache (sglang's ``DSV41_INDEX_PAGE_SIZE`` without
#: DeepGEMM's paged sparse MQA logits).
FP4_INDEX_PAGE_TOKENS = 64


@dataclass(frozen=True)
class Fp4IndexKeyLayout(PagedLayout):
    """Byte layout of an fp4 index-key page: ``page_tokens`` x ``dim / 2`` payload bytes, then
    ``dim / 32`` biased ue8m0 exponents per entry (:func:`pack_ue8m0`)."""

    dim: int
    page_tokens: int = FP4_INDEX_PAGE_TOKENS

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % UE8M0_BLOCK:
            raise ConfigError(
                f"index_head_dim={self.dim}; the fp4 index keys need a positive multiple of "
                f"{UE8M0_BLOCK} (one ue8m0 scale per {UE8M0_BLOCK} values)"
            )

    @property
    def token_bytes(self) -> int:
        return self.dim // 2

    @property
    def scale_bytes(self) -> int:
        return self.dim // UE8M0_BLOCK

    @property
    def bytes_per_token(self) -> int:
        """68 for ``dim`` 128."""
        return self.token_bytes + self.scale_bytes

    @property
    def scale_base(self) -> int:
        return self.page_tokens * self.token_bytes

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.bytes_per_token

    def pack_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, dim]`` float -> ``(payload [N, dim / 2], exponents [N, dim / 32])``
        uint8; exact for values already on the fp4 grid (``fp4_round_ue8m0``)."""
        check_width(x, self.dim, "x")
        return pack_ue8m0(x)

    def unpack_tokens(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``[N, dim / 2]``, ``[N, dim / 32]`` uint8 -> ``[N, dim]`` float32."""
        return unpack_ue8m0(data, scales)


class Fp4IndexKeyCache(SlotCache):
    """The index keys of one DeepSeek-V4.1 kv-source layer of ratio ``r`` (slots ``full slot
    // r``): fp4 pages (:class:`Fp4IndexKeyLayout`) in the ``fp8`` (pool) format, float rows in
    the ``dense`` one. :meth:`store` writes keys in torch; the Triton rows kernel packs them
    into the pages itself (``kernels/low_ratio/triton.py``)."""

    def __init__(
        self,
        num_slots: int,
        dim: int,
        fmt: CacheFormat,
        device: torch.device | str = "cpu",
        *,
        storage: torch.Tensor | None = None,
        storage_name: str = "storage",
    ) -> None:
        layout = Fp4IndexKeyLayout(dim) if fmt == "fp8" else None
        super().__init__(num_slots, dim, fmt, layout, torch.float32, device, storage, storage_name)

    @classmethod
    def over(
        cls, storage: torch.Tensor, num_slots: int, dim: int, *, name: str = "storage"
    ) -> Fp4IndexKeyCache:
        """An fp4 cache whose pages are the first bytes of ``storage`` (no allocation);
        ``ConfigError`` naming ``name`` when the bytes do not fit."""
        return cls(num_slots, dim, "fp8", device=storage.device, storage=storage, storage_name=name)

    def store(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``rows`` ``[N, dim]`` (float, on the fp4 grid) at ``slots`` ``[N]``; a row of
        slot -1 writes the padding slot 0 instead (sglang's reserved page 0, which no entry
        occupies), so the store needs no host sync and a CUDA graph captures it."""
        self.check_slots(slots)
        check_width(rows, self.dim, "rows")
        kept = slots.long().clamp(min=0)
        if self.layout is None:
            self.storage[kept] = rows.float()
        else:
            self.layout.write_tokens(self.storage, kept, *self.layout.pack_tokens(rows))
