"""DeepSeek-V4.1's low-ratio compressors (ratio 1 and 2, on kv-source layers), from the
formulas (docs/design.md §8).

Per token ``t`` of a request (positions ``0 ... S-1``) the compressor projects ``kv_t = wkv x_t``
and, for ratio 2, ``score_t = wgate x_t`` (``D`` wide each, float32; no positional bias, no
overlap):

* ratio 1: entry ``t`` is token ``t``'s ``kv_t``;
* ratio 2: entry ``w`` pools the pair ``(2w, 2w + 1)``: a per-channel softmax over the pair's
  scores, in float32, weighting their ``kv``;

then ``RMSNorm(bf16(pooled))`` (statistics and weight in float32, the result rounded to bf16,
the module's dtype), RoPE at the entry's first position ``w * ratio`` with the compressed
layers' YaRN table (rounded to bf16), and fp4 fake quantisation with one e4m3 scale per 16
values (``fp4.fake_quant_e4m3``). A row at position ``p`` sees entries ``0 ... (p + 1) //
ratio - 1`` (a ratio-1 row its own token's entry too).
"""

from __future__ import annotations

import torch

from dsv4_backend.errors import ContractError
from dsv4_backend.testing.reference.fp4 import fake_quant_e4m3
from dsv4_backend.testing.reference.norm import rms_norm
from dsv4_backend.testing.reference.rope import RopeParams, apply_rope


def pool_pairs(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Ratio 2: ``[S, D]`` kv and scores -> ``[S // 2, D]`` float32, each pair pooled by a
    per-channel softmax of its two scores."""
    n = kv.shape[0] // 2
    kv2, score2 = (
        kv[: 2 * n].float().unflatten(0, (n, 2)),
        score[: 2 * n].float().unflatten(0, (n, 2)),
    )
    return (torch.softmax(score2, dim=1) * kv2).sum(dim=1)


def low_ratio_entries(
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor | None,
    norm_weight: torch.Tensor,
    ratio: int,
    rope: RopeParams,
    eps: float,
) -> torch.Tensor:
    """Every complete entry of one request (module docstring).

    Parameters
    ----------
    kv_proj : ``[S, D]`` float32 ``wkv x`` of the request's tokens.
    score_proj : ``[S, D]`` float32 ``wgate x`` (ratio 2); None for ratio 1.
    norm_weight : ``[D]`` the compressor's RMSNorm weight; ``eps`` its epsilon.
    ratio : 1 or 2.
    rope : the compressed layers' RoPE (``rope_for_ratio(config, ratio)``).

    Returns ``[S // ratio, D]`` float32 (values on the fp4 grid times their scales).
    """
    if ratio not in (1, 2) or (score_proj is None) != (ratio == 1):
        raise ContractError(
            f"ratio={ratio} with score_proj {'None' if score_proj is None else 'given'}; "
            "expected ratio 1 without scores or ratio 2 with them"
        )
    pooled = kv_proj.float() if score_proj is None else pool_pairs(kv_proj, score_proj)
    normed = rms_norm(pooled.bfloat16(), norm_weight, eps).bfloat16()
    positions = torch.arange(pooled.shape[0], device=pooled.device) * ratio
    cos, sin = rope.cos_sin(positions)
    return fake_quant_e4m3(apply_rope(normed, cos, sin).bfloat16())
