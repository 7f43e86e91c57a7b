"""The opt-in FP8 attention kernels on a GPU (skipped without one; ``scripts/gpu_check.sh``).

None of ``pipelined``, ``ws``, ``flashmla`` (FlashMLA's sparse FP8 decode, where ``flash_mla``
is installed) and ``flashmla_prefill`` (its sparse prefill over gathered bf16 keys) has run on
a GPU yet: this is the check that decides it. At
DeepSeek-V4-Flash shapes (64 heads, D = 512, fp8 caches with 584-byte tokens; ``ws-dense``:
the ws kernel on dense bf16 caches) for every layer kind, rows of several lengths (one split
and several, a row without keys), each kernel's bf16 output equals the torch path on the same
bytes within the bf16 tolerance (``attention_tolerance`` plus the output's own bf16
rounding).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from attention_inputs import PAGE_TOKENS, make_cache, random_indices, random_keys

from dsv4_backend.cache import TokenCache
from dsv4_backend.kernels.attention.common import AttentionCall, attention_tolerance
from dsv4_backend.kernels.attention.table import ATTENTION, variant_reason
from dsv4_backend.kernels.attention.torch import sparse_attention_torch

pytestmark = pytest.mark.gpu


def _on_cuda(cache: TokenCache) -> TokenCache:
    return TokenCache(
        cache.num_slots, cache.dim, cache.rope_dim, cache.page_tokens, cache.fmt,
        cache.storage.dtype, "cuda", storage=cache.storage.cuda(),
    )  # fmt: skip


def _inputs(ratio: int, lengths: list[int], extra_lengths: list[int], seed: int, fmt="fp8"):
    """fp8 caches, or dense bf16 ones (``fmt="dense"``)."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16  # (a dense cache's storage; fp8 ignores it)
    win = _on_cuda(make_cache(random_keys(1000, 512, g), PAGE_TOKENS[0], fmt, dtype))
    idx, lens = random_indices(lengths, 128, 1000, g, holes=0.1)
    extra = (None, None, None)
    if ratio:
        ext = _on_cuda(make_cache(random_keys(600, 512, g), PAGE_TOKENS[ratio], fmt, dtype))
        eidx, elens = random_indices(extra_lengths, 512, 600, g, holes=0.1)
        extra = (ext, eidx.cuda(), elens.cuda())
    q = torch.randn(len(lengths), 64, 512, generator=g).bfloat16().cuda()
    sink = torch.randn(64, generator=g).cuda()
    return (q, win, idx.cuda(), lens.cuda(), *extra, sink, 512**-0.5)


LIBRARIES = ("flashmla", "flashmla_prefill", "flashmla_prefill-dense")


@pytest.mark.parametrize("kernel", ["pipelined", "ws", "ws-dense", *LIBRARIES])
@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_matches_torch_on_cuda(kernel, ratio, splits):
    fmt = "dense" if kernel.endswith("-dense") else "fp8"
    args = _inputs(ratio, [128, 1, 77, 0, 128, 128], [512, 3, 0, 0, 100, 512], ratio, fmt)
    variant = ATTENTION[kernel.removesuffix("-dense")]
    q, window, extra = args[0], args[1], args[4]
    if kernel in LIBRARIES:  # a library: skipped where it is not installed, with its reason
        reason = variant_reason(variant, q.device, window, extra, q.shape[1], q.shape[2])
        if reason is not None:
            pytest.skip(reason)
    if "num_splits" in inspect.signature(variant.entry).parameters:
        out = variant.entry(AttentionCall.of(*args), num_splits=splits)
    elif splits is None:
        out = variant.entry(AttentionCall.of(*args))
    else:
        pytest.skip(f"{variant.name} schedules its own splits")
    expected = sparse_attention_torch(AttentionCall.of(*args))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), expected, atol=attention_tolerance("cuda"), rtol=2**-8, msg=kernel
    )
    assert (out[3] == 0).all()  # row 3 has no key
