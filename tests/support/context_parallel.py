"""Prefill context-parallel ranks of the simulated sglang host (``--enable-prefill-cp
--cp-strategy interleave``), laid out by sglang 0.5.23's own CP code.

* :func:`interleave_cp` binds sglang's interleave strategy (``init_cp_strategy``, as
  ``ServerArgs`` resolution binds it) and :func:`as_rank` enters a rank's parallel context
  (``get_parallel().override``: ``attn_cp_rank`` of ``attn_cp_size``, attention TP 1);
* :class:`CPRank` is one rank's backend: :meth:`CPRank.plan` runs sglang's
  ``prepare_cp_forward`` on the rank's copy of a batch (``attn_cp_metadata``, ``out_cache_loc``
  trimmed to the batch's tokens), plans it, and gives the rank's query rows
  (``InterleaveCPStrategy.shard_hidden_states``: tokens ``rank, rank + cp, ...``, then padding
  to the physical count); :meth:`CPRank.layer` runs a layer as the rank, the window keys and
  the compressors' projections whole (what sglang's model all-gathers) and the rest the rank's;
* :func:`gloo_rank` is one rank in a process of its own: the window keys and projections are
  the rank's rows, all-gathered by sglang's ``cp_materialize_global_token_order`` over a gloo
  group (sglang's ``attn_cp_group`` needs its distributed init; :class:`GlooCPGroup` is its
  ``all_gather_into_tensor`` on ``torch.distributed``), then handed to the backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from v41_host import SglangV41Model, V41Feed

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels import dispatch
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel
from dsv4_backend.testing.simulation.v41 import tiny_v41


@contextlib.contextmanager
def interleave_cp(size: int) -> Iterator[None]:
    """sglang's interleave strategy bound for ``size`` ranks; the process's strategy restored
    after."""
    from sglang.srt.layers.cp import base

    saved = base._STRATEGY
    base.init_cp_strategy(enable_prefill_cp=True, cp_size=size, cp_strategy="interleave")
    try:
        yield
    finally:
        base._STRATEGY = saved


def as_rank(rank: int, size: int, **parallel: Any) -> contextlib.AbstractContextManager[object]:
    """sglang's parallel context of CP rank ``rank`` of ``size`` (attention TP 1), with
    further ``parallel`` fields (e.g. ``attn_cp_group``)."""
    from sglang.srt.runtime_context import get_parallel

    # The whole topology, consistent on its own: a test before may have published another.
    return get_parallel().override(
        tp_size=size, tp_rank=rank, attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1,
        attn_dp_rank=0, attn_cp_size=size, attn_cp_rank=rank, moe_ep_size=1, moe_dp_size=1,
        moe_tp_size=size, enable_prefill_cp=True, cp_strategy="interleave",
        enable_cp_tp_group_sharing=False, **parallel,
    )  # fmt: skip


@dataclasses.dataclass
class CPRank:
    """Rank ``rank`` of ``size``: its own backend (its runner: ``tp_size = attn_cp_size =
    size``, prefill CP on) over the pool."""

    backend: DSV4AttentionBackend
    rank: int
    size: int
    parallel: dict[str, Any] = dataclasses.field(default_factory=dict)

    #: ``--enable-cp-decode-attn-tp``: batches that are not split give the rank its
    #: ``1 / size`` of the query heads (and of the sink), as sglang's model slices them.
    decode_attn_tp: bool = False

    @classmethod
    def build(
        cls,
        pool: PagedRequestPool,
        hf: dict[str, Any],
        rank: int,
        size: int,
        *,
        decode_attn_tp: bool = False,
        **parallel: Any,
    ) -> CPRank:
        runner = harness.mock_runner(pool, hf, tp_size=size, attn_cp_size=size)
        runner.server_args.enable_prefill_cp = True
        runner.server_args.enable_cp_decode_attn_tp = decode_attn_tp
        backend = DSV4AttentionBackend(runner, cache_format="dense")
        return cls(backend, rank, size, parallel, decode_attn_tp)

    def context(self) -> contextlib.AbstractContextManager[object]:
        return as_rank(self.rank, self.size, **self.parallel)

    def plan(self, step: harness.Step) -> harness.Step:
        """The rank's copy of ``step``, through sglang's ``prepare_cp_forward`` when it is a
        CP prefill, planned; its rows are the rank's query rows (``None``: padding), or
        ``step.rows`` itself for a batch that is not split (decode)."""
        from sglang.srt.layers.cp.base import get_cp_strategy
        from sglang.srt.layers.cp.utils import is_cp_active, prepare_cp_forward

        batch = dataclasses.replace(step.batch)
        with self.context():
            if not is_cp_active(batch):
                self.backend.init_forward_metadata(batch)
                return harness.Step(batch, step.rows)
            prepare_cp_forward(batch)
            self.backend.init_forward_metadata(batch)
            ids = torch.arange(1, len(step.rows) + 1)
            local = get_cp_strategy().shard_hidden_states(ids, batch) - 1  # padding: -1
        rows = [step.rows[i] if i >= 0 else None for i in local.tolist()]
        return harness.Step(batch, rows)

    def layer(
        self,
        sim: harness.SimulatedModel,
        step: harness.Step,
        local: harness.Step,
        layer: int,
        whole: harness.Feed | None = None,
    ) -> torch.Tensor:
        """Layer ``layer`` as this rank on its planned ``local`` step: its own rows, and the
        batch's window keys and projections (``whole``; default: ``step``'s feed)."""
        with self.context():
            if local.rows is step.rows:  # not split: the whole batch on every rank
                tp = harness.AttentionTPRank(self.rank, self.size) if self.decode_attn_tp else None
                return sim.layer(self.backend, local, layer, tp)
            own = sim.feed(local.rows, layer)
            whole = whole or sim.feed(step.rows, layer)
            return sim.run_feed(self.backend, local.batch, layer, whole, local=own)


def own_rows(rank: int, size: int, num_rows: int) -> list[int]:
    """The rows of the batch that are rank ``rank``'s (interleave: ``i % size == rank``)."""
    return list(range(rank, num_rows, size))


