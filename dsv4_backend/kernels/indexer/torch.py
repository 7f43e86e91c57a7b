"""The lightning indexer's torch variant: the plain implementation (CPU without the
interpreter, meta tensors) of its scores and its selection."""

from __future__ import annotations

import torch

from dsv4_backend.kernels.indexer.common import IndexCall, SelectCall, entry_slots, select_entries


def indexer_scores_torch(call: IndexCall) -> torch.Tensor:
    """``[T, max_candidates]`` fp32 scores of each row's first ``num_candidates`` entries (-inf
    past them); ``entries_per_page`` entries a full-cache page (c4, or DeepSeek-V4.1's c1 /
    c2)."""
    cols = torch.arange(call.max_candidates, device=call.q_idx.device)
    valid = cols[None, :] < call.num_candidates[:, None]
    slots = entry_slots(call.page_table, torch.where(valid, cols, -1), call.entries_per_page)
    k = call.keys.gather(slots)  # [T, N, DI]
    dots = torch.einsum("thd,tnd->thn", call.q_idx.float(), k)
    scores = torch.einsum("th,thn->tn", call.weights.float(), dots.relu())
    return scores.masked_fill(~valid, float("-inf"))


def select_topk_torch(call: SelectCall) -> None:
    """``select_topk`` off the Triton paths: ``out`` receives the c4 slots of the entries
    ``select_entries`` selects."""
    selected = select_entries(call.scores, call.num_candidates, call.topk)
    call.out.copy_(entry_slots(call.page_table, selected))
