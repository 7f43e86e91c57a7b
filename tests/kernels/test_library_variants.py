"""The FlashMLA and DeepGEMM variants, checked on the CPU up to the library call.

``flash_mla`` and ``deep_gemm`` need CUDA, so each test installs a stand-in module in
``sys.modules``. Its functions take the real packages' parameters, in their order and with
their defaults (sgl-flash-mla 1.0.0 ``flash_mla_interface.py``; sgl-deep-gemm 0.2.3.post2
``__init__.py`` and its op schemas), assert what the real ones document or check (shapes,
dtypes, strides, the cache views, int32 indices with -1 padding, per-row lengths, the flags
sglang passes) and then compute the library's result with this project's torch twin over the
bytes they were handed: FlashMLA's sparse decode is ``sparse_attention_torch`` over the caches
the views describe; DeepGEMM's logits are the torch ``index_scores`` of the e4m3 codes with the
folded weights, its columns past a row's length left as NaN (``clean_logits=False`` leaves them
unwritten); over fp4 keys (``fp8_fp4_paged_mqa_logits``, DeepGEMM's ``attention.hpp``
checks of its fp4 branch) the torch ``index_scores`` of the unpacked e2m1 queries on the fp4
pages. Comparing a variant with the op's torch path on the same inputs then checks the glue:
index and length translation, head padding, sink, scale, query quantisation, masking. Nothing
here runs the real libraries (they need CUDA; DeepGEMM's fp4 logits sm_100 / sm_120).

The device check stands in the way on the CPU: the variants' reason functions are replaced for
the end-to-end comparisons, and tested apart with an injected compute capability.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dsv4_backend.cache import TokenCache
from dsv4_backend.cache.fp4_format import (
    C4_ROUNDING,
    Fp4IndexKeyCache,
    fp4_round_ue8m0,
    unpack_ue8m0,
)
from dsv4_backend.cache.fp8_format import Fp8TokenLayout
from dsv4_backend.cache.indexer_cache import IndexerKeyCache
from dsv4_backend.cache.token_cache import CacheFormat
from dsv4_backend.config import WINDOW_PAGE_TOKENS
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention import flashmla, flashmla_library, flashmla_prefill
from dsv4_backend.kernels.attention.common import AttentionCall
from dsv4_backend.kernels.attention.flashmla import (
    flashmla_arguments,
    flashmla_unsupported_reason,
    sparse_attention_flashmla,
)
from dsv4_backend.kernels.attention.flashmla_prefill import sparse_attention_flashmla_prefill
from dsv4_backend.kernels.attention.torch import sparse_attention_torch
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.kernels.indexer import deep_gemm as indexer_deep_gemm
from dsv4_backend.kernels.indexer.common import IndexCall, select_entries
from dsv4_backend.kernels.indexer.deep_gemm import (
    deep_gemm_arguments,
    deep_gemm_unsupported_reason,
    index_scores_deep_gemm,
    paged_mqa_schedule,
    quantise_fp4_queries,
    quantise_queries,
)
from dsv4_backend.kernels.indexer.fp4 import fp4_key_rows, fp4_query_view
from dsv4_backend.kernels.indexer.fp8 import e4m3_round_trip, quantised_view
from dsv4_backend.kernels.indexer.table import index_scores
from dsv4_backend.kernels.indexer.topk import FLASHINFER
from dsv4_backend.kernels.variants import Target

CUDA = torch.device("cuda")  # only named: no test touches a GPU
D, ROPE = 512, 64
#: fp8 page sizes of the window, c4 and c128 caches.
PAGES = {"window": WINDOW_PAGE_TOKENS, "c4": 64, "c128": 2}
HI, DI = 64, 128
#: ``sparse_attention_with_sink``'s positional arguments.
AttentionArgs = tuple[
    torch.Tensor, TokenCache, torch.Tensor, torch.Tensor, TokenCache | None,
    torch.Tensor | None, torch.Tensor | None, torch.Tensor, float,
]  # fmt: skip
#: ``index_scores``' arguments.
IndexerArgs = tuple[
    torch.Tensor, torch.Tensor, IndexerKeyCache | Fp4IndexKeyCache, torch.Tensor, torch.Tensor,
    int,
]  # fmt: skip


# ----------------------------------------------------------------- stand-in flash_mla
@dataclasses.dataclass
class FakeSchedMeta:
    """``flash_mla.FlashMLASchedMeta``: empty until the first call fills its config."""

    have_initialized: bool = False
    config: tuple | None = None


def _flashmla_cache(view: torch.Tensor, name: str) -> TokenCache:
    """The fp8 cache a ``[pages, page_tokens, 1, 584]`` view describes, read back as sglang's
    V4 pages: ``page_tokens`` x 576 data bytes, then their 8 scale bytes, page stride
    ``stride(0)`` (FlashMLA's checks: uint8, one KV head, 584 B a token, contiguous pages)."""
    pages, page_tokens, heads_k, per_token = view.shape
    assert view.dtype == torch.uint8, f"{name}: {view.dtype}"
    assert heads_k == 1 and per_token == 584, f"{name}: shape {tuple(view.shape)} (V4: 584 B)"
    assert view.stride()[1:] == (584, 584, 1), f"{name}: page blocks not contiguous"
    layout = Fp8TokenLayout(D - ROPE, ROPE, page_tokens)
    assert view.stride(0) == layout.page_bytes, f"{name}: page stride {view.stride(0)}"
    assert view.data_ptr() % 16 == 0, f"{name}: base not 16-byte aligned"
    pages_bytes = view.as_strided((pages, layout.page_bytes), (layout.page_bytes, 1))
    return TokenCache.over(pages_bytes, pages * page_tokens, D, ROPE, page_tokens)


def _flashmla_indices(indices: Any, lengths: Any, rows: int, name: str) -> None:
    """``indices`` ``[b, 1, topk]`` int32 (-1: none, topk a multiple of 64, 32-byte rows),
    ``lengths`` ``[b]`` int32 contiguous, within ``[0, topk]``."""
    assert isinstance(indices, torch.Tensor) and indices.dtype == torch.int32, name
    assert indices.dim() == 3 and indices.shape[:2] == (rows, 1), f"{name}: {indices.shape}"
    assert indices.shape[2] % 64 == 0, f"{name}: topk {indices.shape[2]} not a multiple of 64"
    assert indices.stride(-1) == 1 and indices.stride(0) % 8 == 0, f"{name}: strides"
    assert int(indices.min()) >= -1, f"{name}: an invalid index other than -1"
    assert isinstance(lengths, torch.Tensor) and lengths.dtype == torch.int32, name
    assert lengths.shape == (rows,) and lengths.is_contiguous(), f"{name} lengths"
    assert int(lengths.min()) >= 0 and int(lengths.max()) <= indices.shape[2], name


def fake_flash_mla_with_kvcache(
    q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
    num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
    attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
    extra_topk_length=None, enable_batch_invariant=False, use_legacy=False, kv_format=None,
    descale_q=None, descale_k=None,
):  # fmt: skip
    """``flash_mla.flash_mla_with_kvcache``'s sparse fp8 path: ``(out [b, s_q, h_q, 512]
    bf16, lse [b, h_q, s_q] fp32)``."""
    assert q.dtype == torch.bfloat16 and q.dim() == 4 and q.is_contiguous(), q.dtype
    b, s_q, h_q, d_qk = q.shape
    assert s_q == 1 and h_q in (64, 128) and d_qk == 512 and head_dim_v == 512, q.shape
    assert block_table is None and cache_seqlens is None  # ignored; sglang passes None
    assert isinstance(tile_scheduler_metadata, FakeSchedMeta) and num_splits is None
    assert not causal and is_fp8_kvcache is True and use_legacy is True  # V4: legacy kernels
    assert kv_format is None and not enable_batch_invariant
    assert descale_q is None and descale_k is None
    assert isinstance(softmax_scale, float)
    assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,)
    assert attn_sink.stride(0) == 1
    window = _flashmla_cache(k_cache, "k_cache")
    _flashmla_indices(indices, topk_length, b, "indices")
    extra_given = [x is not None for x in (extra_k_cache, extra_indices_in_kvcache)]
    assert extra_given in ([False, False], [True, True])
    assert (extra_topk_length is not None) == extra_given[0]
    extra_args: tuple[TokenCache | None, torch.Tensor | None, torch.Tensor | None]
    extra_args = (None, None, None)
    if extra_k_cache is not None:
        extra = _flashmla_cache(extra_k_cache, "extra_k_cache")
        _flashmla_indices(extra_indices_in_kvcache, extra_topk_length, b, "extra indices")
        extra_args = (extra, extra_indices_in_kvcache[:, 0], extra_topk_length)
    config = (b, s_q, h_q, k_cache.shape[1], indices.shape[-1], *extra_given)
    if tile_scheduler_metadata.have_initialized:  # reused: the same shapes
        assert tile_scheduler_metadata.config == config, "sched_meta reused for other shapes"
    tile_scheduler_metadata.have_initialized, tile_scheduler_metadata.config = True, config
    ext, ext_indices, ext_lengths = extra_args
    call = AttentionCall.of(
        q[:, 0].float(), window, indices[:, 0], topk_length, ext, ext_indices, ext_lengths,
        attn_sink, softmax_scale,
    )  # fmt: skip
    out = sparse_attention_torch(call)
    return out.bfloat16()[:, None], torch.zeros(b, h_q, s_q)


