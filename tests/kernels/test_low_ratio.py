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
from dsv4_backend.kernels.low_ratio.table import low_ratio_scores
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
    with force_path(TORCH):
        want = low_ratio_scores(q, weights, keys, page_table, visible, ratio, width)
    with force_path(TRITON_INTERPRETER):
        got = low_ratio_scores(q, weights, keys, page_table, visible, ratio, width)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert finite.sum() == visible.sum()  # -inf exactly past each row's visible entries
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-5)
    slots = {}
    for path in (TORCH, TRITON_INTERPRETER):
        out = torch.full((q.shape[0], 16), -1, dtype=torch.int32)
        with force_path(path):
            select_entries(q, weights, keys, page_table, visible, ratio, 16, out)
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
    width = pages * per_page
    with force_variant(LOW_RATIO_SCORES, "torch"):
        want = low_ratio_scores(q, weights, keys, page_table, visible, ratio, width)
    with force_path(TRITON), force_variant(LOW_RATIO_SCORES, "triton"):
        got = low_ratio_scores(q, weights, keys, page_table, visible, ratio, width)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    # bf16 tensor-core dots of fp4 values: exact products, fp32 sums in another order
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-3)
