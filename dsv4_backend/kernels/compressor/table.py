"""The compressor's variants (:data:`COMPRESSOR`, ``kernels/variants.py``) and its entry point
:func:`compress_forward`, which checks the inputs and runs the chosen one: ``fused`` (the
one-launch kernel, ``fused.py``; the interpreter's default, opt-in on CUDA until it passes
``scripts/gpu_check.sh``), ``entries`` (the entry and ring-write kernels, then the cache store,
``entries.py``; the CUDA baseline) or ``torch`` (``torch.py``, the torch path)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4_backend.cache.state import CompressorState
from dsv4_backend.cache.token_cache import SlotCache
from dsv4_backend.kernels.compressor.common import CompressCall
from dsv4_backend.kernels.compressor.entries import compress_entries
from dsv4_backend.kernels.compressor.fused import compress_fused
from dsv4_backend.kernels.compressor.torch import compress_torch
from dsv4_backend.kernels.variants import TRITON_PATHS, OpTable, Variant, resolve
from dsv4_backend.ops.rope import CosSin

#: The variants: each entry takes one checked ``common.CompressCall``.
COMPRESSOR: OpTable[Callable[[CompressCall], torch.Tensor]] = OpTable(
    "compressor",
    "softmax-gated pooling of tokens into c4 / c128 entries, the rings, the entry store",
    (
        Variant(
            "fused",
            compress_fused,
            (TRITON_PATHS,),
            "every ratio and mode, the store in the same launch",
        ),
        Variant(
            "entries",
            compress_entries,
            (TRITON_PATHS,),
            "every ratio and mode; 3 launches",
            baseline=True,
        ),
        Variant("torch", compress_torch, (), "every ratio and mode", baseline=True),
    ),
)


def _unit_channel_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def compress_forward(
    state: CompressorState,
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    rope: CosSin,
    req_pool_indices: torch.Tensor,
    window_slots: torch.Tensor,
    positions: torch.Tensor,
    compress_plan: torch.Tensor,
    write_plan: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
    store: tuple[SlotCache, torch.Tensor] | None = None,
    max_rows_per_request: int | None = None,
) -> torch.Tensor:
    """Entries completed by this forward's rows, then the ring updated for the next forward.

    Parameters
    ----------
    state : the layer's (or indexer's) rings; ``state.ring`` is updated in place.
    kv_proj, score_proj : ``[T, c*D]`` float — this forward's projections (scores without ape).
    ape : ``[r, c*D]`` float.
    norm_weight : ``[D]`` float RMSNorm weight.
    rope : the compressed layers' RoPE cos/sin (``AttentionState.rope``, a ``RopeTable``).
    req_pool_indices : ``[B]`` int — ring slot of each batch id (request-scoped c128 rings).
    window_slots : ``[T, >= span]`` int — window slot of positions ``p, p - 1, ...`` of each row
        (``AttentionMetadata.swa_page_indices``); a page-scoped (c4) ring slot is a position's
        ``window_slot // state.window_page``. Only columns ``< span`` of rows with records
        are read.
    positions : ``[T]`` int — absolute position of each row.
    compress_plan, write_plan : ``[T, 4]`` int32 plan records of this ratio (planning/metadata.py).
    norm_eps : the RMSNorm epsilon (sglang: the compressor's ``norm.variance_epsilon``).
    store : ``(cache, out_loc)``: also store each row's entry in ``cache`` at ``out_loc``
        ``[T]`` (``-1``: none), as ``store_rows`` does.
    max_rows_per_request : the most rows a request has in this forward when known (uniform
        kinds); where ``ring_write_is_safe`` says so, the one-launch kernel skips the check
        for writes that must wait for an entry's ring reads (``DEFER_WRITES``).

    Returns ``[T, D]`` float32 aligned to rows: the finished (normed, roped) entry completed by
    each row, zeros for rows that complete none. Decode is the same call with one row per
    request.
    """
    # The kernels step channels and batch ids with unit stride (rows may be strided: the
    # kv and score halves of one projection are used in place).
    call = CompressCall(
        state,
        _unit_channel_stride(kv_proj),
        _unit_channel_stride(score_proj),
        ape.contiguous(),
        norm_weight,
        rope,
        req_pool_indices.contiguous(),
        _unit_channel_stride(window_slots),
        positions,
        compress_plan,
        write_plan,
        norm_eps,
        store,
        max_rows_per_request,
    )
    return resolve(COMPRESSOR, kv_proj.device).variant.entry(call)