def fake_flash_mla_sparse_fwd(
    q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, use_legacy=False,
    return_log2_lse=None,
):  # fmt: skip
    """``flash_mla.flash_mla_sparse_fwd`` (legacy kernels, no statistics): ``(out [s_q, h_q,
    512] bf16, None, None)``, computed here from its documented definition (the keys
    ``kv[indices[i, 0, :topk_length[i]]]`` that are in ``[0, s_kv)``, the sink added to the
    softmax denominator); rows without a key are NaN (the variant must not rely on them)."""
    assert q.dtype == torch.bfloat16 and q.dim() == 3 and q.stride(-1) == 1, q.dtype
    s_q, h_q, d_qk = q.shape
    assert h_q in (64, 128) and d_qk == 512 and d_v == 512, q.shape
    assert kv.dtype == torch.bfloat16 and kv.dim() == 3 and kv.stride(-1) == 1, kv.dtype
    s_kv, h_kv, _ = kv.shape
    assert h_kv == 1 and kv.shape[2] == d_qk and s_kv >= 1, kv.shape
    assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, h_kv), indices.shape
    # Hopper's kernel: params.topk % (2 * B_TOPK) == 0, B_TOPK = 64.
    assert indices.shape[2] % 128 == 0 and indices.stride(-1) == 1, indices.shape
    assert int(indices.min()) >= -1 and int(indices.max()) < s_kv
    assert attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,)
    assert topk_length.dtype == torch.int32 and topk_length.shape == (s_q,)
    assert int(topk_length.min()) >= 0 and int(topk_length.max()) <= indices.shape[2]
    assert isinstance(sm_scale, float) and use_legacy is True and return_log2_lse is False
    out = torch.full((s_q, h_q, d_v), float("nan"))
    for i in range(s_q):
        cols = indices[i, 0, : int(topk_length[i])].long()
        keys = kv[cols[cols >= 0], 0].float()  # [n, 512]
        if keys.shape[0]:
            logits = (q[i].float() @ keys.T) * sm_scale  # [h_q, n]
            m = logits.amax(-1)
            p = torch.exp(logits - m[:, None])
            denom = p.sum(-1) + torch.exp(attn_sink - m)
            out[i] = (p @ keys[:, :d_v]) / denom[:, None]
    return out.bfloat16(), None, None


def _fake_flash_mla(legacy: bool = True) -> types.ModuleType:
    module = types.ModuleType("flash_mla")
    module.__version__ = "1.0.0"  # type: ignore[attr-defined]
    module.has_legacy = lambda: legacy  # type: ignore[attr-defined]
    module.get_mla_metadata = lambda *a, **k: (FakeSchedMeta(), None)  # type: ignore[attr-defined]
    module.flash_mla_with_kvcache = fake_flash_mla_with_kvcache  # type: ignore[attr-defined]
    module.flash_mla_sparse_fwd = fake_flash_mla_sparse_fwd  # type: ignore[attr-defined]
    return module


@pytest.fixture
def flash_mla(monkeypatch) -> types.ModuleType:
    module = _fake_flash_mla()
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    return module


# ----------------------------------------------------------------- attention inputs
def _token_cache(num: int, page_tokens: int, fmt: CacheFormat, g: torch.Generator) -> TokenCache:
    cache = TokenCache(num, D, ROPE, page_tokens, fmt, torch.bfloat16)
    with dispatch.force_path("torch"):
        store_rows(cache, torch.randn(num, D, generator=g), torch.arange(num))
    return cache


