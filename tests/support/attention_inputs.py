"""Inputs of the sparse-attention tests: token caches of given rows, random keys and index
lists, and one request laid out in caches as the planner indexes it (the tiny configuration).
"""

from __future__ import annotations

import torch

from dsv4_backend.cache import TokenCache
from dsv4_backend.config import WINDOW_PAGE_TOKENS, DSV4AttentionConfig
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.cache_store.table import store_rows

TINY = DSV4AttentionConfig.tiny()
ROPE = TINY.rope_dim
#: fp8 page sizes of the three token caches (cache-format.md).
PAGE_TOKENS = {0: WINDOW_PAGE_TOKENS, 4: 64, 128: 2}


def make_cache(
    rows: torch.Tensor, page_tokens: int, fmt: str, dtype: torch.dtype = torch.float32
) -> TokenCache:
    """A token cache holding ``rows`` ``[num_slots, D]`` at slots ``0 ... num_slots-1``."""
    cache = TokenCache(rows.shape[0], rows.shape[1], ROPE, page_tokens, fmt, dtype)
    with dispatch.force_path("torch"):
        store_rows(cache, rows, torch.arange(rows.shape[0]))
    return cache


def random_keys(num: int, dim: int, g: torch.Generator) -> torch.Tensor:
    """Random keys, bf16 values in fp32 (so every storage format holds the rope part exactly)."""
    return torch.randn(num, dim, generator=g).bfloat16().float()


def random_indices(
    lengths: list[int], width: int, num_slots: int, g: torch.Generator, holes: float = 0.25
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, width]`` int32 random slots with ``-1`` holes, and ``[T]`` int32 lengths.

    Columns at or past a row's length hold stale slots, which the op must ignore.
    """
    idx = torch.randint(0, num_slots, (len(lengths), width), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < holes] = -1
    return idx, torch.tensor(lengths, dtype=torch.int32)


def request_inputs(
    ratio: int, seq_len: int, positions: list[int], fmt: str, seed: int
) -> tuple[list, tuple]:
    """One request of ``seq_len`` tokens laid out in caches at shuffled slots, indexed for the
    query rows at ``positions`` as the planner indexes them (docs/design.md §4): the attention
    op's arguments, and ``(q_all, kv, compressed, selected, sink)`` for the reference."""
    g = torch.Generator().manual_seed(seed)
    heads, dim, window = TINY.num_heads, TINY.head_dim, TINY.window_size
    q_all = torch.randn(seq_len, heads, dim, generator=g)
    kv = random_keys(seq_len, dim, g)
    sink = torch.randn(heads, generator=g)
    win_slot = torch.randperm(seq_len + 50, generator=g)[:seq_len]
    win_rows = torch.zeros(seq_len + 50, dim)
    win_rows[win_slot] = kv
    pos = torch.tensor(positions)
    cols = pos[:, None] - torch.arange(TINY.swa_index_width)[None, :]
    swa_idx = torch.where(cols >= 0, win_slot[cols.clamp(min=0)], -1).int()
    swa_len = (pos + 1).clamp(max=window).int()
    args = [q_all[pos], make_cache(win_rows, PAGE_TOKENS[0], fmt), swa_idx, swa_len]
    if ratio == 0:
        return [*args, None, None, None, sink, TINY.softmax_scale], (q_all, kv, None, None, sink)

    n_entries = seq_len // ratio
    compressed = random_keys(n_entries, dim, g)
    ent_slot = torch.randperm(n_entries + 7, generator=g)[:n_entries]
    ent_rows = torch.zeros(n_entries + 7, dim)
    ent_rows[ent_slot] = compressed
    visible = (pos + 1) // ratio
    if ratio == 4:  # top-k of the visible entries (ascending, -1 padded), then -1 holes
        k = TINY.index_topk
        selected = torch.full((seq_len, k), -1)
        for t in range(seq_len):
            n = min((t + 1) // 4, k)
            selected[t, :n] = torch.randperm((t + 1) // 4, generator=g)[:n].sort().values
        selected[torch.rand(selected.shape, generator=g) < 0.2] = -1
        entries = selected[pos]
        ext_len = visible.clamp(min=1, max=k)
    else:  # every visible entry
        selected = None
        entries = torch.arange(max(1, -(-seq_len // ratio)))[None, :].expand(len(pos), -1)
        entries = torch.where(entries < visible[:, None], entries, -1)
        ext_len = visible.clamp(min=1)
    ext_idx = torch.where(entries >= 0, ent_slot[entries.clamp(min=0)], -1).int()
    ext = make_cache(ent_rows, PAGE_TOKENS[ratio], fmt)
    args += [ext, ext_idx, ext_len.int(), sink, TINY.softmax_scale]
    return args, (q_all, kv, compressed, selected, sink)


#: Query rows per layer kind: lengths 1, 3-9, 64-65, 127-129 and, for c128, the first entries.
REQUEST_ROWS = {
    0: (140, [0, 2, 3, 4, 5, 6, 7, 8, 63, 64, 126, 127, 128, 139]),
    4: (140, [0, 1, 2, 3, 4, 8, 63, 64, 126, 127, 128, 139]),
    128: (300, [0, 3, 126, 127, 128, 255, 256, 299]),
}
