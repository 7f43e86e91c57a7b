"""DeepSeek-V4.1's low-ratio ops in torch (docs/design.md §8): the ratio-2 pair pooling over
the pair ring, the entries and index keys of a kv source, and an index source's selection (the
full top-k, the candidate blocks it publishes, the top-k among them). No Triton kernels yet:
these run on every device, a GPU included.

Shapes: ``T`` rows, ``D`` head dim, ``HI`` / ``DI`` indexer heads / head dim, ``K``
``index_topk``, ``N`` score columns (entries the page table can address), ``NB`` candidate
blocks a row keeps. Entry ``e`` of a row's request lives at slot ``page_table[t, e * r // 256]
* (256 // r) + e % (256 // r)`` of the kv source's caches.
"""

from __future__ import annotations

import torch

from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache, fp4_round_e4m3, fp4_round_ue8m0
from dsv4_backend.cache.state import CompressorState
from dsv4_backend.config import REQUIRED_PAGE_SIZE, entries_per_page
from dsv4_backend.ops.norm import rms_norm
from dsv4_backend.ops.rope import apply_rope

#: Bytes of scores and gathered keys one chunk of rows may hold (the torch selection works on
#: row chunks so that a long prefill does not hold ``[T, N, DI]`` keys at once).
_CHUNK_BYTES = 1 << 28


def bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to bf16 (nearest even), as the model's bf16 tensors hold it."""
    return x.bfloat16().float()


