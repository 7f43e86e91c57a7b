"""Caches: byte layouts, FP8 codec, store kernels (Triton == torch, byte for byte), loaders, pools.

FP8 error bound tested (token caches): with ``v = x / scale`` (exact, the scale is a power of two
and ``|v| <= 448`` by construction, so nothing saturates), e4m3 keeps 3 mantissa bits, hence
``|x - deq| <= 2^-4 * 2^floor(log2|x|)`` when ``|v| >= 2^-6`` (normal), and
``|x - deq| <= 2^-10 * scale`` otherwise (half the subnormal step 2^-9).
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from marks import needs_interpreter

from dsv4_backend.cache import (
    DSV4CachePools,
    Fp8IndexerLayout,
    Fp8TokenLayout,
    IndexerKeyCache,
    TokenCache,
)
from dsv4_backend.cache.fp8_format import e4m3_decode, e4m3_encode, ue8m0_exponent
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ConfigError, ContractError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.kernels.device.fp8 import (
    bf16_bits_to_fp32,
    e4m3_to_fp32,
    fp32_to_bf16_bits,
    fp32_to_e4m3,
    load_bf16_rope_block,
    load_dense_block,
    load_fp8_indexer_block,
    load_fp8_nope_block,
    load_fp8_token_block,
    triton_constexprs,
    ue8m0_exponent_of,
)

# Cache shapes: (name, factory(fmt, dtype)) covering tiny and Flash widths, all page sizes.
CACHES = {
    "tiny-window": lambda fmt, dtype: TokenCache(300, 128, 64, 128, fmt, dtype),
    "tiny-c4": lambda fmt, dtype: TokenCache(192, 128, 64, 64, fmt, dtype),
    "flash-c128": lambda fmt, dtype: TokenCache(12, 512, 64, 2, fmt, dtype),
    "indexer-tiny": lambda fmt, dtype: IndexerKeyCache(130, 64, fmt, dtype),
    "indexer-flash": lambda fmt, dtype: IndexerKeyCache(70, 128, fmt, dtype),
}


def _rows(n: int, dim: int, seed: int) -> torch.Tensor:
    """Rows spanning 12 orders of magnitude (one magnitude per row), plus exact zeros."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, dim, generator=g) * torch.logspace(-6, 6, n)[:, None]
    rows[0, : min(dim, 64)] = 0.0  # an all-zero scale group
    return rows


