"""Compress and write plans of one compress ratio (plan records of ``planning/metadata.py``).

Both plans are ``[T, 4]`` int32 records ``(ragged_id, batch_id, position, window_len)``: the
valid records first, in row order, then rows of ``-1``. The shape depends on ``T`` only, so the
plans can be built inside a CUDA graph: the valid rows are compacted with a cumulative sum and a
scatter, never with ``nonzero`` or a host sync. This torch function is the reference the TVM
kernel (symbolic shapes) must match exactly.
"""

from __future__ import annotations

import torch

from dsv4_backend.config import check_compressed_ratio, compress_span
from dsv4_backend.planning.kernels.compress_plan_call import CompressPlanCall


def _compact(records: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rows of ``records`` [T, 4] where ``valid`` [T] bool, first and in order; then -1 rows."""
    rows = records.shape[0]
    dest = torch.cumsum(valid, 0) - 1
    # Invalid rows all land in a spare row ``T`` that is dropped afterwards.
    dest = torch.where(valid, dest, rows)
    out = records.new_full((rows + 1, records.shape[1]), -1)
    out.index_copy_(0, dest, records)
    return out[:rows]


def compute_compress_plans(call: CompressPlanCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress plan and write plan of ``call.ratio`` for its ``T`` query rows.

    Returns
    -------
    ``(compress_plan, write_plan)``, each ``[T, 4]`` int32 records
    ``(ragged_id, batch_id, position, window_len)``, valid records first in row order, then
    ``-1`` rows. The compress plan lists rows with ``(position + 1) % ratio == 0``; the write
    plan rows with ``position >= (seq_len // ratio) * ratio`` (``- ratio`` for ratio 4) and,
    for ratio 4, the last ``ratio`` positions of every page (``position % page_size >=
    page_size - ratio``): the block a request starting from that cached, page-aligned prefix
    pools first, kept in the page's own (page-scoped) ring.
    ``window_len = min(span, position - first_new_position + 1)`` with span 8 (c4) / 128 (c128).
    """
    row_batch_ids, positions, first_new_positions, request_seq_lens, ratio, page_size = call
    check_compressed_ratio(ratio, "compress plan")
    positions = positions.long()
    ragged_ids = torch.arange(positions.shape[0], device=positions.device)
    window_len = torch.clamp(positions - first_new_positions + 1, max=compress_span(ratio))
    records = torch.stack((ragged_ids, row_batch_ids.long(), positions, window_len), dim=1).to(
        torch.int32
    )
    keep_from = (request_seq_lens.long() // ratio) * ratio - (ratio if ratio == 4 else 0)
    keep = positions >= keep_from
    if ratio == 4:
        keep |= positions % page_size >= page_size - ratio
    compress_plan = _compact(records, (positions + 1) % ratio == 0)
    write_plan = _compact(records, keep)
    return compress_plan, write_plan