# --------------------------------------------------------------------------- compressors
def pair_pool(
    rings: CompressorState,
    kv: torch.Tensor,
    score: torch.Tensor,
    req_rows: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
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
    ring = rings.ring
    rows_per_slot = ring.shape[1]
    d = kv.shape[1]
    req = torch.where(valid, req_rows, 0)
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


def latents(pooled: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm(bf16(pooled))`` rounded to bf16: the entries before RoPE, ``[T, D]`` float32."""
    return bf16(rms_norm(bf16(pooled), norm_weight, eps))


def entries(latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Compressed entries: ``latent`` ``[T, D]`` roped at each entry's first position
    (``cos`` / ``sin`` ``[T, R/2]``), rounded to bf16, then to fp4 with e4m3 scales."""
    return fp4_round_e4m3(bf16(apply_rope(latent, cos, sin)))


def index_keys(
    latent: torch.Tensor,
    wk: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """A kv source's index keys ``[T, DI]`` float32: ``bf16(latent @ wk^T)`` (``wk`` ``[DI,
    D]``), ``k_norm`` rounded to bf16, RoPE rounded to bf16, fp4 with ue8m0 scales."""
    projected = bf16(latent @ wk.float().T)
    normed = bf16(rms_norm(projected, k_norm_weight, eps))
    return fp4_round_ue8m0(bf16(apply_rope(normed, cos, sin)))


def index_queries(q_proj: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """An index source's queries ``[T, HI, DI]`` float32 from ``wq_b(q_lora)`` (bf16 values):
    RoPE at the rows' positions rounded to bf16, fp4 with ue8m0 scales."""
    return fp4_round_ue8m0(bf16(apply_rope(bf16(q_proj.float()), cos, sin)))


# ----------------------------------------------------------------------------- selection
def entry_slots(page_table: torch.Tensor, entry_ids: torch.Tensor, ratio: int) -> torch.Tensor:
    """Slots (int64, same shape as ``entry_ids`` ``[T, n]``) of each row's entries in a c1 / c2
    cache; -1 stays -1."""
    per_page = entries_per_page(ratio)
    safe = entry_ids.clamp(min=0)
    pages = page_table.long().gather(1, safe * ratio // REQUIRED_PAGE_SIZE)
    return torch.where(entry_ids >= 0, pages * per_page + safe % per_page, -1)


def _scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: Fp4IndexKeyCache,
    page_table: torch.Tensor,
    visible: torch.Tensor,
    ratio: int,
    width: int,
) -> torch.Tensor:
    """``[T, width]`` float32 ``sum_h w_h relu(q_h . k_e)`` of entries ``e < visible``; -inf
    elsewhere."""
    cols = torch.arange(width, device=q.device)
    valid = cols[None, :] < visible[:, None]
    ids = torch.where(valid, cols[None, :], -1)
    k = keys.gather(entry_slots(page_table, ids, ratio))  # [T, N, DI]
    dots = torch.einsum("thd,tnd->thn", q.float(), k).relu()
    scores = torch.einsum("th,thn->tn", weights.float(), dots)
    return scores.masked_fill(~valid, float("-inf"))


def best_columns(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, k]`` int64 ids of each row's ``k`` best ``allowed`` columns (equal scores: the
    lower id first), -1 past a row's allowed count."""
    order = torch.sort(
        scores.masked_fill(~allowed, float("-inf")), dim=1, descending=True, stable=True
    )
    ids = order.indices[:, :k]
    if ids.shape[1] < k:
        ids = torch.cat((ids, ids.new_full((ids.shape[0], k - ids.shape[1]), -1)), 1)
    counts = allowed.sum(1, keepdim=True)
    return torch.where(torch.arange(k, device=ids.device)[None, :] < counts, ids, -1)


def publish_blocks(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, num_blocks: int
) -> torch.Tensor:
    """``[T, num_blocks]`` int64 candidate blocks (the newest block first, then the best by
    their largest score; equal: the lower block), -1 past a row's block count."""
    rows, width = scores.shape
    padded = -(-width // block_size) * block_size
    wide = torch.full((rows, padded), float("-inf"), device=scores.device)
    wide[:, :width] = scores
    keys = wide.unflatten(1, (-1, block_size)).amax(2)  # [T, blocks]
    blocks = (visible.long() + block_size - 1) // block_size
    ids = torch.arange(keys.shape[1], device=scores.device)[None, :]
    newest = (blocks - 1)[:, None]
    keys = torch.where(ids == newest, float("inf"), keys)
    return best_columns(keys, ids < blocks[:, None], num_blocks)


def select_entries(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: Fp4IndexKeyCache,
    page_table: torch.Tensor,
    visible: torch.Tensor,
    ratio: int,
    topk: int,
    out_slots: torch.Tensor,
    *,
    among_blocks: tuple[torch.Tensor, int] | None = None,
    publish: tuple[torch.Tensor, int] | None = None,
) -> None:
    """An index source's selection: each row's ``topk`` best visible entries, their slots
    written to ``out_slots`` ``[T, topk]`` (ascending entry order, -1 padded).

    ``q`` ``[T, HI, DI]`` (fp4 queries), ``weights`` ``[T, HI]``, ``keys`` the kv source's
    index keys, ``visible`` ``[T]`` int. ``among_blocks`` ``(blocks [T, NB], block_size)``: a
    candidate consumer's, only entries of those blocks count. ``publish`` ``(out [T, NB],
    block_size)``: the candidate source's, its candidate blocks written to ``out``.
    """
    rows = q.shape[0]
    width = max(1, page_table.shape[1] * entries_per_page(ratio))
    per_row = width * (q.shape[1] + q.shape[2] + 2) * 4
    chunk = max(1, _CHUNK_BYTES // per_row)
    for start in range(0, rows, chunk):
        part = slice(start, min(rows, start + chunk))
        scores = _scores(
            q[part], weights[part], keys, page_table[part], visible[part], ratio, width
        )
        cols = torch.arange(width, device=q.device)[None, :]
        allowed = cols < visible[part, None]
        if among_blocks is not None:
            blocks, block_size = among_blocks
            kept = torch.zeros(
                (scores.shape[0], -(-width // block_size) + 1), dtype=torch.bool, device=q.device
            )
            chosen = blocks[part].long()
            kept.scatter_(1, torch.where(chosen >= 0, chosen, kept.shape[1] - 1), True)
            allowed &= kept[:, :-1].repeat_interleave(block_size, 1)[:, :width]
        if publish is not None:
            out_blocks, block_size = publish
            out_blocks[part] = publish_blocks(
                scores, visible[part], block_size, out_blocks.shape[1]
            ).to(out_blocks.dtype)
        ids = best_columns(scores, allowed, topk)
        ids = torch.where(ids >= 0, ids, width).sort(1).values  # ascending, -1s last
        ids = torch.where(ids < width, ids, -1)
        out_slots[part] = entry_slots(page_table[part], ids, ratio).to(out_slots.dtype)