def _slots(cache, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(cache.num_slots, generator=g)[:n]
    slots[1::4] = -1
    return slots


def _touched(cache, slots: torch.Tensor) -> torch.Tensor:
    """Bool mask over the flat storage bytes that a store at ``slots`` may write."""
    flat = torch.zeros(cache.storage.numel() * cache.storage.element_size(), dtype=torch.bool)
    valid = slots[slots >= 0]
    if cache.layout is None:
        width = cache.dim * cache.storage.element_size()
        idx = valid[:, None] * width + torch.arange(width)
        flat[idx.reshape(-1)] = True
        return flat
    layout = cache.layout
    flat[(layout.data_offsets(valid)[:, None] + torch.arange(layout.token_bytes)).reshape(-1)] = 1
    flat[(layout.scale_offsets(valid)[:, None] + torch.arange(layout.scale_bytes)).reshape(-1)] = 1
    return flat


def _bytes(cache) -> torch.Tensor:
    return cache.storage.reshape(-1).view(torch.uint8)


# ------------------------------------------------------------------------------------ layouts
def test_flash_token_layout_sizes() -> None:
    window = Fp8TokenLayout(448, 64, 256)  # sglang's SWA page
    assert (window.token_bytes, window.bytes_per_token, window.num_scales) == (576, 584, 7)
    assert window.page_bytes == 149_760  # 256 * 584 = 149504, padded to 260 * 576
    assert window.scale_base == 256 * 576
    assert Fp8TokenLayout(448, 64, 64).page_bytes == 65 * 576  # c4: 37376 -> 37440
    assert Fp8TokenLayout(448, 64, 2).page_bytes == 3 * 576  # c128: 1168 -> 1728
    tiny = Fp8TokenLayout(64, 64, 128)
    assert (tiny.token_bytes, tiny.page_bytes) == (192, 134 * 192)


def test_indexer_layout_sizes() -> None:
    layout = Fp8IndexerLayout(128)
    assert (layout.bytes_per_token, layout.page_bytes, layout.scale_base) == (132, 8448, 8192)
    cache = IndexerKeyCache(130, 128, "fp8")
    assert cache.storage.shape == (3, 8448) and cache.storage.dtype == torch.uint8


def test_layout_rejects_unsupported_widths() -> None:
    with pytest.raises(ConfigError, match="multiple of 64"):
        Fp8TokenLayout(100, 64, 64)
    with pytest.raises(ConfigError, match="needs 9 scales"):
        Fp8TokenLayout(576, 64, 64)
    with pytest.raises(ConfigError, match="multiple of 4"):
        Fp8IndexerLayout(66)


def test_known_token_bytes() -> None:
    """Pin the format: slot 65 of a 64-token page sits at page 1, token 1."""
    cache = TokenCache(128, 128, 64, 64, "fp8")
    row = torch.cat([torch.full((64,), 1.0), torch.full((64,), 1.5)])[None]
    with dispatch.force_path("torch"):
        store_rows(cache, row, torch.tensor([65]))
    page = cache.storage[1]
    data = page[192 : 192 + 192]
    assert torch.all(data[:64] == 0x78)  # 1.0 / 2^-8 = 256 = e4m3 0x78
    assert data[64:].tolist() == [0xC0, 0x3F] * 64  # bf16 1.5 = 0x3FC0, little endian
    scales = page[64 * 192 + 8 : 64 * 192 + 16]
    assert scales.tolist() == [119, 0, 0, 0, 0, 0, 0, 0]  # 2^(119-127) = 2^ceil(log2(1/448))
    assert torch.count_nonzero(cache.storage).item() == 64 + 128 + 1


# ---------------------------------------------------------------------------------- fp8 codec
@triton.jit
def _codec_kernel(
    x_ptr,  # [N] fp32
    code_ptr,  # [N] uint8 out: e4m3(x)
    dec_ptr,  # [N] fp32 out: decode(code)
    e_ptr,  # [N] int32 out: ue8m0 exponent of |x|
    bf16_ptr,  # [N] fp32 out: bf16(x) back to fp32
    N: tl.constexpr,
):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    code = fp32_to_e4m3(x)
    tl.store(code_ptr + offs, code)
    tl.store(dec_ptr + offs, e4m3_to_fp32(code))
    tl.store(e_ptr + offs, ue8m0_exponent_of(tl.abs(x)))
    tl.store(bf16_ptr + offs, bf16_bits_to_fp32(fp32_to_bf16_bits(x)))


def _codec_inputs() -> torch.Tensor:
    """Every e4m3 value, every rounding midpoint and its fp32 neighbours, randoms, edges."""
    values = e4m3_decode(torch.arange(256, dtype=torch.uint8))
    finite = values[~values.isnan()].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    up, down = torch.tensor(math.inf), torch.tensor(-math.inf)
    g = torch.Generator().manual_seed(0)
    edges = [0.0, -0.0, 448, 449, 464, 1e6, 1e-30, 2**-10, -(2**-10), 1.75 * 2**20, 2**-149]
    return torch.cat(
        [
            finite,
            mids,
            mids.nextafter(up),
            mids.nextafter(down),
            torch.randn(900, generator=g) * 30,
            torch.randn(300, generator=g) * 1e-3,
            torch.tensor(edges),
        ]
    )


@needs_interpreter
def test_triton_codec_matches_torch() -> None:
    values = _codec_inputs()
    n = triton.next_power_of_2(values.numel())
    x = torch.zeros(n)
    x[: values.numel()] = values
    code = torch.empty(n, dtype=torch.uint8)
    dec, e, bf = torch.empty(n), torch.empty(n, dtype=torch.int32), torch.empty(n)
    with dispatch.force_path("triton-interpreter"):
        _codec_kernel[(1,)](x, code, dec, e, bf, N=n)
    torch.testing.assert_close(code, e4m3_encode(x), rtol=0, atol=0)
    assert torch.equal(dec.view(torch.int32), e4m3_decode(code).view(torch.int32))
    torch.testing.assert_close(e, ue8m0_exponent(x.abs()), rtol=0, atol=0)
    assert torch.equal(bf, x.to(torch.bfloat16).float())


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0, max_value=2.0**127, width=32))
def test_ue8m0_is_smallest_power_of_two_covering(amax: float) -> None:
    e = int(ue8m0_exponent(torch.tensor([amax], dtype=torch.float32)))
    if amax == 0:
        assert e == 127
        return
    assert 448 * 2.0 ** (e - 127) >= amax  # |x| / scale <= 448: never saturates
    assert e == 0 or 448 * 2.0 ** (e - 128) < amax  # and the scale is the smallest such


