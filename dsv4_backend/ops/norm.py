"""RMSNorm (float32), as the compressor applies it to finished entries."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim; fp32 in, fp32 out.

    ``x``: ``[..., D]`` any float dtype; ``weight``: ``[D]`` or None (no scaling).
    """
    x = x.float()
    scaled = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    return scaled if weight is None else scaled * weight.float()
