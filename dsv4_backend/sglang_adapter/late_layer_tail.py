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
(``enter_late_layer_dp``). On a prefill CP rank the late layers run over the rank's share of
the tail (``planning.tail_cp_layout``), handed with the tail's own
``InterleaveContextParallelMetadata`` for the collectives (sglang's tail graphs keep such a
tail eager).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.attention.deepseek_v4_backend import (
    LateLayerTail as SglangLateLayerTail,
)
from sglang.srt.layers.attention.deepseek_v4_backend import late_layer_whole_extend
from sglang.srt.layers.dp_attention import get_local_dp_buffer_len, set_local_dp_buffer_len

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.planning import (
    AttentionMetadata,
    BatchView,
    late_layer_tail,
    plan,
    read_plan,
    tail_cp_layout,
)


def bounded_replay(args: Any, config: DSV4AttentionConfig) -> bool:
    """Whether ``args`` (sglang's ``ServerArgs``, as resolved: its V4.1 hook turns the replay on
    by default on CUDA) turn the decoder SWA bounded replay on; ``ConfigError`` naming the
    option for a model the tail cannot serve (``config.late_layer_start``)."""
    if not getattr(args, "enable_decoder_swa_bounded_replay", False):
        return False
    config.late_layer_start  # noqa: B018 -- validates the model's layers for the tail
    return True


@dataclass(frozen=True)
class TailForward:
    """The backend's ``tail_forward_metadata``: the plan of the tail rows, which
    ``enter_late_layer_tail`` makes current, and sglang's ``LateLayerTail`` the model reads;
    on a prefill CP rank, the rank's rows of the tail plan (``cp_read``, ``planning.read_plan``)
    its index sources and attention read."""

    metadata: AttentionMetadata
    late_layer_tail: SglangLateLayerTail
    cp_read: AttentionMetadata | None = None


def plan_tail(
    config: DSV4AttentionConfig,
    view: BatchView,
    forward_batch: Any,
    *,
    dspark: bool,
    cp: tuple[int, int] | None = None,
) -> TailForward:
    """The tail of the extend ``view`` (planned from ``forward_batch``; ``dspark``: the
    server's speculative algorithm is DSpark, whose draft reads tail rows only). ``cp``: this
    prefill CP rank and the CP size, for a split extend: the rank's tail rows are its own
    extend rows' (``planning.tail_cp_layout``, as sglang's ``_late_layer_tail_cp_layout``),
    gathered for the collectives by the tail's own ``InterleaveContextParallelMetadata``."""
    whole = late_layer_whole_extend(forward_batch, dspark=dspark)
    tail = late_layer_tail(view, config.window_size, whole)
    metadata = plan(config, tail.batch)
    positions = forward_batch.positions
    if tail.contiguous_start is not None:
        positions = positions[tail.contiguous_start :]
    else:
        positions = positions[tail.token_indices]
    lens = torch.tensor(tail.tail_lens, dtype=torch.int32, device=positions.device)
    swa_out_cache_loc = metadata.swa_out_loc.to(torch.int32)
    if cp is None:
        sglang_tail = SglangLateLayerTail(
            token_indices=tail.token_indices,
            positions=positions,
            extend_seq_lens=lens,
            extend_seq_lens_cpu=tail.tail_lens,
            swa_out_cache_loc=swa_out_cache_loc,
            contiguous_start=tail.contiguous_start,
        )
        return TailForward(metadata=metadata, late_layer_tail=sglang_tail)
    from sglang.srt.layers.cp.interleave import InterleaveContextParallelMetadata

    rank, size = cp
    layout = tail_cp_layout(view, tail, rank, size)
    width = layout.max_rows
    pad_rows = width - layout.rank_rows[rank]
    cp_metadata = InterleaveContextParallelMetadata(
        per_rank_actual_token=[width] * size,
        max_rank_len=[width] * size,
        total_seq_lens=len(layout.gather_index),
        bs=len(tail.tail_lens),
        per_rank_logical_token=layout.rank_rows,
        gather_index=layout.gather_index,
        local_index=layout.local_index,
    )
    sglang_tail = SglangLateLayerTail(
        token_indices=layout.local_token_indices,
        positions=torch.cat([positions[layout.local_rows], positions.new_zeros(pad_rows)]),
        extend_seq_lens=lens,
        extend_seq_lens_cpu=tail.tail_lens,
        swa_out_cache_loc=swa_out_cache_loc,
        pad_rows=pad_rows,
        cp_metadata=cp_metadata,
        local_lens_cpu=layout.local_lens,
        req_global=torch.repeat_interleave(forward_batch.req_pool_indices.to(torch.int64), lens),
        pos_global=positions.to(torch.int64),
    )
    cp_read = read_plan(config, metadata, layout.local_rows, num_rows=width)
    return TailForward(metadata=metadata, late_layer_tail=sglang_tail, cp_read=cp_read)


def swap_cp_layout(fb: Any, tail: TailForward) -> tuple[Any, int] | None:
    """Inside the tail a prefill context-parallel rank's collectives gather the tail's rows, as
    sglang swaps them: ``fb``'s ``attn_cp_metadata`` and the local data-parallel buffer length
    become the tail's; returns what :func:`restore_cp_layout` puts back (None without CP)."""
    cp_metadata = tail.late_layer_tail.cp_metadata
    if cp_metadata is None:
        return None
    saved = (fb.attn_cp_metadata, get_local_dp_buffer_len())
    fb.attn_cp_metadata = cp_metadata
    set_local_dp_buffer_len(sum(cp_metadata.per_rank_actual_token))
    return saved


def restore_cp_layout(fb: Any, saved: tuple[Any, int] | None) -> None:
    """Put back what :func:`swap_cp_layout` swapped (nothing for None)."""
    if saved is not None:
        fb.attn_cp_metadata, dp_buffer_len = saved
        set_local_dp_buffer_len(dp_buffer_len)
