"""sglang's DeepSeek-V4 KV pool built by sglang's own configurator code from a checkpoint config.

A real server builds its ``DeepSeekV4TokenToKVPool`` in
``KVCacheConfigurator._build_dsv4_kv_pool`` (``mem_cache/kv_cache_configurator.py``) from its
``ModelConfig`` (the checkpoint's ``config.json``) and the runner's ``ModelLayerInfo``
(``resolve_layer_indices``). :func:`configured_kv_pool` runs those three sglang functions on
the CPU, with the sizes a test chooses, so the pool carries what a checkpoint gives it: the
whole ``compress_ratios`` list with the draft layers' slots (V4's MTP layer, DSpark's stages),
the stage sglang derives, DeepSeek-V4.1's ``kv_source_layer_ids``. The backend's tests alias
this pool rather than one built from the list the backend keeps.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.model_executor.model_runner_components.layer_setup import resolve_layer_indices
from sglang.srt.runtime_context import get_context
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from dsv4_backend.config import REQUIRED_PAGE_SIZE


@functools.cache
def _model_config(config_json: str) -> ModelConfig:
    """sglang's ``ModelConfig`` of a checkpoint whose ``config.json`` is ``config_json``."""
    directory = Path(tempfile.mkdtemp(prefix="dsv4-config-"))
    (directory / "config.json").write_text(config_json)
    with get_context().override_server_args(device="cpu"):
        return ModelConfig(str(directory))


def model_config(hf: Mapping[str, Any]) -> ModelConfig:
    """sglang's ``ModelConfig`` read from a checkpoint directory holding ``hf`` as its
    ``config.json`` (built once per distinct mapping)."""
    return _model_config(json.dumps(hf, sort_keys=True))


def configured_kv_pool(
    hf: Mapping[str, Any],
    *,
    full_size: int,
    swa_size: int,
    num_req_slots: int,
    c4_state_pool_size: int,
    c128_state_pool_size: int,
    stage: range | None = None,
    is_draft_worker: bool = False,
    **server_args: Any,
) -> DeepSeekV4TokenToKVPool:
    """The fp8 ``DeepSeekV4TokenToKVPool`` sglang's configurator builds for a checkpoint whose
    ``config.json`` is ``hf`` (``harness.tiny_hf_config`` or a tiny checkpoint's).

    ``stage``: a pipeline stage's ``[start_layer, end_layer)`` (the model's
    ``start_layer`` / ``end_layer`` that ``resolve_layer_indices`` reads; default every
    layer). ``server_args`` override sglang's server arguments while the pool is built
    (``speculative_algorithm="EAGLE"``, ...). Sizes as the configurator passes them: token
    slots of the full and window pools (c4 / c128 pools ``full_size // 4`` / ``// 128``),
    ``req_to_token`` rows, and the c4 / c128 state rows. fp32 compressor states (sglang's
    default, ``_get_dsv4_compress_state_dtypes``).
    """
    config = model_config(hf)
    model = (
        SimpleNamespace()
        if stage is None
        else SimpleNamespace(start_layer=stage.start, end_layer=stage.stop)
    )
    algorithm = server_args.get("speculative_algorithm")
    with get_context().override_server_args(
        device="cpu", page_size=REQUIRED_PAGE_SIZE, **server_args
    ):
        configurator = SimpleNamespace(
            model_config=config,
            is_draft_worker=is_draft_worker,
            layer_info=resolve_layer_indices(
                model=model, model_config=config, is_draft_worker=is_draft_worker
            ),
            spec_algorithm=SpeculativeAlgorithm.from_string(algorithm),
            pool_page_size=REQUIRED_PAGE_SIZE,
            device="cpu",
            kv_cache_dtype=torch.float8_e4m3fn,
        )
        pool = KVCacheConfigurator._build_dsv4_kv_pool(
            configurator,
            max_running_requests=num_req_slots - 1,
            full_max_total_num_tokens=full_size,
            swa_max_total_num_tokens=swa_size,
            c4_max_total_num_tokens=full_size // 4,
            c128_max_total_num_tokens=full_size // 128,
            c4_state_pool_size=c4_state_pool_size,
            c128_state_pool_size=c128_state_pool_size,
            c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32,
            req_to_token_pool=SimpleNamespace(
                req_to_token=torch.empty(num_req_slots, 0, dtype=torch.int32)
            ),
        )
    assert isinstance(pool, DeepSeekV4TokenToKVPool)
    return pool
