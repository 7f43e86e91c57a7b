"""A real sglang ``DeepSeekV4TokenToKVPool`` on the CPU, whose buffers the backend's caches
alias (``cache/test_pool_alias.py``; the DSpark adapter, EAGLE loop and prefix-cache tests).

Built by sglang's own configurator code (``testing.configured_pool``) from a checkpoint config
with the MTP slot. sglang's pool hard-codes the Flash geometry (448 nope + 64 rope, indexer dim
128), so :data:`CONFIG` is Flash-width with four layers.
"""

from __future__ import annotations

from typing import Any

import torch
from configured_pool import configured_kv_pool
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.testing import harness

CONFIG = DSV4AttentionConfig(compress_ratios=(0, 4, 128, 4), num_heads=8, index_topk=16)
#: The checkpoint config: ``compress_ratios`` carries the MTP layer's slot, as DeepSeek-V4
#: checkpoints' do, and sglang's pool keeps it.
HF = harness.tiny_hf_config(CONFIG)
REQUEST_SLOTS = 4


def make_pool(
    swa_size: int = 512,
    full_size: int = 1024,
    stage: range | None = None,
    hf: dict[str, Any] = HF,
    **options: Any,
) -> DeepSeekV4TokenToKVPool:
    """The pool sglang's configurator builds for the checkpoint config ``hf`` (page 256,
    paged window, offline fp32 c128 state), ``REQUEST_SLOTS`` request rows; ``stage``: a
    pipeline stage's pool, of those layers only; ``options``: ``configured_kv_pool``'s
    (``is_draft_worker``, server arguments)."""
    return configured_kv_pool(
        hf,
        full_size=full_size,
        swa_size=swa_size,
        num_req_slots=REQUEST_SLOTS,
        c4_state_pool_size=swa_size // 256 * 8,
        c128_state_pool_size=REQUEST_SLOTS * 128,
        stage=stage,
        **options,
    )


def inside(view: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``view``'s bytes lie in ``buf``'s."""
    lo = buf.data_ptr()
    return lo <= view.data_ptr() and view.data_ptr() + view.nbytes <= lo + buf.nbytes
