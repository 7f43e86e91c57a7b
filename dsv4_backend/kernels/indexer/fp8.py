"""sglang's quantised lightning-indexer inputs: the optional ``indexer_selection="fp8"``.

sglang 0.5.23's built-in backend scores the c4 entries from fp8 copies: it rotates indexer
queries and keys by the normalised Sylvester Hadamard matrix ``H / sqrt(DI)`` (orthonormal, so
``q . k`` is unchanged before quantisation), then quantises them to e4m3 with one scale per
query (token, head) and one per key (token): ``scale = max(amax, 1e-4) / 448``, code
``e4m3(x * (1 / scale))``. Its logits ``sum_h relu(code_q . code_k) * (w * scale_q) * scale_k``
equal ``sum_h w * relu(deq(q) . deq(k))``, so this mode hands the exact indexer the
de-quantised rotated values; selections then differ from the exact ones where quantisation
reorders near scores (a few percent of the entries at real shapes). ``"exact"`` (the default)
skips both rotation and quantisation.

Torch ops only (no host sync; the Hadamard matrix is built once per size and device).
"""

from __future__ import annotations

import functools
import math

import torch

#: Largest finite e4m3 value.
E4M3_MAX = 448.0
#: sglang's floor on a row's amax before it becomes a scale.
MIN_AMAX = 1e-4


@functools.lru_cache(maxsize=8)
def hadamard(n: int, device: torch.device) -> torch.Tensor:
    """``[n, n]`` float32 ``H / sqrt(n)``, ``H[i, j] = (-1)^popcount(i & j)`` (the natural order
    of sglang's butterfly kernels); ``n`` a power of two."""
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(device)


def e4m3_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., n]`` quantised to e4m3 with one scale per row (last dim), de-quantised;
    float32."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / E4M3_MAX
    codes = (x * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.float() * scale


def quantised_view(x: torch.Tensor) -> torch.Tensor:
    """sglang's fp8 view of indexer queries ``[T, HI, DI]`` or keys ``[T, DI]``: rotated by
    ``hadamard(DI)``, then ``e4m3_round_trip`` per (token, head) / per token; float32."""
    return e4m3_round_trip(x.float() @ hadamard(x.shape[-1], x.device))
