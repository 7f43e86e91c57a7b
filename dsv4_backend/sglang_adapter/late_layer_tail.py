"""DeepSeek-V4.1's decoder SWA bounded replay as sglang 0.5.23's model drives it
(``models/deepseek_v4.py``: ``write_tail_source_kv``, ``enter_late_layer_tail`` /
``exit_late_layer_tail``, ``tail_forward_metadata.late_layer_tail``; docs/design.md §8).

For every extend (``is_extend_without_speculative``: EXTEND, MIXED) the backend plans the
late-layer tail beside the batch (``planning.late_layer_tail``, the one planner) and hands the
model sglang's own ``LateLayerTail`` of it: the tail rows' indices into the extend, their
positions, lengths and window slots. Which requests keep their whole extend is sglang's own
``late_layer_whole_extend`` (prompt logprobs; every hidden state outside DSpark).

sglang's row-bucket tail graphs (``DecoderReplayTail``, on by default: their
``SGLANG_DSV4_DECODER_TAIL_GRAPH_MAX_ROWS`` is 2048) replay the late layers with the backend's
calls as eager breaks (``deepseek_v4_attention_with_output``, ``deepseek_v4_low_ratio_sources``,
``_tail_kv_store``): each break gets a copy of the batch whose ``out_cache_loc`` is cut to the
tail's row count, which the backend matches by its requests inside the tail (the rows are the
tail plan's); a bucket's first use runs them three times (two warmups and the capture), which
rewrites the same entries. The prefill-graph tail (``run_in_prefill_graph``) needs the prefill
CUDA graph, which the backend refuses. Under DP attention the tail is the real requests' rows (an
extend's padding tokens are no request's); the late layers' DP token counts are the model's
(``enter_late_layer_dp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.attention.deepseek_v4_backend import (
    LateLayerTail as SglangLateLayerTail,
)
from sglang.srt.layers.attention.deepseek_v4_backend import late_layer_whole_extend

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.planning import AttentionMetadata, BatchView, late_layer_tail, plan


def bounded_replay(args: Any, config: DSV4AttentionConfig) -> bool:
    """Whether ``args`` (sglang's ``ServerArgs``, as resolved: its V4.1 hook turns the replay on
    by default on CUDA) turn the decoder SWA bounded replay on; ``ConfigError`` naming the
    option for a model the tail cannot serve (``config.late_layer_start``)."""
    if not getattr(args, "enable_decoder_swa_bounded_replay", False):
        return False
    config.late_layer_start  # noqa: B018 -- validates the model's layers for the tail
    if prefill_cp(args):
        raise ConfigError(
            "--enable-decoder-swa-bounded-replay with prefill CP (--enable-prefill-cp / "
            "--attention-context-parallel-size): the dsv4 backend does not plan the late-layer "
            "tail's CP layout yet (sglang turns the replay off under CP by default); start with "
            "--no-enable-decoder-swa-bounded-replay"
        )
    return True


def prefill_cp(args: Any) -> bool:
    """Whether ``args`` (sglang's ``ServerArgs``) split prefills over CP ranks, as sglang's V4.1
    hook reads it (``--enable-prefill-cp`` before ``attn_cp_size`` resolves, or the size)."""
    return bool(getattr(args, "enable_prefill_cp", False)) or (
        int(getattr(args, "attn_cp_size", 1) or 1) > 1
    )


@dataclass(frozen=True)
class TailForward:
    """The backend's ``tail_forward_metadata``: the plan of the tail rows, which
    ``enter_late_layer_tail`` makes current, and sglang's ``LateLayerTail`` the model reads."""

    metadata: AttentionMetadata
    late_layer_tail: SglangLateLayerTail


def plan_tail(
    config: DSV4AttentionConfig, view: BatchView, forward_batch: Any, *, dspark: bool
) -> TailForward:
    """The tail of the extend ``view`` (planned from ``forward_batch``; ``dspark``: the
    server's speculative algorithm is DSpark, whose draft reads tail rows only)."""
    whole = late_layer_whole_extend(forward_batch, dspark=dspark)
    tail = late_layer_tail(view, config.window_size, whole)
    metadata = plan(config, tail.batch)
    positions = forward_batch.positions
    if tail.contiguous_start is not None:
        positions = positions[tail.contiguous_start :]
    else:
        positions = positions[tail.token_indices]
    lens = torch.tensor(tail.tail_lens, dtype=torch.int32, device=positions.device)
    sglang_tail = SglangLateLayerTail(
        token_indices=tail.token_indices,
        positions=positions,
        extend_seq_lens=lens,
        extend_seq_lens_cpu=tail.tail_lens,
        swa_out_cache_loc=metadata.swa_out_loc.to(torch.int32),
        contiguous_start=tail.contiguous_start,
    )
    return TailForward(metadata=metadata, late_layer_tail=sglang_tail)
