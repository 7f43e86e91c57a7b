"""The FP4 (e2m1) formats (docs/design.md §8): DeepSeek-V4.1's compressed entries' fake
quantisation (one e4m3 scale per 16 values), the index keys' (one ue8m0 scale per 32 values),
and the fp4 index-key cache (sglang's ``DeepSeekV4IndexerPool`` fp4 pages: 64 entries a page,
``DI / 2`` payload bytes each, then ``DI / 32`` exponent bytes each; 68 B per entry for ``DI =
128``) of a DeepSeek-V4.1 kv-source layer, and of a DeepSeek-V4 c4 layer under sglang's
``--enable-deepseek-v4-fp4-indexer`` (``indexer_selection="fp4"``).

An e2m1 code is a sign (bit 3, set for nonzero magnitudes only) and a magnitude code 0-7 (0,
0.5, 1, 1.5, 2, 3, 4, 6). A scaled value rounds to the nearest magnitude and saturates at 6:
the magnitude code counts the thresholds (the midpoints of neighbouring magnitudes) below the
value. The two ue8m0 roundings (:class:`Ue8m0Rounding`) differ at a tie (to the even code, or
down) and in how a block's exponent follows its amax. Every step is elementwise and exact in
float32, so a kernel gives the same codes.
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
#: sglang's c4 fp4 indexer floors a block's amax at 1e-4 (float32) before dividing it by 6.
C4_AMAX_FLOOR = 1e-4


@dataclass(frozen=True)
class Ue8m0Rounding:
    """How an fp4 quantiser with ue8m0 block scales picks a block's exponent and its codes.

    ``ties_even``: a value halfway between two magnitudes goes to the even code (else down,
    sglang's ``ax > threshold`` counts); ``amax_floor``: a block's amax counts as at least
    this; ``exact_exponent``: the exponent is the smallest ``e`` with ``6 * 2^e >= amax``
    (exact comparisons), else the float32 quotient ``amax / 6`` rounded up to a power of two
    (sglang's ``cast_to_ue8m0``: its exponent field, plus one for a nonzero mantissa)."""

    name: str
    ties_even: bool
    amax_floor: float
    exact_exponent: bool


#: DeepSeek-V4.1's index keys and queries (sglang's ``fp4_fake_quant.fake_quant_fp4``).
V41_ROUNDING = Ue8m0Rounding(
    "v41", ties_even=True, amax_floor=UE8M0_AMAX_FLOOR, exact_exponent=True
)
#: DeepSeek-V4's c4 indexer under ``--enable-deepseek-v4-fp4-indexer``: sglang's CUDA kernels
#: (``fused_norm_rope_indexer_fp4`` for the keys, ``fused_q_indexer_rope_hadamard_fp4_quant``
#: for the queries: ``quant_fp4_e2m1``'s strict thresholds, ``max(1e-4, amax) / 6``).
C4_ROUNDING = Ue8m0Rounding("c4", ties_even=False, amax_floor=C4_AMAX_FLOOR, exact_exponent=False)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ContractError(
            f"fp4 rounding of shape {tuple(x.shape)}: the last dim must be a multiple of the "
            f"block size {block}"
        )
    return x.float().unflatten(-1, (-1, block))


def e2m1_codes(scaled: torch.Tensor, ties_even: bool = True) -> torch.Tensor:
    """e2m1 codes (uint8, sign in bit 3 of nonzero magnitudes) of float32 ``scaled`` (any
    shape), nearest, saturating at 6; a tie to the even code (``ties_even``) or down."""
    magnitude = scaled.abs()
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for below in range(len(E2M1_MAGNITUDES) - 1):
        threshold = (E2M1_MAGNITUDES[below] + E2M1_MAGNITUDES[below + 1]) / 2
        up = magnitude >= threshold if ties_even and below % 2 else magnitude > threshold
        code += up.to(torch.uint8)
    return code | (((scaled < 0) & (code > 0)).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of e2m1 ``codes`` (uint8, sign in bit 3)."""
    table = torch.tensor(E2M1_MAGNITUDES, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -magnitude, magnitude)


def ue8m0_exponents(
    x: torch.Tensor, rounding: Ue8m0Rounding = V41_ROUNDING, block: int = UE8M0_BLOCK
) -> torch.Tensor:
    """``[..., N / block]`` int32 ``e`` per block of ``x`` ``[..., N]``, ``a`` its amax floored
    at ``rounding.amax_floor``: the smallest ``e`` with ``6 * 2^e >= a`` (``exact_exponent``:
    found from float32 ``frexp`` of ``a / 6`` and settled by exact comparisons against ``6 *
    2^e``), else the smallest with ``2^e >=`` the float32 quotient ``a / 6``."""
    amax = _blocks(x, block).abs().amax(dim=-1).clamp(min=rounding.amax_floor)
    mantissa, exponent = torch.frexp(amax / E2M1_MAX)
    if not rounding.exact_exponent:  # a power of two (mantissa 0.5) is its own ceiling
        return (exponent - (mantissa == 0.5).to(exponent.dtype)).int()
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


def _codes_with(
    x: torch.Tensor, scale: torch.Tensor, block: int, ties_even: bool = True
) -> torch.Tensor:
    """``[..., N / block, block]`` e2m1 codes of ``x`` ``[..., N]`` over its block scales."""
    blocks = _blocks(x, block)
    return e2m1_codes((blocks / scale[..., None]).clamp(-E2M1_MAX, E2M1_MAX), ties_even)


def _round_with(
    x: torch.Tensor, scale: torch.Tensor, block: int, ties_even: bool = True
) -> torch.Tensor:
    codes = _codes_with(x, scale, block, ties_even)
    return (e2m1_values(codes) * scale[..., None]).flatten(-2)


def fp4_round_ue8m0(x: torch.Tensor, rounding: Ue8m0Rounding = V41_ROUNDING) -> torch.Tensor:
    """``x`` ``[..., N]`` rounded to fp4 with one ue8m0 scale per 32 values (index keys and
    queries) by ``rounding``; float32."""
    scale = _pow2(ue8m0_exponents(x, rounding))
    return _round_with(x, scale, UE8M0_BLOCK, rounding.ties_even)


def fp4_round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., N]`` rounded to fp4 with one e4m3 scale per 16 values (compressed
    entries); float32."""
    return _round_with(x, e4m3_scales(x), E4M3_BLOCK)


def pack_ue8m0(
    x: torch.Tensor, rounding: Ue8m0Rounding = V41_ROUNDING
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4 index keys ``x`` ``[n, DI]`` quantised by ``rounding`` as sglang's index-K cache
    stores them: ``[n, DI / 2]`` uint8 payload (element ``2i`` in the low nibble, ``2i + 1`` in
    the high one) and ``[n, DI / 32]`` uint8 biased exponents (``e + 127``)."""
    exponent = ue8m0_exponents(x, rounding)
    codes = _codes_with(x, _pow2(exponent), UE8M0_BLOCK, rounding.ties_even).flatten(-2)
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
    ``dim / 32`` biased ue8m0 exponents per entry (:func:`pack_ue8m0` by ``rounding``)."""

    dim: int
    page_tokens: int = FP4_INDEX_PAGE_TOKENS
    rounding: Ue8m0Rounding = V41_ROUNDING

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
        """One exponent a block (``bytes_per_token``: 68 for ``dim`` 128)."""
        return self.dim // UE8M0_BLOCK

    def pack_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, dim]`` float -> ``(payload [N, dim / 2], exponents [N, dim / 32])``
        uint8, quantised by ``rounding`` (exact for V4.1 values already on its fp4 grid; the
        c4 rounding takes the unrounded keys: its exponent follows their amax)."""
        check_width(x, self.dim, "x")
        return pack_ue8m0(x, self.rounding)

    def unpack_tokens(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``[N, dim / 2]``, ``[N, dim / 32]`` uint8 -> ``[N, dim]`` float32."""
        return unpack_ue8m0(data, scales)


class Fp4IndexKeyCache(SlotCache):
    """fp4 index keys addressed by slot: a DeepSeek-V4.1 kv-source layer's of ratio ``r``
    (slots ``full slot // r``, :data:`V41_ROUNDING`), or a DeepSeek-V4 c4 layer's under
    ``indexer_selection="fp4"`` (c4 slots, :data:`C4_ROUNDING`). fp4 pages
    (:class:`Fp4IndexKeyLayout`) in the ``fp8`` (pool) format, float rows in the ``dense`` one.
    :meth:`store` writes keys in torch; the V4.1 Triton rows kernel packs them into the pages
    itself (``kernels/low_ratio/triton.py``), the cache store's kernel the c4 keys
    (``kernels/cache_store/``)."""

    def __init__(
        self,
        num_slots: int,
        dim: int,
        fmt: CacheFormat,
        device: torch.device | str = "cpu",
        *,
        rounding: Ue8m0Rounding = V41_ROUNDING,
        storage: torch.Tensor | None = None,
        storage_name: str = "storage",
    ) -> None:
        layout = Fp4IndexKeyLayout(dim, rounding=rounding) if fmt == "fp8" else None
        super().__init__(num_slots, dim, fmt, layout, torch.float32, device, storage, storage_name)
        self.rounding = rounding

    @classmethod
    def over(
        cls,
        storage: torch.Tensor,
        num_slots: int,
        dim: int,
        *,
        rounding: Ue8m0Rounding = V41_ROUNDING,
        name: str = "storage",
    ) -> Fp4IndexKeyCache:
        """An fp4 cache whose pages are the first bytes of ``storage`` (no allocation);
        ``ConfigError`` naming ``name`` when the bytes do not fit."""
        return cls(
            num_slots,
            dim,
            "fp8",
            storage.device,
            rounding=rounding,
            storage=storage,
            storage_name=name,
        )

    def store(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``rows`` ``[N, dim]`` (float; V4.1: on the fp4 grid) at ``slots`` ``[N]``,
        quantised by the cache's rounding (dense rows: the rounded values); a row of slot -1
        writes the padding slot 0 instead (sglang's reserved page 0, which no entry occupies),
        so the store needs no host sync and a CUDA graph captures it."""
        self.check_slots(slots)
        check_width(rows, self.dim, "rows")
        kept = slots.long().clamp(min=0)
        if self.layout is None:
            self.storage[kept] = fp4_round_ue8m0(rows, self.rounding)
        else:
            self.layout.write_tokens(self.storage, kept, *self.layout.pack_tokens(rows))
