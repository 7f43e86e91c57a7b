"""Interleaved-pair RoPE on the trailing ``R`` channels, with a cached cos/sin table.

Pairs ``(2i, 2i+1)`` of the last ``R = rope_dim`` channels rotate by ``position * freq[i]``.
Window-only layers (ratio 0) use ``rope_theta`` without YaRN; compressed layers (ratio 4 or
128), their compressors and the indexer use ``compress_rope_theta`` with YaRN whenever
``yarn_original_max_position > 0`` (sglang's rule). YaRN blends ``freq / factor`` and ``freq``
with a linear ramp between the correction dims of ``beta_fast`` and ``beta_slow`` and never
rescales the cos/sin magnitudes (docs/design.md §2).

:class:`RopeTable` holds cos/sin for every position ``[0, max_positions)`` on one device, built
once, so a forward only gathers rows of it: no host work and nothing recomputed per layer. Its
rows are those of sglang's ``freqs_cis`` table (``precompute_freqs_cis``): frequencies, ramp
and angles ``float32(p) * freq`` all in float32, in sglang's order. An exact (float64) angle
differs from that by up to 3e-3 rad at 64K positions and 5e-2 near 1M; the compressed entries
and indexer queries this backend ropes must agree with the keys and queries sglang's model
ropes, so the float32 table is the one to match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from dsv4_backend.config import COMPRESSED_RATIOS, LOW_RATIOS, DSV4AttentionConfig
from dsv4_backend.errors import ConfigError, ContractError

#: Positions per chunk when building a table (bounds the scratch memory of the angles).
_TABLE_CHUNK = 1 << 16


class CosSin(Protocol):
    """Anything giving ``(cos, sin)`` ``[*positions.shape, R/2]`` float32 for int positions."""

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True, kw_only=True)
class Yarn:
    """YaRN frequency blending: ``factor``, ``original_max_position``, ``beta_fast/slow``."""

    factor: float
    original_max_position: int
    beta_fast: float
    beta_slow: float

    def ramp(self, rope_dim: int, theta: float) -> torch.Tensor:
        """``[R/2]`` float32 weight of ``freq / factor`` per pair: 0 up to the fast correction
        dim, 1 from the slow one on, linear between."""

        def correction_dim(rotations: float) -> float:
            # The pair whose wavelength fits `rotations` times into the original context.
            wavelengths = self.original_max_position / (rotations * 2 * math.pi)
            return rope_dim * math.log(wavelengths) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), rope_dim - 1)
        width = high - low + (0.001 if high == low else 0.0)  # one-pair ramp: a step
        pairs = torch.arange(rope_dim // 2, dtype=torch.float32)
        return ((pairs - low) / width).clamp(0.0, 1.0)


@dataclass(frozen=True, kw_only=True)
class RopeParams:
    """One RoPE: ``rope_dim`` trailing channels, base ``theta``, optional YaRN."""

    rope_dim: int
    theta: float
    yarn: Yarn | None = None

    def frequencies(self) -> torch.Tensor:
        """``[R/2]`` float32 angular frequency of each pair (on the CPU), computed as sglang's
        ``precompute_freqs_cis`` does (module docstring)."""
        exponents = torch.arange(0, self.rope_dim, 2, dtype=torch.float32) / self.rope_dim
        freqs = 1.0 / (self.theta**exponents)
        if self.yarn is None:
            return freqs
        keep = 1.0 - self.yarn.ramp(self.rope_dim, self.theta)  # sglang's "smooth"
        return freqs / self.yarn.factor * (1.0 - keep) + freqs * keep


def rope_for_ratio(config: DSV4AttentionConfig, ratio: int) -> RopeParams:
    """The RoPE of a layer of compress ``ratio`` (0: window only; 4 or 128, and
    DeepSeek-V4.1's 1 or 2: compressed, one table for all)."""
    if ratio == 0:
        return RopeParams(rope_dim=config.rope_dim, theta=config.rope_theta)
    if ratio not in COMPRESSED_RATIOS + LOW_RATIOS:
        raise ConfigError(f"ratio={ratio}; expected 0 or one of {COMPRESSED_RATIOS + LOW_RATIOS}")
    yarn = None
    if config.yarn_original_max_position > 0:
        yarn = Yarn(
            factor=config.yarn_factor,
            original_max_position=config.yarn_original_max_position,
            beta_fast=config.yarn_beta_fast,
            beta_slow=config.yarn_beta_slow,
        )
    return RopeParams(rope_dim=config.rope_dim, theta=config.compress_rope_theta, yarn=yarn)


class RopeTable:
    """cos/sin of ``params`` for positions ``[0, max_positions)`` on ``device``.

    Memory: ``max_positions * R * 4`` bytes (cos and sin, float32). Negative positions read row
    0 (rows that complete no compressed entry ask for one; their values are multiplied by 0);
    a position ``>= max_positions`` is an index error (``IndexError`` on the CPU, a device
    assert on a GPU), never a silent wrap.
    """

    def __init__(
        self, params: RopeParams, max_positions: int, device: torch.device | str = "cpu"
    ) -> None:
        if max_positions <= 0:
            raise ConfigError(f"max_positions={max_positions}; expected a positive integer")
        self.params = params
        self.max_positions = max_positions
        freqs = params.frequencies().to(device)
        half = freqs.shape[0]
        self.cos = torch.empty(max_positions, half, dtype=torch.float32, device=device)
        self.sin = torch.empty_like(self.cos)
        for start in range(0, max_positions, _TABLE_CHUNK):
            stop = min(start + _TABLE_CHUNK, max_positions)
            positions = torch.arange(start, stop, dtype=torch.float32, device=device)
            angles = positions[:, None] * freqs  # float32, as sglang's table
            self.cos[start:stop] = angles.cos()
            self.sin[start:stop] = angles.sin()

    @property
    def device(self) -> torch.device:
        return self.cos.device

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[*positions.shape, R/2]`` float32 for int ``positions`` (a gather)."""
        rows = positions.long().clamp(min=0)
        return self.cos[rows], self.sin[rows]

    def __repr__(self) -> str:
        return f"RopeTable({self.params}, max_positions={self.max_positions}, {self.device})"


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing ``R = 2 * cos.shape[-1]`` channels of ``x`` in interleaved pairs.

    Parameters
    ----------
    x : ``[N, ..., D]`` any float dtype; channels ``D - R ...`` rotate, the others pass through.
    cos, sin : ``[N, R/2]`` float32 (one position per leading index).
    inverse : rotate by ``-angle`` (undoes the forward rotation).

    Returns a new float32 tensor shaped like ``x``.
    """
    half = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape[0] != x.shape[0] or 2 * half > x.shape[-1]:
        raise ContractError(
            f"apply_rope got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin "
            f"{tuple(sin.shape)}; expected cos/sin [N, R/2] with N = x.shape[0] and R <= D"
        )
    x = x.float()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        sin = -sin
    passthrough, pairs = x[..., : -2 * half], x[..., -2 * half :].unflatten(-1, (half, 2))
    even, odd = pairs.unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return torch.cat((passthrough, rotated.flatten(-2)), dim=-1)