# ---------------------------------------------------------------------------- fp8 round trip
def _check_token_bound(layout: Fp8TokenLayout, x: torch.Tensor, deq: torch.Tensor) -> None:
    nope, dn = x[:, : layout.nope_dim].double(), deq[:, : layout.nope_dim].double()
    groups = nope.reshape(x.shape[0], -1, 64)
    e = ue8m0_exponent(groups.abs().amax(-1).float()).double()
    scale = torch.exp2(e - 127)[..., None].expand_as(groups).reshape(nope.shape)
    err = (nope - dn).abs()
    normal = nope.abs() >= 2.0**-6 * scale
    magnitude = torch.exp2(torch.floor(torch.log2(nope.abs().clamp(min=1e-300))))
    assert torch.all(err[normal] <= 2.0**-4 * magnitude[normal])
    assert torch.all(err[~normal] <= 2.0**-10 * scale[~normal])
    rope = x[:, layout.nope_dim :]
    assert torch.equal(deq[:, layout.nope_dim :], rope.to(torch.bfloat16).float())


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-30, 30),
    n=st.integers(1, 9),
)
def test_fp8_token_round_trip_bound(seed: int, log_scale: float, n: int) -> None:
    layout = Fp8TokenLayout(448, 64, 2)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=g) * math.exp(log_scale)
    x[:, 448:] = x[:, 448:].to(torch.bfloat16).float()  # bf16-representable rope: exact
    x[0, :64] *= 1e-9  # a group far below its neighbours still gets its own scale
    deq = layout.unpack_tokens(*layout.pack_tokens(x))
    _check_token_bound(layout, x, deq)


def test_fp8_indexer_round_trip_bound() -> None:
    layout = Fp8IndexerLayout(128)
    x = _rows(16, 128, seed=3)
    deq = layout.unpack_tokens(*layout.pack_tokens(x)).double()
    scale = torch.where(x.abs().amax(1) == 0, 1.0, x.abs().amax(1) / 448).double()[:, None]
    v = x.double() / scale
    magnitude = torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=1e-300))))
    # e4m3 rounding of v (half an ulp), plus fp32 rounding of v and of the product.
    bound = torch.where(v.abs() >= 2**-6, 2.0**-4 * magnitude, 2.0**-10) * scale
    assert torch.all((deq - x.double()).abs() <= bound * (1 + 2**-20) + 2**-22 * x.abs())


