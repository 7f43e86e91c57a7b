"""A DSpark draft head over the requests of a target's pool: its window-only stages served
through ``plan_dspark_block``, the caches and the kernels, with the reference rows
(``reference_dspark_block``) each output must equal.

What sglang's DSpark worker does each round, as this simulator does it:

1. **KV inject.** The committed tokens' draft keys (projected from the target's hidden states,
   one key per stage) are written to the draft's window cache at the tokens' window slots
   (``inject``): after a prefill, its tokens; after a verify, the anchor and the accepted
   drafts, overwriting the block keys the draft block left at those slots.
2. **Draft block** (``block``): ``g`` rows per request at ``L ... L + g - 1``, each stage writes
   the block's keys at the slots the target's verify of the block writes next, then attends
   to the last ``W`` committed keys and the whole block.
3. The target verifies ``g + 1`` tokens (a TARGET_VERIFY of the target model, not simulated
   here) and accepts some; rejected positions keep stale block keys until the next block
   overwrites them, and no later block sees them (its context ends at its own ``L``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dsv4_backend import ops
from dsv4_backend.cache.state import AttentionState
from dsv4_backend.compute import forward_layer
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.planning import (
    AttentionMetadata,
    BatchView,
    ForwardKind,
    GraphMetadataBuffers,
    PlanWidths,
    dspark_swa_width,
    plan_dspark_block,
)
from dsv4_backend.self_check.requests import PagedRequestPool
from dsv4_backend.testing.reference import make_random_layer, reference_dspark_block
from dsv4_backend.testing.simulation.model import timed

#: Window-only attention stages of the DSpark draft head of the official checkpoints.
NUM_STAGES = 3


@dataclass(frozen=True)
class BlockResult:
    """One draft block: per stage, the real rows' outputs and the reference's.

    Attributes
    ----------
    metadata : the plan the stages ran with (graph: the loaded buffers' views).
    rows : ``(request, position)`` of each real row, in row order.
    outputs, expected : per stage ``[T_real, H, D]`` float32 on the CPU.
    """

    metadata: AttentionMetadata
    rows: list[tuple[int, int]]
    outputs: list[torch.Tensor]
    expected: list[torch.Tensor]

    def max_error(self) -> float:
        return max(
            ((o - e).abs().max().item() for o, e in zip(self.outputs, self.expected, strict=True)),
            default=0.0,
        )


@dataclass(frozen=True)
class StageInputs:
    """One stage's block rows: ``q`` ``[T, H, D]``, ``kv`` ``[T, D]`` (the block's keys),
    ``sink`` ``[H]`` and the reference's ``expected`` ``[T, H, D]`` float32."""

    q: torch.Tensor
    kv: torch.Tensor
    sink: torch.Tensor
    expected: torch.Tensor

    def padded(self, num_rows: int) -> StageInputs:
        """The rows followed by zero rows up to ``num_rows`` (graph padding)."""
        pad = num_rows - self.q.shape[0]
        return dataclasses.replace(
            self,
            q=torch.cat([self.q, self.q.new_zeros(pad, *self.q.shape[1:])]),
            kv=torch.cat([self.kv, self.kv.new_zeros(pad, self.kv.shape[1])]),
        )


def draft_config(config: DSV4AttentionConfig, num_stages: int = NUM_STAGES) -> DSV4AttentionConfig:
    """The draft head's attention configuration: ``num_stages`` window-only layers
    (``layer_id = stage_id``), the target's widths."""
    return dataclasses.replace(config, compress_ratios=(0,) * num_stages)


def graph_rows(num_rows: int) -> int:
    """The graph bucket of ``num_rows`` rows: the next power of two."""
    return 1 << max(0, num_rows - 1).bit_length()


