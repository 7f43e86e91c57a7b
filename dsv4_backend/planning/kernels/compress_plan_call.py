"""The compress plans' call: what every variant of ``table.py``'s ``COMPRESS_PLANS`` takes
(``compress_plan_torch.py``, ``compress_plan_tvm.py``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsv4_backend.config import REQUIRED_PAGE_SIZE


class CompressPlanCall(NamedTuple):
    """The inputs of the compress and write plans of ``ratio`` for ``T`` query rows.

    Attributes
    ----------
    row_batch_ids : ``[T]`` int32 — request of each row.
    positions : ``[T]`` int64 — absolute position of each row.
    first_new_positions : ``[T]`` int64 — position of the first row of this row's request in
        this forward (earlier tokens come from the compressor state ring).
    request_seq_lens : ``[T]`` int32 — the shortest length the row's request can have after
        this forward (``keep_len`` of ``planning/metadata.py``: ``seq_lens + 1`` for verify).
    ratio : 4 or 128.
    page_size : tokens per KV page (the window pages that scope the c4 rings).
    """

    row_batch_ids: torch.Tensor
    positions: torch.Tensor
    first_new_positions: torch.Tensor
    request_seq_lens: torch.Tensor
    ratio: int
    page_size: int = REQUIRED_PAGE_SIZE
