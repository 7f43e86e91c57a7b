"""FP4 (e2m1) fake quantisation of DeepSeek-V4.1, from the formats' definitions.

e2m1: a sign, 2 exponent bits (bias 1) and 1 mantissa bit; the magnitudes of codes 0-7 are
0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6. A value rounds to the nearest magnitude; a value
halfway between two goes to the even code (mantissa bit 0); beyond 6 it saturates.

A block of values shares one scale; each value is divided by it, clamped to [-6, 6], rounded
to e2m1 and multiplied back (the scale is chosen so that the block's largest magnitude maps to
at most 6):

* index keys and queries (:func:`fake_quant_ue8m0`, blocks of 32): the smallest power of two
  at or above ``amax / 6`` (a ue8m0 exponent; ``amax`` at least ``6 * 2^-126``, so a zero
  block keeps a finite scale);
* compressed latents (:func:`fake_quant_e4m3`, blocks of 16): ``amax / 6`` clamped to
  ``[2^-9, 448]`` (e4m3's smallest subnormal and largest finite value) and rounded to e4m3
  (nearest, ties to even).
"""

from __future__ import annotations

import torch

from dsv4_backend.errors import ContractError

#: e2m1 magnitudes of codes 0 ... 7.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
#: ue8m0 scales keep ``amax`` at least this (the smallest normal fp32 times 6).
UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126
E4M3_SCALE_RANGE = (2.0**-9, 448.0)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any shape, values in [-6, 6]) rounded to e2m1, ties to the even code; float32."""
    grid = torch.tensor(E2M1_VALUES, device=x.device)
    halfway = (grid[1:] + grid[:-1]) / 2
    magnitude = x.float().abs()
    code = torch.bucketize(magnitude, halfway)  # halfway[code - 1] < magnitude <= halfway[code]
    tie = (code < len(halfway)) & (magnitude == halfway[code.clamp(max=len(halfway) - 1)])
    code = torch.where(tie & (code % 2 == 1), code + 1, code)  # a tie goes to the even code
    return grid[code] * torch.sign(x.float())


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ContractError(
            f"fp4 fake quantisation of shape {tuple(x.shape)}: the last dim must be a "
            f"multiple of the block size {block}"
        )
    return x.float().unflatten(-1, (-1, block))


def _quantise(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scaled = (blocks / scale).clamp(-E2M1_MAX, E2M1_MAX)
    return (round_e2m1(scaled) * scale).flatten(-2)


def ue8m0_scales(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``[..., N / block]`` float32 powers of two: per block, the smallest at or above
    ``max(amax, UE8M0_AMAX_FLOOR) / 6``, computed exactly (in float64)."""
    amax = _blocks(x, block).abs().amax(dim=-1).clamp(min=UE8M0_AMAX_FLOOR)
    mantissa, exponent = torch.frexp(amax.double() / E2M1_MAX)  # v = m 2^e, m in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float64), exponent).float()


def e4m3_scales(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """``[..., N / block]`` float32: per block ``amax / 6`` clamped to ``E4M3_SCALE_RANGE``,
    rounded to e4m3."""
    amax = _blocks(x, block).abs().amax(dim=-1)
    low, high = E4M3_SCALE_RANGE
    return (amax / E2M1_MAX).clamp(low, high).to(torch.float8_e4m3fn).float()


def fake_quant_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``x`` ``[..., N]`` through fp4 with one ue8m0 scale per ``block`` values and back;
    float32."""
    return _quantise(_blocks(x, block), ue8m0_scales(x, block)[..., None])


def fake_quant_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """``x`` ``[..., N]`` through fp4 with one e4m3 scale per ``block`` values and back;
    float32."""
    return _quantise(_blocks(x, block), e4m3_scales(x, block)[..., None])