class DSparkDraft:
    """The draft stages of one pool's requests (module docstring).

    Parameters
    ----------
    config : the target model's attention configuration.
    pool : the target's request pool (the draft shares ``req_to_token`` and ``full_to_swa``).
    block_size : ``g``, draft rows per request and block (sglang: ``num_draft_tokens - 1``).
    generator : draws the committed keys and the sinks.
    fmt : window cache format, ``"dense"`` or ``"fp8"``.
    state : the caches to serve (e.g. an sglang adapter backend's); None allocates them.
    """

    def __init__(
        self,
        config: DSV4AttentionConfig,
        pool: PagedRequestPool,
        *,
        block_size: int,
        generator: torch.Generator,
        fmt: str = "dense",
        device: torch.device | str = "cpu",
        num_stages: int = NUM_STAGES,
        state: AttentionState | None = None,
    ) -> None:
        self.config = draft_config(config, num_stages)
        self.pool = pool
        self.block_size = block_size
        self.device = torch.device(device)
        self.context_kv: list[list[torch.Tensor]] = []  # [stage][request] [max_len, D]
        self.sinks: list[torch.Tensor] = []
        for _ in range(num_stages):
            layers = [make_random_layer(self.config, 0, n, generator) for n in pool.max_lens]
            self.context_kv.append([inputs.kv for inputs, _ in layers])
            self.sinks.append(layers[0][1].sink)
        self.state = state or AttentionState.allocate(
            self.config,
            num_full_slots=pool.num_full_slots,
            num_swa_slots=pool.num_full_slots,
            num_request_slots=pool.num_requests + 1,
            fmt=fmt,  # type: ignore[arg-type]
            device=self.device,
        )
        self._buffers: GraphMetadataBuffers | None = None
        #: Per request, the positions below which its committed keys are injected.
        self.injected = [0] * pool.num_requests

    @property
    def swa_width(self) -> int:
        return dspark_swa_width(self.config, self.block_size)

    def inject(self, request: int, positions: Sequence[int]) -> None:
        """KV inject: write the committed ``positions``' draft keys of every stage."""
        if not positions:
            return
        slots = self.pool.full_to_swa[self.pool.slots(request, positions)]
        index = torch.tensor(list(positions), dtype=torch.long)
        for stage, per_request in enumerate(self.context_kv):
            kv = per_request[request][index].to(self.device)
            store_rows(self.state.pools.window(stage), kv, slots)

    def commit(self, requests: Sequence[int], seq_lens: Sequence[int]) -> None:
        """KV inject of every committed position not injected yet: ``request`` has committed
        ``seq_lens`` tokens (a prefill's, or a verify's anchor and accepted drafts)."""
        for request, length in zip(requests, seq_lens, strict=True):
            self.inject(request, range(self.injected[request], length))
            self.injected[request] = max(self.injected[request], length)

    def buffers(self, max_rows: int) -> GraphMetadataBuffers:
        """The graph buffers, grown to ``max_rows`` rows when needed."""
        if self._buffers is None or self._buffers.max_rows < max_rows:
            self._buffers = GraphMetadataBuffers(
                self.config,
                max_batch_size=max_rows,
                max_rows=max_rows,
                widths=PlanWidths.for_max_len(self.pool.max_context, self.config.page_size),
                device=self.device,
                swa_width=self.swa_width,
            )
        return self._buffers

    def view(
        self, requests: Sequence[int], seq_lens: Sequence[int], *, dp_pad: int = 0
    ) -> BatchView:
        """The block's batch (``DSPARK_BLOCK``) at committed lengths ``seq_lens``, with
        ``dp_pad`` data-parallel padding requests appended."""
        view = self.pool.verify(requests, seq_lens, self.block_size, kind=ForwardKind.DSPARK_BLOCK)
        return self.pool.pad_requests(view, dp_pad) if dp_pad else view

    def plan(self, view: BatchView, *, graph: bool = False) -> AttentionMetadata:
        """The block's plan: eager, or loaded into the graph buffers padded to a bucket."""
        if not graph:
            return plan_dspark_block(self.config, view)
        buffers = self.buffers(graph_rows(view.num_rows))
        metadata = plan_dspark_block(self.config, view, widths=buffers.widths)
        return buffers.load(metadata, num_rows=graph_rows(view.num_rows))

    def block_inputs(
        self, requests: Sequence[int], seq_lens: Sequence[int], *, seed: int
    ) -> list[StageInputs]:
        """Per stage, a block's queries and keys at committed lengths ``seq_lens`` (drawn
        from ``seed``: equal seeds, equal data) and the reference's output rows."""
        g = self.block_size
        generator = torch.Generator().manual_seed(seed)
        stages = []
        for stage, sink in enumerate(self.sinks):
            blocks = [make_random_layer(self.config, 0, g, generator)[0] for _ in requests]
            expected = [
                reference_dspark_block(self.config, b.q, self.context_kv[stage][r][:s], b.kv, sink)
                for b, r, s in zip(blocks, requests, seq_lens, strict=True)
            ]
            q, kv = torch.cat([b.q for b in blocks]), torch.cat([b.kv for b in blocks])
            stages.append(StageInputs(q=q, kv=kv, sink=sink, expected=torch.cat(expected)))
        return stages

    def block(
        self,
        requests: Sequence[int],
        seq_lens: Sequence[int],
        *,
        seed: int,
        graph: bool = False,
        dp_pad: int = 0,
        planner: Callable[[BatchView], AttentionMetadata] | None = None,
        timings: dict[str, float] | None = None,
    ) -> BlockResult:
        """Run one draft block at committed lengths ``seq_lens`` through ``forward_layer``
        (``block_inputs``' data); ``planner`` replaces ``plan`` (negative controls);
        ``timings`` gains the seconds of planning and of the stages (``RandomModel.forward``)."""
        view = self.view(requests, seq_lens, dp_pad=dp_pad)
        with timed(timings, "plan", self.device):
            metadata = self.plan(view, graph=graph) if planner is None else planner(view)
        g = self.block_size
        rows = [(r, s + i) for r, s in zip(requests, seq_lens, strict=True) for i in range(g)]
        stages = self.block_inputs(requests, seq_lens, seed=seed)
        outputs = []
        for stage, inputs in enumerate(stages):
            padded = inputs.padded(metadata.num_rows)
            layer_inputs = ops.LayerInputs(q=padded.q.to(self.device), kv=padded.kv.to(self.device))
            with timed(timings, "kernels", self.device):
                out = forward_layer(
                    self.state,
                    stage,
                    metadata,
                    view.req_pool_indices,
                    layer_inputs,
                    ops.LayerParams(sink=inputs.sink.to(self.device)),
                )
            outputs.append(out[: len(rows)].cpu())
        expected = [inputs.expected for inputs in stages]
        return BlockResult(metadata=metadata, rows=rows, outputs=outputs, expected=expected)