class SimulatedCPGroup:
    """sglang's ``attn_cp_group.all_gather_into_tensor`` for ranks simulated one after another
    in one process: ``world`` holds every rank's rows of the tensor being gathered (set before
    the collective), which the collective lays out rank-major, each shard zero-padded to the
    shard length; the calling rank's own shard must equal its ``world`` entry."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.world: list[torch.Tensor] = []
        self.gathers = 0

    def all_gather_into_tensor(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        own = self.world[self.rank]
        if not torch.equal(input_[: own.shape[0]], own.to(input_.dtype)):
            raise AssertionError(f"rank {self.rank} gathers rows that are not its own")
        for shard, rows in zip(output.chunk(len(self.world)), self.world, strict=True):
            shard.zero_()
            shard[: rows.shape[0]] = rows
        self.gathers += 1


def row_positions(rows: list[Any]) -> torch.Tensor:
    """``[n]`` positions of ``(request, position)`` rows (0 for padding rows, None)."""
    return torch.tensor([0 if row is None else row[1] for row in rows])


def v41_cp_forward(
    model: SglangV41Model,
    ranks: list[CPRank],
    step: harness.Step,
    planned: list[harness.Step],
    tail_tokens: list[int],
    groups: list[SimulatedCPGroup] | None = None,
) -> list[list[tuple[list[Any], torch.Tensor]]]:
    """Every layer of a DeepSeek-V4.1 CP prefill under the decoder SWA bounded replay on
    ``ranks`` (planned steps ``planned``), as sglang's ``DeepseekV4Model.forward`` drives a
    rank: each layer's window keys of every row (the model all-gathers them into the pool;
    ``store_cache`` here) and the rank's own rows otherwise; at ``late_layer_start``
    ``write_tail_source_kv`` of the rank's rows (the backend gathers every row),
    ``enter_late_layer_tail`` (the tail's CP layout), the late layers over the rank's share of
    the tail (``tail.rows``: padded to the largest share) with the window keys of the whole
    tail (the extend's rows ``tail_tokens``), then ``exit_late_layer_tail``. ``groups``: the
    simulated collectives of every rank in ``ranks``, given every rank's rows before each
    gather; None over a real CP group. Returns each rank's layers' rows and outputs."""
    late = model.config.late_layer_start
    outputs: list[list[tuple[list[Any], torch.Tensor]]] = [[] for _ in ranks]

    def gathered(layer: int, of: list[list[Any]]) -> list[V41Feed]:
        owns = [model.feed(rows, layer) for rows in of]
        for group in groups or ():
            group.world = [
                own.x[: sum(row is not None for row in rows)]
                for own, rows in zip(owns, of, strict=True)
            ]
        return owns

    def run(layer: int, of: list[list[Any]], whole: list[Any]) -> None:
        keys = model.feed(whole, layer).kv
        owns = gathered(layer, of)
        for i, (rank, local, own) in enumerate(zip(ranks, planned, owns, strict=True)):
            with rank.context():
                out = model.run_feed(
                    rank.backend, local.batch, layer, own, row_positions(of[i]), window_keys=keys
                )
            outputs[i].append((of[i], out))

    rows = [local.rows for local in planned]
    for layer in range(late):
        run(layer, rows, step.rows)
    saved, tail_rows = [], []
    for rank, local, own, mine in zip(ranks, planned, gathered(late, rows), rows, strict=True):
        with rank.context(), torch.no_grad():
            rank.backend.write_tail_source_kv(
                layer=model.layers[late], x=own.x, positions=row_positions(mine),
                forward_batch=local.batch,
            )  # fmt: skip
            saved.append(rank.backend.enter_late_layer_tail(local.batch))
        tail = rank.backend.tail_forward_metadata.late_layer_tail
        tail_rows.append([mine[j] for j in tail.token_indices.tolist()] + [None] * tail.pad_rows)
    whole_tail = [step.rows[t] for t in tail_tokens]
    for layer in range(late, len(model.layers)):
        run(layer, tail_rows, whole_tail)
    for rank, local, state in zip(ranks, planned, saved, strict=True):
        with rank.context():
            rank.backend.exit_late_layer_tail(state, local.batch)
    return outputs


class GlooCPGroup:
    """sglang's ``attn_cp_group.all_gather_into_tensor`` over the default (gloo) process
    group: the ranks' equal shards, rank-major."""

    def all_gather_into_tensor(self, output: torch.Tensor, input_: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_gather(list(output.chunk(dist.get_world_size())), input_.contiguous())


#: The gloo run's configuration, pool and batches (every process builds the same).
GLOO_CONFIG = DSV4AttentionConfig.tiny(speculative=True)
GLOO_LENS = ([0, 0, 0], [100, 131, 1])


def gloo_rank(rank: int, size: int, port: int, out_dir: str) -> None:
    """One CP rank in a process (``torch.multiprocessing.spawn``'s entry): a prefill of three
    requests, each layer's window keys and compressor projections computed from the rank's
    own rows and all-gathered by sglang's ``cp_materialize_global_token_order`` over gloo.
    Writes ``rank<r>.json``: the largest differences of the gathered tensors to the batch's,
    of the rank's rows to the full causal pass and to a single backend's rows, and whether
    the padding rows are 0; with a hash of every cache and ring."""
    import torch.distributed as dist
    from sglang.srt.layers.cp.utils import cp_materialize_global_token_order

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        with dispatch.force_path(dispatch.TORCH), interleave_cp(size):
            hf = harness.tiny_hf_config(GLOO_CONFIG)
            pool = PagedRequestPool(GLOO_CONFIG, [140, 300, 40], generator=_seeded(3))
            model = RandomModel(GLOO_CONFIG, pool, generator=_seeded(4))
            sim = harness.SimulatedModel(model)
            single = DSV4AttentionBackend(harness.mock_runner(pool, hf), cache_format="dense")
            me = CPRank.build(pool, hf, rank, size, attn_cp_group=GlooCPGroup())
            step = harness.BatchBuilder(pool).extend([0, 1, 2], *GLOO_LENS)
            single.init_forward_metadata(step.batch)
            local = me.plan(step)
            mine = own_rows(rank, size, len(step.rows))
            result: dict[str, float | bool | str] = {"gather": 0.0, "single": 0.0}
            result.update(reference=0.0, padding_zero=True)
            for layer in range(len(GLOO_CONFIG.compress_ratios)):
                want = sim.layer(single, step, layer)
                whole, own = sim.feed(step.rows, layer), sim.feed(local.rows, layer)
                gathered = {}
                with me.context():
                    for name in ("kv", "kv_score", "index_kv_score"):
                        if getattr(own, name) is not None:
                            gathered[name] = cp_materialize_global_token_order(
                                getattr(own, name), local.batch
                            )
                            diff = (gathered[name] - getattr(whole, name)).abs().max()
                            result["gather"] = max(float(result["gather"]), float(diff))
                out = me.layer(sim, step, local, layer, dataclasses.replace(whole, **gathered))
                diff = (out[: len(mine)] - want[mine]).abs().max()
                result["single"] = max(float(result["single"]), float(diff))
                err = sim.max_error(local.rows, layer, out)
                result["reference"] = max(float(result["reference"]), err)
                result["padding_zero"] = bool(result["padding_zero"]) and not out[len(mine) :].any()
            result["state"] = _state_digest(me.backend)
            result["single_state"] = _state_digest(single)
            result.update(_gloo_v41(rank, size))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


#: The DeepSeek-V4.1 of the CP tests (sglang's pool hard-codes the Flash widths), DSpark's block.
V41_CP_CONFIG = tiny_v41(
    head_dim=512, index_head_dim=128, num_heads=8, speculative=True, num_draft_tokens=5
)


def v41_cp_runner(paged: PagedRequestPool, cp: int, **server_args: Any) -> Any:
    """A ``V41_CP_CONFIG`` runner of ``cp`` prefill CP ranks (1: none) with DSpark, over sglang's
    V4.1 pool of its own."""
    from v41_host import v41_hf_config, v41_sglang_pool

    draft = V41_CP_CONFIG.num_draft_tokens
    runner = harness.mock_runner(
        paged, v41_hf_config(V41_CP_CONFIG), topk=0, speculative_algorithm="DSPARK",
        num_draft_tokens=draft, tp_size=cp, attn_cp_size=cp, **server_args,
    )  # fmt: skip
    runner.server_args.enable_prefill_cp = cp > 1
    runner.token_to_kv_pool = v41_sglang_pool(V41_CP_CONFIG, paged, draft)
    return runner


def _gloo_v41(rank: int, size: int) -> dict[str, float | bool]:
    """DeepSeek-V4.1 as one gloo rank: a CP prefill of two requests under the decoder SWA
    bounded replay (``v41_cp_forward``: the low-ratio sources' rows and the tail's gathered by
    sglang's collectives over gloo). The largest difference of the rank's rows to a single
    backend's, their mean relative error to the reference with the tail's window floors, and
    whether the padding rows are 0."""
    from v41_host import SglangV41Model

    lengths, extend, tail = (280, 150), [200, 101], V41_CP_CONFIG.window_size
    paged = PagedRequestPool(V41_CP_CONFIG, lengths, generator=_seeded(5))
    model = SglangV41Model(V41_CP_CONFIG, lengths)
    floors = [torch.zeros(n, dtype=torch.int64) for n in lengths]
    for r, n in enumerate(extend):
        floors[r][n - min(tail, n) : n] = max(0, n - tail)
    model.replay_late_layers(floors)
    replay = {"enable_decoder_swa_bounded_replay": True}
    single = DSV4AttentionBackend(v41_cp_runner(paged, 1, **replay))
    group = {"attn_cp_group": GlooCPGroup()}
    me = CPRank(DSV4AttentionBackend(v41_cp_runner(paged, size, **replay)), rank, size, group)
    step = harness.BatchBuilder(paged).extend([0, 1], [0, 0], extend)
    single.init_forward_metadata(step.batch)
    want = [dict(zip(rows, out, strict=True)) for rows, out in model.forward(single, step)]
    tail_tokens = single.tail_forward_metadata.late_layer_tail.token_indices.tolist()
    [outputs] = v41_cp_forward(model, [me], step, [me.plan(step)], tail_tokens)
    worst, relative, padding_zero = 0.0, 0.0, True
    for layer, (rows, out) in enumerate(outputs):
        real = [k for k, row in enumerate(rows) if row is not None]
        padding_zero = padding_zero and not out[len(real) :].any()
        got = out[real].float()
        expected = torch.stack([want[layer][rows[k]] for k in real]).float()
        worst = max(worst, float((got - expected).abs().max()))
        ref = torch.stack([model.expected[rows[k][0]].outputs[layer][rows[k][1]] for k in real])
        relative = max(relative, float((got - ref).abs().mean() / ref.abs().mean()))
    return {"v41_single": worst, "v41_reference": relative, "v41_padding_zero": padding_zero}


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _state_digest(backend: DSV4AttentionBackend) -> str:
    """A hash of every cache and ring's bytes (equal digests: equal state)."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(backend.state.named_tensors().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
