"""A CPU twin of sglang 0.5.23's decoder tail graphs, the backend's side of them
(docs/design.md §8): what ``DecoderReplayTail.run`` (``models/deepseek_v4_replay_tail.py``) and
``RowBucketGraphRunner`` (``model_executor/runner/row_bucket_graph_runner.py``) hand the backend
while the late layers run from a row-bucket breakable CUDA graph, which needs a GPU.

What it calls is sglang's own: the eager breaks' bodies (``deepseek_v4_attention_with_output``,
``deepseek_v4_low_ratio_sources`` with its capture stub, ``_tail_kv_store``) through their
``eager_on_graph`` wrappers, recorded into sglang's ``BreakableCUDAGraph`` by a capture whose
segments record nothing; the forward and piecewise contexts (``forward_context``,
``set_tc_piecewise_forward_context``) and ``_replay_tail_scope``. What it mirrors:

- the step batch: a ``copy.copy`` of the live batch whose ``global_num_token_non_padded_cpu``
  is the tail's row count (``RowBucketGraphRunner.run``), which every break reads;
- a bucket's first use captures every bucket from ``max_rows`` down to it, each with two eager
  warmups and a capture pass (``_capture`` / ``_record``); a replay runs the recorded breaks
  with their capture-time arguments (``BreakableCUDAGraph.replay``);
- the segments between breaks: the layer's activations land in static bucket-sized buffers
  (what a captured segment computes into its pool tensors at fixed addresses), rows past the
  live ones holding what an earlier step left (``garbage`` at capture);
- ``MQALayer``'s window-key store in a tail graph (``bcg_tail_kv_store``), whose
  ``_compute_kv_to_cache`` under ``SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE`` (which the backend
  sets) hands ``store_cache`` the normed, roped keys: here the fed keys.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

BREAK_GARBAGE = 1e4  #: what a bucket's padding rows hold when it is captured


@dataclass
class _Capture:
    """The capture ``eager_on_graph`` records breaks into (``BreakableCUDAGraphCapture``'s
    attributes it reads), with segments that record nothing."""

    cuda_graph: Any
    _barrier_fn: None = None

    def _end_current_segment(self) -> None:
        pass

    def _begin_new_segment(self) -> None:
        pass


@dataclass
class _Static:
    """One tail layer's bucket-sized buffers (``positions``, ``x``, ``q_lora``, ``q``, ``kv``,
    ``out``) and its ``MQALayer`` (``spec``)."""

    spec: Any
    buffers: dict[str, torch.Tensor]


@dataclass
class _Graph:
    breaks: Any  # sglang's BreakableCUDAGraph
    static: list[_Static]


@dataclass
class LayerCall:
    """One tail layer's activations of the live rows (bf16): ``x`` ``[n, hidden]``,
    ``q_lora`` ``[n, q_lora]``, ``q`` ``[n, H, D]``, ``kv`` ``[n, D]``; ``spec``: sglang's
    ``MQALayer`` attributes (``layer_id``, ``compress_ratio``, ``compressor``, ``indexer``)."""

    spec: Any
    x: torch.Tensor
    q_lora: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor


@dataclass
class TailGraphs:
    """Row-bucket tail graphs of ``row_step`` (sglang: ``SWA_WINDOW``) rows up to ``max_rows``
    (``SGLANG_DSV4_DECODER_TAIL_GRAPH_MAX_ROWS``), keyed by bucket like sglang's runner."""

    row_step: int
    max_rows: int
    sinks: torch.Tensor
    num_heads: int
    graphs: dict[int, _Graph] = field(default_factory=dict)
    captures: int = 0  #: capture passes run (one per bucket)

    def bucket_rows(self, num_rows: int) -> int | None:
        """``RowBucketGraphRunner.bucket_rows``: None when no graph serves ``num_rows``."""
        if num_rows == 0 or num_rows > self.max_rows:
            return None
        return -(-num_rows // self.row_step) * self.row_step

    def run(
        self, backend: Any, forward_batch: Any, positions: torch.Tensor, calls: Sequence[LayerCall]
    ) -> list[torch.Tensor]:
        """The tail layers ``calls`` over the tail's ``positions`` ``[n]`` from their bucket's
        graph (captured on first use), inside the tail the backend entered: each layer's
        attention output ``[n, H, D]`` bf16."""
        num_rows = positions.shape[0]
        rows = self.bucket_rows(num_rows)
        if rows is None:
            raise ValueError(f"{num_rows} tail rows have no graph (max_rows {self.max_rows})")
        step_batch = copy.copy(forward_batch)
        step_batch.global_num_token_non_padded_cpu = num_rows
        with self._contexts(backend, step_batch, calls):
            if rows not in self.graphs:
                for bucket in range(self.max_rows, rows - 1, -self.row_step):
                    if bucket not in self.graphs:
                        self.graphs[bucket] = self._capture(bucket, positions, calls)
            graph = self.graphs[rows]
            _fill(graph.static, positions, calls, garbage=None)
            for replay_break in graph.breaks._break_fns:
                replay_break()
        return [layer.buffers["out"][:num_rows].clone() for layer in graph.static]

    @contextmanager
    def _contexts(
        self, backend: Any, step_batch: Any, calls: Sequence[LayerCall]
    ) -> Iterator[None]:
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
        from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager import (  # noqa: E501
            set_tc_piecewise_forward_context,
        )
        from sglang.srt.models.deepseek_v4_replay_tail import _replay_tail_scope

        layers: list[Any] = [None] * (max(c.spec.layer_id for c in calls) + 1)
        for call in calls:
            layers[call.spec.layer_id] = SimpleNamespace(
                layer_id=call.spec.layer_id, tp_q_head_num=self.num_heads
            )
        with (
            forward_context(ForwardContext(attn_backend=backend), forward_batch=step_batch),
            set_tc_piecewise_forward_context(step_batch, layers, None, [], []),
            _replay_tail_scope(),
        ):
            yield

    def _capture(self, rows: int, positions: torch.Tensor, calls: Sequence[LayerCall]) -> _Graph:
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
            breakable_cuda_graph as bcg,
        )

        static = [
            _Static(
                spec=c.spec,
                buffers={
                    "positions": positions.new_zeros(rows),
                    **{name: _rows_like(getattr(c, name), rows) for name in _FED},
                    "out": _rows_like(c.q, rows),
                },
            )
            for c in calls
        ]
        _fill(static, positions, calls, garbage=BREAK_GARBAGE)
        for _ in range(2):  # _record's eager warmups
            self._body(static)
        capture = _Capture(cuda_graph=bcg.BreakableCUDAGraph())
        token = bcg._current_capture_var.set(capture)
        try:
            self._body(static)
        finally:
            bcg._current_capture_var.reset(token)
        self.captures += 1
        return _Graph(breaks=capture.cuda_graph, static=static)

    def _body(self, static: Sequence[_Static]) -> None:
        """``_layer_stack``'s breaks, layer by layer, as ``MQALayer.forward`` reaches them in
        a tail graph: the window-key store, the low-ratio sources, the attention."""
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
            eager_on_graph,
        )
        from sglang.srt.models.deepseek_v4 import (
            bcg_deepseek_v4_low_ratio_sources,
            deepseek_v4_attention_with_output,
        )
        from sglang.srt.models.deepseek_v4_replay_tail import bcg_tail_kv_store

        # The attention break's body itself: sglang registers it as a CUDA-only custom op.
        attention_break = eager_on_graph(True)(inspect.unwrap(deepseek_v4_attention_with_output))

        for layer in static:
            spec, buf, layer_id = layer.spec, layer.buffers, layer.spec.layer_id
            attention = SimpleNamespace(_compute_kv_to_cache=_store_fed_keys(layer_id))
            bcg_tail_kv_store(attention, buf["x"], buf["positions"], buf["kv"])
            with torch.no_grad():
                if spec.compressor is not None or spec.indexer is not None:
                    bcg_deepseek_v4_low_ratio_sources(
                        spec, buf["x"], buf["q_lora"], buf["positions"]
                    )
                attention_break(
                    buf["q"], buf["q"], buf["out"], layer_id, spec.compress_ratio, self.sinks, False
                )


_FED = ("x", "q_lora", "q", "kv")


def _rows_like(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.new_zeros((rows, *t.shape[1:]))


def _fill(
    static: Sequence[_Static],
    positions: torch.Tensor,
    calls: Sequence[LayerCall],
    garbage: float | None,
) -> None:
    """What the segments compute into the static buffers: the live rows' activations; with
    ``garbage``, the padding rows too (what a fresh bucket's pool tensors may hold)."""
    n = positions.shape[0]
    for layer, call in zip(static, calls, strict=True):
        buf = layer.buffers
        for name in _FED:
            if garbage is not None:
                buf[name].fill_(garbage)
            buf[name][:n].copy_(getattr(call, name))
        buf["positions"][:n].copy_(positions)


def _store_fed_keys(layer_id: int) -> Callable[..., None]:
    """``MQALayer._compute_kv_to_cache`` under ``SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE``:
    ``store_cache`` of the layer's normed, roped keys, here the fed ``qkv_a``."""

    def compute_kv_to_cache(x, positions, forward_batch, attn_backend, qkv_a=None) -> None:
        attn_backend.store_cache(layer_id=layer_id, swa_k=qkv_a, forward_batch=forward_batch)

    return compute_kv_to_cache
