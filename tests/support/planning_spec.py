"""Brute-force planning straight from docs/design.md §3-4, and batch builders.

A test helper module, not a test. ``expected_metadata`` walks the rows of a batch one by one
over plain Python ints (no vectorisation, nothing shared with the planner) and produces every
field of ``AttentionMetadata``; ``AttentionMetadata.named_tensors`` turns a plan into the
same ``name -> tensor`` form so tests compare every field with ``torch.equal``. ``make_batch``
builds a ``BatchView`` whose request pages are scattered randomly through the pool (``slot =
page * 256 + offset``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.planning import BatchView, DraftStep, ForwardKind

PAGE = 256
#: Tokens that feed one compressed entry (c4 entries overlap the previous block).
SPAN = {4: 8, 128: 128}
INT64_FIELDS = {
    "swa_out_loc", "positions_causal", "c4.out_loc", "c128.out_loc", "c1.out_loc", "c2.out_loc",
}  # fmt: skip


@dataclass(frozen=True)
class Row:
    batch_id: int
    position: int
    out_loc: int
    first_new: int  # position of the request's first row in this forward
    request_len: int  # the request's length after this forward
    keep_len: int  # its shortest possible length after it: verify drafts may be rejected


# ---------------------------------------------------------------------------- brute force
def expected_rows(batch: BatchView) -> list[Row]:
    """The rows of ``batch``, straight from the row table of ``planning/batch.py``."""
    seq = [int(v) for v in batch.seq_lens.tolist()]
    loc = [int(v) for v in batch.out_cache_loc.tolist()]
    rows: list[Row] = []
    kind = batch.kind
    if kind in (ForwardKind.IDLE, ForwardKind.DECODE):
        for b, s in enumerate(seq):
            if batch.draft is None:
                rows.append(Row(b, s - 1, loc[b], s - 1, s, s))
            else:
                d = batch.draft
                p = s + d.step_id
                # layout [bs, topk, num_steps]; topk branch 0
                rows.append(Row(b, p, loc[b * d.topk * d.num_steps + d.step_id], p, p + 1, p + 1))
    elif kind is ForwardKind.TARGET_VERIFY:
        n = batch.num_draft_tokens
        for b, s in enumerate(seq):
            for i in range(n):
                rows.append(Row(b, s + i, loc[b * n + i], s, s + n, s + 1))
    else:
        r = 0
        pairs = zip(batch.extend_prefix_lens, batch.extend_seq_lens, strict=True)
        for b, (prefix, extend) in enumerate(pairs):
            for i in range(extend):
                rows.append(Row(b, prefix + i, loc[r], prefix, prefix + extend, prefix + extend))
                r += 1
    return rows


def _plan_records(rows: list[Row], ratio: int, valid: list[bool]) -> list[list[int]]:
    records = [
        [t, row.batch_id, row.position, min(SPAN[ratio], row.position - row.first_new + 1)]
        for t, row in enumerate(rows)
        if valid[t]
    ]
    return records + [[-1] * 4] * (len(rows) - len(records))


def _tensor(values: list, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    return t.reshape(len(values), width) if width is not None else t.reshape(len(values))


def expected_metadata(
    config: DSV4AttentionConfig, batch: BatchView, widths: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """Every field of the plan of ``batch`` as ``name -> CPU tensor`` (the form of
    ``AttentionMetadata.named_tensors``).

    ``widths`` = ``(page_table columns, c128 columns)``; by default sized for the longest
    request: ceil(max_len / 256) pages, max_len // 128 c128 entries, at least 1 each.
    """
    rows = expected_rows(batch)
    max_len = max((row.request_len for row in rows), default=0)
    pw, n128 = widths or (max(1, math.ceil(max_len / PAGE)), max(1, max_len // 128))
    req_to_token = batch.req_to_token.tolist()
    req_pool = [int(v) for v in batch.req_pool_indices.tolist()]
    to_swa = batch.full_to_swa.tolist() if batch.full_to_swa is not None else None
    window, topk = config.window_size, config.index_topk
    ratios = [] if batch.kind is ForwardKind.DRAFT_EXTEND else sorted(config.ratios_present)

    out: dict[str, list] = {
        name: []
        for name in (
            "row_batch_ids",
            "page_table",
            "swa_out_loc",
            "positions_causal",
            "swa_page_indices",
            "swa_topk_lengths",
        )
    }
    low = [] if batch.kind is ForwardKind.DRAFT_EXTEND else sorted(config.low_ratios_present)
    candidates = config.v41.candidate_topk_blocks if config.v41 is not None else 0
    for r in ratios + low:
        for name in (
            "out_loc",
            "topk_lengths_raw",
            "sparse_topk_lengths",
            "page_indices",
        ):
            out[f"c{r}.{name}"] = []
        if r == config.candidate_ratio:
            out[f"c{r}.candidate_blocks"] = []
    for row in rows:
        p, tokens = row.position, req_to_token[req_pool[row.batch_id]]
        seq_len = p + 1
        out["row_batch_ids"].append(row.batch_id)
        out["page_table"].append(
            [tokens[k * PAGE] // PAGE if k * PAGE < row.request_len else -1 for k in range(pw)]
        )
        out["swa_out_loc"].append(to_swa[row.out_loc] if to_swa is not None else row.out_loc)
        out["positions_causal"].append(p)
        floor = batch.window_floors[row.batch_id] if batch.window_floors is not None else 0
        swa = []
        for i in range(config.swa_index_width):
            if i < min(seq_len, window) and p - i >= floor:
                slot = tokens[p - i]
                swa.append(to_swa[slot] if to_swa is not None else slot)
            else:
                swa.append(-1)
        out["swa_page_indices"].append(swa)
        out["swa_topk_lengths"].append(min(seq_len - floor, window))
        for r in ratios:
            raw = seq_len // r
            clamp1 = max(raw, 1)
            out[f"c{r}.out_loc"].append(row.out_loc // r if seq_len % r == 0 else -1)
            out[f"c{r}.topk_lengths_raw"].append(raw)
            out[f"c{r}.sparse_topk_lengths"].append(min(clamp1, topk) if r == 4 else clamp1)
            if r == 4:
                out["c4.page_indices"].append([-1] * topk)
            else:
                # entry j = full_loc(token j*r + r - 1) // r (section 3)
                out["c128.page_indices"].append(
                    [tokens[j * r + r - 1] // r if j < raw else -1 for j in range(n128)]
                )

        for r in low:  # DeepSeek-V4.1: the entry the row completes, the entries it sees
            if r == 1 or p % 2 == 1:
                out[f"c{r}.out_loc"].append(row.out_loc // r)
            else:
                out[f"c{r}.out_loc"].append(-1)
            out[f"c{r}.topk_lengths_raw"].append(seq_len // r)
            out[f"c{r}.sparse_topk_lengths"].append(max(min(seq_len // r, topk), 1))
            out[f"c{r}.page_indices"].append([-1] * topk)  # written by the index sources
            if r == config.candidate_ratio:
                out[f"c{r}.candidate_blocks"].append([-1] * candidates)

    widths_of = {
        **{f"c{r}.page_indices": topk for r in low},
        **{f"c{r}.candidate_blocks": candidates for r in low},
        "page_table": pw,
        "swa_page_indices": config.swa_index_width,
        "c4.page_indices": topk,
        "c128.page_indices": n128,
    }
    result = {
        name: _tensor(
            values, torch.int64 if name in INT64_FIELDS else torch.int32, widths_of.get(name)
        )
        for name, values in out.items()
    }
    for r in ratios:
        completes = [(row.position + 1) % r == 0 for row in rows]
        # The ring keeps the request's tail and (c4) the last block of every page.
        keep = [
            row.position >= (row.keep_len // r) * r - (r if r == 4 else 0)
            or (r == 4 and row.position % config.page_size >= config.page_size - r)
            for row in rows
        ]
        result[f"c{r}.compress_plan"] = _tensor(_plan_records(rows, r, completes), torch.int32, 4)
        result[f"c{r}.write_plan"] = _tensor(_plan_records(rows, r, keep), torch.int32, 4)
    return result


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    """Exact equality of every field (values, shapes and dtypes)."""
    assert sorted(got) == sorted(want), f"{label}: fields {sorted(got)} != {sorted(want)}"
    for name in want:
        g, w = got[name].cpu(), want[name]
        assert g.dtype == w.dtype, f"{label}: {name} dtype {g.dtype} != {w.dtype}"
        assert torch.equal(g, w), f"{label}: {name} differs\n got {g.tolist()}\nwant {w.tolist()}"


# -------------------------------------------------------------------------- batch builders
@dataclass(frozen=True)
class BatchSpec:
    """A batch described by lengths; ``make_batch`` builds it with a random page layout.

    ``seq_lens`` follow ``BatchView``: including the new tokens for DECODE / extend kinds,
    excluding them for TARGET_VERIFY and draft steps. ``extend_lens`` are the new tokens per
    request of an extend kind (prefix = seq_len - extend_len).
    """

    name: str
    kind: ForwardKind
    seq_lens: tuple[int, ...] = ()
    extend_lens: tuple[int, ...] = ()
    num_draft_tokens: int | None = None
    draft_steps: int | None = None
    step_id: int = 0
    swa_map: bool = False
    seed: int = 0

    def tokens_needed(self, b: int) -> int:
        s = self.seq_lens[b]
        if self.kind is ForwardKind.TARGET_VERIFY:
            return s + self.num_draft_tokens
        return s + (self.draft_steps or 0)


def make_batch(spec: BatchSpec, *, host_lens: bool = True, extra_context: int = 256) -> BatchView:
    """Build ``spec`` with request pages drawn from a random permutation of the pool's pages."""
    g = torch.Generator().manual_seed(spec.seed)
    bs = len(spec.seq_lens)
    need = [spec.tokens_needed(b) for b in range(bs)]
    pages = [math.ceil(n / PAGE) for n in need]
    total_pages = sum(pages) + 3  # a few free pages stay unused
    perm = torch.randperm(total_pages, generator=g)
    pool_rows = bs + 2
    req_pool = torch.randperm(pool_rows, generator=g)[:bs]
    context = math.ceil(max(need, default=1) / PAGE) * PAGE + extra_context
    req_to_token = torch.zeros(pool_rows, context, dtype=torch.int32)
    start = 0
    for b in range(bs):
        own = perm[start : start + pages[b]]
        start += pages[b]
        slots = (own[:, None] * PAGE + torch.arange(PAGE)).flatten()
        req_to_token[req_pool[b], : slots.numel()] = slots.int()

    def slot(b: int, pos: int) -> int:
        return int(req_to_token[req_pool[b], pos])

    kind, seq = spec.kind, spec.seq_lens
    draft = None
    extend_prefix = extend = None
    if spec.draft_steps is not None:
        draft = DraftStep(topk=1, num_steps=spec.draft_steps, step_id=spec.step_id)
        loc = [slot(b, seq[b] + i) for b in range(bs) for i in range(spec.draft_steps)]
    elif kind is ForwardKind.TARGET_VERIFY:
        n = spec.num_draft_tokens
        loc = [slot(b, seq[b] + i) for b in range(bs) for i in range(n)]
    elif kind in (ForwardKind.EXTEND, ForwardKind.DRAFT_EXTEND):
        extend = list(spec.extend_lens)
        extend_prefix = [s - e for s, e in zip(seq, extend, strict=True)]
        loc = [slot(b, p) for b in range(bs) for p in range(extend_prefix[b], seq[b])]
    else:
        loc = [slot(b, s - 1) for b, s in enumerate(seq)]
    full_to_swa = None
    if spec.swa_map:
        full_to_swa = (torch.randperm(total_pages * PAGE, generator=g) + 11).int()
    return BatchView(
        kind=kind,
        req_pool_indices=req_pool,
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        out_cache_loc=torch.tensor(loc, dtype=torch.int64),
        req_to_token=req_to_token,
        seq_lens_cpu=list(seq) if host_lens else None,
        extend_prefix_lens=extend_prefix,
        extend_seq_lens=extend,
        num_draft_tokens=spec.num_draft_tokens,
        draft=draft,
        full_to_swa=full_to_swa,
    )
