"""DeepSeek-V4.1's low-ratio ops in torch (docs/design.md §8): the ratio-2 pair pooling over
the pair ring, and the torch variant of ``table.py``'s rows (entries, index keys, index
queries); the index scores' torch variant is the lightning indexer's (the selection over them
is ``selection.py``'s). They run on every device, a GPU included, without a host sync.

Shapes: ``T`` rows, ``D`` head dim, ``HI`` / ``DI`` indexer heads / head dim. Entry ``e`` of a
row's request lives at slot ``page_table[t, e // E] * E + e % E`` of the kv source's caches
(``E = 256 / r``, ``indexer.common.entry_slots``).
"""

from __future__ import annotations

import torch

from dsv4_backend.cache.fp4_format import fp4_round_e4m3, fp4_round_ue8m0
from dsv4_backend.kernels.low_ratio.common import PairCall, RowsCall
from dsv4_backend.ops.norm import rms_norm
from dsv4_backend.ops.rope import apply_rope


def bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to bf16 (nearest even), as the model's bf16 tensors hold it."""
    return x.bfloat16().float()


def pair_pool(call: PairCall) -> torch.Tensor:
    """Ratio 2: each row pooled with the token before it, ``[T, D]`` float32 (meaningful on
    odd positions: the pair ``(p - 1, p)``), by a per-channel softmax of the two scores.

    The partner is the previous row when it is the same request's previous position, else
    the pair ring's row ``(request, (p - 1) % R)``; then every ring row a row maps to,
    ``(request, p % R)``, takes the ``[kv | score]`` of the request's last row mapping there.
    ``kv`` / ``score`` ``[T, D]`` float32, ``req_rows`` ``[T]`` int64 (request pool row of each
    row), ``positions`` ``[T]`` int64, ``valid`` ``[T]`` bool (False: a graph bucket's padding
    row, which writes only the padding pool row 0). A request's rows are consecutive, with
    consecutive positions. No host sync (a CUDA graph captures it). Updates ``rings.ring``.
    """
    kv, score, positions, valid = call.kv, call.score, call.positions, call.valid
    ring = call.rings.ring
    rows_per_slot = ring.shape[1]
    d = kv.shape[1]
    req = torch.where(valid, call.req_rows, 0)
    previous = torch.zeros_like(valid)
    previous[1:] = (req[1:] == req[:-1]) & (positions[1:] == positions[:-1] + 1) & valid[:-1]
    carried = ring[req, (positions - 1).remainder(rows_per_slot)]  # [T, 2D]
    partner_kv = torch.where(previous[:, None], kv.roll(1, 0), carried[:, :d])
    partner_score = torch.where(previous[:, None], score.roll(1, 0), carried[:, d:])
    weights = torch.softmax(torch.stack((partner_score, score)), dim=0)
    pooled = weights[0] * partner_kv + weights[1] * kv
    # Rows sharing a ring row all write the last one's value: no write order matters.
    last = req.new_full((ring.shape[0],), -1).scatter_reduce(0, req, positions, "amax")
    rows = torch.arange(positions.shape[0], device=positions.device)
    winner = rows + rows_per_slot * ((last[req] - positions) // rows_per_slot)
    ring[req, positions % rows_per_slot] = torch.cat((kv, score), 1)[winner]
    return pooled


def fp4_rows_torch(call: RowsCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``table.low_ratio_rows`` in torch: ``bf16(x)``, then (``norm``) ``RMSNorm`` rounded to
    bf16, RoPE rounded to bf16, fp4 with ``scale``'s block scales."""
    y = bf16(call.x.float())
    normed = None
    if call.norm is not None:
        weight, eps = call.norm
        y = normed = bf16(rms_norm(y, weight, eps))
    roped = bf16(apply_rope(y, call.cos, call.sin))  # [N, H, D]: every head at its position
    out = fp4_round_e4m3(roped) if call.scale == "e4m3" else fp4_round_ue8m0(roped)
    if call.store is not None:
        cache, slots = call.store
        cache.store(out, slots)
    return out, normed
