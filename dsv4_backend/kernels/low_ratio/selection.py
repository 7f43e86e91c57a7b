"""DeepSeek-V4.1's index selection (docs/design.md §8), torch without a host sync: an index
source's full top-k, the candidate blocks the candidate source publishes, a candidate
consumer's top-k among them, over the scores of ``table.py``'s variant, written as slots.

Shapes: ``T`` rows, ``K`` ``index_topk``, ``N`` score columns (the entries the page table
addresses), ``NB`` candidate blocks a row keeps. Ties: equal scores go to the lower entry
(equal block keys to the lower block), as the reference orders them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dsv4_backend.kernels.indexer.common import IndexCall, entry_slots
from dsv4_backend.kernels.indexer.topk import best_columns as topk_columns
from dsv4_backend.kernels.low_ratio.table import low_ratio_scores

#: Bytes of scores and gathered keys one chunk of rows may hold (the selection works on row
#: chunks so that a long prefill does not hold ``[T, N, DI]`` keys at once).
_CHUNK_BYTES = 1 << 28


def best_columns(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, k]`` int64 ids of each row's ``k`` best ``allowed`` columns (equal scores: the
    lower id), in no particular order, -1 for the rest of a row with fewer: the indexer's
    top-k (``kernels/indexer/topk.py``: flashinfer's on CUDA, a stable sort elsewhere)."""
    masked = scores.masked_fill(~allowed, float("-inf"))
    if masked.shape[1] <= k:  # the top-k takes more columns than it keeps
        pad = masked.new_full((masked.shape[0], k + 1 - masked.shape[1]), float("-inf"))
        masked = torch.cat((masked, pad), 1)
    ids = topk_columns(masked, k).long()
    kept = torch.cat((allowed, allowed.new_zeros(allowed.shape[0], 1)), 1)
    return torch.where(kept.gather(1, ids.clamp(max=allowed.shape[1])), ids, -1)


def publish_blocks(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, num_blocks: int
) -> torch.Tensor:
    """``[T, num_blocks]`` int64 candidate blocks, unordered: the newest block (keyed +inf) and
    the best by their largest score (equal: the lower block); -1 past a row's block count."""
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
    call: IndexCall,
    topk: int,
    out_slots: torch.Tensor,
    *,
    among_blocks: tuple[torch.Tensor, int] | None = None,
    publish: tuple[torch.Tensor, int] | None = None,
) -> None:
    """An index source's selection: each row's ``topk`` best visible entries, their slots
    written to ``out_slots`` ``[T, topk]`` (ascending entry order, -1 padded).

    ``call``: the index scores' (``table.low_ratio_scores``): the fp4 queries, head weights,
    the kv source's index keys, page table and visible entries of each row, ``N`` score
    columns and the ratio's entries a page. ``among_blocks`` ``(blocks [T, NB], block_size)``:
    a candidate consumer's, only entries of those blocks count. ``publish`` ``(out [T, NB],
    block_size)``: the candidate source's, its candidate blocks written to ``out``.
    """
    q, visible, width = call.q_idx, call.num_candidates, call.max_candidates
    rows = q.shape[0]
    per_row = width * (q.shape[1] + q.shape[2] + 2) * 4
    chunk = max(1, _CHUNK_BYTES // per_row)
    for start in range(0, rows, chunk):
        part = slice(start, min(rows, start + chunk))
        page_table = call.page_table[part]
        scores = low_ratio_scores(
            replace(
                call,
                q_idx=q[part],
                weights=call.weights[part],
                page_table=page_table,
                num_candidates=visible[part],
            )
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
        slots = entry_slots(page_table, ids, call.entries_per_page)
        out_slots[part] = slots.to(out_slots.dtype)