def _slots(lengths: list[int], width: int, num: int, g: torch.Generator):
    """``[T, width]`` int32 slots with -1 holes (stale slots past each length) and ``[T]``
    int32 lengths (some past the width, one negative: the op clamps them)."""
    idx = torch.randint(0, num, (len(lengths), width), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    return idx, torch.tensor(lengths, dtype=torch.int32)


def _attention_args(
    heads: int, layer: str, g: torch.Generator, fmt: CacheFormat = "fp8"
) -> AttentionArgs:
    """The op's arguments for 5 rows: bf16-valued queries (FlashMLA's dtype loses nothing),
    sinks large enough to matter, widths that are not multiples of 64; ``fmt`` caches."""
    window = _token_cache(300, PAGES["window"], fmt, g)
    swa_idx, swa_len = _slots([100, 1, 0, 130, 37], 100, 300, g)
    extra: tuple[TokenCache | None, torch.Tensor | None, torch.Tensor | None] = (None,) * 3
    if layer != "window":
        cache = _token_cache(90, PAGES[layer], fmt, g)
        extra = (cache, *_slots([70, 0, 5, -3, 90], 70, 90, g))
    q = torch.randn(5, heads, D, generator=g).bfloat16().float()
    sink = torch.randn(heads, generator=g) + 2.0
    return (q, window, swa_idx, swa_len, *extra, sink, D**-0.5)


# --------------------------------------------------------------------- FlashMLA tests
@pytest.mark.parametrize("layer", ["window", "c4", "c128"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_flashmla_matches_the_torch_path(flash_mla, monkeypatch, heads, layer):
    """Through the stand-in FlashMLA, the variant's output is the torch path's (bf16 output
    rounding apart) for 16 (padded to 64), 64 and 128 heads, window-only and both extra
    caches, lengths of 0, past the width and negative, -1 holes."""
    monkeypatch.setattr(flashmla, "flashmla_unsupported_reason", lambda *a, **k: None)
    args = _attention_args(heads, layer, torch.Generator().manual_seed(heads + len(layer)))
    out = sparse_attention_flashmla(AttentionCall.of(*args))
    expected = sparse_attention_torch(AttentionCall.of(*args))
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    if layer == "window":  # row 2 has no key: 0
        assert (out[2] == 0).all()


def test_flashmla_takes_the_prefill_kernel_above_sglangs_threshold(flash_mla, monkeypatch):
    """As sglang's built-in: a call of more than ``PREFILL_ROWS`` rows (lowered here) goes
    through the stand-in's sparse prefill, the others through its decode; both give the torch
    path's output."""
    monkeypatch.setattr(flashmla, "flashmla_unsupported_reason", lambda *a, **k: None)
    calls: list[str] = []
    for name in ("flash_mla_with_kvcache", "flash_mla_sparse_fwd"):
        real = getattr(flash_mla, name)
        monkeypatch.setattr(flash_mla, name, functools.partial(_recorded, calls, name, real))
    args = _attention_args(64, "c4", torch.Generator().manual_seed(3))
    expected = sparse_attention_torch(AttentionCall.of(*args))
    assert flashmla.PREFILL_ROWS == 11673
    for threshold, kernel in ((5, "flash_mla_with_kvcache"), (4, "flash_mla_sparse_fwd")):
        with flashmla.flashmla_prefill_above(threshold):
            out = sparse_attention_flashmla(AttentionCall.of(*args))  # 5 rows
        assert calls.pop() == kernel and not calls
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def _recorded(calls: list[str], name: str, real: Callable[..., Any], **kwargs: Any) -> Any:
    calls.append(name)
    return real(**kwargs)


def test_flashmla_schedule_is_shared_and_splits_are_checked(flash_mla, monkeypatch):
    """A given schedule is the one FlashMLA fills (and reuses); a fresh one otherwise; a bad
    ``num_splits`` is refused; no rows give an empty result without a call."""
    monkeypatch.setattr(flashmla, "flashmla_unsupported_reason", lambda *a, **k: None)
    args = _attention_args(64, "c4", torch.Generator().manual_seed(1))
    schedule = flashmla.flashmla_schedule()
    first = sparse_attention_flashmla(AttentionCall.of(*args), schedule=schedule, num_splits=4)
    assert schedule.have_initialized
    torch.testing.assert_close(
        sparse_attention_flashmla(AttentionCall.of(*args), schedule=schedule), first
    )
    with pytest.raises(BatchError, match="num_splits=0"):
        sparse_attention_flashmla(AttentionCall.of(*args), num_splits=0)
    q, window, swa_idx, swa_len, ext, ext_idx, ext_len, sink, scale = args
    assert ext_idx is not None and ext_len is not None
    empty = (q[:0], window, swa_idx[:0], swa_len[:0], ext, ext_idx[:0], ext_len[:0], sink, scale)
    assert sparse_attention_flashmla(AttentionCall.of(*empty)).shape == (0, 64, D)


def test_flashmla_reads_a_one_page_cache(flash_mla, monkeypatch):
    """A cache of one page still hands FlashMLA the layout's page stride (``view`` alone
    would give that size-1 dim another stride, which FlashMLA checks)."""
    monkeypatch.setattr(flashmla, "flashmla_unsupported_reason", lambda *a, **k: None)
    g = torch.Generator().manual_seed(9)
    window = _token_cache(200, PAGES["window"], "fp8", g)
    assert window.storage.shape[0] == 1
    assert window.layout is not None
    view = flashmla.flashmla_cache(window)
    assert view.stride() == (window.layout.page_bytes, 584, 584, 1)
    q = torch.randn(2, 64, D, generator=g).bfloat16().float()
    idx, lens = _slots([3, 200], 64, 200, g)
    args = (q, window, idx, lens, None, None, None, torch.randn(64, generator=g), D**-0.5)
    out = sparse_attention_flashmla(AttentionCall.of(*args))
    torch.testing.assert_close(
        out.float(), sparse_attention_torch(AttentionCall.of(*args)), atol=1e-2, rtol=1e-2
    )


def _flashmla_kwargs(g: torch.Generator) -> dict[str, Any]:
    q, window, swa_idx, swa_len, ext, ext_idx, ext_len, sink, scale = _attention_args(16, "c4", g)
    assert ext is not None and ext_idx is not None and ext_len is not None
    call = AttentionCall.of(q, window, swa_idx, swa_len, ext, ext_idx, ext_len, sink, scale)
    return flashmla_arguments(call, FakeSchedMeta())


def _contiguous_pages(kw: dict) -> None:
    kw["k_cache"] = kw["k_cache"].contiguous()


#: One wrong argument each: the stand-in refuses them all (its checks can fail).
FLASHMLA_MISTAKES = {
    "int64 indices": lambda kw: kw.update(indices=kw["indices"].long()),
    "unpadded indices": lambda kw: kw.update(indices=kw["indices"][..., :100]),
    "lengths past the width": lambda kw: kw.update(topk_length=kw["topk_length"] + 100),
    "fp32 queries": lambda kw: kw.update(q=kw["q"].float()),
    "unpadded heads": lambda kw: kw.update(q=kw["q"][:, :, :16].contiguous()),
    "short sink": lambda kw: kw.update(attn_sink=kw["attn_sink"][:16]),
    "flat cache": lambda kw: kw.update(k_cache=kw["k_cache"].reshape(-1, 1, 1, 584)),
    "repacked pages": _contiguous_pages,
    "current kernels": lambda kw: kw.update(use_legacy=False),
    "dense flag": lambda kw: kw.update(is_fp8_kvcache=False),
    "extra cache alone": lambda kw: kw.update(extra_indices_in_kvcache=None),
}


@pytest.mark.parametrize("mistake", FLASHMLA_MISTAKES)
def test_flashmla_stand_in_refuses_wrong_arguments(mistake):
    kwargs = _flashmla_kwargs(torch.Generator().manual_seed(2))
    fake_flash_mla_with_kvcache(**kwargs)  # as built: accepted
    FLASHMLA_MISTAKES[mistake](kwargs)
    with pytest.raises(AssertionError):
        fake_flash_mla_with_kvcache(**kwargs)


def test_flashmla_reasons(monkeypatch):
    """Each reason names what is missing: the CUDA device, fp8 caches, the geometry, the
    package (with its import error), the legacy kernels, the compute capability."""
    g = torch.Generator().manual_seed(3)
    fp8, dense = _token_cache(8, 256, "fp8", g), _token_cache(8, 256, "dense", g)
    small = TokenCache(8, 128, ROPE, 256, "fp8")
    monkeypatch.setitem(sys.modules, "flash_mla", _fake_flash_mla())

    def reason(device=CUDA, window=fp8, extra=None, heads=64, dim=D, capability=(9, 0)):
        return flashmla_unsupported_reason(device, window, extra, heads, dim, capability=capability)

    assert "CUDA devices only" in reason(device=torch.device("cpu"))
    assert "extra cache is dense" in reason(extra=dense)
    assert "window cache is dense" in reason(window=dense)
    assert "head_dim 128" in reason(window=small, dim=128)
    assert "100 query heads" in reason(heads=100)
    assert "compute capability 8.0" in reason(capability=(8, 0))
    assert "compute capability 12.0" in reason(capability=(12, 0))
    for heads, capability in ((1, (9, 0)), (64, (10, 0)), (128, (10, 3))):
        assert reason(extra=fp8, heads=heads, capability=capability) is None
    monkeypatch.setitem(sys.modules, "flash_mla", _fake_flash_mla(legacy=False))
    assert "no legacy kernels" in reason()
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import raises ImportError
    assert "flash_mla does not import (import of flash_mla halted" in reason()
    with pytest.raises(BatchError, match="CUDA devices only"):
        sparse_attention_flashmla(AttentionCall.of(*_attention_args(8, "window", g)))


# ------------------------------------------------------------- FlashMLA prefill tests
@pytest.mark.parametrize("fmt", ["fp8", "dense"])
@pytest.mark.parametrize("layer", ["window", "c4", "c128"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_flashmla_prefill_matches_the_torch_path(flash_mla, monkeypatch, heads, layer, fmt):
    """Through the stand-in sparse prefill, the variant's output is the torch path's (bf16
    output rounding apart) for padded and full head counts, both cache formats, window-only and
    both extra caches, lengths of 0, past the width and negative, -1 holes; a row without a
    key is 0 although the stand-in leaves NaN there."""
    monkeypatch.setattr(flashmla_prefill, "library_unsupported_reason", lambda *a, **k: None)
    args = _attention_args(heads, layer, torch.Generator().manual_seed(heads + len(layer)), fmt)
    out = sparse_attention_flashmla_prefill(AttentionCall.of(*args))
    expected = sparse_attention_torch(AttentionCall.of(*args))
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    if layer == "window":  # row 2 has no key: 0
        assert (out[2] == 0).all()


def test_flashmla_prefill_workspace_holds_each_referenced_key_once():
    """The gather: each valid slot once (window then compressed), every row's valid keys
    packed to the front in workspace rows, -1 after them, ``topk_length`` the count, the
    width the op's widths rounded up to 64; keys bit-equal to the cache's rows."""
    g = torch.Generator().manual_seed(6)
    q, window, swa_idx, swa_len, ext, ext_idx, ext_len, sink, scale = _attention_args(16, "c4", g)
    assert ext is not None and ext_idx is not None and ext_len is not None
    call = AttentionCall.of(q, window, swa_idx, swa_len, ext, ext_idx, ext_len, sink, scale)
    kw = flashmla_library.prefill_arguments(call)
    indices, lengths, kv = kw["indices"][:, 0], kw["topk_length"], kw["kv"][:, 0]
    assert indices.shape == (5, 256) and kw["q"].shape == (5, 64, D)  # 100 + 70 -> 256
    seen = []
    for row in range(5):
        n = int(lengths[row])
        assert (indices[row, :n] >= 0).all() and (indices[row, n:] == -1).all()
        expected = []
        for cache, idx, length in ((window, swa_idx, swa_len), (ext, ext_idx, ext_len)):
            slots = idx[row, : max(0, min(int(length[row]), idx.shape[1]))]
            expected.append(cache.gather(slots[slots >= 0]))
        torch.testing.assert_close(kv[indices[row, :n].long()].float(), torch.cat(expected))
        seen.append(indices[row, :n])
    assert torch.cat(seen).unique().numel() == kv.shape[0]  # no unreferenced row


#: One wrong argument each: the stand-in refuses them all (its checks can fail).
PREFILL_MISTAKES = {
    "int64 indices": lambda kw: kw.update(indices=kw["indices"].long()),
    "unpadded indices": lambda kw: kw.update(indices=kw["indices"][..., :100]),
    "index past the workspace": lambda kw: kw.update(kv=kw["kv"][:1]),
    "lengths past the width": lambda kw: kw.update(topk_length=kw["topk_length"] + 1000),
    "fp32 keys": lambda kw: kw.update(kv=kw["kv"].float()),
    "unpadded heads": lambda kw: kw.update(q=kw["q"][:, :16].contiguous()),
    "short sink": lambda kw: kw.update(attn_sink=kw["attn_sink"][:16]),
    "current kernels": lambda kw: kw.update(use_legacy=False),
}


@pytest.mark.parametrize("mistake", PREFILL_MISTAKES)
def test_flashmla_prefill_stand_in_refuses_wrong_arguments(mistake):
    q, window, swa_idx, swa_len, ext, ext_idx, ext_len, sink, scale = _attention_args(
        16, "c4", torch.Generator().manual_seed(7)
    )
    assert ext is not None and ext_idx is not None and ext_len is not None
    call = AttentionCall.of(q, window, swa_idx, swa_len, ext, ext_idx, ext_len, sink, scale)
    kwargs = flashmla_library.prefill_arguments(call)
    fake_flash_mla_sparse_fwd(**kwargs)  # as built: accepted
    PREFILL_MISTAKES[mistake](kwargs)
    with pytest.raises(AssertionError):
        fake_flash_mla_sparse_fwd(**kwargs)


def test_each_library_variant_is_refused_without_a_function_it_calls(flash_mla, monkeypatch):
    """A release of the library without a function a variant calls refuses that variant when
    it is chosen, naming the function (sgl-deep-gemm 0.2.5 removed one; see the DeepGEMM
    reasons), and leaves the variants that do not call it (``flashmla`` calls the prefill
    above ``PREFILL_ROWS`` rows, so it needs both kernels)."""
    fp8 = _token_cache(8, 256, "fp8", torch.Generator().manual_seed(9))
    del flash_mla.get_mla_metadata
    decode = flashmla.flashmla_unsupported_reason(CUDA, fp8, fp8, 64, D, capability=(9, 0))
    assert "has no get_mla_metadata" in decode
    prefill = flashmla_prefill.flashmla_prefill_unsupported_reason
    assert prefill(CUDA, fp8, fp8, 64, D, capability=(9, 0)) is None
    del flash_mla.flash_mla_sparse_fwd
    missing = "flash_mla 1.0.0 has no flash_mla_sparse_fwd; install sgl-flash-mla"
    assert missing in prefill(CUDA, fp8, fp8, 64, D, capability=(9, 0))
    both = flashmla.flashmla_unsupported_reason(CUDA, fp8, fp8, 64, D, capability=(9, 0))
    assert "get_mla_metadata, flash_mla_sparse_fwd" in both

    host = Target("triton", "cuda", (9, 0), frozenset({"flashinfer"}))
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.1"))
    assert FLASHINFER.unmet(host) == "flashinfer 0.1 has no top_k, TopKTieBreak"
    described = dataclasses.replace(host, hypothetical=True)  # info's CUDA column: no import
    assert FLASHINFER.unmet(described) is None
    monkeypatch.setitem(
        sys.modules, "flashinfer", types.SimpleNamespace(top_k=None, TopKTieBreak=None)
    )
    assert FLASHINFER.unmet(host) is None


def test_flashmla_prefill_reasons_and_edges(flash_mla, monkeypatch):
    """Dense caches are taken (the keys are gathered); the library's reasons stand (device,
    heads, capability, legacy kernels); no rows give an empty result without a call; an
    unsupported input at a forward is a BatchError naming the reason."""
    g = torch.Generator().manual_seed(8)
    dense = _token_cache(8, 256, "dense", g)

    def reason(device=CUDA, heads=64, dim=D, capability=(9, 0)):
        return flashmla_prefill.flashmla_prefill_unsupported_reason(
            device, dense, dense, heads, dim, capability=capability
        )

    assert reason() is None and reason(heads=128, capability=(10, 0)) is None
    assert "CUDA devices only" in reason(device=torch.device("cpu"))
    assert "100 query heads" in reason(heads=100)
    assert "head_dim 128" in reason(dim=128)
    assert "compute capability 8.9" in reason(capability=(8, 9))
    monkeypatch.setitem(sys.modules, "flash_mla", _fake_flash_mla(legacy=False))
    assert "no legacy kernels" in reason()
    with pytest.raises(BatchError, match="CUDA devices only"):
        sparse_attention_flashmla_prefill(AttentionCall.of(*_attention_args(8, "window", g)))
    monkeypatch.setattr(flashmla_prefill, "library_unsupported_reason", lambda *a, **k: None)
    q, window, swa_idx, swa_len, *_, sink, scale = _attention_args(8, "window", g)
    empty = (q[:0], window, swa_idx[:0], swa_len[:0], None, None, None, sink, scale)
    assert sparse_attention_flashmla_prefill(AttentionCall.of(*empty)).shape == (0, 8, D)
    none = torch.zeros_like(swa_len)  # no row has a key: a one-row zero workspace
    out = sparse_attention_flashmla_prefill(
        AttentionCall.of(q, window, swa_idx, none, None, None, None, sink, scale)
    )
    assert (out == 0).all()


# ----------------------------------------------------------------- stand-in deep_gemm
class FakeDeepGemm(types.ModuleType):
    """``deep_gemm``'s paged MQA logits: schedules remember the lengths they were built on."""

    def __init__(self) -> None:
        super().__init__("deep_gemm")
        self.schedules: list[tuple[torch.Tensor, torch.Tensor]] = []

    def get_num_sms(self) -> int:
        return 132

    def get_paged_mqa_logits_metadata(self, context_lens, block_kv, num_sms, indices=None):
        assert context_lens.dtype == torch.int32 and context_lens.dim() == 2
        assert context_lens.is_contiguous() and block_kv == 64 and num_sms == 132
        assert indices is None
        schedule = torch.zeros(num_sms + 1, 2, dtype=torch.int32)
        self.schedules.append((schedule, context_lens.clone()))
        return schedule

    def _paged_call(
        self, batch, next_n, heads, weights, context_lens, block_table, schedule_meta,
        max_context_len, clean_logits, indices,
    ) -> None:  # fmt: skip
        """The checks both paged MQA logits make of their other arguments."""
        assert weights.dtype == torch.float32 and weights.shape == (batch * next_n, heads)
        assert weights.is_contiguous()
        assert context_lens.dtype == torch.int32 and context_lens.shape == (batch, next_n)
        assert context_lens.is_contiguous()
        assert int(context_lens.min()) >= 0 and int(context_lens.max()) <= max_context_len
        assert block_table.dtype == torch.int32 and block_table.dim() == 2
        assert block_table.shape[0] == batch and block_table.stride(1) == 1
        built_on = [lens for s, lens in self.schedules if s is schedule_meta]
        assert built_on and torch.equal(built_on[0], context_lens), "schedule of other lengths"
        assert isinstance(max_context_len, int) and clean_logits is False and indices is None

    @staticmethod
    def _logits(q, weights, keys, block_table, context_lens, max_context_len) -> torch.Tensor:
        """``[B, >= max_context_len]`` fp32, 256-column aligned rows: the torch ``index_scores``
        of the float queries ``q`` ``[B, H, D]`` over ``keys``; columns past a row's length
        unwritten (NaN here)."""
        with dispatch.force_path("torch"):
            scores = index_scores(
                q, weights, keys, block_table, context_lens[:, 0], max_context_len
            )
        stride = -(-max_context_len // 256) * 256
        logits = torch.full((q.shape[0], stride), float("nan"))
        logits[:, :max_context_len] = scores.masked_fill(scores == float("-inf"), float("nan"))
        return logits

    def fp8_paged_mqa_logits(
        self, q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
        clean_logits=False, indices=None,
    ):  # fmt: skip
        """e4m3 queries over fp8 key pages (132 B a key)."""
        assert q.dtype == torch.float8_e4m3fn and q.dim() == 4 and q.is_contiguous()
        batch, next_n, heads, dim = q.shape
        assert next_n == 1 and heads in (32, 64) and dim == 128, q.shape
        assert kv_cache.dtype == torch.uint8 and kv_cache.dim() == 4, kv_cache.shape
        pages, block_kv, heads_kv, with_sf = kv_cache.shape
        assert block_kv == 64 and heads_kv == 1 and with_sf == dim + 4, kv_cache.shape
        assert kv_cache.stride(1) == with_sf and kv_cache.stride(3) == 1
        assert kv_cache.is_contiguous()
        self._paged_call(
            batch, next_n, heads, weights, context_lens, block_table, schedule_meta,
            max_context_len, clean_logits, indices,
        )  # fmt: skip
        keys = IndexerKeyCache.over(kv_cache.reshape(-1), pages * block_kv, dim)
        return self._logits(q[:, 0].float(), weights, keys, block_table, context_lens,
                            max_context_len)  # fmt: skip

    def fp8_fp4_paged_mqa_logits(
        self, q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
        clean_logits=False, logits_dtype=torch.float32, indices=None,
    ):  # fmt: skip
        """fp4 queries ``(q_fp4 [B, next_n, H, D / 2] int8, q_sf [B, next_n, H] int32: 4 ue8m0
        bytes)`` over fp4 key pages (68 B a key: 64 keys' e2m1 pairs, then their int32
        exponents)."""
        assert isinstance(q, tuple) and len(q) == 2, type(q)
        q_fp, q_sf = q
        assert q_fp.dtype == torch.int8 and q_fp.dim() == 4 and q_fp.is_contiguous()
        batch, next_n, heads, half_dim = q_fp.shape
        dim = 2 * half_dim
        assert next_n == 1 and heads in (8, 16, 32, 64) and dim == 128, q_fp.shape
        assert q_sf.dtype == torch.int32 and q_sf.shape == (batch, next_n, heads), q_sf.shape
        assert q_sf.is_contiguous()
        assert kv_cache.dtype == torch.uint8 and kv_cache.dim() == 4, kv_cache.shape
        pages, block_kv, heads_kv, with_sf = kv_cache.shape
        assert block_kv == 64 and heads_kv == 1 and with_sf == dim // 2 + 4, kv_cache.shape
        assert kv_cache.stride(1) == with_sf and kv_cache.stride(3) == 1
        assert kv_cache.stride(0) % 4 == 0 and kv_cache.is_contiguous()
        assert logits_dtype == torch.float32
        self._paged_call(
            batch, next_n, heads, weights, context_lens, block_table, schedule_meta,
            max_context_len, clean_logits, indices,
        )  # fmt: skip
        exponents = q_sf[:, 0].contiguous().view(torch.uint8).view(batch, heads, dim // 32)
        queries = unpack_ue8m0(q_fp[:, 0].view(torch.uint8), exponents)
        keys = Fp4IndexKeyCache.over(kv_cache.reshape(-1), pages * block_kv, dim)
        return self._logits(queries, weights, keys, block_table, context_lens, max_context_len)


@pytest.fixture
def deep_gemm(monkeypatch) -> FakeDeepGemm:
    module = FakeDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", module)
    return module


def _indexer_args(g: torch.Generator, selection: str = "fp8") -> IndexerArgs:
    """``index_scores``' arguments for 6 rows: keys of 8 pages stored in an fp8 cache (``fp4``:
    an fp4 one), pages permuted per row, candidate counts across page edges, 0, and past ``N =
    200``. Queries and keys of ``selection``: ``exact`` random, ``fp8``
    ``indexer.fp8.quantised_view`` values, ``fp4`` ``indexer.fp4``'s (keys of every scale)."""
    fp4 = selection == "fp4"
    keys: IndexerKeyCache | Fp4IndexKeyCache = (
        Fp4IndexKeyCache(8 * 64, DI, "fp8", rounding=C4_ROUNDING)
        if fp4
        else IndexerKeyCache(8 * 64, DI, "fp8")
    )
    rows = torch.randn(keys.num_slots, DI, generator=g)
    q = torch.randn(6, HI, DI, generator=g)
    if selection == "fp8":
        rows, q = quantised_view(rows), quantised_view(q)
    elif fp4:
        rows = fp4_key_rows(rows * torch.rand(keys.num_slots, 1, generator=g))
        q = fp4_query_view(q)
    with dispatch.force_path("torch"):
        store_rows(keys, rows, torch.arange(keys.num_slots))
    page_table = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(6)]).int()
    num = torch.tensor([200, 0, 1, 64, 65, 250], dtype=torch.int32)
    weights = torch.rand(6, HI, generator=g) * (HI * DI) ** -0.5
    return q, weights, keys, page_table, num, 200


# -------------------------------------------------------------------- DeepGEMM tests
def test_deep_gemm_equals_the_op_for_fp8_selection(deep_gemm, monkeypatch):
    """Through the stand-in DeepGEMM, the variant's scores are the torch ``index_scores`` of
    fp8-selection queries (fp32 summation order apart), ``-inf`` at the same columns; a given
    schedule is used as is."""
    monkeypatch.setattr(indexer_deep_gemm, "deep_gemm_call_reason", lambda *a, **k: None)
    args = _indexer_args(torch.Generator().manual_seed(4))
    with dispatch.force_path("torch"):
        expected = index_scores(*args)
    out = index_scores_deep_gemm(IndexCall.of(*args))
    assert out.dtype == torch.float32 and out.shape == (6, 200)
    assert torch.equal(out == float("-inf"), expected == float("-inf"))
    assert (out[0] > float("-inf")).all() and (out[5] > float("-inf")).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    schedule = paged_mqa_schedule(args[4], args[5])
    torch.testing.assert_close(index_scores_deep_gemm(IndexCall.of(*args), schedule=schedule), out)
    assert index_scores_deep_gemm(IndexCall.of(*args[:5], 0)).shape == (6, 0)


def test_deep_gemm_rounds_exact_queries(deep_gemm, monkeypatch):
    """Full-precision (``indexer_selection="exact"``) queries: the variant scores their e4m3
    round trip -- the op on those, not on the queries -- which is why the reason refuses it."""
    monkeypatch.setattr(indexer_deep_gemm, "deep_gemm_call_reason", lambda *a, **k: None)
    args = _indexer_args(torch.Generator().manual_seed(5), selection="exact")
    q, rest = args[0], args[1:]
    out = index_scores_deep_gemm(IndexCall.of(q, *rest))
    with dispatch.force_path("torch"):
        exact, rounded = index_scores(q, *rest), index_scores(e4m3_round_trip(q), *rest)
    valid = exact > float("-inf")
    torch.testing.assert_close(out[valid], rounded[valid], rtol=1e-5, atol=1e-6)
    assert ((out - exact)[valid].abs() / exact[valid].abs().max()).max() > 1e-3


def test_quantised_queries_are_sglangs_and_idempotent():
    """``codes * scale`` is ``e4m3_round_trip`` bit for bit; quantising its output again (the
    fp8 selection's queries) gives the same codes, and the scale within an fp32 rounding."""
    q = torch.randn(6, HI, DI, generator=torch.Generator().manual_seed(6)) * 3
    q[0, 0] = 1e-6  # below the amax floor
    codes, scale = quantise_queries(q)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (6, HI)
    assert torch.equal(codes.float() * scale[..., None], e4m3_round_trip(q))
    again, scale_again = quantise_queries(e4m3_round_trip(q))
    assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8))
    torch.testing.assert_close(scale_again, scale, rtol=2.4e-7, atol=0)


def _deep_gemm_kwargs(deep_gemm: FakeDeepGemm, selection: str = "fp8") -> dict[str, Any]:
    """The arguments the variant hands DeepGEMM's logits for ``selection``'s keys."""
    seed = torch.Generator().manual_seed(7 if selection == "fp8" else 16)
    args = _indexer_args(seed, selection=selection)
    return deep_gemm_arguments(IndexCall.of(*args), paged_mqa_schedule(args[4], args[5]))


#: One wrong argument each: the stand-in refuses them all (its checks can fail).
DEEP_GEMM_MISTAKES = {
    "bf16 queries": lambda kw: kw.update(q=kw["q"].bfloat16()),
    "no next_n dim": lambda kw: kw.update(q=kw["q"][:, 0]),
    "flat key pages": lambda kw: kw.update(kv_cache=kw["kv_cache"].reshape(8, 1, 1, -1)),
    "unscaled 3-d weights": lambda kw: kw.update(weights=kw["weights"][..., None]),
    "1-d lengths": lambda kw: kw.update(context_lens=kw["context_lens"][:, 0]),
    "lengths past N": lambda kw: kw.update(context_lens=kw["context_lens"] + 100),
    "int64 page table": lambda kw: kw.update(block_table=kw["block_table"].long()),
    "cleaned logits": lambda kw: kw.update(clean_logits=True),
    "foreign schedule": lambda kw: kw.update(schedule_meta=torch.zeros(133, 2, dtype=torch.int32)),
}


def test_deep_gemm_reasons(deep_gemm, monkeypatch):
    """Each reason names what is missing: the CUDA device, an fp8 key cache of sglang's
    geometry, the heads, the package (with its import error, or a version without the
    functions the variant calls), the compute capability, and
    the ``fp8`` selection the variant is exact for."""
    fp8 = IndexerKeyCache(64, DI, "fp8")

    def reason(device=CUDA, keys=fp8, heads=HI, dim=DI, selection="fp8", capability=(9, 0)):
        return deep_gemm_unsupported_reason(
            device, keys, heads, dim, selection, capability=capability
        )

    assert "CUDA devices only" in reason(device=torch.device("cpu"))
    assert "key cache is dense" in reason(keys=IndexerKeyCache(64, DI, "dense"))
    assert "holds 64 channels" in reason(keys=IndexerKeyCache(64, 64, "fp8"), dim=64)
    assert "16 indexer heads" in reason(heads=16)
    assert "compute capability 8.9" in reason(capability=(8, 9))
    assert "indexer_selection='exact'" in reason(selection="exact")
    for heads, capability in ((32, (9, 0)), (64, (10, 0)), (64, (12, 0))):
        assert reason(heads=heads, capability=capability) is None
    # sgl-deep-gemm 0.2.5: no fp8_paged_mqa_logits
    newer = types.SimpleNamespace(
        __version__="0.2.5",
        get_paged_mqa_logits_metadata=deep_gemm.get_paged_mqa_logits_metadata,
        get_num_sms=deep_gemm.get_num_sms,
    )
    monkeypatch.setitem(sys.modules, "deep_gemm", newer)
    assert "deep_gemm 0.2.5 has no fp8_paged_mqa_logits; install sgl-deep-gemm" in reason()
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import raises ImportError
    assert "deep_gemm does not import (import of deep_gemm halted" in reason()
    q, weights, keys, page_table, num, n = _indexer_args(torch.Generator().manual_seed(8))
    with pytest.raises(BatchError, match="CUDA devices only"):
        index_scores_deep_gemm(IndexCall.of(q, weights, keys, page_table, num, n))


# ------------------------------------------------------------ DeepGEMM over fp4 keys
def test_deep_gemm_equals_the_op_for_fp4_selection(deep_gemm, monkeypatch):
    """fp4 keys (sglang's ``--enable-deepseek-v4-fp4-indexer``): through the stand-in's
    ``fp8_fp4_paged_mqa_logits`` the variant's scores are the torch variant's on the same fp4
    pages and ``fp4_query_view`` queries, ``-inf`` at the same columns, and select the same
    entries."""
    monkeypatch.setattr(indexer_deep_gemm, "deep_gemm_call_reason", lambda *a, **k: None)
    args = _indexer_args(torch.Generator().manual_seed(14), selection="fp4")
    with dispatch.force_path("torch"):
        expected = index_scores(*args)
    out = index_scores_deep_gemm(IndexCall.of(*args))
    assert out.dtype == torch.float32 and out.shape == (6, 200)
    assert torch.equal(out == float("-inf"), expected == float("-inf"))
    assert (out[0] > float("-inf")).all() and (out[5] > float("-inf")).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    num = args[4]
    assert torch.equal(select_entries(out, num, 16), select_entries(expected, num, 16))


def test_fp4_queries_pack_as_sglangs_exactly():
    """``quantise_fp4_queries`` writes sglang's ``fused_q_indexer_rope_hadamard_fp4_quant``
    format (int8 e2m1 pairs, the 4 exponent bytes of a (row, head) little-endian in an int32)
    and, for ``fp4_query_view`` values of every scale (blocks below the 1e-4 amax floor, zero
    blocks, blocks whose largest code is below 4), unpacks to those values bit for bit."""
    g = torch.Generator().manual_seed(15)
    q = torch.randn(6, HI, DI, generator=g) * 2.0 ** torch.randint(-16, 8, (6, HI, 1), generator=g)
    q[0, 0, :32], q[0, 1] = 1e-6, 0.0  # below the floor, and all zero
    view = fp4_query_view(q)
    # rounded blocks of one value each: some take a smaller exponent once rounded (3 = 6 / 2)
    for block, top in enumerate((3.1, 2.1, 1.6, 1.1, 0.6)):
        view[1, block, :32] = fp4_round_ue8m0(torch.full((32,), top) * 2.0**-block, C4_ROUNDING)
    payload, exponents = quantise_fp4_queries(view)
    assert payload.dtype == torch.int8 and payload.shape == (6, HI, DI // 2)
    assert exponents.dtype == torch.int32 and exponents.shape == (6, HI)
    ue8m0 = exponents.view(torch.uint8).view(6, HI, 4).long()
    assert torch.equal(
        sum(ue8m0[..., b] << (8 * b) for b in range(4)).int(), exponents
    )  # byte b: channels 32 b .. 32 b + 31
    assert torch.equal(unpack_ue8m0(payload.view(torch.uint8), ue8m0.to(torch.uint8)), view)


#: One wrong argument each for the fp4 logits: the stand-in refuses them all.
DEEP_GEMM_FP4_MISTAKES = {
    "e4m3 queries": lambda kw: kw.update(q=kw["q"][0].view(torch.float8_e4m3fn)),
    "uint8 payload": lambda kw: kw.update(q=(kw["q"][0].view(torch.uint8), kw["q"][1])),
    "exponent bytes": lambda kw: kw.update(q=(kw["q"][0], kw["q"][1].view(torch.uint8))),
    "no next_n dim": lambda kw: kw.update(q=(kw["q"][0][:, 0], kw["q"][1][:, 0])),
    "flat key pages": lambda kw: kw.update(kv_cache=kw["kv_cache"].reshape(8, 1, 1, -1)),
    "fp8-sized keys": lambda kw: kw.update(kv_cache=kw["kv_cache"].reshape(8, 32, 1, 136)),
    "bf16 weights": lambda kw: kw.update(weights=kw["weights"].bfloat16()),
    "1-d lengths": lambda kw: kw.update(context_lens=kw["context_lens"][:, 0]),
    "int64 page table": lambda kw: kw.update(block_table=kw["block_table"].long()),
    "cleaned logits": lambda kw: kw.update(clean_logits=True),
    "bf16 logits": lambda kw: kw.update(logits_dtype=torch.bfloat16),
    "foreign schedule": lambda kw: kw.update(schedule_meta=torch.zeros(133, 2, dtype=torch.int32)),
}


#: Each key format's logits function and its wrong arguments.
STAND_IN_CASES = {
    "fp8": ("fp8_paged_mqa_logits", DEEP_GEMM_MISTAKES),
    "fp4": ("fp8_fp4_paged_mqa_logits", DEEP_GEMM_FP4_MISTAKES),
}


@pytest.mark.parametrize(
    ("selection", "mistake"),
    [(selection, name) for selection, (_, mistakes) in STAND_IN_CASES.items() for name in mistakes],
)
def test_deep_gemm_stand_in_refuses_wrong_arguments(deep_gemm, selection, mistake):
    function, mistakes = STAND_IN_CASES[selection]
    logits = getattr(deep_gemm, function)
    kwargs = _deep_gemm_kwargs(deep_gemm, selection)
    logits(**kwargs)  # as built: accepted
    mistakes[mistake](kwargs)
    with pytest.raises(AssertionError):
        logits(**kwargs)


def test_deep_gemm_fp4_reasons(deep_gemm, monkeypatch):
    """Over fp4 keys the variant runs on sm_100 (8 / 16 / 32 / 64 heads) and sm_120 (64) with
    ``fp8_fp4_paged_mqa_logits``, for ``indexer_selection="fp4"``; each reason names what is
    missing. A release without ``fp8_paged_mqa_logits`` (sgl-deep-gemm 0.2.5) still serves fp4
    keys and refuses fp8 ones."""
    fp4 = Fp4IndexKeyCache(64, DI, "fp8", rounding=C4_ROUNDING)

    def reason(keys=fp4, heads=HI, dim=DI, selection="fp4", capability=(10, 0), device=CUDA):
        return deep_gemm_unsupported_reason(
            device, keys, heads, dim, selection, capability=capability
        )

    for heads, capability in ((8, (10, 0)), (32, (10, 3)), (64, (10, 0)), (64, (12, 0))):
        assert reason(heads=heads, capability=capability) is None
    assert "CUDA devices only" in reason(device=torch.device("cpu"))
    assert "key cache is dense" in reason(keys=Fp4IndexKeyCache(64, DI, "dense"))
    assert "holds 64 channels" in reason(keys=Fp4IndexKeyCache(64, 64, "fp8"), dim=64)
    sm90 = reason(capability=(9, 0))
    assert "compute capability 9.0; DeepGEMM's fp8_fp4_paged_mqa_logits runs on" in sm90
    assert "majors (10, 12)" in sm90
    assert "32 indexer heads of dim 128; DeepGEMM's fp8_fp4_paged_mqa_logits takes 64 heads" in (
        reason(heads=32, capability=(12, 0))
    )
    assert "12 indexer heads" in reason(heads=12)
    assert "indexer_selection='exact'" in reason(selection="exact")
    assert "only for indexer_selection='fp4'" in reason(selection="fp8")
    fp8 = IndexerKeyCache(64, DI, "fp8")
    assert "only for indexer_selection='fp8'" in reason(keys=fp8, selection="fp4")
    newer = types.SimpleNamespace(
        __version__="0.2.5",
        fp8_fp4_paged_mqa_logits=deep_gemm.fp8_fp4_paged_mqa_logits,
        get_paged_mqa_logits_metadata=deep_gemm.get_paged_mqa_logits_metadata,
        get_num_sms=deep_gemm.get_num_sms,
    )
    monkeypatch.setitem(sys.modules, "deep_gemm", newer)
    assert reason() is None
    assert "0.2.5 has no fp8_paged_mqa_logits" in reason(keys=fp8, selection="fp8")
    del newer.fp8_fp4_paged_mqa_logits
    assert "deep_gemm 0.2.5 has no fp8_fp4_paged_mqa_logits; install sgl-deep-gemm" in reason()
    q, weights, keys, page_table, num, n = _indexer_args(
        torch.Generator().manual_seed(17), selection="fp4"
    )
    with pytest.raises(BatchError, match="CUDA devices only"):
        index_scores_deep_gemm(IndexCall.of(q, weights, keys, page_table, num, n))
