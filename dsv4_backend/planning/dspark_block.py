"""The plan of a DSpark draft block (docs/design.md §5, "DSpark draft blocks").

DSpark, the draft head of the official DeepSeek-V4 checkpoints, drafts ``g`` tokens of a request
in one forward of its window-only stages: the anchor (the last token the target sampled) at
position ``L = seq_lens[b]`` and ``g - 1`` mask tokens after it, at ``L ... L + g - 1``. sglang
0.5.23 runs it as a TARGET_VERIFY batch on the draft worker (``seq_lens = L``, ``g`` write slots
per request, the slots the target's verify of the block writes next) and plans it like sglang's
``init_forward_metadata_dspark_draft_block``: every row of the block attends to the same keys,

* the request's last ``C = min(L, W, L - valid_from)`` committed positions ``L - C ... L - 1``
  (their draft keys were injected from the target's hidden states), then
* all ``g`` keys of the block itself (no causal mask inside the block),

so ``swa_topk_lengths = C + g`` on each row, in ``swa_page_indices`` of
``dspark_swa_width(config, g)`` columns. The block is window only (no c4 / c128 fields). A
DSpark block is therefore not a decode row of length ``p + 1`` (design §2's invariant); its
reference is ``testing.reference.reference_dspark_block``.

The rows, their write slots and their checks are a verify batch's (``planner.verify_rows``,
``planner.checked_rows``: a write slot must be the one ``req_to_token`` holds), and so the key
slots of the block are read from ``req_to_token`` like the context's. Shapes depend on the row
count only and nothing reads the device on the host (CUDA graphs), except in strict mode.
"""

from __future__ import annotations

import math

import torch

from dsv4_backend.config import SWA_INDEX_ALIGN, DSV4AttentionConfig
from dsv4_backend.errors import BatchError
from dsv4_backend.planning import planner
from dsv4_backend.planning.batch import BatchView, ForwardKind
from dsv4_backend.planning.metadata import AttentionMetadata
from dsv4_backend.planning.planner import PlanWidths


def dspark_swa_width(config: DSV4AttentionConfig, block_size: int) -> int:
    """Columns of a block's ``swa_page_indices``: ``W + g`` rounded up to ``SWA_INDEX_ALIGN``."""
    if block_size < 1:
        raise BatchError(f"DSpark block_size={block_size}; expected >= 1")
    return math.ceil((config.window_size + block_size) / SWA_INDEX_ALIGN) * SWA_INDEX_ALIGN


def plan_dspark_block(
    config: DSV4AttentionConfig,
    batch: BatchView,
    *,
    widths: PlanWidths | None = None,
    valid_from: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Plan a DSpark draft block: ``g = batch.num_draft_tokens`` rows per request, window only.

    Parameters
    ----------
    config : the draft model's attention configuration (its layers are window only).
    batch : a ``DSPARK_BLOCK`` view: ``seq_lens = L`` (committed tokens), ``out_cache_loc``
        ``[B * g]`` the block's full-cache write slots, request by request.
    widths : fixed ``page_table`` width (CUDA graphs); None derives it from the host lengths.
        The page table is not read by a window-only forward; it is kept for the plan's shape.
    valid_from : optional ``[pool_rows]`` int — per ``req_to_token`` row, the first position
        whose draft window key this request wrote (sglang's ``swa_valid_from``); positions
        below it are left out of the context. None: every position.

    Returns an ``AttentionMetadata`` of kind ``DSPARK_BLOCK`` (module docstring), tagged with
    the batch; raises ``BatchError`` as ``plan`` does (index ranges, write slots, lengths).
    """
    if batch.kind is not ForwardKind.DSPARK_BLOCK:
        raise BatchError(f"plan_dspark_block needs a DSPARK_BLOCK batch, got {batch.kind.name}")
    block = batch.rows_per_request or 0
    host = batch.host_seq_lens
    host_lens = None if host is None else [s + block for s in host]
    widths = planner.resolve_widths(config, batch, host_lens, widths)
    rows_in = planner.verify_rows(batch)
    # Every row reads up to W committed keys (L - W ... L - 1): all of them are checked.
    req, rows, pending = planner.checked_rows(
        config, batch, rows_in, widths.page_table, context_keys=config.window_size
    )
    committed = rows.first_new  # [T] L of the row's request
    context = committed.clamp(max=config.window_size)
    if valid_from is not None:
        written = committed - valid_from.long()[req]
        context = torch.minimum(context, written.clamp(min=0))
    width = dspark_swa_width(config, block)
    column = torch.arange(width, device=committed.device)
    key_pos = committed[:, None] - context[:, None] + column
    valid = column < (context + block)[:, None]
    last = batch.req_to_token.shape[1] - 1
    slots = batch.req_to_token[req[:, None], key_pos.clamp(0, last)].long()
    if batch.full_to_swa is not None:
        slots = batch.full_to_swa[slots]
    page_table = planner.plan_page_table(
        batch.req_to_token, req, rows.request_lens, widths.page_table, config.page_size
    )
    return AttentionMetadata(
        kind=batch.kind,
        batch_size=batch.batch_size,
        num_rows=batch.num_rows,
        max_request_rows=planner.max_request_rows(batch),
        row_batch_ids=rows.batch_ids,
        page_table=page_table,
        swa_out_loc=planner.swa_write_slots(batch, rows.out_loc),
        positions_causal=rows.positions,
        swa_page_indices=torch.where(valid, slots, -1).int(),
        swa_topk_lengths=(context + block).int(),
        tag=planner.batch_tag(batch),
        pending_checks=pending,
    )
