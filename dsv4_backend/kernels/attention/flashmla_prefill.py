"""FlashMLA's sparse prefill (``flash_mla_sparse_fwd``) as a variant of the ``sparse_attention``
op.

sglang 0.5.23 runs a non-speculative extend of more than 11673 query rows (or any, with
``SGLANG_OPT_FLASHMLA_SPARSE_PREFILL``) through this kernel instead of the sparse decode
(``srt/layers/attention/deepseek_v4_backend.py``, ``_use_sparse_prefill`` /
``_forward_prefill_sparse``): it dequantises each request's window and compressed entries into
a flat bf16 workspace and hands the kernel per-row indices rebased into it. This variant does
the same from the op's arguments (``flashmla_library.prefill_arguments``):

* workspace ``kv`` ``[U, 1, D]`` bf16: the distinct slots the rows reference (valid columns
  only: below the row's length and not -1), window slots first, then the compressed cache's,
  each read with ``TokenCache.gather`` (exact: an fp8 cache's e4m3 x power-of-two values and
  bf16 rope fit bf16); any cache format, so dense bf16 caches are taken too;
* ``indices`` ``[T, 1, W']`` int32: each row's valid window keys, then its valid compressed
  keys, as workspace rows, packed to the front (the order does not change a softmax), -1
  after them, ``W'`` the op's window + compressed widths rounded up to a multiple of 128
  (``flashmla_library.PREFILL_INDEX_ALIGN``: the kernel reads two 64-column blocks a step);
  ``topk_length`` ``[T]`` int32 the row's valid key count, so the kernel skips the -1 tail;
* queries and sink zero-padded to 64 heads as for the decode (``flashmla_library``);
  ``sm_scale`` as given, ``d_v = D``; ``use_legacy=True`` as sglang's wrapper
  (``sglang/kernels/ops/attention/flash_mla_interface.py``) calls it; ``return_log2_lse=False``:
  the op needs no statistics, and the legacy kernel then skips writing them.

FlashMLA returns ``[T, Hk, D]`` bf16; the variant returns its first ``H`` heads, rows without
a valid key set to 0 (the op's contract, whatever the kernel leaves there). The workspace has
a data-dependent size (``torch.unique``), so the variant synchronises once a call and is not
CUDA-graph safe; sglang runs the same path eagerly (DSv4 has no prefill graph).

Not run here: ``flash_mla`` needs CUDA; the tests check the arguments against its documented
signature with a stand-in module and compare the result with ``sparse_attention_torch``.
"""

from __future__ import annotations

import torch

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.attention.common import AttentionCall
from dsv4_backend.kernels.attention.flashmla_library import (
    PREFILL_FUNCTIONS,
    library_unsupported_reason,
    prefill_arguments,
    sparse_prefill,
)


def flashmla_prefill_unsupported_reason(
    device: torch.device,
    window: TokenCache,
    extra: TokenCache | None,
    heads: int,
    dim: int,
    *,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why :func:`sparse_attention_flashmla_prefill` cannot run on these inputs (None when it
    can): ``flashmla_library.library_unsupported_reason`` for ``heads`` queries of ``dim`` on
    ``device``. The caches are read through ``TokenCache.gather``, so any format serves."""
    return library_unsupported_reason(device, heads, dim, capability, PREFILL_FUNCTIONS)


def sparse_attention_flashmla_prefill(call: AttentionCall) -> torch.Tensor:
    """``sparse_attention_with_sink`` on FlashMLA's sparse prefill: the same arguments
    (``[T, H, D]`` queries, window and extra caches with their ``[T, W]`` int32 slots and
    ``[T]`` int32 lengths, ``[H]`` fp32 sink) and result, ``[T, H, D]`` bf16; rows without a
    valid key are 0. ``rows_per_group``, the op's argument, is not used (FlashMLA tiles the
    rows itself). Raises ``BatchError`` / ``ContractError`` for bad inputs (the op's checks)
    and ``BatchError`` naming :func:`flashmla_prefill_unsupported_reason`'s reason.
    """
    _, heads, dim = call.q.shape
    reason = flashmla_prefill_unsupported_reason(
        call.q.device, call.window, call.extra_cache, heads, dim
    )
    if reason is not None:
        raise BatchError(reason)
    return sparse_prefill(prefill_arguments(call), heads)
