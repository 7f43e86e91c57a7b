"""DeepSeek-V4.1's low-ratio kernels: the fp4 format (against the reference's rounding, every
code, packing round trip, the 68-byte pages) and the index scores' Triton variant (the
lightning indexer's kernel reading fp4 index-key pages) against its torch twin, on fp4 and
dense keys of both low ratios, with the selection over them."""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.cache.fp4_format import (
    Fp4IndexKeyCache,
    e2m1_codes,
    e2m1_values,
    fp4_round_e4m3,
    fp4_round_ue8m0,
    pack_ue8m0,
    unpack_ue8m0,
)
from dsv4_backend.config import entries_per_page
from dsv4_backend.kernels.dispatch import TORCH, TRITON_INTERPRETER, force_path
from dsv4_backend.kernels.low_ratio.selection import select_entries
from dsv4_backend.kernels.low_ratio.table import low_ratio_call, low_ratio_scores
from dsv4_backend.testing.reference import fake_quant_e4m3, fake_quant_ue8m0, round_e2m1


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 300.0, 1e5])
def test_fp4_rounding_equals_the_reference(scale: float) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(48, 128, generator=g) * scale).bfloat16().float()
    x[0] = 0.0  # a zero block keeps a finite scale
    x[1, :32] = 6 * 2.0**-126  # amax at the floor
    assert torch.equal(fp4_round_ue8m0(x), fake_quant_ue8m0(x))
    assert torch.equal(fp4_round_e4m3(x), fake_quant_e4m3(x))


def test_every_e2m1_code_and_tie() -> None:
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ties = (magnitudes[1:] + magnitudes[:-1]) / 2
    values = torch.cat([magnitudes, ties, ties + 1e-3, ties - 1e-3, torch.tensor([7.0, 100.0])])
    values = torch.cat([values, -values])
    assert torch.equal(e2m1_values(e2m1_codes(values)), round_e2m1(values.clamp(-6, 6)))
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_codes(e2m1_values(codes)) & 7, codes & 7)  # every code round-trips


def test_packed_index_keys_round_trip_in_68_byte_entries() -> None:
    g = torch.Generator().manual_seed(4)
    keys = fp4_round_ue8m0(torch.randn(130, 128, generator=g) * 3)
    payload, exponents = pack_ue8m0(keys)
    assert payload.shape == (130, 64) and exponents.shape == (130, 4)
    assert torch.equal(unpack_ue8m0(payload, exponents), keys)
    cache = Fp4IndexKeyCache(256, 128, "fp8")
    assert cache.storage.shape == (4, 64 * 68)
    slots = torch.randperm(256, generator=g)[:130]
    cache.store(keys, slots)
    assert torch.equal(cache.gather(slots), keys)
    assert torch.equal(cache.gather(torch.tensor([-1])), torch.zeros(1, 128))


def _setup(fmt: str, ratio: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    rows, heads, dim, pages = 9, 4, 64, 3
    per_page = entries_per_page(ratio)
    keys = Fp4IndexKeyCache(pages * 2 * per_page, dim, fmt)  # twice the pages the table uses
    page_table = torch.randperm(2 * pages, generator=g)[:pages].int().repeat(rows, 1)
    every = torch.arange(2 * pages * per_page)
    keys.store(fp4_round_ue8m0(torch.randn(every.numel(), dim, generator=g)), every)
    q = fp4_round_ue8m0(torch.randn(rows, heads, dim, generator=g))
    weights = torch.randn(rows, heads, generator=g)
    visible = torch.randint(0, pages * per_page + 1, (rows,), generator=g)
    visible[:2] = torch.tensor([0, pages * per_page])
    return q, weights, keys, page_table, visible, pages * per_page


@pytest.mark.parametrize("fmt", ["fp8", "dense"])
@pytest.mark.parametrize("ratio", [1, 2])
def test_triton_index_scores_equal_the_torch_twin(fmt: str, ratio: int) -> None:
    q, weights, keys, page_table, visible, width = _setup(fmt, ratio, seed=ratio)
    call = low_ratio_call(q, weights, keys, page_table, visible, ratio)
    assert call.max_candidates == width
    with force_path(TORCH):
        want = low_ratio_scores(call)
    with force_path(TRITON_INTERPRETER):
        got = low_ratio_scores(call)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert finite.sum() == visible.sum()  # -inf exactly past each row's visible entries
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-5)
    slots = {}
    for path in (TORCH, TRITON_INTERPRETER):
        out = torch.full((q.shape[0], 16), -1, dtype=torch.int32)
        with force_path(path):
            select_entries(call, 16, out)
        slots[path] = out
    assert torch.equal(slots[TORCH], slots[TRITON_INTERPRETER])
    assert torch.equal((slots[TORCH] >= 0).sum(1), visible.clamp(max=16).int())


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2])
def test_triton_index_scores_on_cuda(ratio: int) -> None:
    """The Triton variant compiled for the GPU (Flash's 32 heads of 128, fp4 pages) against
    the torch twin on the same bytes, with the selection over them."""
    from dsv4_backend.kernels.dispatch import TRITON
    from dsv4_backend.kernels.low_ratio.table import LOW_RATIO_SCORES
    from dsv4_backend.kernels.variants import force_variant

    g = torch.Generator().manual_seed(ratio)
    rows, heads, dim, pages = 33, 32, 128, 5
    per_page = entries_per_page(ratio)
    keys = Fp4IndexKeyCache(pages * per_page, dim, "fp8", "cuda")
    every = torch.arange(pages * per_page)
    keys.store(fp4_round_ue8m0(torch.randn(every.numel(), dim, generator=g)).cuda(), every.cuda())
    page_table = torch.randperm(pages, generator=g).int().repeat(rows, 1).cuda()
    q = fp4_round_ue8m0(torch.randn(rows, heads, dim, generator=g)).cuda()
    weights = torch.randn(rows, heads, generator=g).cuda()
    visible = torch.randint(0, pages * per_page + 1, (rows,), generator=g).cuda()
    call = low_ratio_call(q, weights, keys, page_table, visible, ratio)
    with force_variant(LOW_RATIO_SCORES, "torch"):
        want = low_ratio_scores(call)
    with force_path(TRITON), force_variant(LOW_RATIO_SCORES, "triton"):
        got = low_ratio_scores(call)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    # bf16 tensor-core dots of fp4 values: exact products, fp32 sums in another order
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-3)


