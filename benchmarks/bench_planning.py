"""Host cost of metadata planning per mode and batch size (a script, not a test).

For each mode (decode, extend, verify, draft step) and batch size it prints:

* ``eager ms`` — median wall time of ``plan(config, batch)`` (widths from host lengths);
* ``graph ms`` — median of the graph path, ``GraphMetadataBuffers.plan`` (the fused planner
  writing into the buffers; elsewhere ``plan(..., widths=...)`` then ``load``);
* ``checks ms`` / ``checks %`` — of the eager time, the batch checks (index ranges and write
  slots against ``req_to_token``, ``planning/checks.py``, read at once as in strict mode; the
  fused planner's one check launch where it runs);
* ``launches`` — device launches of one eager plan and of one graph-path plan
  (``LaunchCounter``: torch kernels plus Triton / TVM launches; the same on a CPU as on a GPU);
* ``graph syncs`` — host-sync ops on the graph path (must be 0; extend is not a graph kind
  but is counted too).

Uses the DeepSeek-V4-Flash attention config (index_topk 512, c4 and c128 layers), or with
``--model v41`` DeepSeek-V4.1-Flash's (c1 and c2 layers, 2048 candidate blocks).

The kernel path is ``kernels/dispatch.py``'s: on a CPU the torch planner, or with
``TRITON_INTERPRET=1`` the fused Triton planner in the interpreter (the launches a GPU runs;
its CPU times say nothing, and large batches take minutes: pass ``--batch-sizes 1 8``).

    python benchmarks/bench_planning.py [--repeat 30] [--device cpu] [--threads 1]
        [--batch-sizes 1 8 64 256] [--model v4|v41]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from dsv4_backend.config import DSV4AttentionConfig, V41Sources
from dsv4_backend.kernels.dispatch import select_path
from dsv4_backend.planning import (
    BatchView,
    DraftStep,
    ForwardKind,
    GraphMetadataBuffers,
    PlanWidths,
    plan,
    planner,
)
from dsv4_backend.planning.checks import strict_checks
from dsv4_backend.tools.op_counter import LaunchCounter

PAGE = 256
MAX_CONTEXT = 8192
BATCH_SIZES = (1, 8, 64, 256)
EXTEND_TOKENS = 32  # new tokens per request of an extend batch
DRAFT_TOKENS = 4  # verify
DRAFT_STEPS = 3


def flash_config(model: str = "v4") -> DSV4AttentionConfig:
    """DeepSeek-V4-Flash's attention config, or DeepSeek-V4.1-Flash's (``model="v41"``)."""
    if model == "v41":
        return DSV4AttentionConfig(
            compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20, index_n_heads=32,
            v41=V41Sources(
                kv_source_layers=(2, 8, 14, 20), index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
                candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8,
            ),
        )  # fmt: skip
    ratios = tuple(0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(43))
    return DSV4AttentionConfig(compress_ratios=ratios)


def make_batch(mode: str, bs: int, device: str, gen: torch.Generator) -> BatchView:
    """``bs`` requests of random lengths whose pages are scattered through the pool."""
    pages_per_req = MAX_CONTEXT // PAGE
    perm = torch.randperm(bs * pages_per_req, generator=gen).view(bs, pages_per_req)
    req_to_token = (perm[:, :, None] * PAGE + torch.arange(PAGE)).view(bs, MAX_CONTEXT).int()
    seq = torch.randint(1, MAX_CONTEXT - 64, (bs,), generator=gen)
    rows = torch.arange(bs)
    common = dict(req_pool_indices=rows, req_to_token=req_to_token)
    if mode == "decode":
        kw = dict(kind=ForwardKind.DECODE, seq_lens=seq, out_cache_loc=req_to_token[rows, seq - 1])
    elif mode == "verify":
        pos = seq[:, None] + torch.arange(DRAFT_TOKENS)
        kw = dict(
            kind=ForwardKind.TARGET_VERIFY,
            seq_lens=seq,
            num_draft_tokens=DRAFT_TOKENS,
            out_cache_loc=req_to_token[rows[:, None], pos].flatten(),
        )
    elif mode == "draft step":
        pos = seq[:, None] + torch.arange(DRAFT_STEPS)
        kw = dict(
            kind=ForwardKind.DECODE,
            seq_lens=seq,
            draft=DraftStep(topk=1, num_steps=DRAFT_STEPS, step_id=1),
            out_cache_loc=req_to_token[rows[:, None], pos].flatten(),
        )
    else:
        seq = seq + EXTEND_TOKENS
        pos = seq[:, None] - EXTEND_TOKENS + torch.arange(EXTEND_TOKENS)
        kw = dict(
            kind=ForwardKind.EXTEND,
            seq_lens=seq,
            extend_prefix_lens=(seq - EXTEND_TOKENS).tolist(),
            extend_seq_lens=[EXTEND_TOKENS] * bs,
            out_cache_loc=req_to_token[rows[:, None], pos].flatten(),
        )
    kw.update(common)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return BatchView(seq_lens_cpu=seq.tolist(), **kw)


def median_ms(fn: Callable[[], object], repeat: int, device: str) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--model", choices=("v4", "v41"), default="v4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = flash_config(args.model)
    widths = PlanWidths.for_max_len(MAX_CONTEXT)
    gen = torch.Generator().manual_seed(0)
    print(
        f"device={args.device} torch threads={torch.get_num_threads()} widths={widths} "
        f"index_topk={config.index_topk} path={select_path(args.device)}"
    )
    header = f"{'mode':<11}{'bs':>5}{'rows':>7}{'eager ms':>10}{'graph ms':>10}"
    print(header + f"{'checks ms':>11}{'checks %':>10}{'graph syncs':>13}  launches eager / graph")
    for mode in ("decode", "extend", "verify", "draft step"):
        for bs in args.batch_sizes:
            batch = make_batch(mode, bs, args.device, gen)
            rows = batch.num_rows
            bufs = GraphMetadataBuffers(
                config, max_batch_size=bs, max_rows=rows, widths=widths, device=args.device
            )

            def graph_path(batch: BatchView = batch, bufs: GraphMetadataBuffers = bufs) -> None:
                bufs.plan(batch)

            eager = median_ms(lambda batch=batch: plan(config, batch), args.repeat, args.device)
            graph = median_ms(graph_path, args.repeat, args.device)
            if planner.fuses(batch):  # the one check launch (and the layout it reads)
                layout = planner._row_layout(batch)
                run_checks = functools.partial(
                    planner.fused_checks, config, batch, layout, widths.page_table
                )
            else:
                expanded = planner._KINDS[batch.kind].expand(batch)  # the rows the checks read
                run_checks = functools.partial(
                    planner._checked_rows, config, batch, expanded, widths.page_table
                )
            with strict_checks():  # the checks' full cost: computed and read back
                checks = median_ms(run_checks, args.repeat, args.device)
            with LaunchCounter() as launches:
                plan(config, batch)
            with LaunchCounter() as graph_launches:
                graph_path()
            syncs = sum(graph_launches.syncs.values())
            print(
                f"{mode:<11}{bs:>5}{rows:>7}{eager:>10.3f}{graph:>10.3f}{checks:>11.3f}"
                f"{100 * checks / eager:>9.1f}%{syncs:>13}  "
                f"{launches.summary()} / {graph_launches.summary()}"
            )


if __name__ == "__main__":
    main()
