"""DeepGEMM's paged MQA logits as a variant of the lightning indexer's scores.

:func:`index_scores_deep_gemm` takes the arguments of ``table.index_scores`` and returns its
``[T, N]`` fp32 scores from the ``deep_gemm`` package sglang 0.5.23 pins (:data:`DISTRIBUTION`),
called as sglang's DeepSeek-V4 indexer calls it (``srt/layers/attention/dsv4/indexer.py``,
``C4IndexerBackendMixin``'s paged branch, ``run_paged_indexer``; the schedule as
``dsv4/metadata.py``'s ``PagedIndexerMetadata`` builds it): ``fp8_paged_mqa_logits`` over fp8
keys (``indexer_selection="fp8"``), ``fp8_fp4_paged_mqa_logits`` over fp4 keys
(``indexer_selection="fp4"``, sglang's ``--enable-deepseek-v4-fp4-indexer``).
:func:`deep_gemm_unsupported_reason` says where it runs (``table.py`` declares it).

fp8 keys. DeepGEMM scores e4m3 queries: ``logits = sum_h w'_h relu(code_h . code_k) scale_k``.
The variant quantises ``q_idx`` per (row, head) by sglang's rule (``max(amax, 1e-4) / 448``,
:func:`quantise_queries`: the last step of sglang's ``fused_q_indexer_rope_hadamard_quant``,
whose rotation is ``fp8.quantised_view``'s) and folds the scale into the weights,
``w' = w * scale_q``, as that kernel does. Since the scales are positive this is
``sum_h w_h relu(deq(q_h) . deq(k))``: ``index_scores`` of the e4m3 round trip of ``q_idx``.

* ``indexer_selection="fp8"``: the queries reaching the op are ``fp8.quantised_view`` values,
  already e4m3 codes times that per-(row, head) scale; quantising them again gives the same
  codes and the scale within an fp32 rounding, so the variant computes the op's scores (up to
  fp32 summation order).
* ``indexer_selection="exact"`` (the default): the queries are full precision; their e4m3
  round trip moves every score (and so the selection), so the variant does not compute the
  op's contract there and :func:`deep_gemm_unsupported_reason` refuses it.

fp4 keys. DeepGEMM scores e2m1 queries with one ue8m0 exponent per 32 channels:
``logits = sum_h w_h relu(deq(q_h) . deq(k))``. The queries reaching the op are
``fp4.fp4_query_view`` values, already on that grid; :func:`quantise_fp4_queries` packs them
as sglang's ``fused_q_indexer_rope_hadamard_fp4_quant`` writes its output (``q_fp4`` ``[T, HI,
DI / 2]`` int8, element ``2i`` in the low nibble; ``q_sf`` ``[T, HI]`` int32, the exponent
byte of channels ``32 b ..`` in byte ``b``), whose values are those exactly (a block whose
largest code is below 4 may take a smaller exponent than sglang's, for the same values), and
the weights stay as they are (the scales are in ``q_sf``). So the variant computes the op's
scores (up to fp32 summation order).

The rest of the mapping (:func:`deep_gemm_arguments`): ``q`` ``[T, 1, HI, DI]`` e4m3, or the
pair ``([T, 1, HI, DI / 2] int8, [T, 1, HI] int32)`` (one query token a batch entry); the key
cache's pages viewed ``[pages, 64, 1, bytes a key]`` uint8 (their layout is DeepGEMM's: 64 keys
of e4m3 bytes then their fp32 scales, 132 B a key at DI = 128; or 64 keys of e2m1 pairs then
their 4 ue8m0 exponent bytes, 68 B a key); ``weights`` ``[T, HI]`` fp32; ``context_lens``
``[T, 1]`` int32, ``num_candidates`` clamped to ``[0, N]`` (the op clamps; DeepGEMM would write
past ``N``); ``block_table`` the page table (``[T, Pw]`` int32: a row's c4 entry ``s`` is key
page ``page_table[t, s // 64]``, slot ``s % 64``, as ``common.entry_slots`` has it);
``max_context_len = N``; ``clean_logits=False`` (sglang's): DeepGEMM leaves columns past a
row's length unwritten and the variant sets them to ``-inf``, the op's contract; fp32 logits
(``fp8_fp4_paged_mqa_logits``' default ``logits_dtype``, which sglang's indexer keeps).

Not run here: ``deep_gemm`` needs CUDA (the fp4 logits SM100 or SM120) and no machine this
project is tested on has run it; the tests check the arguments against its documented contract
(DeepGEMM's ``csrc/apis/attention.hpp`` checks) with a stand-in module and compare the result
with the torch ``index_scores`` on the same bytes.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from dsv4_backend.cache.fp4_format import C4_ROUNDING, Fp4IndexKeyCache, pack_ue8m0
from dsv4_backend.cache.fp8_format import INDEXER_PAGE_TOKENS
from dsv4_backend.cache.indexer_cache import IndexerKeyCache
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.indexer.common import IndexCall
from dsv4_backend.kernels.indexer.fp8 import E4M3_MAX, MIN_AMAX

#: The module it calls and the distribution (as sglang 0.5.23 pins it) that provides it.
PACKAGE = "deep_gemm"
DISTRIBUTION = "sgl-deep-gemm==0.2.3.post2"
#: What the variant calls of it for either key format (the schedule).
FUNCTIONS = ("get_paged_mqa_logits_metadata", "get_num_sms")
#: The logits function for fp8 keys and for fp4 keys (sgl-deep-gemm 0.2.5, newer than
#: sglang's pin, has no ``fp8_paged_mqa_logits``: the variant is refused there for fp8 keys,
#: not failed at its first call).
FP8_LOGITS, FP4_LOGITS = "fp8_paged_mqa_logits", "fp8_fp4_paged_mqa_logits"
#: Indexer heads DeepGEMM's paged MQA logits take at each compute capability major, for fp8
#: keys (sm_90, sm_100, sm_120) and fp4 keys (sm_100: its ``sm100_paged_mqa_logits``; sm_120:
#: sgl-deep-gemm's ``sm120_fp4_paged_mqa_logits``, 64 heads only). DeepSeek-V4: 64.
FP8_HEADS = {9: (32, 64), 10: (32, 64), 12: (32, 64)}
FP4_HEADS = {10: (8, 16, 32, 64), 12: (64,)}
#: Indexer head dim of sglang's paged key caches (132 B a key in fp8, 68 B in fp4).
HEAD_DIM = 128
#: Keys a DeepGEMM KV block: one indexer-cache page.
BLOCK_KV = INDEXER_PAGE_TOKENS


def _selection_for(keys: IndexerKeyCache | Fp4IndexKeyCache) -> str:
    """The ``indexer_selection`` whose queries the variant scores exactly over ``keys``."""
    return "fp4" if isinstance(keys, Fp4IndexKeyCache) else "fp8"


def deep_gemm_unsupported_reason(
    device: torch.device,
    keys: IndexerKeyCache | Fp4IndexKeyCache,
    heads: int,
    dim: int,
    indexer_selection: str,
    *,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why :func:`index_scores_deep_gemm` would not compute ``index_scores`` here (None when it
    does): the reasons of :func:`deep_gemm_call_reason`, then an ``indexer_selection`` (the
    config's) other than the keys' own (``fp8`` for fp8 keys, ``fp4`` for fp4 keys), whose
    queries the variant would round to DeepGEMM's format (module docstring)."""
    reason = deep_gemm_call_reason(device, keys, heads, dim, capability=capability)
    exact_for = _selection_for(keys)
    if reason is None and indexer_selection != exact_for:
        return (
            f"indexer_selection={indexer_selection!r}; DeepGEMM scores {exact_for} queries "
            f"over these keys, which equal the op's only for indexer_selection={exact_for!r}"
        )
    return reason


