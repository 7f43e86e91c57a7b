"""DeepSeek-V4.1's late-layer tail: the rows the late layers of an extend run over under the
decoder SWA bounded replay (docs/design.md §8).

From ``late_layer_start`` (``DSV4AttentionConfig.late_layer_start``: the last kv source) on, an
extend computes each request's last ``min(tail_len, extend_len)`` rows only (its whole extend
where the host needs every row: prompt logprobs, every hidden state). The late layers' window
keys then exist for those rows, so a tail row reads its window from the request's
``seq_len - tail_len`` on (for a whole extend, ``prefix - tail_len``, which cuts nothing): the
window floor. The kv source itself compresses every row before the tail starts, so the late
layers' c1 entries are complete.

:func:`late_layer_tail` gives the tail as an EXTEND ``BatchView`` of the tail rows (the same
requests and lengths, the tail rows' write slots, ``window_floors``), planned by the one
planner like any batch, and the tail rows' indices into the extend.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4_backend.errors import BatchError
from dsv4_backend.planning.batch import BatchView, ForwardKind


@dataclass(frozen=True)
class LateLayerTail:
    """The tail of one extend batch.

    Attributes
    ----------
    batch : the EXTEND batch of the tail rows: request ``b`` has ``tail_lens[b]`` rows at
        positions ``seq_len - tail_lens[b] ... seq_len - 1``, writing their slots of the
        extend's ``out_cache_loc``, window floors set.
    token_indices : ``[sum(tail_lens)]`` int64 — each tail row's row in the extend.
    tail_lens : host rows of each request in the tail.
    window_floors : host window floor of each request (``batch.window_floors``).
    contiguous_start : the first tail row when the tail is the extend's last rows (one
        request), else None.
    """

    batch: BatchView
    token_indices: torch.Tensor
    tail_lens: list[int]
    window_floors: list[int]
    contiguous_start: int | None


def late_layer_tail(
    batch: BatchView, tail_len: int, whole_extend: Sequence[bool] | None = None
) -> LateLayerTail:
    """The late-layer tail of EXTEND ``batch`` (module docstring): each request's last
    ``min(tail_len, extend_len)`` rows, or all of them where ``whole_extend[b]``."""
    if batch.kind is not ForwardKind.EXTEND:
        raise BatchError(f"a late-layer tail is an EXTEND batch's, got kind {batch.kind.name}")
    prefix, extend = batch.extend_prefix_lens, batch.extend_seq_lens
    assert prefix is not None and extend is not None  # BatchView requires them for EXTEND
    whole = list(whole_extend) if whole_extend is not None else [False] * len(extend)
    if len(whole) != len(extend):
        raise BatchError(f"whole_extend has {len(whole)} entries, expected {len(extend)}")
    tails = [n if w else min(tail_len, n) for n, w in zip(extend, whole, strict=True)]
    seq = [p + n for p, n in zip(prefix, extend, strict=True)]
    floors = [
        max(0, s - t - tail_len) if w else max(0, s - tail_len)
        for s, t, w in zip(seq, tails, whole, strict=True)
    ]
    device = batch.out_cache_loc.device
    token_indices = torch.tensor(_tail_tokens(extend, tails), dtype=torch.int64, device=device)
    tail = dataclasses.replace(
        batch,
        out_cache_loc=batch.out_cache_loc[token_indices],
        extend_prefix_lens=[s - t for s, t in zip(seq, tails, strict=True)],
        extend_seq_lens=tails,
        window_floors=floors,
    )
    contiguous = extend[0] - tails[0] if len(extend) == 1 else None
    return LateLayerTail(tail, token_indices, tails, floors, contiguous)


def _tail_tokens(extend: Sequence[int] | torch.Tensor, tails: Sequence[int]) -> list[int]:
    """Each tail row's row in the extend: request ``b``'s last ``tails[b]`` of ``extend[b]``
    (host lengths; ``BatchView`` holds them as ints)."""
    ends = itertools.accumulate(int(n) for n in extend)
    return [i for end, t in zip(ends, tails, strict=True) for i in range(end - t, end)]


@dataclass(frozen=True)
class TailCPLayout:
    """A prefill context-parallel rank's share of a late-layer tail. Under sglang's interleave
    layout extend token ``i`` is rank ``i % cp``'s, so a tail row is the rank's that owns its
    token; every rank's tail rows are padded to the largest share for the collectives.

    Attributes
    ----------
    rank_rows : host tail rows of each rank.
    local_rows : ``[n]`` int64 — this rank's tail rows (rows of the tail), in order.
    gather_index : ``[T]`` int64 — each tail row's row in the rank-major all-gather of every
        rank's rows, each rank's padded to ``max(rank_rows)``.
    local_index : ``[max(rank_rows)]`` int64 — ``local_rows``, then this rank's padding rows:
        rows past the tail, distinct across the ranks.
    local_token_indices : ``[n]`` int64 — each of this rank's tail rows among the rank's own
        extend rows (token ``i`` is the rank's row ``i // cp``).
    local_lens : host tail rows of each request on this rank.
    """

    rank_rows: list[int]
    local_rows: torch.Tensor
    gather_index: torch.Tensor
    local_index: torch.Tensor
    local_token_indices: torch.Tensor
    local_lens: list[int]

    @property
    def max_rows(self) -> int:
        """Every rank's padded tail rows."""
        return max(self.rank_rows)


def tail_cp_layout(batch: BatchView, tail: LateLayerTail, rank: int, size: int) -> TailCPLayout:
    """Rank ``rank`` of ``size``'s share of ``tail``, the tail of ``batch`` (``TailCPLayout``;
    from host lengths: no device read)."""
    if not 0 <= rank < size:
        raise BatchError(f"CP rank {rank} of {size}: expected 0 <= rank < size")
    assert batch.extend_seq_lens is not None  # an EXTEND batch's (late_layer_tail checks it)
    tokens = _tail_tokens(batch.extend_seq_lens, tail.tail_lens)
    owners = [t % size for t in tokens]
    rank_rows = [owners.count(r) for r in range(size)]
    width = max(rank_rows, default=0)
    seen = [0] * size
    gather, local = [], []
    for row, owner in enumerate(owners):
        gather.append(owner * width + seen[owner])
        seen[owner] += 1
        if owner == rank:
            local.append(row)
    pad_start = len(tokens) + sum(width - n for n in rank_rows[:rank])
    padding = list(range(pad_start, pad_start + width - rank_rows[rank]))
    requests = [b for b, n in enumerate(tail.tail_lens) for _ in range(n)]
    per_request = Counter(requests[row] for row in local)
    device = tail.token_indices.device

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return TailCPLayout(
        rank_rows=rank_rows,
        local_rows=ints(local),
        gather_index=ints(gather),
        local_index=ints(local + padding),
        local_token_indices=ints([(tokens[row] - rank) // size for row in local]),
        local_lens=[per_request[b] for b in range(len(tail.tail_lens))],
    )