def _rows_inputs(kind: str, device: str = "cpu", seed: int = 5) -> tuple:
    """``(x, cos, sin, scale, norm)`` of one use of ``low_ratio_rows`` at Flash's widths:
    ``entries`` (512 channels, e4m3, the compressor's norm), ``keys`` (128, ue8m0, k_norm),
    ``queries`` (32 heads of 128, ue8m0, no norm); bf16 values with a zero row, a row of
    e2m1 ties and rows of tiny and large magnitude."""
    g = torch.Generator().manual_seed(seed)
    rows = 21
    shape = {"entries": (rows, 512), "keys": (rows, 128), "queries": (rows, 32, 128)}[kind]
    x = torch.randn(shape, generator=g) * 3
    x[1] = 0.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[2] = ties.repeat(x[2].numel() // 8).reshape(x[2].shape)
    x[3] *= 1e-30
    x[4] *= 1e20
    angle = torch.rand(rows, 32, generator=g) * 100
    norm = None
    if kind != "queries":
        norm = (torch.rand(shape[-1], generator=g) + 0.5, 1e-6 if kind == "entries" else 1e-20)
    scale = "e4m3" if kind == "entries" else "ue8m0"
    to = dict(device=device)
    norm = None if norm is None else (norm[0].to(**to), norm[1])
    return x.bfloat16().float().to(**to), angle.cos().to(**to), angle.sin().to(**to), scale, norm


@pytest.mark.parametrize("kind", ["entries", "keys", "queries"])
def test_triton_rows_equal_the_torch_twin(kind: str) -> None:
    """Entries, index keys and index queries by the Triton kernel (interpreter) equal the
    torch twin bit for bit, the RMSNorm's output included."""
    from dsv4_backend.kernels.low_ratio.table import low_ratio_rows

    x, cos, sin, scale, norm = _rows_inputs(kind)
    with force_path(TORCH):
        want, want_normed = low_ratio_rows(x, cos, sin, scale, norm)
    with force_path(TRITON_INTERPRETER):
        got, got_normed = low_ratio_rows(x, cos, sin, scale, norm)
    assert torch.equal(got, want) and got.shape == x.shape
    assert (want_normed is None) == (norm is None)
    if want_normed is not None:
        assert got_normed is not None and torch.equal(got_normed, want_normed)


@pytest.mark.parametrize("fmt", ["fp8", "dense"])
def test_triton_rows_store_the_index_keys(fmt: str) -> None:
    """The kernel's store into the fp4 pages (packed in the kernel) or a dense cache holds
    what the torch store holds at every slot: each row at its slot, a slot -1 row at the
    padding slot 0, nothing else written."""
    from dsv4_backend.kernels.low_ratio.table import low_ratio_rows

    x, cos, sin, scale, norm = _rows_inputs("keys")
    slots = torch.randperm(255, generator=torch.Generator().manual_seed(6))[: x.shape[0]] + 1
    slots[5] = -1
    caches = {}
    for path in (TORCH, TRITON_INTERPRETER):
        caches[path] = cache = Fp4IndexKeyCache(256, 128, fmt)
        cache.store(torch.full((256, 128), 0.5), torch.arange(256))
        with force_path(path):
            low_ratio_rows(x, cos, sin, scale, norm, store=(cache, slots))
    every = torch.arange(256)
    stored = caches[TRITON_INTERPRETER].gather(every)
    assert torch.equal(stored, caches[TORCH].gather(every))
    untouched = torch.ones(256, dtype=torch.bool)
    untouched[slots.clamp(min=0)] = False
    assert stored[untouched].eq(0.5).all() and not stored[0].eq(0.5).all()


def test_triton_rows_refuse_what_they_do_not_take() -> None:
    from dsv4_backend.errors import ContractError
    from dsv4_backend.kernels.low_ratio.common import RowsCall
    from dsv4_backend.kernels.low_ratio.triton import fp4_rows_triton

    x, cos, sin, _, _ = _rows_inputs("keys")
    with pytest.raises(ContractError, match="power-of-two number of 32-channel blocks"):
        fp4_rows_triton(RowsCall(x[:, :96], cos, sin, "ue8m0"))
    keys = Fp4IndexKeyCache(256, 128, "fp8")
    with pytest.raises(ContractError, match="ue8m0 scales; got scale 'e4m3'"):
        fp4_rows_triton(RowsCall(x, cos, sin, "e4m3", store=(keys, torch.arange(x.shape[0]))))
    with pytest.raises(ContractError, match="scale 'e5m2'; expected 'e4m3' or 'ue8m0'"):
        RowsCall(x, cos, sin, "e5m2")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["entries", "keys", "queries"])