def _cache_reason(keys: IndexerKeyCache | Fp4IndexKeyCache) -> str | None:
    """Why DeepGEMM cannot read ``keys`` (None when it can): sglang's paged layout, contiguous
    pages of :data:`BLOCK_KV` keys of :data:`HEAD_DIM` channels."""
    if keys.fmt != "fp8" or keys.layout is None:
        return (
            f"the indexer key cache is {keys.fmt}; DeepGEMM reads sglang's paged fp8 (132 B a "
            "key) or fp4 (68 B a key) pages"
        )
    page_tokens = keys.layout.page_tokens
    if keys.dim != HEAD_DIM or page_tokens != BLOCK_KV or not keys.storage.is_contiguous():
        return (
            f"the indexer key cache holds {keys.dim} channels in pages of {page_tokens} keys; "
            f"DeepGEMM reads contiguous pages of {BLOCK_KV} keys of {HEAD_DIM} channels"
        )
    return None


def deep_gemm_call_reason(
    device: torch.device,
    keys: IndexerKeyCache | Fp4IndexKeyCache,
    heads: int,
    dim: int,
    *,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why DeepGEMM cannot be called on these inputs (None when it can), in order: a CUDA
    device; a key cache of sglang's paged geometry (:func:`_cache_reason`); ``deep_gemm``
    importable, with :data:`FUNCTIONS` and the keys' logits function (:data:`FP8_LOGITS`,
    :data:`FP4_LOGITS`); a compute capability major of :data:`FP8_HEADS` / :data:`FP4_HEADS`
    (fp4: sm_100, sm_120); ``heads`` among that major's, ``dim`` = :data:`HEAD_DIM`.
    ``capability``: None reads it from ``device`` (tests pass one)."""
    if device.type != "cuda":
        return f"DeepGEMM runs on CUDA devices only; the tensors are on {device}"
    reason = _cache_reason(keys)
    if reason is not None:
        return reason
    fp4 = isinstance(keys, Fp4IndexKeyCache)
    logits, heads_by_major = (FP4_LOGITS, FP4_HEADS) if fp4 else (FP8_LOGITS, FP8_HEADS)
    try:
        module = importlib.import_module(PACKAGE)
    except ImportError as error:  # the wheel, or its extension against this torch
        return f"{PACKAGE} does not import ({error}); install {DISTRIBUTION}"
    missing = [name for name in (logits, *FUNCTIONS) if not hasattr(module, name)]
    if missing:  # sgl-deep-gemm 0.2.5 removed fp8_paged_mqa_logits
        version = getattr(module, "__version__", "of unknown version")
        return f"{PACKAGE} {version} has no {', '.join(missing)}; install {DISTRIBUTION}"
    major, minor = capability or torch.cuda.get_device_capability(device)
    if major not in heads_by_major:
        return (
            f"compute capability {major}.{minor}; DeepGEMM's {logits} runs on capability "
            f"majors {tuple(heads_by_major)}"
        )
    if heads not in heads_by_major[major] or dim != HEAD_DIM:
        return (
            f"{heads} indexer heads of dim {dim}; DeepGEMM's {logits} takes "
            f"{' or '.join(map(str, heads_by_major[major]))} heads of dim {HEAD_DIM} at "
            f"compute capability {major}.x"
        )
    return None


def quantise_queries(q_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_idx`` ``[T, HI, DI]`` float as ``(codes [T, HI, DI] float8_e4m3fn, scale [T, HI]
    fp32)``, one scale per (row, head): ``max(amax, 1e-4) / 448``, codes ``e4m3(x * (1 /
    scale))`` -- ``fp8.e4m3_round_trip``'s rule, so ``codes * scale`` is that round
    trip."""
    x = q_idx.float()
    scale = x.abs().amax(dim=-1).clamp(min=MIN_AMAX) / E4M3_MAX
    codes = (x * (1.0 / scale)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def quantise_fp4_queries(q_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_idx`` ``[T, HI, DI]`` float as sglang's fp4 indexer queries: ``(payload [T, HI,
    DI / 2] int8, exponents [T, HI] int32)``, e2m1 pairs (element ``2i`` in the low nibble) and
    the 4 biased ue8m0 exponents of a (row, head) in one int32 (byte ``b``: channels ``32 b``
    to ``32 b + 31``), quantised by ``C4_ROUNDING``. Exact for ``fp4.fp4_query_view`` values
    (module docstring); requires ``DI`` = 128 (4 exponents an int32)."""
    payload, exponents = pack_ue8m0(q_idx.float(), C4_ROUNDING)
    return payload.view(torch.int8), exponents.contiguous().view(torch.int32)[..., 0]


def _context_lens(num_candidates: torch.Tensor, max_candidates: int) -> torch.Tensor:
    """``[T, 1]`` int32 contiguous: each row's candidates clamped to ``[0, N]`` (the shape
    sglang passes, ``c4_seq_lens.unsqueeze(-1)``)."""
    return num_candidates.clamp(0, max_candidates).to(torch.int32).reshape(-1, 1).contiguous()


def paged_mqa_schedule(num_candidates: torch.Tensor, max_candidates: int) -> torch.Tensor:
    """DeepGEMM's schedule for these rows (``get_paged_mqa_logits_metadata`` over the
    context lengths, 64-key blocks, every SM; the same for fp8 and fp4 keys). Calls with the
    same ``num_candidates`` may share it: sglang builds one a forward for every indexer layer
    (``PagedIndexerMetadata``)."""
    deep_gemm = importlib.import_module(PACKAGE)
    lens = _context_lens(num_candidates, max_candidates)
    return deep_gemm.get_paged_mqa_logits_metadata(lens, BLOCK_KV, deep_gemm.get_num_sms())


def deep_gemm_arguments(call: IndexCall, schedule: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments of ``deep_gemm.fp8_paged_mqa_logits`` (fp8 keys) or
    ``deep_gemm.fp8_fp4_paged_mqa_logits`` (fp4 keys) for ``index_scores``' inputs (checked;
    the cache accepted by :func:`deep_gemm_call_reason`); the module docstring maps them. Pure
    torch: runs on any device."""
    keys = call.keys
    assert keys.layout is not None  # deep_gemm_call_reason refused dense caches
    weights = call.weights.float()
    if isinstance(keys, Fp4IndexKeyCache):
        payload, exponents = quantise_fp4_queries(call.q_idx)
        q: Any = (payload[:, None], exponents[:, None])
    else:
        codes, scale = quantise_queries(call.q_idx)
        q, weights = codes[:, None], weights * scale
    pages = keys.storage.shape[0]
    return dict(
        q=q,
        kv_cache=keys.storage.view(pages, BLOCK_KV, 1, keys.layout.bytes_per_token),
        weights=weights.contiguous(),
        context_lens=_context_lens(call.num_candidates, call.max_candidates),
        block_table=call.page_table.contiguous(),
        schedule_meta=schedule,
        max_context_len=call.max_candidates,
        clean_logits=False,
    )


