"""Default A/B tolerances, derived from the device and both sides' cache formats.

Outputs are attention rows of order 1 (random model). Three cases:

* same cache format on the CPU: float32 everywhere, the two sides differ by summation order
  only: ``max |A - B| <= 1e-4``;
* same format on CUDA: the attention dots take bf16 operands, so the bound follows from that
  dtype (``attention.common.attention_tolerance``: 12 roundoffs of bf16, 0.047);
* one side FP8, the other dense (``--a dsv4-fp8 --b dsv4``): every key (which serves as key and
  value) is rounded to e4m3 at its 64-channel group's ue8m0 (power-of-two) scale. Round to
  nearest moves an element by at most half an ulp, ``u |x|`` with ``u = 2^-4`` (3 mantissa
  bits), about uniformly in that range, so its RMS relative error is at most ``u / sqrt(3)``
  (0.036); the power-of-two scale is exact and values below e4m3's normal range (< 2^-6 of the
  scale) err by at most 2^-10 of it, negligible. An output row is a softmax-weighted mean of
  keys whose rounding errors are independent: its relative error is of the size of one key
  element's, so the **median row's relative error** ``||a - b|| / ||b||`` must stay within
  ``u / sqrt(3)`` (measured 0.022-0.025 on the tiny model, seeds 0-5; a saturating scale, one
  exponent too small, gives 0.13-0.16, rounding toward zero 0.06). Single rows can move
  further: on c4 layers a quantised indexer key can swap an entry at the top-k boundary, which
  moves that row by the weight of the entries swapped, not by a rounding. The element-wise bound
  is therefore only a gross check: 16 roundoffs of e4m3, ``16 u = 1.0`` (measured at most 0.49).

Both sides FP8 (``sglang:dsv4`` against ``dsv4-fp8``) round the same values the same way, so the
same-format bound applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv4_backend.kernels.attention.common import attention_tolerance

#: Unit roundoff of e4m3 (3 mantissa bits): half an ulp is at most this fraction of a value.
E4M3_ROUNDOFF = 2.0**-4
#: RMS relative error of one e4m3-rounded element (error uniform within half an ulp).
E4M3_RMS_ROUNDOFF = E4M3_ROUNDOFF / math.sqrt(3)
#: Element-wise gross bound of a dense-vs-FP8 comparison, in e4m3 roundoffs (module docstring).
FP8_MAX_ABS_ROUNDOFFS = 16
#: float32 on both sides: summation order only.
CPU_ATOL = 1e-4


@dataclass(frozen=True)
class Tolerance:
    """What a mode must meet: ``max |A - B| <= atol`` and, where set, the median row's
    relative error ``||a - b|| / ||b|| <= median_row_rtol``; ``derivation`` says why."""

    atol: float
    median_row_rtol: float | None
    derivation: str


def same_format_atol(device: torch.device) -> float:
    """``max |A - B|`` bound of two sides with the same cache format on ``device``."""
    return CPU_ATOL if device.type == "cpu" else attention_tolerance(torch.device("cuda"))


def default_tolerance(device: torch.device, format_a: str, format_b: str) -> Tolerance:
    """The default :class:`Tolerance` of an A/B run (module docstring); formats are ``"dense"``
    or ``"fp8"``."""
    base = same_format_atol(device)
    if format_a == format_b:
        why = (
            "float32 on both sides, summation order only"
            if device.type == "cpu"
            else "bf16 dot operands: 12 roundoffs of bf16 (12 * 2^-8)"
        )
        return Tolerance(base, None, f"same cache format ({format_a}): {why}")
    atol = max(base, FP8_MAX_ABS_ROUNDOFFS * E4M3_ROUNDOFF)
    return Tolerance(
        atol,
        E4M3_RMS_ROUNDOFF,
        "FP8 caches on one side, dense on the other: keys rounded to e4m3 at a power-of-two "
        "(ue8m0) scale, relative error <= u = 2^-4 per element, RMS "
        f"u/sqrt(3) = {E4M3_RMS_ROUNDOFF:.3g}: the median row's relative error must stay within "
        "it; single rows may move further (a c4 top-k entry swapped by a quantised index key), "
        f"so max |A-B| is only checked against {FP8_MAX_ABS_ROUNDOFFS} u = {atol:.3g}",
    )
