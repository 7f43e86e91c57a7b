"""RMSNorm in float32."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed and returned in fp32.

    ``x`` is ``[..., D]``; ``weight`` is ``[D]`` or None (the per-head query norm has none).
    """
    x = x.float()
    out = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return out if weight is None else out * weight.float()
