"""DeepGEMM's paged MQA logits as a variant of the lightning indexer's scores.

:func:`index_scores_deep_gemm` takes the arguments of ``table.index_scores`` and returns its
``[T, N]`` fp32 scores from ``deep_gemm.fp8_paged_mqa_logits`` (the ``deep_gemm`` package
sglang 0.5.23 pins, :data:`DISTRIBUTION`), called as sglang's DeepSeek-V4 indexer calls it
(``srt/layers/attention/dsv4/indexer.py``, ``C4IndexerBackendMixin``'s paged branch,
``run_paged_indexer``; the schedule as ``dsv4/metadata.py``'s ``PagedIndexerMetadata`` builds
it). :func:`deep_gemm_unsupported_reason` says where it runs (``table.py`` declares it).

Queries. DeepGEMM scores e4m3 queries: ``logits = sum_h w'_h relu(code_h . code_k) scale_k``.
The variant quantises ``q_idx`` per (row, head) by sglang's rule (``max(amax, 1e-4) / 448``,
:func:`quantise_queries`: the last step of sglang's ``fused_q_indexer_rope_hadamard_quant``,
whose rotation is ``fp8.quantised_view``'s) and folds the scale into the weights,
``w' = w * scale_q``, as that kernel does. Since the scales are positive this is
``sum_h w_h relu(deq(q_h) . deq(k))``: ``index_scores`` of the e4m3 round trip of ``q_idx``.

* ``indexer_selection="fp8"`` (:data:`EXACT_FOR_SELECTIONS`): the queries reaching the op are
  ``fp8.quantised_view`` values, already e4m3 codes times that per-(row, head) scale;
  quantising them again gives the same codes and the scale within an fp32 rounding, so the
  variant computes the op's scores (up to fp32 summation order).
* ``indexer_selection="exact"`` (the default): the queries are full precision; their e4m3
  round trip moves every score (and so the selection), so the variant does not compute the
  op's contract there and :func:`deep_gemm_unsupported_reason` refuses it.

The rest of the mapping (:func:`deep_gemm_arguments`): ``q`` ``[T, 1, HI, DI]`` e4m3 (one
query token a batch entry); the fp8 key cache viewed ``[pages, 64, 1, DI + 4]`` uint8 (its
layout is DeepGEMM's: 64 keys of e4m3 bytes, then their fp32 scales, 132 B a key at DI = 128);
``weights`` ``[T, HI]`` fp32; ``context_lens`` ``[T, 1]`` int32, ``num_candidates`` clamped to
``[0, N]`` (the op clamps; DeepGEMM would write past ``N``); ``block_table`` the page table
(``[T, Pw]`` int32: a row's c4 entry ``s`` is key page ``page_table[t, s // 64]``, slot
``s % 64``, as ``common.entry_slots`` has it); ``max_context_len = N``;
``clean_logits=False`` (sglang's): DeepGEMM leaves columns past a row's length unwritten and the
variant sets them to ``-inf``, the op's contract.

Not run here: ``deep_gemm`` needs CUDA; the tests check the arguments against its documented
signature with a stand-in module and compare the result with the torch ``index_scores``.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache
from dsv4_backend.cache.fp8_format import INDEXER_PAGE_TOKENS
from dsv4_backend.cache.indexer_cache import IndexerKeyCache
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.indexer.common import IndexCall
from dsv4_backend.kernels.indexer.fp8 import E4M3_MAX, MIN_AMAX

#: The module it calls and the distribution (as sglang 0.5.23 pins it) that provides it.
PACKAGE = "deep_gemm"
DISTRIBUTION = "sgl-deep-gemm==0.2.3.post2"
#: What the variant calls of it (sgl-deep-gemm 0.2.5, newer than sglang's pin, has no
#: ``fp8_paged_mqa_logits``: the variant is refused there, not failed at its first call).
FUNCTIONS = ("fp8_paged_mqa_logits", "get_paged_mqa_logits_metadata", "get_num_sms")
#: ``DSV4AttentionConfig.indexer_selection`` values for which the variant computes the op.
EXACT_FOR_SELECTIONS = ("fp8",)
#: Indexer heads DeepGEMM's fp8 paged MQA logits take on sm_90 and sm_100 (DeepSeek-V4: 64).
HEADS = (32, 64)
#: Indexer head dim of sglang's paged key cache (132 B a key).
HEAD_DIM = 128
#: Keys a DeepGEMM KV block: one indexer-cache page.
BLOCK_KV = INDEXER_PAGE_TOKENS
#: Compute capability majors with an fp8 paged MQA logits kernel for 64-key blocks.
ARCH_MAJORS = (9, 10, 12)


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
    config's) outside :data:`EXACT_FOR_SELECTIONS`, whose full-precision queries the variant
    would round to e4m3 (module docstring)."""
    reason = deep_gemm_call_reason(device, keys, heads, dim, capability=capability)
    if reason is None and indexer_selection not in EXACT_FOR_SELECTIONS:
        return (
            f"indexer_selection={indexer_selection!r}; DeepGEMM scores e4m3 queries, which "
            f"equal the op's only for indexer_selection in {EXACT_FOR_SELECTIONS}"
        )
    return reason


