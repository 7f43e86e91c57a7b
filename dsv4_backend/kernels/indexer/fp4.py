"""sglang's fp4 lightning-indexer inputs: ``indexer_selection="fp4"``, what sglang 0.5.23
scores under ``--enable-deepseek-v4-fp4-indexer`` (SM100 / SM120).

As for ``"fp8"`` (``fp8.py``), queries and keys are rotated by ``hadamard(DI)``; then each is
quantised to e2m1 with one ue8m0 scale per 32 values by ``fp4_format.C4_ROUNDING`` (sglang's
``quant_fp4_e2m1`` thresholds, a tie rounding down; exponent ``ceil(log2(max(1e-4, amax) /
6))``): the keys by ``fused_norm_rope_indexer_fp4`` straight into the c4 indexer pool's fp4
pages (the cache's rounding, :func:`fp4_key_rows`), the queries by
``fused_q_indexer_rope_hadamard_fp4_quant`` after rounding the rotated values to bf16
(:func:`fp4_query_view`). DeepGEMM's ``fp8_fp4_paged_mqa_logits`` then scores ``sum_h w *
relu(deq(q) . deq(k))``: the exact indexer's scores of the de-quantised values, which every
indexer variant computes from the fp4 pages (``table.py``).

Torch ops only (no host sync).
"""

from __future__ import annotations

import torch

from dsv4_backend.cache.fp4_format import C4_ROUNDING, fp4_round_ue8m0
from dsv4_backend.kernels.indexer.fp8 import hadamard


def fp4_key_rows(entries: torch.Tensor) -> torch.Tensor:
    """The rows a c4 fp4 indexer cache stores for the compressor's ``entries`` ``[N, DI]``:
    rotated by ``hadamard(DI)``, float32, not yet rounded (the cache quantises them by its
    rounding; the exponent follows the unrounded block's amax)."""
    return entries.float() @ hadamard(entries.shape[-1], entries.device)


def fp4_query_view(q: torch.Tensor) -> torch.Tensor:
    """sglang's fp4 indexer queries ``[T, HI, DI]`` de-quantised: rotated by ``hadamard(DI)``,
    rounded to bf16, then to fp4 per (token, head) by ``C4_ROUNDING``; float32."""
    rotated = (q.float() @ hadamard(q.shape[-1], q.device)).bfloat16().float()
    return fp4_round_ue8m0(rotated, C4_ROUNDING)