def index_scores_deep_gemm(
    call: IndexCall, *, schedule: torch.Tensor | None = None
) -> torch.Tensor:
    """``table.index_scores`` on DeepGEMM: the same call (``common.IndexCall``: an fp8 or fp4
    key cache) and ``[T, N]`` fp32 scores, ``-inf`` at columns ``>= num_candidates`` -- of the
    queries' round trip to DeepGEMM's format, equal to the op's for the keys' selection
    (module docstring).

    ``schedule``: a :func:`paged_mqa_schedule` of the same ``num_candidates``; None builds
    one. Raises ``BatchError`` naming :func:`deep_gemm_call_reason`'s reason.
    """
    q_idx, keys, max_candidates = call.q_idx, call.keys, call.max_candidates
    rows, heads, dim = q_idx.shape
    reason = deep_gemm_call_reason(q_idx.device, keys, heads, dim)
    if reason is not None:
        raise BatchError(reason)
    if rows == 0 or max_candidates == 0:
        return torch.empty(rows, max_candidates, dtype=torch.float32, device=q_idx.device)
    deep_gemm = importlib.import_module(PACKAGE)
    if schedule is None:
        schedule = paged_mqa_schedule(call.num_candidates, max_candidates)
    kwargs = deep_gemm_arguments(call, schedule)
    logits_of = getattr(deep_gemm, FP4_LOGITS if isinstance(keys, Fp4IndexKeyCache) else FP8_LOGITS)
    # DeepGEMM's rows are 256-column aligned: the slice is a view of the first N.
    logits = logits_of(**kwargs)[:, :max_candidates]
    cols = torch.arange(max_candidates, device=q_idx.device)
    return logits.masked_fill(cols >= kwargs["context_lens"], float("-inf"))
