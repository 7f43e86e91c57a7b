"""Compressor kernel: every schedule of forwards reproduces the one-shot reference entries."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_backend.cache.state import ArrivalCounters, CompressorState
from dsv4_backend.config import DSV4AttentionConfig, compress_span
from dsv4_backend.errors import ConfigError, ContractError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.compressor import fused
from dsv4_backend.kernels.compressor.common import ring_write_is_safe
from dsv4_backend.kernels.compressor.fused import (
    MAX_ENTRY_WORKERS,
    channel_splits,
    entry_workers,
    force_channel_splits,
    fused_tiles,
)
from dsv4_backend.kernels.compressor.table import compress_forward
from dsv4_backend.kernels.variants import force_unverified
from dsv4_backend.planning.kernels.compress_plan_call import CompressPlanCall
from dsv4_backend.planning.kernels.compress_plan_torch import compute_compress_plans
from dsv4_backend.testing.reference import compress_entries, overlap, rope_for_ratio

CONFIG = DSV4AttentionConfig.tiny()
SPEC_CONFIG = DSV4AttentionConfig.tiny(speculative=True)
PAGE = CONFIG.page_size
#: Window pages per request (requests here are at most 4 pages long).
PAGES_PER_REQUEST = 4


@dataclass(frozen=True)
class Layer:
    """Compressor parameters: ratio, head dim ``D`` and the learned tensors."""

    ratio: int
    head_dim: int
    ape: torch.Tensor  # [r, c*D]
    norm_weight: torch.Tensor  # [D]


@dataclass(frozen=True)
class Request:
    """One request's true token projections (scores without ape), its pool row (the c128
    ring slot) and the window page of each of its 256-token pages (c4 ring slots): pages
    ``4 * pool_index + k`` unless it shares another request's (a cached prefix)."""

    pool_index: int
    kv: torch.Tensor  # [S, c*D]
    score: torch.Tensor  # [S, c*D]
    window_pages: tuple[int, ...] = ()

    def pages(self) -> tuple[int, ...]:
        first = PAGES_PER_REQUEST * self.pool_index
        return self.window_pages or tuple(range(first, first + PAGES_PER_REQUEST))

    def window_slot(self, position: int) -> int:
        return self.pages()[position // PAGE] * PAGE + position % PAGE


def allocate(config: DSV4AttentionConfig, layer: Layer, pool_rows: int) -> CompressorState:
    """Rings for requests in pool rows ``< pool_rows`` (c4: their window pages)."""
    slots = pool_rows * (PAGES_PER_REQUEST if layer.ratio == 4 else 1)
    return CompressorState.allocate(config, layer.ratio, layer.head_dim, slots)


def make_layer(ratio: int, head_dim: int, seed: int = 0) -> Layer:
    g = torch.Generator().manual_seed(seed)
    cd = overlap(ratio) * head_dim
    ape = torch.randn(ratio, cd, generator=g) * 0.5
    return Layer(ratio, head_dim, ape, 1 + 0.1 * torch.randn(head_dim, generator=g))


def make_request(layer: Layer, seq_len: int, pool_index: int, seed: int) -> Request:
    g = torch.Generator().manual_seed(1000 + seed)
    cd = overlap(layer.ratio) * layer.head_dim
    kv, score = torch.randn(2, seq_len, cd, generator=g).unbind(0)
    return Request(pool_index, kv, score)


def reference(layer: Layer, req: Request) -> torch.Tensor:
    rope = rope_for_ratio(CONFIG, layer.ratio)
    return compress_entries(
        req.kv, req.score, layer.ape, layer.norm_weight, layer.ratio, rope, layer.head_dim
    )


@dataclass(frozen=True)
class Segment:
    """Rows ``start ... start + n - 1`` of batch entry ``req``; ``junk`` rows replace the true
    projections from row ``junk_from`` on (rejected draft tokens); ``committed`` is the
    request's length the write plan keeps state for (default ``start + n``)."""

    req: Request
    start: int
    n: int
    junk_from: int | None = None
    committed: int | None = None


def run_forward(
    state: CompressorState,
    layer: Layer,
    segments: list[Segment],
    found: dict,
    max_rows_per_request: int | None = None,
) -> torch.Tensor:
    """One forward over ``segments`` (one per batch entry); record entries of committed rows
    into ``found[(pool_index, w)]``. Returns the ``[T, D]`` output. ``max_rows_per_request``
    as ``compress_forward`` takes it (a bound spares the kernel the deferred writes)."""
    kv, score, batch_ids, positions, first_new, lens, window = [], [], [], [], [], [], []
    g = torch.Generator().manual_seed(7)
    for b, seg in enumerate(segments):
        rows = slice(seg.start, seg.start + seg.n)
        seg_kv, seg_score = seg.req.kv[rows].clone(), seg.req.score[rows].clone()
        if seg.junk_from is not None:
            junk = slice(seg.junk_from - seg.start, None)
            seg_kv[junk] = torch.randn(seg_kv[junk].shape, generator=g) * 3
            seg_score[junk] = torch.randn(seg_score[junk].shape, generator=g) * 3
        kv.append(seg_kv)
        score.append(seg_score)
        batch_ids += [b] * seg.n
        positions += range(seg.start, seg.start + seg.n)
        first_new += [seg.start] * seg.n
        lens += [seg.start + seg.n if seg.committed is None else seg.committed] * seg.n
        window += [
            [seg.req.window_slot(p - k) if p >= k else -1 for k in range(8)]
            for p in range(seg.start, seg.start + seg.n)
        ]
    positions_t = torch.tensor(positions)
    plans = compute_compress_plans(
        CompressPlanCall(
            torch.tensor(batch_ids, dtype=torch.int32),
            positions_t,
            torch.tensor(first_new),
            torch.tensor(lens, dtype=torch.int32),
            layer.ratio,
        )
    )
    out = compress_forward(
        state, torch.cat(kv), torch.cat(score), layer.ape, layer.norm_weight,
        rope_for_ratio(CONFIG, layer.ratio),
        torch.tensor([s.req.pool_index for s in segments]),
        torch.tensor(window, dtype=torch.int32).reshape(-1, 8), positions_t, *plans,
        max_rows_per_request=max_rows_per_request,
    )  # fmt: skip
    done = (positions_t + 1) % layer.ratio == 0
    assert not out[~done].any(), "rows that complete no entry must be zero"
    row = 0
    for seg in segments:
        committed = seg.start + seg.n if seg.junk_from is None else seg.junk_from
        for p in range(seg.start, seg.start + seg.n):
            if (p + 1) % layer.ratio == 0 and p < committed:
                found[(seg.req.pool_index, (p + 1) // layer.ratio - 1)] = out[row]
            row += 1
    return out


def check_entries(layer: Layer, requests: list[Request], found: dict) -> None:
    for req in requests:
        want = reference(layer, req)
        assert sum(key[0] == req.pool_index for key in found) == want.shape[0]
        if want.shape[0]:
            got = torch.stack([found[(req.pool_index, w)] for w in range(want.shape[0])])
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def run_schedule(layer: Layer, lengths: list[int], chunks: list[list[int]], path: str) -> None:
    """Requests of ``lengths`` fed in forwards of ``chunks[i]`` new tokens each (0 = idle),
    on kernel ``path``; request ``i`` uses ring slot ``3 + 2i`` (not its batch id)."""
    requests = [make_request(layer, n, 3 + 2 * i, i) for i, n in enumerate(lengths)]
    state = allocate(CONFIG, layer, 2 * len(lengths) + 4)
    found: dict = {}
    done = [0] * len(lengths)
    for step in range(max(len(c) for c in chunks)):
        segments = []
        for i, req in enumerate(requests):
            if step < len(chunks[i]) and chunks[i][step]:
                segments.append(Segment(req, done[i], chunks[i][step]))
                done[i] += chunks[i][step]
        with dispatch.force_path(path):
            run_forward(state, layer, segments, found)
    assert done == lengths
    check_entries(layer, requests, found)


C4 = make_layer(4, CONFIG.head_dim)
C128 = make_layer(128, CONFIG.head_dim, seed=1)
INDEXER_C4 = make_layer(4, CONFIG.index_head_dim, seed=2)  # the indexer's compressor (DI)
LENGTHS = [1, 3, 4, 5, 6, 7, 8, 9, 64, 65, 127, 128, 129, 255, 256, 257, 383, 384, 511, 512, 513]


TORCH, INTERP = dispatch.TORCH, dispatch.TRITON_INTERPRETER


@pytest.mark.parametrize(
    ("layer", "lengths", "path"),
    [
        (C4, [*LENGTHS, 600], TORCH),
        (C128, [*LENGTHS[10:], 600], TORCH),
        (INDEXER_C4, [*LENGTHS, 600], TORCH),
        (C4, [1, 3, 4, 9, 65, 129], INTERP),
        (C128, [127, 128, 257], INTERP),
        (INDEXER_C4, [5, 8, 65], INTERP),
    ],
    ids=["c4", "c128", "indexer-c4", "c4-interp", "c128-interp", "indexer-c4-interp"],
)
def test_one_shot_prefill_equals_reference(layer: Layer, lengths: list[int], path: str) -> None:
    # One forward, every request one segment (ring slots differ from batch ids).
    run_schedule(layer, lengths, [[n] for n in lengths], path)


@pytest.mark.parametrize(
    ("layer", "prefix", "end", "path"),
    [
        (C4, 124, 132, TORCH),
        (C4, 252, 260, TORCH),
        (C4, 508, 516, TORCH),
        (C128, 124, 132, TORCH),
        (C128, 252, 260, TORCH),
        (C128, 508, 516, TORCH),
        (C4, 124, 132, INTERP),
        (C128, 252, 260, INTERP),
    ],
)
def test_decode_token_by_token_equals_one_shot(
    layer: Layer, prefix: int, end: int, path: str
) -> None:
    # A second request starts from scratch beside it (mixed positions in one decode batch).
    steps = end - prefix
    run_schedule(layer, [end, 8 + steps], [[prefix] + [1] * steps, [8] + [1] * steps], path)


@pytest.mark.parametrize("path", [TORCH, INTERP])
def test_decode_from_empty_c4(path: str) -> None:
    run_schedule(C4, [21], [[1] * 21], path)


@pytest.mark.parametrize(
    "chunks",
    [[3, 1], [126, 4], [250, 10], [130, 200], [127, 1, 1, 127, 128, 129, 87], [5, 64, 3, 9, 300]],
)
@pytest.mark.parametrize("layer", [C4, C128], ids=["c4", "c128"])
def test_chunked_extend_equals_one_shot(layer: Layer, chunks: list[int]) -> None:
    run_schedule(layer, [sum(chunks)], [chunks], TORCH)


def test_chunked_extend_two_requests_interpreter() -> None:
    run_schedule(C4, [130, 7], [[3, 126, 1], [1, 2, 4]], INTERP)
    run_schedule(C128, [134, 129], [[126, 4, 4], [1, 127, 1]], INTERP)


@settings(max_examples=10, deadline=None)
@given(
    ratio=st.sampled_from([4, 128]),
    chunks=st.lists(st.integers(1, 140), min_size=1, max_size=5).filter(lambda c: sum(c) >= 128),
)
def test_any_chunking_equals_one_shot(ratio: int, chunks: list[int]) -> None:
    run_schedule(C4 if ratio == 4 else C128, [sum(chunks)], [chunks], TORCH)


@pytest.mark.parametrize("bounded", [True, False], ids=["one-launch", "replaced"])
@pytest.mark.parametrize("layer", [C4, C128], ids=["c4", "c128"])
def test_triton_interpreter_equals_torch(layer: Layer, bounded: bool) -> None:
    """The one-launch kernel and the kernels it replaces (the CUDA default until it passes on
    a GPU): two extend chunks (the one-launch kernel's deferred writes), then decode steps."""
    outs, rings = [], []
    for path in (TORCH, INTERP):
        req = make_request(layer, 200, 1, seed=5)
        state = allocate(CONFIG, layer, 3)
        found: dict = {}
        with dispatch.force_path(path), force_unverified(bounded):
            run_forward(state, layer, [Segment(req, 0, 126)], found)
            outs.append(run_forward(state, layer, [Segment(req, 126, 2)], found))
            for p in range(128, 133):  # decode: one row a request
                outs.append(run_forward(state, layer, [Segment(req, p, 1)], found, 1))
        rings.append(state.ring)
    half = len(outs) // 2
    torch.testing.assert_close(outs[:half], outs[half:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rings[0], rings[1], atol=0, rtol=0)


def test_ring_write_is_safe_only_when_no_entry_reads_what_it_replaces() -> None:
    """``R - span + 1`` rows a request at most: 1 without speculative rings, ``span + 1``
    with them; extend (unknown) never (the one-launch kernel then defers writes)."""
    for config, ratio, most in ((CONFIG, 4, 1), (CONFIG, 128, 1), (SPEC_CONFIG, 4, 9),
                                (SPEC_CONFIG, 128, 129)):  # fmt: skip
        state = CompressorState.allocate(config, ratio, 64, 1)
        assert ring_write_is_safe(state, most) and not ring_write_is_safe(state, most + 1)
        assert not ring_write_is_safe(state, None)


@pytest.mark.parametrize("path", [TORCH, INTERP])
def test_strided_pool_indices(path: str) -> None:
    """A strided ``req_pool_indices`` view is read through its stride (c128 ring slots 3, 1)."""
    reqs = [make_request(C128, 12, 0, seed=s) for s in (11, 12)]
    kv, score = torch.cat([r.kv for r in reqs]), torch.cat([r.score for r in reqs])
    batch_ids = torch.arange(2).repeat_interleave(12).int()
    positions = torch.arange(12).repeat(2)
    first, lens = torch.zeros(24, dtype=torch.int64), torch.full((24,), 12, dtype=torch.int32)
    plans = compute_compress_plans(CompressPlanCall(batch_ids, positions, first, lens, 128))
    rope = rope_for_ratio(CONFIG, 128)
    rings = []
    for pool_indices in (torch.tensor([3, 1]), torch.tensor([3, 0, 1, 2])[::2]):
        state = allocate(CONFIG, C128, 4)
        with dispatch.force_path(path):
            compress_forward(state, kv, score, C128.ape, C128.norm_weight, rope, pool_indices,
                             torch.zeros(24, 0, dtype=torch.int32), positions, *plans)  # fmt: skip
        rings.append(state.ring)
    assert torch.isfinite(rings[0][[1, 3], :12]).all()  # positions 0-11 kept in slots 3 and 1
    torch.testing.assert_close(rings[1], rings[0], atol=0, rtol=0)


def test_state_reset_scope_and_allocation_sizes() -> None:
    for config, rows in ((CONFIG, {4: 8, 128: 128}), (SPEC_CONFIG, {4: 16, 128: 256})):
        for ratio, width in ((4, 4 * 128), (128, 2 * 128)):
            state = CompressorState.allocate(config, ratio, 128, 2)
            assert state.ring.shape == (2, rows[ratio], width)
            assert state.window_page == (PAGE if ratio == 4 else 0)
            assert not state.ring[..., : width // 2].any()
            assert (state.ring[..., width // 2 :] == float("-inf")).all()
    state.ring.fill_(1.0)
    state.reset()
    assert not state.ring[..., :128].any() and (state.ring[..., 128:] == float("-inf")).all()
    with pytest.raises(ConfigError, match="c4 state is page-scoped"):
        CompressorState(ratio=4, head_dim=128, ring=state.ring)
    with pytest.raises(ConfigError, match="c128 state request-scoped"):
        CompressorState(ratio=128, head_dim=128, ring=state.ring, window_page=PAGE)


def test_ratio_128_entries_are_split_across_programs() -> None:
    """On a GPU the one-launch kernel pools a c128 entry in 32-channel programs (a Flash
    layer's 512 channels: 16 programs, four steps of [32, 32] tiles each); c4 entries (8
    tokens) in one program. The interpreter takes one program an entry unless forced."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects only: nothing runs
    assert channel_splits(512, 128, cuda) == 16
    tiles = dict(BLOCK_S=32, CHANNEL_SPLITS=16, BLOCK_W=512, ZERO_ROWS=8)
    assert fused_tiles(512, 128, 16) == tiles
    assert channel_splits(512, 8, cuda) == 1
    assert fused_tiles(512, 8, 1) == dict(BLOCK_S=8, CHANNEL_SPLITS=1, BLOCK_W=512, ZERO_ROWS=8)
    assert channel_splits(128, 8, cuda) == 1  # the indexer's compressor
    assert channel_splits(512, 128, cpu) == 1
    with force_channel_splits(4):
        assert channel_splits(512, 128, cpu) == 4 and channel_splits(512, 8, cpu) == 1
        with pytest.raises(ConfigError, match="of a 2-channel entry"):
            channel_splits(2, 128, cpu)
    with pytest.raises(ConfigError, match="expected a power of two"):
        force_channel_splits(3).__enter__()
    # Entry workers: one a (record, split) item, at most MAX_ENTRY_WORKERS.
    assert entry_workers(1, 16) == 16  # decode of one request
    assert entry_workers(64, 16) == MAX_ENTRY_WORKERS == 256
    assert entry_workers(300, 1) == 0  # unsplit: the record programs pool


def test_split_entries_equal_torch_and_leave_the_counters_zero(monkeypatch) -> None:
    """c128 entries in 32-channel programs, as a GPU splits them, after a prefill on the torch
    path: a decode row completing an entry from 127 ring rows beside an extend whose entry
    reads the ring rows its writes replace (the owner's last split defers them), then decode
    rows writing the ring beside another request's decode entry, equal the torch path; each
    launch leaves its arrival counters at zero. Three entry workers, so each takes several
    (record, split) items."""
    splits = channel_splits(C128.head_dim, 128, torch.device("cuda"))
    assert splits == 4
    monkeypatch.setattr(fused, "MAX_ENTRY_WORKERS", 3)
    outs, rings = [], []
    for path in (TORCH, INTERP):
        requests = [make_request(C128, n, i, seed=6 + i) for i, n in enumerate((130, 140, 128))]
        state = allocate(CONFIG, C128, 3)
        found: dict = {}
        with dispatch.force_path(TORCH):
            prefill = [Segment(r, 0, n) for r, n in zip(requests, (127, 120, 127), strict=True)]
            run_forward(state, C128, prefill, found)
        with dispatch.force_path(path), force_channel_splits(splits):
            for forward in ([(0, 127, 1), (1, 120, 10)], [(0, 128, 1), (1, 130, 1), (2, 127, 1)]):
                segments = [Segment(requests[i], start, n) for i, start, n in forward]
                outs.append(run_forward(state, C128, segments, found))
                counters = state.arrivals.at_least(0)
                assert not counters.any(), counters.nonzero()
        assert (counters.numel() >= 11) == (path == INTERP)  # counters only where split
        rings.append(state.ring)
        check_entries(C128, [requests[0], requests[2]], found)
    assert outs[0][[0, 8]].all(dim=1).tolist() == [True, True]  # both complete an entry
    assert outs[1][2].all() and not outs[1][:2].any()
    torch.testing.assert_close(outs[:2], outs[2:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rings[0], rings[1], atol=0, rtol=0)


def test_arrival_counters_grow_and_keep_what_a_graph_captured() -> None:
    counters = ArrivalCounters(torch.device("cpu"))
    first = counters.at_least(5)
    assert first.numel() == 8 and first.dtype == torch.int32 and not first.any()
    assert counters.at_least(8) is first
    grown = counters.at_least(9)
    assert grown.numel() == 16 and not grown.any()
    alive = weakref.ref(first)
    del first
    gc.collect()
    assert alive() is not None  # a CUDA graph that captured it may still write it


@pytest.mark.parametrize(
    ("layer", "seq", "path"),
    [(C4, 126, INTERP), (C4, 253, TORCH), (C128, 126, TORCH), (C128, 253, INTERP)],
)
def test_speculative_verify_with_rejections_equals_one_shot(
    layer: Layer, seq: int, path: str
) -> None:
    """Verify forwards of 4 draft tokens where only some are accepted, on the doubled rings.

    Each verify row past the accepted ones carries junk (a rejected draft); the next verify
    starts right after the accepted tokens. The write plan keeps state from the request's
    committed length (``seq + 1``: the first verify token is always accepted), so every ring
    row a later entry needs holds an accepted token; the doubled ring leaves room for the
    drafts beyond it.
    """
    n, accepts = 4, [0, 3, 1, 2, 0, 3, 1, 0]
    total = seq + sum(a + 1 for a in accepts)
    req = make_request(layer, total + n, 0, seed=seq)
    state = allocate(SPEC_CONFIG, layer, 1)
    found: dict = {}
    with dispatch.force_path(path):
        run_forward(state, layer, [Segment(req, 0, seq)], found)
        for a in accepts:
            verify = Segment(req, seq, n, junk_from=seq + a + 1, committed=seq + 1)
            run_forward(state, layer, [verify], found)
            seq += a + 1
    want = reference(layer, Request(0, req.kv[:seq], req.score[:seq]))
    got = torch.stack([found[(0, w)] for w in range(want.shape[0])])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_padding_records_are_ignored() -> None:
    """Plans padded with -1 records (CUDA-graph shapes) leave the output and ring alone."""
    req = make_request(C4, 8, 0, seed=9)
    state = CompressorState.allocate(CONFIG, 4, 128, 1)
    plan = torch.full((8, 4), -1, dtype=torch.int32)
    out = compress_forward(
        state, req.kv, req.score, C4.ape, C4.norm_weight, rope_for_ratio(CONFIG, 4),
        torch.tensor([0]), torch.zeros(8, 8, dtype=torch.int32), torch.arange(8), plan, plan,
    )  # fmt: skip
    assert not out.any()
    assert (state.ring[..., 256:] == float("-inf")).all()


def test_shape_errors_name_the_tensor() -> None:
    state = CompressorState.allocate(CONFIG, 4, 128, 1)
    plan = torch.full((8, 4), -1, dtype=torch.int32)
    args = (torch.zeros(8, 256), torch.zeros(8, 256), torch.zeros(4, 256), torch.ones(128))
    rope = rope_for_ratio(CONFIG, 4)
    window = torch.zeros(8, 8, dtype=torch.int32)
    with pytest.raises(ContractError, match=r"kv_proj has shape \(8, 128\), expected \(8, 256\)"):
        compress_forward(state, torch.zeros(8, 128), *args[1:], rope, torch.tensor([0]), window,
                         torch.arange(8), plan, plan)  # fmt: skip
    with pytest.raises(ContractError, match=r"compress_plan has dtype torch\.int64"):
        compress_forward(state, *args, rope, torch.tensor([0]), window, torch.arange(8),
                         plan.long(), plan)  # fmt: skip
    with pytest.raises(ContractError, match=r"window_slots has shape \(8, 4\), expected \(8, >="):
        compress_forward(state, *args, rope, torch.tensor([0]), window[:, :4], torch.arange(8),
                         plan, plan)  # fmt: skip


@pytest.mark.parametrize(
    ("layer", "prefix", "chunks", "path"),
    [
        (C4, 256, [5, 1, 1], TORCH),
        (C4, 512, [130, 3], TORCH),
        (INDEXER_C4, 256, [300], TORCH),
        (C128, 256, [127, 1, 1], TORCH),
        (C128, 512, [200], TORCH),
        (C4, 256, [9, 1], INTERP),
        (C128, 256, [128, 1], INTERP),
    ],
)
def test_request_starting_from_a_cached_prefix_equals_one_shot(
    layer: Layer, prefix: int, chunks: list[int], path: str
) -> None:
    """Request B shares A's first ``prefix`` tokens and their window pages (a radix-cache hit)
    and starts there in its own pool row, then goes on in ``chunks``.

    A prefilled in one forward, so only the write plan's last-block-of-every-page rule left
    the block before ``prefix`` in its (page-scoped) c4 ring. B's own c128 ring and its own
    window pages' c4 rings hold NaN (an earlier request's leftovers): nothing may read them.
    """
    total = prefix + sum(chunks)
    owner = make_request(layer, 700, 1, seed=40)
    data = make_request(layer, total, 2, seed=41)
    kv, score = data.kv.clone(), data.score.clone()
    kv[:prefix], score[:prefix] = owner.kv[:prefix], owner.score[:prefix]
    shared = prefix // PAGE
    own_pages = tuple(range(PAGES_PER_REQUEST * 2, PAGES_PER_REQUEST * 3))
    hit = Request(2, kv, score, window_pages=(*owner.pages()[:shared], *own_pages))
    state = allocate(CONFIG, layer, 3)
    found: dict = {}
    with dispatch.force_path(path):
        run_forward(state, layer, [Segment(owner, 0, 700)], found)
        if layer.ratio == 4:
            state.ring[list(own_pages)] = float("nan")
        else:
            state.ring[2] = float("nan")
        start = prefix
        for n in chunks:
            run_forward(state, layer, [Segment(hit, start, n)], found)
            start += n
    want = reference(layer, hit)
    first = prefix // layer.ratio
    got = torch.stack([found[(2, w)] for w in range(first, want.shape[0])])
    torch.testing.assert_close(got, want[first:], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("layer", "first", "rest"),
    [
        (C128, 8, 124),  # the tail's writes 128-131 replace ring rows 0-3 the first entry reads
        (C128, 4, 256),  # the same for 256-259: the writes find the owner by a search
        (C4, 5, 8),  # both ring-reading entries read the row position 12 replaces
        (C4, 8, 8),  # the first entry reads positions 4-7, which 12-15 replace
    ],
    ids=["c128-near", "c128-far", "c4-two-readers", "c4-one-reader"],
)
def test_extend_writes_wait_for_the_entries_that_read_the_ring(
    layer: Layer, first: int, rest: int
) -> None:
    """One launch for an extend whose writes replace ring rows its first entries read.

    Request B resumes at ``first`` behind a fresh request A that completes more entries than
    it writes rows, so B's write records have lower program ids than its ring-reading
    entries (the interpreter runs programs in order: a write not deferred to the reader is
    seen by it)."""
    ahead = 128 if layer.ratio == 128 else 32
    # c128 entries split as a GPU splits them (the owner's last split defers the writes).
    splits = channel_splits(layer.head_dim, compress_span(layer.ratio), torch.device("cuda"))
    with force_channel_splits(splits):
        run_schedule(layer, [ahead, first + rest], [[0, ahead], [first, rest]], INTERP)


@pytest.mark.stress
@settings(max_examples=30, deadline=None)
@given(data=st.data(), layer=st.sampled_from([C4, C128, INDEXER_C4]))
def test_any_multi_request_schedule_on_the_one_launch_kernel(data, layer: Layer) -> None:
    """2-3 requests resuming and idling in random chunks, on the interpreter's one-launch
    kernel (extend: the deferred writes; c128: entries split as on a GPU), equal the
    reference."""
    limit = 140 if layer.ratio == 128 else 40
    steps = data.draw(st.integers(1, 3))
    # Request 0 takes tokens in every forward; the others idle at times (0), never throughout.
    busy = st.lists(st.integers(1, limit), min_size=steps, max_size=steps)
    chunk = st.one_of(st.just(0), st.integers(1, limit))
    some = st.lists(chunk, min_size=1, max_size=steps).filter(any)
    chunks = [data.draw(busy), *data.draw(st.lists(some, min_size=1, max_size=2))]
    # c128 entries split as a GPU splits them, over few entry workers (several items each).
    splits = channel_splits(layer.head_dim, compress_span(layer.ratio), torch.device("cuda"))
    with force_channel_splits(splits), pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused, "MAX_ENTRY_WORKERS", 5)
        run_schedule(layer, [sum(c) for c in chunks], chunks, INTERP)
