"""What the backend reads from sglang's DeepSeek-V4 model modules, and the order it reads it in.

The indexer's queries and head weights (V4's ``C4Indexer``, V4.1's ``DeepseekV41Indexer``), with
sglang's multi-stream order for the c4 indexer (``c4_indexer_inputs``); the attention's queries
and sink, checked; a compressor's ape in checkpoint layout. ``backend.py`` calls these from
sglang's layer calls; nothing here plans or keeps state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from dsv4_backend.errors import ContractError
from dsv4_backend.ops.rope import RopeTable, apply_rope
from dsv4_backend.planning import AttentionMetadata

if TYPE_CHECKING:
    from sglang.srt.layers.attention.dsv4.compressor import Compressor
    from sglang.srt.layers.attention.dsv4.indexer import C4Indexer


class CudaStreams:
    """The two stream calls of sglang's multi-stream indexer path (``torch.cuda``): the
    current stream, and a context making another stream current. A backend's ``streams``
    attribute; tests swap in a recorder."""

    @staticmethod
    def current() -> Any:
        return torch.cuda.current_stream()

    @staticmethod
    def use(stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)


def index_weights(c4_indexer: C4Indexer, x: torch.Tensor) -> torch.Tensor:
    """``[T, HI]`` float32 head weights: the projection times ``weight_scale`` in fp32."""
    return c4_indexer.compute_weights(x, skip_scale=True).float() * c4_indexer.weight_scale


def index_queries(
    c4_indexer: C4Indexer, q_lora: torch.Tensor, rope: RopeTable, metadata: AttentionMetadata
) -> torch.Tensor:
    """``[T, HI, DI]`` float32 indexer queries, roped (``rope``) at each row's position."""
    q, _ = c4_indexer.wq_b(q_lora)
    q = q.view(q.shape[0], c4_indexer.n_heads, c4_indexer.head_dim)
    cos, sin = rope.cos_sin(metadata.positions_causal)
    return apply_rope(q, cos, sin)


def attention_queries(
    q: torch.Tensor, attn_sink: torch.Tensor | None, head_dim: int, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` as ``[T, H, head_dim]`` (from ``[T, H * head_dim]`` too) and ``attn_sink``
    ``[H]``, checked: ``ContractError`` for a missing sink or shapes that do not fit."""
    if attn_sink is None:
        raise ContractError(f"{where}: attn_sink is required (the per-head sink logits)")
    if q.dim() == 2 and q.shape[1] % head_dim == 0:
        q = q.view(q.shape[0], -1, head_dim)
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ContractError(
            f"{where}: q has shape {tuple(q.shape)}; expected [T, H, {head_dim}] or "
            f"[T, H * {head_dim}] (head_dim={head_dim})"
        )
    if attn_sink.shape != (q.shape[1],):
        raise ContractError(
            f"{where}: attn_sink has shape {tuple(attn_sink.shape)}; expected one logit per "
            f"query head, ({q.shape[1]},)"
        )
    return q, attn_sink


def original_ape(compressor: Compressor) -> torch.Tensor:
    """``[r, c*D]`` float32 ape in checkpoint layout.

    sglang's ``Compressor._apply_ape_hotfix`` (``ape_converted``) stores a ratio-4 ape
    ``[4, 2D]`` as its two halves stacked, ``[2, 4, D]``; undo that.
    """
    ape = compressor.ape.float()
    if compressor.ratio == 4 and getattr(compressor, "ape_converted", False):
        ape = ape.reshape(2, 4, -1).permute(1, 0, 2).reshape(4, -1)
    return ape


def c4_indexer_inputs(
    c4_indexer: C4Indexer,
    x: torch.Tensor,
    q_lora: torch.Tensor,
    rope: RopeTable,
    metadata: AttentionMetadata,
    *,
    compress: Callable[[], None] | None,
    streams: CudaStreams | None,
    alt_streams: Sequence[Any] | None,
    q_lora_ready: Any,
    where: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The c4 indexer's queries ``[T, HI, DI]`` and head weights ``[T, HI]`` (float32), after
    ``compress`` (the indexer compressor; None: skipped), in sglang's order
    (``C4IndexerBackendMixin``).

    ``streams`` (sglang's ``enable_multi_stream``; None: everything on the current stream): the
    model calls the indexer on its indexer stream *before* ``q_lora`` is computed, handing the
    event ``q_lora_ready``; the compressor runs on the current stream, the head weights on
    ``alt_streams[1]``, the queries on ``alt_streams[0]`` after waiting for ``q_lora_ready``
    (and the weights), and the current stream joins ``alt_streams[0]`` before the top-k.
    ``ContractError`` for ``q_lora_ready`` without ``streams`` (sglang asserts it is None) or
    fewer than two ``alt_streams`` with them."""
    if streams is None:
        if q_lora_ready is not None:
            raise ContractError(
                f"{where}: q_lora_ready given without enable_multi_stream; the event belongs to "
                "the multi-stream path (sglang asserts it is None otherwise)"
            )
        if compress is not None:
            compress()
        weights = index_weights(c4_indexer, x)
        return index_queries(c4_indexer, q_lora, rope, metadata), weights
    if alt_streams is None or len(alt_streams) < 2:
        raise ContractError(
            f"{where}: enable_multi_stream needs two alt_streams (queries, weights), "
            f"got {alt_streams!r}"
        )
    current = streams.current()
    stream_q, stream_weights = alt_streams[0], alt_streams[1]
    stream_q.wait_stream(current)
    stream_weights.wait_stream(current)
    if compress is not None:
        compress()
    with streams.use(stream_weights):
        weights = index_weights(c4_indexer, x)
        weights_ready = stream_weights.record_event()
    with streams.use(stream_q):
        if q_lora_ready is not None:
            stream_q.wait_event(q_lora_ready)
        stream_q.wait_event(weights_ready)
        q = index_queries(c4_indexer, q_lora, rope, metadata)
    current.wait_stream(stream_q)
    return q, weights


def low_ratio_indexer_inputs(
    indexer: Any, x: torch.Tensor, q_lora: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4.1's index source (sglang's ``DeepseekV41Indexer`` ``indexer``): queries
    ``indexer.wq_b(q_lora)`` as ``[T, HI, DI]`` and head weights ``indexer.head_weights_raw(x)``
    times ``indexer.head_weight_scale`` ``[T, HI]`` float32."""
    q, _ = indexer.wq_b(q_lora)
    q = q.view(q.shape[0], indexer.n_local_heads, indexer.index_head_dim)
    return q, indexer.head_weights_raw(x).float() * indexer.head_weight_scale
