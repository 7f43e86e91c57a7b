"""The compressor's torch path: the kernels' gathers, vectorised over records
(:func:`pool_torch`, :func:`write_torch`); ``table.compress_forward`` finishes the pooled
entries with ``ops.compress.finish_entries``."""

from __future__ import annotations

import torch

from dsv4_backend.config import compress_overlap, compress_span
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.kernels.compressor.common import CompressCall
from dsv4_backend.ops.compress import finish_entries, pool_slots


def _ring_slots(
    call: CompressCall, ragged: torch.Tensor, batch: torch.Tensor, lags: torch.Tensor
) -> torch.Tensor:
    """Ring slot of position ``p - lag`` of each record ``[n, lags]`` (``ragged``, ``batch``
    ``[n]``; ``lags`` ``[n, k]`` in ``[0, SPAN)``, clamped by the caller where unused)."""
    if call.state.window_page:
        return call.window_slots.long()[ragged[:, None], lags] // call.state.window_page
    return call.req_pool_indices.long()[batch][:, None].expand_as(lags)


def pool_torch(call: CompressCall) -> torch.Tensor:
    """Torch implementation of the pooling kernel (same gathers, vectorised over records)."""
    state, kv_proj, score_proj, ape = call.state, call.kv_proj, call.score_proj, call.ape
    d, ratio, ring = state.head_dim, state.ratio, state.ring
    span, rows = compress_span(ratio), kv_proj.shape[0]
    out = torch.zeros(rows, d, dtype=torch.float32, device=kv_proj.device)
    plan = call.compress_plan.long()
    plan = plan[plan[:, 0] >= 0]
    ragged, batch, pos, window_len = plan.unbind(1)
    j = torch.arange(span, device=plan.device)
    q = pos[:, None] - span + 1 + j  # [n, span] token position of each slot
    from_rows = q > (pos - window_len)[:, None]
    from_ring = (q >= 0) & ~from_rows
    src = torch.where(from_rows, ragged[:, None] - (pos[:, None] - q), 0)
    lags = torch.where(from_ring, pos[:, None] - q, 0)
    slots = _ring_slots(call, ragged, batch, lags)
    slot_rows = ring[slots, q.clamp(min=0) % ring.shape[1]]
    cd = kv_proj.shape[1]
    in_rows, present = from_rows[..., None], (from_rows | from_ring)[..., None]
    kv = torch.where(in_rows, kv_proj.float()[src], slot_rows[..., :cd])
    score = score_proj.float()[src] + ape.float()[q.clamp(min=0) % ratio]
    score = torch.where(in_rows, score, slot_rows[..., cd:])
    # Negative positions (ratio 4, first entry) are missing slots: kv 0, score -inf.
    kv = torch.where(present, kv, 0.0)
    score = torch.where(present, score, float("-inf"))
    # Ratio 4: slots 0-3 (previous block) use dims [:D], slots 4-7 (current block) [D:].
    second = (j >= ratio)[None, :, None]
    if compress_overlap(ratio) == 2:
        kv = torch.where(second, kv[..., d:], kv[..., :d])
        score = torch.where(second, score[..., d:], score[..., :d])
    out[ragged] = pool_slots(kv, score)
    return out


def write_torch(call: CompressCall) -> None:
    """Torch implementation of the ring-write kernel."""
    state = call.state
    plan = call.write_plan.long()
    ragged, batch, pos, _ = plan[plan[:, 0] >= 0].unbind(1)
    score = call.score_proj[ragged].float() + call.ape.float()[pos % state.ratio]
    rows = torch.cat([call.kv_proj[ragged].float(), score], dim=1)
    lag0 = torch.zeros(ragged.shape[0], 1, dtype=torch.long, device=ragged.device)
    slots = _ring_slots(call, ragged, batch, lag0)[:, 0]
    state.ring[slots, pos % state.ring_rows] = rows


def compress_torch(call: CompressCall) -> torch.Tensor:
    """``table.compress_forward`` (inputs checked) with torch ops: the gathers, the ring
    writes, then ``ops.compress.finish_entries`` and the cache store (``max_rows_per_request``
    is not used)."""
    pooled = pool_torch(call)
    write_torch(call)
    ratio = call.state.ratio
    entry_ids = torch.div(call.positions.long() + 1, ratio, rounding_mode="floor") - 1
    entries = finish_entries(pooled, entry_ids, call.norm_weight, ratio, call.rope, call.norm_eps)
    if call.store is not None:
        store_rows(call.store[0], entries, call.store[1])
    return entries