def test_triton_rows_on_cuda(kind: str) -> None:
    """The Triton rows compiled for the GPU against the torch twin: the GPU's rsqrt and fused
    multiply-adds may move a value across a bf16 rounding boundary, so a few values (< 0.5 %)
    may land one fp4 step away; the stored keys decode to the kernel's own rows."""
    from dsv4_backend.kernels.dispatch import TRITON
    from dsv4_backend.kernels.low_ratio.table import LOW_RATIO_ROWS, low_ratio_rows
    from dsv4_backend.kernels.variants import force_variant

    x, cos, sin, scale, norm = _rows_inputs(kind, "cuda")
    keys = Fp4IndexKeyCache(256, 128, "fp8", "cuda")
    slots = torch.arange(x.shape[0], device="cuda") + 1
    store = (keys, slots) if kind == "keys" else None
    with force_variant(LOW_RATIO_ROWS, "torch"):
        want, _ = low_ratio_rows(x, cos, sin, scale, norm)
    with force_path(TRITON), force_variant(LOW_RATIO_ROWS, "triton"):
        got, _ = low_ratio_rows(x, cos, sin, scale, norm, store=store)
    assert (got != want).float().mean().item() < 5e-3
    if store is not None:
        assert torch.equal(keys.gather(slots), got)


def _pair_batch(seed: int) -> tuple:
    """A ratio-2 batch over a pair ring of 4 rows a slot: requests (pool rows 3, 1, 2) of 1, 6
    and 2 rows at consecutive positions from 0, 9 and 4 (the first rows read the ring; the
    second request's rows overwrite ring rows its first row reads), then 2 padding rows."""
    from dsv4_backend.cache.state import CompressorState

    g = torch.Generator().manual_seed(seed)
    d = 192  # not a multiple of the kernels' 128 channels a program
    ring = torch.randn(5, 4, 2 * d, generator=g)
    req = torch.tensor([3, 1, 1, 1, 1, 1, 1, 2, 2, 0, 0])
    positions = torch.tensor([0, 9, 10, 11, 12, 13, 14, 4, 5, 0, 0])
    valid = torch.tensor([True] * 9 + [False] * 2)
    kv, score = torch.randn(11, d, generator=g), torch.randn(11, d, generator=g) * 4
    return CompressorState(ratio=2, head_dim=d, ring=ring), kv, score, req, positions, valid


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_pair_pooling_equals_the_torch_twin(seed: int) -> None:
    """The pooled rows (to float32 rounding: the exponentials differ in the last bits) and the
    ring (exactly, outside the padding pool row 0) equal the torch twin's."""
    from dsv4_backend.kernels.low_ratio.table import low_ratio_pairs

    out = {}
    for path in (TORCH, TRITON_INTERPRETER):
        rings, *batch = _pair_batch(seed)
        with force_path(path):
            out[path] = low_ratio_pairs(rings, *batch), rings.ring
    (want, want_ring), (got, got_ring) = out[TORCH], out[TRITON_INTERPRETER]
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert torch.equal(got_ring[1:], want_ring[1:])
    before = _pair_batch(seed)[0].ring
    assert not torch.equal(got_ring[1], before[1])  # the ring was written


@pytest.mark.gpu
def test_triton_pair_pooling_on_cuda() -> None:
    """The pair kernels compiled for the GPU (programs in any order: the ring write waits for
    the pooling's reads by being a second launch, and a ring row is written by one row only)
    against the torch twin."""
    from dsv4_backend.cache.state import CompressorState
    from dsv4_backend.kernels.dispatch import TRITON
    from dsv4_backend.kernels.low_ratio.table import LOW_RATIO_PAIRS, low_ratio_pairs
    from dsv4_backend.kernels.variants import force_variant

    out = {}
    for variant in ("torch", "triton"):
        rings, *batch = _pair_batch(0)
        rings = CompressorState(ratio=2, head_dim=rings.head_dim, ring=rings.ring.cuda())
        cuda = [t.cuda() for t in batch]
        with force_path(TRITON), force_variant(LOW_RATIO_PAIRS, variant):
            out[variant] = low_ratio_pairs(rings, *cuda), rings.ring
    torch.testing.assert_close(out["triton"][0], out["torch"][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out["triton"][1][1:], out["torch"][1][1:])
