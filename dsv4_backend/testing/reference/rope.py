"""Interleaved-pair RoPE on the trailing ``R`` dims: the project's single RoPE implementation.

Pairs ``(2i, 2i+1)`` of the last ``R = rope_dim`` channels rotate by ``position * freq[i]``.
Window-only layers (ratio 0) use ``rope_theta`` without YaRN; compressed layers (ratio 4 or 128,
DeepSeek-V4.1's 1 or 2), their compressors and the indexer use ``compress_rope_theta`` with YaRN.

YaRN here blends ``freq / factor`` and ``freq`` with a linear ramp between the correction dims
of ``beta_fast`` and ``beta_slow`` (DeepSeek's formula) and never rescales cos/sin magnitudes.
Activation rule (the sources disagree, docs/design.md §2): like sglang, YaRN applies
whenever ``yarn_original_max_position > 0``; DeepSeek's own code applies it only when the
maximum sequence length exceeds that value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError, ContractError


@dataclass(frozen=True, kw_only=True)
class Yarn:
    """YaRN frequency blending: ``factor``, ``original_max_position``, ``beta_fast/slow``."""

    factor: float
    original_max_position: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True, kw_only=True)
class RopeParams:
    """Which RoPE a layer uses: ``rope_dim`` trailing dims, base ``theta``, optional YaRN."""

    rope_dim: int
    theta: float
    yarn: Yarn | None = None

    def frequencies(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[R/2]`` float32 angular frequency of each pair, built on ``device``.

        float32 arithmetic in the order of sglang's ``precompute_freqs_cis``, so the values are
        the ones its ``freqs_cis`` table is built from.
        """
        dim = self.rope_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        freqs = 1.0 / (self.theta**exponents)
        if self.yarn is None:
            return freqs
        low, high = _correction_range(self.yarn, dim, self.theta)
        pairs = torch.arange(dim // 2, dtype=torch.float32, device=device)
        # smooth 1 (fast-rotating dims below `low`) keeps freq; 0 (slow dims) gets freq/factor.
        smooth = 1 - ((pairs - low) / (high - low)).clamp(0, 1)
        return freqs / self.yarn.factor * (1 - smooth) + freqs * smooth

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[*positions.shape, R/2]`` float32, on ``positions.device``.

        The rows of sglang's float32 ``freqs_cis`` table at ``positions``: the angle is the
        float32 product ``float32(p) * freq`` (not an exact one: at position 1M the two differ
        by up to 0.05 rad), then its float32 cosine and sine. Computed per call on
        ``positions.device`` (no host copy, so it may run inside a CUDA graph).
        """
        angles = positions.to(torch.float32)[..., None] * self.frequencies(positions.device)
        return angles.cos(), angles.sin()


def _correction_dim(num_rotations: float, dim: int, theta: float, max_position: int) -> float:
    """The pair index whose wavelength fits ``num_rotations`` times in ``max_position``."""
    return dim * math.log(max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))


def _correction_range(yarn: Yarn, dim: int, theta: float) -> tuple[float, float]:
    low = math.floor(_correction_dim(yarn.beta_fast, dim, theta, yarn.original_max_position))
    high = math.ceil(_correction_dim(yarn.beta_slow, dim, theta, yarn.original_max_position))
    low, high = max(low, 0), min(high, dim - 1)
    return float(low), float(high) + (0.001 if low == high else 0.0)


def rope_for_ratio(config: DSV4AttentionConfig, ratio: int) -> RopeParams:
    """The RoPE of a layer with compress ``ratio`` (0: window only; 4 or 128, and
    DeepSeek-V4.1's 1 or 2: compressed)."""
    if ratio == 0:
        return RopeParams(rope_dim=config.rope_dim, theta=config.rope_theta)
    if ratio not in (1, 2, 4, 128):
        raise ConfigError(f"ratio={ratio}; expected 0, 1, 2, 4 or 128")
    yarn = None
    if config.yarn_original_max_position > 0:
        yarn = Yarn(
            factor=config.yarn_factor,
            original_max_position=config.yarn_original_max_position,
            beta_fast=config.yarn_beta_fast,
            beta_slow=config.yarn_beta_slow,
        )
    return RopeParams(rope_dim=config.rope_dim, theta=config.compress_rope_theta, yarn=yarn)


def rope_cos_sin(
    config: DSV4AttentionConfig, ratio: int, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[*positions.shape, R/2]`` float32 for a layer of compress ``ratio``."""
    return rope_for_ratio(config, ratio).cos_sin(positions)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing ``R = 2 * cos.shape[-1]`` dims of ``x`` in interleaved pairs.

    Parameters
    ----------
    x : ``[N, ..., D]`` any float dtype; dims ``D - R ...`` are rotated, the rest pass through.
    cos, sin : ``[N, R/2]`` float32 from ``rope_cos_sin`` (one position per leading index).
    inverse : rotate by ``-angle`` (undoes the forward rotation; used on the attention output).

    Returns a new float32 tensor shaped like ``x``.
    """
    half = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape[0] != x.shape[0] or 2 * half > x.shape[-1]:
        raise ContractError(
            f"apply_rope got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin "
            f"{tuple(sin.shape)}; expected cos/sin [N, R/2] with N = x.shape[0] and R <= D"
        )
    x = x.float()
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.reshape(view), sin.reshape(view)
    if inverse:
        sin = -sin
    out = x.clone()
    even, odd = x[..., -2 * half :: 2], x[..., -2 * half + 1 :: 2]
    out[..., -2 * half :: 2] = even * cos - odd * sin
    out[..., -2 * half + 1 :: 2] = even * sin + odd * cos
    return out