# -------------------------------------------------------------------------------------- store
@needs_interpreter
@pytest.mark.parametrize("name", sorted(CACHES))
@pytest.mark.parametrize(
    ("fmt", "dtype", "row_dtype"),
    [
        ("dense", torch.float32, torch.float32),
        ("dense", torch.bfloat16, torch.float32),
        ("fp8", torch.float32, torch.float32),
        ("fp8", torch.float32, torch.bfloat16),
    ],
)
def test_triton_store_matches_torch_bytes(name, fmt, dtype, row_dtype) -> None:
    caches = [CACHES[name](fmt, dtype) for _ in range(2)]
    initial = torch.randint(0, 256, _bytes(caches[0]).shape, dtype=torch.uint8)
    n = 12
    rows = _rows(n, caches[0].dim, seed=1).to(row_dtype)
    slots = _slots(caches[0], n, seed=2)
    for cache, path in zip(caches, ("torch", "triton-interpreter"), strict=True):
        _bytes(cache).copy_(initial)
        with dispatch.force_path(path):
            store_rows(cache, rows, slots)
    torch_bytes, triton_bytes = _bytes(caches[0]), _bytes(caches[1])
    assert torch.equal(torch_bytes, triton_bytes)
    untouched = ~_touched(caches[0], slots)
    assert torch.equal(torch_bytes[untouched], initial[untouched])  # -1 and padding untouched
    assert not torch.equal(torch_bytes, initial)


PATHS = ["torch", pytest.param("triton-interpreter", marks=needs_interpreter)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["dense", "fp8"])
def test_gather_after_store(path: str, fmt: str) -> None:
    cache = TokenCache(256, 512, 64, 64, fmt)
    rows = _rows(10, 512, seed=4)
    rows[:, 448:] = rows[:, 448:].to(torch.bfloat16).float()
    slots = _slots(cache, 10, seed=5)
    with dispatch.force_path(path):
        store_rows(cache, rows, slots)
    query = torch.stack([slots, slots.flip(0)])  # any shape; -1 reads zeros
    got = cache.gather(query)
    assert got.shape == (2, 10, 512) and got.dtype == torch.float32
    expected = torch.where(slots[:, None] >= 0, rows, 0.0)
    assert torch.equal(got[0], got[1].flip(0))
    if fmt == "dense":
        assert torch.equal(got[0], expected)
    else:
        _check_token_bound(cache.layout, expected, got[0])


def test_store_skips_minus_one_and_empty() -> None:
    cache = TokenCache(64, 128, 64, 64, "fp8")
    store_rows(cache, torch.ones(3, 128), torch.tensor([-1, -1, -1]))
    store_rows(cache, torch.ones(0, 128), torch.empty(0, dtype=torch.int64))
    assert torch.count_nonzero(cache.storage) == 0


def test_store_and_gather_errors() -> None:
    cache = TokenCache(64, 128, 64, 64, "dense")
    with pytest.raises(BatchError, match=r"expected a float tensor \[N, 128\]"):
        store_rows(cache, torch.ones(2, 96), torch.tensor([0, 1]))
    with pytest.raises(BatchError, match=r"spans \[0, 64\]; expected slot ids in \[0, 64\)"):
        store_rows(cache, torch.ones(2, 128), torch.tensor([0, 64]))
    with pytest.raises(BatchError, match="spans"):
        cache.gather(torch.tensor([-2]))
    with pytest.raises(BatchError, match="integer tensor"):
        cache.gather(torch.tensor([0.0]))
    with pytest.raises(BatchError, match=r"expected \(2,\), one per row"):
        store_rows(cache, torch.ones(2, 128), torch.tensor([0, 1, 2]))
    with pytest.raises(ConfigError, match="fmt='fp4'"):
        TokenCache(64, 128, 64, 64, "fp4")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ device loaders
