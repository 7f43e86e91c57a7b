"""A real sglang ``DeepSeekV4TokenToKVPool`` on the CPU, whose buffers the backend's caches
alias (``cache/test_pool_alias.py``; the DSpark adapter, EAGLE loop and prefix-cache tests).

sglang's pool hard-codes the Flash geometry (448 nope + 64 rope, indexer dim 128), so
:data:`CONFIG` is Flash-width with four layers.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.runtime_context import get_context

from dsv4_backend.config import DSV4AttentionConfig

CONFIG = DSV4AttentionConfig(compress_ratios=(0, 4, 128, 4), num_heads=8, index_topk=16)
REQUEST_SLOTS = 4


def make_pool(
    swa_size: int = 512,
    full_size: int = 1024,
    ratios: tuple[int, ...] = CONFIG.compress_ratios,
    stage: range | None = None,
) -> DeepSeekV4TokenToKVPool:
    """A pool as sglang's configurator builds it (page 256, paged window, offline c128), of
    layers of compress ``ratios``; ``stage``: a pipeline stage's pool, of those layers only
    (``layer_num``, ``start_layer`` / ``end_layer`` as ``kv_cache_configurator`` passes them)."""
    stage = stage or range(len(ratios))
    with get_context().override_server_args(device="cpu"):
        return DeepSeekV4TokenToKVPool(
            max_num_reqs=REQUEST_SLOTS - 1,
            num_req_slots=REQUEST_SLOTS,
            swa_size=swa_size,
            c4_size=full_size // 4,
            c128_size=full_size // 128,
            c4_state_pool_size=swa_size // 256 * 8,
            c128_state_pool_size=REQUEST_SLOTS * 128,
            page_size=256,
            swa_page_size=256,
            dtype=torch.float8_e4m3fn,
            c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32,
            qk_nope_head_dim=448,
            qk_rope_head_dim=64,
            indexer_head_dim=128,
            layer_num=len(stage),
            start_layer=stage.start,
            end_layer=stage.stop,
            device="cpu",
            enable_memory_saver=False,
            compression_ratios=list(ratios),
            full_size=full_size,
        )


def inside(view: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``view``'s bytes lie in ``buf``'s."""
    lo = buf.data_ptr()
    return lo <= view.data_ptr() and view.data_ptr() + view.nbytes <= lo + buf.nbytes
