"""Compressor: softmax-gated pooling of tokens into c4 / c128 entries, prefill and decode alike.

docs/design.md §2 (pooling and finish: :mod:`dsv4_backend.ops.compress`). Shapes use
``T`` ragged rows, ``B`` requests, ``D`` the compressed head dim (``config.head_dim`` for a layer,
``index_head_dim`` for the indexer's compressor), ``c`` the overlap (2 for ratio 4, else 1),
``r`` the ratio, ``span`` the tokens per entry (8 for ratio 4, 128 for ratio 128) and ``R``
``ring_rows``.

State: each request (by its pool index) owns a ring of ``R`` rows ``[kv | score + ape]``
(``2 * c * D`` fp32); position ``p`` lives in ring row ``p % R``. One forward:

1. **pool** (reads only): for each compress-plan record ``(ragged_id, batch_id, position p,
   window_len L)`` the entry ending at ``p`` pools the ``span`` tokens ``p - span + 1 ... p``:
   the last ``L`` are this forward's ragged rows ``ragged_id - L + 1 ... ragged_id`` (score plus
   ``ape[q % r]``), the earlier ones come from the ring, and negative positions are missing
   slots (kv 0, score -inf). Ratio 4 slots 0-3 use projection dims ``[:D]``, slots 4-7
   ``[D:]``.
2. **write**: each write-plan record stores its row ``[kv | score + ape]`` at ring row
   ``p % R``. Writing after every entry is pooled means no row of this forward can overwrite
   ring state an entry of the same forward still needs.
3. **finish**: RMSNorm and RoPE at the entry's position ``p + 1 - r`` (torch, on every row:
   rows that complete no entry stay exactly 0).

The output is **aligned to rows**: ``entries[i]`` is the entry completed by ragged row ``i``,
zeros where row ``i`` completes none. Nothing reads a tensor value on the host, so a forward
can be captured in a CUDA graph (warm up first: the first call compiles).

Paths: pooling and ring writes run the Triton kernels or the torch implementation per
``dispatch.use_triton``; the finish is shared torch code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_backend.cache.state import CompressorState
from dsv4_backend.config import check_compressed_ratio, compress_overlap, compress_span
from dsv4_backend.errors import ContractError
from dsv4_backend.kernels import dispatch
from dsv4_backend.ops.compress import finish_entries, pool_slots
from dsv4_backend.ops.rope import CosSin

#: Upper bound on ``span * BLOCK_D`` elements of one pooling tile.
POOL_TILE = 4096
#: Columns per ring-write program.
WRITE_BLOCK = 256


# --------------------------------------------------------------------------------- kernels
@triton.jit
def _compress_pool_kernel(
    kv_ptr,  # [T, C*D] float kv projection
    score_ptr,  # [T, C*D] float score projection (without ape)
    ape_ptr,  # [RATIO, C*D] float
    ring_ptr,  # [num_slots, ring_rows, 2*C*D] fp32 [kv | score + ape]
    pool_ptr,  # [B] int request pool index of each batch id
    plan_ptr,  # [T, 4] int32 compress plan records
    out_ptr,  # [T, D] fp32 pooled entries, pre-zeroed
    D,
    ring_rows,
    stride_kv,
    stride_score,
    stride_ape,
    stride_ring_slot,
    stride_ring_row,
    stride_plan,
    stride_out,
    RATIO: tl.constexpr,
    SPAN: tl.constexpr,
    OVERLAP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (record, channel block): per-channel softmax over the entry's ``SPAN`` slots."""
    rec = tl.program_id(0)
    ragged = tl.load(plan_ptr + rec * stride_plan).to(tl.int64)
    if ragged < 0:  # padding record
        return
    batch = tl.load(plan_ptr + rec * stride_plan + 1)
    pos = tl.load(plan_ptr + rec * stride_plan + 2).to(tl.int64)
    window_len = tl.load(plan_ptr + rec * stride_plan + 3).to(tl.int64)
    slot = tl.load(pool_ptr + batch).to(tl.int64)

    j = tl.arange(0, SPAN)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_ok = ch < D
    q = pos - SPAN + 1 + j  # [SPAN] token position of each slot
    # Ratio 4: slots RATIO.. (the current block) read the projection's second half.
    col = (j >= RATIO).to(tl.int64)[:, None] * D + ch[None, :]  # [SPAN, BLOCK_D]
    from_rows = q > pos - window_len
    from_ring = (q >= 0) & ~from_rows
    rows = tl.where(from_rows, ragged - (pos - q), 0)
    ring_row = tl.where(from_ring, q, 0) % ring_rows
    m_rows = from_rows[:, None] & ch_ok[None, :]
    m_ring = from_ring[:, None] & ch_ok[None, :]

    ring_base = ring_ptr + slot * stride_ring_slot + ring_row[:, None] * stride_ring_row + col
    kv = tl.load(kv_ptr + rows[:, None] * stride_kv + col, mask=m_rows, other=0.0).to(tl.float32)
    kv += tl.load(ring_base, mask=m_ring, other=0.0)
    ape_row = tl.where(from_rows, q, 0) % RATIO
    score_rows = tl.load(score_ptr + rows[:, None] * stride_score + col, mask=m_rows, other=0.0)
    score_rows = score_rows.to(tl.float32) + tl.load(
        ape_ptr + ape_row[:, None] * stride_ape + col, mask=m_rows, other=0.0
    ).to(tl.float32)
    score_ring = tl.load(ring_base + OVERLAP * D, mask=m_ring, other=0.0)
    score = tl.where(m_rows, score_rows, tl.where(m_ring, score_ring, float("-inf")))
    # Channels past D have no finite slot; give them a harmless 0 score (never stored).
    score = tl.where(ch_ok[None, :], score, 0.0)

    mx = tl.max(score, axis=0)
    p = tl.exp(score - mx[None, :])
    pooled = tl.sum(p * kv, axis=0) / tl.sum(p, axis=0)
    tl.store(out_ptr + ragged * stride_out + ch, pooled, mask=ch_ok)


