"""The union key lists of row groups (``kernels/attention/key_union.py``): Triton (interpreter)
== torch twin, every row sees exactly its own keys, and rows that share keys share columns.

Row lists come in the shapes serving produces: newest-first windows of consecutive positions
(verify / extend rows of one request), one list at growing lengths (c128 entries), unrelated
lists (c4 top-k of rows of different requests), with -1 holes and stale columns past a length.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from marks import needs_interpreter

from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.attention.key_union import KEY_UNION, MAX_GROUP, KeyUnion, key_union
from dsv4_backend.kernels.variants import force_variant

pytestmark = needs_interpreter

WINDOW = 128


def _windows(positions: list[int], base: int, width: int = WINDOW) -> list[list[int]]:
    """Newest-first window slots of rows at ``positions`` (slot = ``base`` + position)."""
    return [[base + q for q in range(p, max(-1, p - WINDOW), -1)][:width] for p in positions]


def _pack(lists: list[list[int]], width: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``[T, width]`` int32 (each list cut to ``width``, stale random slots past its length)
    and ``[T]`` int32 lengths."""
    lists = [row[:width] for row in lists]
    idx = torch.randint(0, 1000, (len(lists), width), generator=g, dtype=torch.int32)
    for t, row in enumerate(lists):
        idx[t, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return idx, torch.tensor([len(row) for row in lists], dtype=torch.int32)


def _union_rows(union: KeyUnion, span: int, group: int, rows: int) -> list[Counter]:
    """Per row, the multiset of valid slots the union shows it in ``span``."""
    seen = [Counter() for _ in range(rows)]
    column = 0 if span == 0 else union.extra_column
    for g in range(union.table.shape[1]):
        n = int(union.lengths[span, g])
        slots, bits = union.table[:, g, column : column + n].tolist()
        for slot, bit in zip(slots, bits, strict=True):
            for r in range(group):
                if bit >> r & 1 and slot >= 0:
                    seen[g * group + r][slot] += 1
    return seen


def _assert_exact(idx, lengths, union: KeyUnion, span: int) -> None:
    """Invariant: each row's valid slots (>= 0), with multiplicity, and nothing else."""
    rows = idx.shape[0]
    for t, got in enumerate(_union_rows(union, span, union.group, rows)):
        n = max(0, min(int(lengths[t]), idx.shape[1]))
        assert got == Counter(s for s in idx[t, :n].tolist() if s >= 0), (span, t)


def _assert_same(a: KeyUnion, b: KeyUnion) -> None:
    assert torch.equal(a.lengths, b.lengths), (a.lengths, b.lengths)
    for span, column in enumerate((0, a.extra_column)[: a.lengths.shape[0]]):
        for g in range(a.table.shape[1]):
            n = int(a.lengths[span, g])
            assert torch.equal(
                a.table[:, g, column : column + n], b.table[:, g, column : column + n]
            ), (span, g)


def _row_lists(kind: str, rows: int, g: torch.Generator) -> list[list[int]]:
    start = int(torch.randint(0, 200, (), generator=g))
    if kind == "windows":
        return _windows(list(range(start, start + rows)), 0)
    if kind == "prefixes":  # one c128 list read to each row's count
        full = torch.randperm(64, generator=g).tolist()
        return [full[: (start + t) % 40] for t in range(rows)]
    lists = []
    for _ in range(rows):  # unrelated, with -1 holes
        row = torch.randint(-1, 60, (int(torch.randint(0, 40, (), generator=g)),), generator=g)
        lists.append(row.tolist())
    return lists


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(0, 11),
    group=st.integers(1, MAX_GROUP),
    kinds=st.tuples(*[st.sampled_from(["windows", "prefixes", "unrelated"])] * 2),
    extra=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_union_is_exact_and_paths_agree(rows, group, kinds, extra, seed):
    """Invariant, any lists and group size: the union shows each row exactly its valid slots,
    and the Triton kernel writes what the torch twin writes."""
    g = torch.Generator().manual_seed(seed)
    idx, lengths = _pack(_row_lists(kinds[0], rows, g), WINDOW, g)
    eidx = elengths = None
    if extra:
        eidx, elengths = _pack(_row_lists(kinds[1], rows, g), 64, g)
    with force_variant(KEY_UNION, "triton"):
        triton_union = key_union(idx, lengths, eidx, elengths, group)
    with force_variant(KEY_UNION, "torch"):
        _assert_same(triton_union, key_union(idx, lengths, eidx, elengths, group))
    _assert_exact(idx, lengths, triton_union, 0)
    if extra:
        _assert_exact(eidx, elengths, triton_union, 1)


@pytest.mark.parametrize("group", [2, 4, 8])
def test_shared_keys_are_gathered_once(group):
    """Consecutive windows of one request: ``W + G (G - 1) / 2`` columns, not ``G W``; one
    c128 list at growing lengths: the longest; rows of two requests in one group: the leader's
    request's union, then the other request's rows whole (nothing of theirs to align to)."""
    g = torch.Generator().manual_seed(group)
    idx, lengths = _pack(_windows(list(range(300, 300 + group)), 0), WINDOW, g)
    full = list(range(500, 540))
    eidx, elengths = _pack([full[: 30 + t] for t in range(group)], 64, g)
    union = key_union(idx, lengths, eidx, elengths, group)
    assert union.lengths[:, 0].tolist() == [WINDOW + group * (group - 1) // 2, 30 + group - 1]

    half = group // 2
    two = _windows(list(range(300, 300 + half)), 0) + _windows(list(range(90, 90 + half)), 2000)
    idx, lengths = _pack(two, WINDOW, g)
    union = key_union(idx, lengths, None, None, group)
    leader_request = WINDOW + half * (half - 1) // 2
    assert union.lengths[0, 0] == leader_request + sum(91 + j for j in range(half))
    _assert_exact(idx, lengths, union, 0)


def test_bad_group_is_refused():
    idx, lengths = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    for bad in (0, MAX_GROUP + 1):
        with pytest.raises(BatchError, match=f"group={bad}"):
            key_union(idx, lengths, None, None, bad)
    with pytest.raises(BatchError, match=r"lengths of shape \(3,\)"):
        key_union(idx, torch.ones(3, dtype=torch.int32), None, None, 2)