@triton.jit
def _load_kernel(
    cache_ptr,  # storage of the cache under test
    slots_ptr,  # [BLOCK_N] int64
    out_ptr,  # [BLOCK_N, BLOCK_D] fp32
    stride_slot,
    d0,  # first channel of the block
    n_valid,  # rows >= n_valid are masked
    KIND: tl.constexpr,  # 0 token, 1 nope, 2 rope, 3 indexer, 4 dense
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = d0 + tl.arange(0, BLOCK_D)
    slots = tl.load(slots_ptr + offs_n)
    mask_n = offs_n < n_valid
    if KIND == 0:
        x = load_fp8_token_block(cache_ptr, slots, offs_d, mask_n, NOPE_DIM, ROPE_DIM, PAGE_TOKENS)
    elif KIND == 1:
        x = load_fp8_nope_block(cache_ptr, slots, offs_d, mask_n, NOPE_DIM, ROPE_DIM, PAGE_TOKENS)
    elif KIND == 2:
        x = load_bf16_rope_block(cache_ptr, slots, offs_d, mask_n, NOPE_DIM, ROPE_DIM, PAGE_TOKENS)
    elif KIND == 3:
        x = load_fp8_indexer_block(cache_ptr, slots, offs_d, mask_n, DIM, PAGE_TOKENS)
    else:
        x = load_dense_block(cache_ptr, stride_slot, slots, offs_d, mask_n, DIM)
    tl.store(out_ptr + offs_n[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], x)


def _run_loader(cache, kind: int, slots: torch.Tensor, d0: int, block_d: int, n_valid: int):
    consts = dict(NOPE_DIM=64, ROPE_DIM=0, PAGE_TOKENS=1, DIM=cache.dim)
    if cache.layout is not None:
        consts.update(triton_constexprs(cache.layout))
    out = torch.full((slots.numel(), block_d), float("nan"))
    _load_kernel[(1,)](
        cache.storage,
        slots,
        out,
        cache.storage.stride(0),
        d0,
        n_valid,
        KIND=kind,
        BLOCK_N=slots.numel(),
        BLOCK_D=block_d,
        **consts,
    )
    return out


@needs_interpreter
@pytest.mark.parametrize(
    ("name", "fmt", "dtype", "kind", "d0", "block_d"),
    [
        ("flash-c128", "fp8", None, 0, 0, 512),  # whole head
        ("flash-c128", "fp8", None, 0, 384, 128),  # a block straddling nope/rope
        ("tiny-window", "fp8", None, 0, 0, 256),  # padded block: channels >= 128 read 0
        ("tiny-c4", "fp8", None, 1, 0, 128),  # nope only: channels >= 64 read 0
        ("flash-c128", "fp8", None, 2, 0, 64),  # rope only
        ("indexer-flash", "fp8", None, 3, 0, 128),
        ("indexer-tiny", "fp8", None, 3, 32, 64),
        ("tiny-c4", "dense", torch.bfloat16, 4, 0, 128),
        ("indexer-tiny", "dense", torch.float32, 4, 0, 64),
    ],
)
def test_device_loaders_match_gather(name, fmt, dtype, kind, d0, block_d) -> None:
    cache = CACHES[name](fmt, dtype or torch.float32)
    slots = torch.randperm(cache.num_slots, generator=torch.Generator().manual_seed(6))[:8]
    with dispatch.force_path("torch"):
        store_rows(cache, _rows(8, cache.dim, seed=7), slots)
    query = torch.cat([slots[:5], torch.tensor([-1, slots[5], slots[6]])])  # -1, then masked
    with dispatch.force_path("triton-interpreter"):
        got = _run_loader(cache, kind, query, d0, block_d, n_valid=7)
    full = cache.gather(torch.where(torch.arange(8) < 7, query, -1))
    channels = d0 + torch.arange(block_d)
    if kind == 2:
        channels = channels + cache.layout.nope_dim
    in_part = channels < cache.dim
    if kind == 1:
        in_part &= channels < cache.layout.nope_dim
    expected = torch.zeros(8, block_d)
    expected[:, in_part] = full[:, channels[in_part]]
    assert torch.equal(got, expected)


# -------------------------------------------------------------------------------------- pools
def test_pools_tiny_sizes() -> None:
    config = DSV4AttentionConfig.tiny()  # ratios (0, 4, 128, 4)
    pools = DSV4CachePools.build(config, num_full_slots=1024, num_swa_slots=384, fmt="fp8")
    assert pools.layers == range(4)
    for layer in range(4):
        window = pools.window(layer)
        assert (window.num_slots, window.page_tokens, window.dim) == (384, 256, 128)
    # sglang's SWA page: 256 * (192 + 8) = 51200 B -> 267 * 192; 384 slots take 2 pages
    assert pools.window(0).storage.shape == (2, 267 * 192)
    c4, c128 = pools.compressed(1), pools.compressed(2)
    # page bytes: 64 * (192 + 8) = 12800 -> 67 * 192; 2 * 200 = 400 -> 3 * 192
    assert (c4.num_slots, c4.page_tokens, c4.storage.shape) == (256, 64, (4, 67 * 192))
    assert (c128.num_slots, c128.page_tokens, c128.storage.shape) == (8, 2, (4, 3 * 192))
    assert pools.indexer(3).num_slots == 256 and pools.indexer(3).dim == 64
    assert pools.indexer(1) is not pools.indexer(3)
    with pytest.raises(ContractError, match="layer 0 has compress ratio 0"):
        pools.compressed(0)
    with pytest.raises(ContractError, match="layer 2 has compress ratio 128 and no indexer"):
        pools.indexer(2)
    with pytest.raises(ContractError, match=r"layer=4; these caches hold layers \[0, 4\)"):
        pools.window(4)


def test_a_pipeline_stage_holds_its_own_layers() -> None:
    """``layers``: a stage's caches only, keyed by the model's layer ids; other layers are
    refused by name, and a range that is not a stage of the model is a ConfigError."""
    config = DSV4AttentionConfig.tiny()  # ratios (0, 4, 128, 4)
    stage = DSV4CachePools.build(
        config, num_full_slots=1024, num_swa_slots=384, fmt="fp8", layers=range(1, 3)
    )
    assert sorted(stage.windows) == [1, 2] and sorted(stage.compressed_caches) == [1, 2]
    assert sorted(stage.indexer_caches) == [1]
    whole = DSV4CachePools.build(config, num_full_slots=1024, num_swa_slots=384, fmt="fp8")
    assert (
        stage.nbytes
        == sum(c.nbytes for c in whole.caches()[1:3])
        + sum(whole.compressed(layer).nbytes for layer in (1, 2))
        + whole.indexer(1).nbytes
    )
    for layer in (0, 3):
        with pytest.raises(
            ContractError, match=rf"layer={layer}; these caches hold layers \[1, 3\)"
        ):
            stage.window(layer)
    for bad in (range(2, 2), range(0, 5), range(0, 4, 2), range(-1, 2)):
        with pytest.raises(ConfigError, match="a pipeline stage's"):
            DSV4CachePools.build(
                config, num_full_slots=1024, num_swa_slots=384, fmt="fp8", layers=bad
            )


def test_pools_flash_dense_and_errors() -> None:
    config = DSV4AttentionConfig(compress_ratios=(0, 0, 4, 128))
    pools = DSV4CachePools.build(
        config, num_full_slots=512, num_swa_slots=256, fmt="dense", dtype=torch.bfloat16
    )
    assert pools.window(0).storage.shape == (256, 512)
    assert pools.compressed(2).storage.shape == (128, 512)
    assert pools.compressed(3).storage.shape == (4, 512)
    assert pools.indexer(2).storage.shape == (128, 128)
    assert pools.nbytes == 2 * (4 * 256 * 512 + 128 * 512 + 4 * 512 + 128 * 128)
    with pytest.raises(ConfigError, match="num_full_slots=300; expected a positive multiple"):
        DSV4CachePools.build(config, num_full_slots=300, num_swa_slots=256, fmt="fp8")