@triton.jit
def _ring_write_kernel(
    kv_ptr,  # [T, C*D] float kv projection
    score_ptr,  # [T, C*D] float score projection (without ape)
    ape_ptr,  # [RATIO, C*D] float
    ring_ptr,  # [num_slots, ring_rows, 2*C*D] fp32
    pool_ptr,  # [B] int request pool index of each batch id
    plan_ptr,  # [T, 4] int32 write plan records
    CD,
    ring_rows,
    stride_kv,
    stride_score,
    stride_ape,
    stride_ring_slot,
    stride_ring_row,
    stride_plan,
    RATIO: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One (record, column block): ``ring[slot, p % R] = [kv | score + ape[p % RATIO]]``."""
    rec = tl.program_id(0)
    ragged = tl.load(plan_ptr + rec * stride_plan).to(tl.int64)
    if ragged < 0:  # padding record
        return
    batch = tl.load(plan_ptr + rec * stride_plan + 1)
    pos = tl.load(plan_ptr + rec * stride_plan + 2).to(tl.int64)
    slot = tl.load(pool_ptr + batch).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < CD
    kv = tl.load(kv_ptr + ragged * stride_kv + cols, mask=ok, other=0.0).to(tl.float32)
    score = tl.load(score_ptr + ragged * stride_score + cols, mask=ok, other=0.0).to(tl.float32)
    score += tl.load(ape_ptr + (pos % RATIO) * stride_ape + cols, mask=ok, other=0.0).to(tl.float32)
    dst = ring_ptr + slot * stride_ring_slot + (pos % ring_rows) * stride_ring_row + cols
    tl.store(dst, kv, mask=ok)
    tl.store(dst + CD, score, mask=ok)


# ------------------------------------------------------------------------------- launchers
def _pool_triton(
    state: CompressorState,
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor,
    ape: torch.Tensor,
    req_pool_indices: torch.Tensor,
    compress_plan: torch.Tensor,
) -> torch.Tensor:
    """Launch ``_compress_pool_kernel``: ``[T, D]`` fp32 pooled entries aligned to rows."""
    d, ratio, ring = state.head_dim, state.ratio, state.ring
    span = compress_span(ratio)
    out = torch.zeros(kv_proj.shape[0], d, dtype=torch.float32, device=kv_proj.device)
    block_d = min(triton.next_power_of_2(d), max(POOL_TILE // span, 16))
    grid = (compress_plan.shape[0], triton.cdiv(d, block_d))
    _compress_pool_kernel[grid](
        kv_proj, score_proj, ape, ring, req_pool_indices, compress_plan, out,
        d, ring.shape[1],
        kv_proj.stride(0), score_proj.stride(0), ape.stride(0), ring.stride(0), ring.stride(1),
        compress_plan.stride(0), out.stride(0),
        RATIO=ratio, SPAN=span, OVERLAP=compress_overlap(ratio), BLOCK_D=block_d,
    )  # fmt: skip
    return out


def _write_triton(
    state: CompressorState,
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor,
    ape: torch.Tensor,
    req_pool_indices: torch.Tensor,
    write_plan: torch.Tensor,
) -> None:
    """Launch ``_ring_write_kernel`` for every write-plan record."""
    ring, cd = state.ring, kv_proj.shape[1]
    grid = (write_plan.shape[0], triton.cdiv(cd, WRITE_BLOCK))
    _ring_write_kernel[grid](
        kv_proj, score_proj, ape, ring, req_pool_indices, write_plan,
        cd, ring.shape[1],
        kv_proj.stride(0), score_proj.stride(0), ape.stride(0), ring.stride(0), ring.stride(1),
        write_plan.stride(0),
        RATIO=state.ratio, BLOCK=WRITE_BLOCK,
    )  # fmt: skip


# ------------------------------------------------------------------------------ torch path
def _pool_torch(
    state: CompressorState,
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor,
    ape: torch.Tensor,
    req_pool_indices: torch.Tensor,
    compress_plan: torch.Tensor,
) -> torch.Tensor:
    """Torch implementation of the pooling kernel (same gathers, vectorised over records)."""
    d, ratio, ring = state.head_dim, state.ratio, state.ring
    span, rows = compress_span(ratio), kv_proj.shape[0]
    out = torch.zeros(rows, d, dtype=torch.float32, device=kv_proj.device)
    plan = compress_plan.long()
    plan = plan[plan[:, 0] >= 0]
    ragged, batch, pos, window_len = plan.unbind(1)
    j = torch.arange(span, device=plan.device)
    q = pos[:, None] - span + 1 + j  # [n, span] token position of each slot
    from_rows = q > (pos - window_len)[:, None]
    from_ring = (q >= 0) & ~from_rows
    src = torch.where(from_rows, ragged[:, None] - (pos[:, None] - q), 0)
    slot_rows = ring[req_pool_indices.long()[batch][:, None], q.clamp(min=0) % ring.shape[1]]
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


def _write_torch(
    state: CompressorState,
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor,
    ape: torch.Tensor,
    req_pool_indices: torch.Tensor,
    write_plan: torch.Tensor,
) -> None:
    """Torch implementation of the ring-write kernel."""
    plan = write_plan.long()
    ragged, batch, pos, _ = plan[plan[:, 0] >= 0].unbind(1)
    score = score_proj[ragged].float() + ape.float()[pos % state.ratio]
    rows = torch.cat([kv_proj[ragged].float(), score], dim=1)
    state.ring[req_pool_indices.long()[batch], pos % state.ring_rows] = rows


# ---------------------------------------------------------------------------------- public
def _check(
    state: CompressorState,
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    compress_plan: torch.Tensor,
    write_plan: torch.Tensor,
) -> None:
    ratio, d = state.ratio, state.head_dim
    check_compressed_ratio(ratio, "compressor")
    t, cd = kv_proj.shape[0], compress_overlap(ratio) * d
    want = {
        "kv_proj": (t, cd),
        "score_proj": (t, cd),
        "ape": (ratio, cd),
        "norm_weight": (d,),
        "positions": (t,),
        "compress_plan": (t, 4),
        "write_plan": (t, 4),
        "state.ring": (state.ring.shape[0], state.ring.shape[1], 2 * cd),
    }
    got = {
        "kv_proj": kv_proj,
        "score_proj": score_proj,
        "ape": ape,
        "norm_weight": norm_weight,
        "positions": positions,
        "compress_plan": compress_plan,
        "write_plan": write_plan,
        "state.ring": state.ring,
    }
    for name, tensor in got.items():
        if tuple(tensor.shape) != want[name]:
            raise ContractError(
                f"compressor (ratio {ratio}, D={d}): {name} has shape {tuple(tensor.shape)}, "
                f"expected {want[name]}"
            )
    for name in ("compress_plan", "write_plan"):
        if got[name].dtype != torch.int32:
            raise ContractError(f"compressor: {name} has dtype {got[name].dtype}, expected int32")
    if state.ring.dtype != torch.float32:
        raise ContractError(f"compressor: state.ring has dtype {state.ring.dtype}, expected fp32")
    if req_pool_indices.dim() != 1:
        raise ContractError(
            f"compressor: req_pool_indices has shape {tuple(req_pool_indices.shape)}, expected [B]"
        )
    devices = {x.device for x in (*got.values(), req_pool_indices)}
    if len(devices) != 1:
        raise ContractError(f"compressor: tensors on several devices {sorted(map(str, devices))}")


def compress_forward(
    state: CompressorState,
    kv_proj: torch.Tensor,
    score_proj: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    rope: CosSin,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    compress_plan: torch.Tensor,
    write_plan: torch.Tensor,
    *,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Entries completed by this forward's rows, then the ring updated for the next forward.

    Parameters
    ----------
    state : the layer's (or indexer's) rings; ``state.ring`` is updated in place.
    kv_proj, score_proj : ``[T, c*D]`` float — this forward's projections (scores without ape).
    ape : ``[r, c*D]`` float.
    norm_weight : ``[D]`` float RMSNorm weight.
    rope : the compressed layers' RoPE cos/sin (``AttentionState.rope``, a ``RopeTable``).
    req_pool_indices : ``[B]`` int — ring slot of each batch id.
    positions : ``[T]`` int — absolute position of each row.
    compress_plan, write_plan : ``[T, 4]`` int32 plan records of this ratio (planning/metadata.py).
    norm_eps : the RMSNorm epsilon (sglang: the compressor's ``norm.variance_epsilon``).

    Returns ``[T, D]`` float32 aligned to rows: the finished (normed, roped) entry completed by
    each row, zeros for rows that complete none. Decode is the same call with one row per
    request.
    """
    _check(state, kv_proj, score_proj, ape, norm_weight, req_pool_indices, positions,
           compress_plan, write_plan)  # fmt: skip
    # The kernels step channels and batch ids with unit stride (no-ops when already so).
    args = (state, kv_proj.contiguous(), score_proj.contiguous(), ape.contiguous(),
            req_pool_indices.contiguous())  # fmt: skip
    if dispatch.use_triton(kv_proj.device):
        pooled = _pool_triton(*args, compress_plan.contiguous())
        _write_triton(*args, write_plan.contiguous())
    else:
        pooled = _pool_torch(*args, compress_plan)
        _write_torch(*args, write_plan)
    entry_ids = torch.div(positions.long() + 1, state.ratio, rounding_mode="floor") - 1
    return finish_entries(pooled, entry_ids, norm_weight, state.ratio, rope, norm_eps)
