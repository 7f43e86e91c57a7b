"""Per-step write slots of a multi-step EAGLE draft (docs/design.md §5, "Per-step draft slots")."""

from __future__ import annotations

import torch

from dsv4_backend.errors import BatchError
from dsv4_backend.planning.batch import DraftStep


def per_step_draft_out_cache_loc(
    out_cache_loc: torch.Tensor, batch_size: int, topk: int, num_steps: int
) -> torch.Tensor:
    """Split a draft batch's write slots into one contiguous row per step.

    Parameters
    ----------
    out_cache_loc : ``[batch_size * topk * num_steps]`` int64, laid out
        ``[batch_size, topk, num_steps]`` (each request's slots are contiguous).

    Returns
    -------
    ``[num_steps, batch_size * topk]`` int64, contiguous: row ``i`` holds the slots step ``i``
    writes, ordered by request then topk branch. (A permuted view would have row stride
    ``num_steps``, which pointer-arithmetic store kernels ignore.)
    """
    expected = batch_size * topk * num_steps
    if out_cache_loc.dim() != 1 or out_cache_loc.numel() != expected:
        raise BatchError(
            f"out_cache_loc has shape {tuple(out_cache_loc.shape)}; expected batch_size * topk * "
            f"num_steps = {batch_size} * {topk} * {num_steps} = {expected} slots"
        )
    steps = out_cache_loc.view(batch_size, topk, num_steps).permute(2, 0, 1)
    return steps.reshape(num_steps, batch_size * topk).contiguous()


def draft_step_slots(out_cache_loc: torch.Tensor, batch_size: int, step: DraftStep) -> torch.Tensor:
    """Step ``step``'s write slots of a draft batch's ``[batch_size, topk, num_steps]`` buffer,
    ``[batch_size * topk]``, without a copy where the layout allows (topk 1: a strided view).
    The row of ``per_step_draft_out_cache_loc`` for that step."""
    steps = out_cache_loc.view(batch_size, step.topk, step.num_steps)
    return steps[:, :, step.step_id].reshape(-1)