def deep_gemm_call_reason(
    device: torch.device,
    keys: IndexerKeyCache | Fp4IndexKeyCache,
    heads: int,
    dim: int,
    *,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why DeepGEMM cannot be called on these inputs (None when it can), in order: a CUDA
    device; an fp8 key cache of sglang's geometry (64-key pages, DI = 128); ``heads`` in
    :data:`HEADS`, ``dim`` = DI; ``deep_gemm`` importable, with :data:`FUNCTIONS`; a compute
    capability in
    :data:`ARCH_MAJORS`. ``capability``: None reads it from ``device`` (tests pass one)."""
    if device.type != "cuda":
        return f"DeepGEMM runs on CUDA devices only; the tensors are on {device}"
    if not isinstance(keys, IndexerKeyCache):
        return (
            f"the indexer keys are a {type(keys).__name__} (fp4 pages, indexer_selection="
            "'fp4'); the variant calls DeepGEMM's fp8 paged MQA logits, not its fp8_fp4 one"
        )
    if keys.fmt != "fp8":
        return (
            f"the indexer key cache is {keys.fmt}; DeepGEMM reads fp8 keys (sglang's "
            "132-byte paged layout)"
        )
    if keys.dim != HEAD_DIM or keys.page_tokens != BLOCK_KV or not keys.storage.is_contiguous():
        return (
            f"the indexer key cache holds {keys.dim} channels in pages of {keys.page_tokens} "
            f"keys; DeepGEMM reads contiguous pages of {BLOCK_KV} keys of {HEAD_DIM} channels"
        )
    if heads not in HEADS or dim != HEAD_DIM:
        return (
            f"{heads} indexer heads of dim {dim}; DeepGEMM's fp8 paged MQA logits take "
            f"{' or '.join(map(str, HEADS))} heads of dim {HEAD_DIM}"
        )
    try:
        module = importlib.import_module(PACKAGE)
    except ImportError as error:  # the wheel, or its extension against this torch
        return f"{PACKAGE} does not import ({error}); install {DISTRIBUTION}"
    missing = [name for name in FUNCTIONS if not hasattr(module, name)]
    if missing:  # sgl-deep-gemm 0.2.5 removed fp8_paged_mqa_logits
        version = getattr(module, "__version__", "of unknown version")
        return f"{PACKAGE} {version} has no {', '.join(missing)}; install {DISTRIBUTION}"
    major, minor = capability or torch.cuda.get_device_capability(device)
    if major not in ARCH_MAJORS:
        return (
            f"compute capability {major}.{minor}; DeepGEMM's fp8 paged MQA logits run on "
            f"capability majors {ARCH_MAJORS} (Hopper, Blackwell, Blackwell GeForce)"
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


def _context_lens(num_candidates: torch.Tensor, max_candidates: int) -> torch.Tensor:
    """``[T, 1]`` int32 contiguous: each row's candidates clamped to ``[0, N]`` (the shape
    sglang passes, ``c4_seq_lens.unsqueeze(-1)``)."""
    return num_candidates.clamp(0, max_candidates).to(torch.int32).reshape(-1, 1).contiguous()


def paged_mqa_schedule(num_candidates: torch.Tensor, max_candidates: int) -> torch.Tensor:
    """DeepGEMM's schedule for these rows (``get_paged_mqa_logits_metadata`` over the
    context lengths, 64-key blocks, every SM). Calls with the same ``num_candidates`` may share
    it: sglang builds one a forward for every indexer layer (``PagedIndexerMetadata``)."""
    deep_gemm = importlib.import_module(PACKAGE)
    lens = _context_lens(num_candidates, max_candidates)
    return deep_gemm.get_paged_mqa_logits_metadata(lens, BLOCK_KV, deep_gemm.get_num_sms())


def deep_gemm_arguments(call: IndexCall, schedule: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments of ``deep_gemm.fp8_paged_mqa_logits`` for ``index_scores``' inputs
    (checked; the cache accepted by :func:`deep_gemm_call_reason`); the module docstring maps
    them. Pure torch: runs on any device."""
    keys = call.c4_keys("the deep_gemm indexer")
    assert keys.layout is not None  # deep_gemm_call_reason refused dense caches
    codes, scale = quantise_queries(call.q_idx)
    pages = keys.storage.shape[0]
    return dict(
        q=codes[:, None],
        kv_cache=keys.storage.view(pages, BLOCK_KV, 1, keys.layout.bytes_per_token),
        weights=(call.weights.float() * scale).contiguous(),
        context_lens=_context_lens(call.num_candidates, call.max_candidates),
        block_table=call.page_table.contiguous(),
        schedule_meta=schedule,
        max_context_len=call.max_candidates,
        clean_logits=False,
    )


def index_scores_deep_gemm(
    call: IndexCall, *, schedule: torch.Tensor | None = None
) -> torch.Tensor:
    """``table.index_scores`` on DeepGEMM: the same call (``common.IndexCall``: the fp8 key
    cache) and ``[T, N]`` fp32 scores, ``-inf`` at columns ``>= num_candidates`` -- of the
    queries' e4m3 round trip, equal to the op's for :data:`EXACT_FOR_SELECTIONS` (module
    docstring).

    ``schedule``: a :func:`paged_mqa_schedule` of the same ``num_candidates``; None builds
    one. Raises ``BatchError`` naming :func:`deep_gemm_call_reason`'s reason.
    """
    q_idx, max_candidates = call.q_idx, call.max_candidates
    keys = call.c4_keys("the deep_gemm indexer")
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
    # DeepGEMM's rows are 256-column aligned: the slice is a view of the first N.
    logits = deep_gemm.fp8_paged_mqa_logits(**kwargs)[:, :max_candidates]
    cols = torch.arange(max_candidates, device=q_idx.device)
    return logits.masked_fill(cols >= kwargs["context_lens"], float("-inf"))
