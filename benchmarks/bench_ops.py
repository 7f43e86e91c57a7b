"""Throughput of every op of one decode step, per kernel path (a script, not a test).

A decode batch of ``--batch`` requests at context ``--context`` is planned once; then each op of
``dsv4_backend.compute`` runs on it: the window-key store, the c4 and c128 compressors, the
indexer compressor and lightning indexer, and sparse attention with sink on a window-only, a c4
and a c128 layer. Cache contents are whatever earlier calls left (zeros at first): timings do
not depend on the values. Per op, batch and path it prints the time per call (host and device
together), rows per second, and the device launches per call (``LaunchCounter``: torch
kernels, Triton and other launches; the same count on a CPU as on a GPU).

* GPU: DeepSeek-V4-Flash attention shapes (H = 64, D = 512, top-k 512, indexer 64 x 128), FP8
  caches, the compiled Triton path; times are medians of ``triton.testing.do_bench``.
* CPU: the tiny configuration, dense caches; the torch path, and the Triton path in the
  interpreter (this script sets ``TRITON_INTERPRET=1`` when no GPU is visible), whose times say
  nothing about GPU speed.

* ``--against deep_gemm``: instead, the lightning indexer's scores beside DeepGEMM's
  ``fp8_paged_mqa_logits`` through its variant of the op (``kernels/indexer/deep_gemm.py``: the
  ``sgl-deep-gemm`` wheel sglang pins, called as sglang's DeepSeek-V4 indexer calls it; its
  time includes the variant's query quantisation and masking) on the same FP8 keys and page
  tables, with queries already e4m3 per (row, head), as ``indexer_selection="fp8"`` gives them:
  the largest score difference and the time of each. Where the variant cannot run (no CUDA
  device, no deep_gemm) it says why and exits with status 0.

    python benchmarks/bench_ops.py [--batch 1 8 32] [--context 600] [--reps 5] [--threads 1]
    python benchmarks/bench_ops.py --against deep_gemm [--batch 64] [--context 8192]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from dsv4_backend.compute import (  # noqa: E402
    AttentionState,
    attend,
    compress_and_store,
    select_c4_entries,
    store_window_keys,
)
from dsv4_backend.config import DSV4AttentionConfig  # noqa: E402
from dsv4_backend.kernels.dispatch import (  # noqa: E402
    TORCH,
    TRITON,
    TRITON_INTERPRETER,
    force_path,
)
from dsv4_backend.planning import plan  # noqa: E402
from dsv4_backend.testing.simulation import PagedRequestPool  # noqa: E402
from dsv4_backend.tools.op_counter import LaunchCounter  # noqa: E402

#: Layers: 0 window only, 1 ratio 4, 2 ratio 128.
RATIOS = (0, 4, 128)


def _time(fn: Callable[[], object], reps: int) -> float:
    """Median seconds per call."""
    if ON_GPU:
        import triton.testing

        return triton.testing.do_bench(fn, rep=50 * reps, return_mode="median") / 1e3
    fn()  # warm up (interpreter set-up, first allocations)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ops(config: DSV4AttentionConfig, batch: int, context: int, device: str, fmt: str):
    """``name -> zero-argument callable`` for every op of one decode step."""
    generator = torch.Generator().manual_seed(0)
    pool = PagedRequestPool(config, [context] * batch, generator=generator, device=device)
    state = AttentionState.allocate(
        config,
        num_full_slots=pool.num_full_slots,
        num_swa_slots=pool.num_full_slots,
        num_request_slots=batch + 1,
        fmt=fmt,  # type: ignore[arg-type]
        dtype=torch.bfloat16 if ON_GPU else torch.float32,
        device=device,
    )
    view = pool.decode(list(range(batch)), [context] * batch)
    metadata = plan(config, view)
    h, d, hi, di = config.num_heads, config.head_dim, config.index_n_heads, config.index_head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    rows, req = metadata.num_rows, view.req_pool_indices
    q, kv, sink = randn(rows, h, d), randn(rows, d), randn(h)
    c4 = (randn(rows, 2 * d), randn(rows, 2 * d), randn(4, 2 * d), randn(d))
    c128 = (randn(rows, d), randn(rows, d), randn(128, d), randn(d))
    index = (randn(rows, 2 * di), randn(rows, 2 * di), randn(4, 2 * di), randn(di))
    index_q, index_w = randn(rows, hi, di), randn(rows, hi).abs()
    return {
        "store window keys": lambda: store_window_keys(state, 0, metadata, kv),
        "compressor c4": lambda: compress_and_store(state, 1, metadata, req, *c4),
        "compressor c128": lambda: compress_and_store(state, 2, metadata, req, *c128),
        "indexer compressor": lambda: compress_and_store(
            state, 1, metadata, req, *index, indexer=True
        ),
        "indexer (scores+top-k)": lambda: select_c4_entries(state, 1, metadata, index_q, index_w),
        "attention window": lambda: attend(state, 0, metadata, q, sink),
        "attention c4": lambda: attend(state, 1, metadata, q, sink),
        "attention c128": lambda: attend(state, 2, metadata, q, sink),
    }


def compare_deep_gemm(batches: list[int], context: int, reps: int) -> None:
    """Indexer scores against DeepGEMM's paged MQA logits (see the module docstring)."""
    from dsv4_backend.cache.indexer_cache import IndexerKeyCache
    from dsv4_backend.kernels.indexer.deep_gemm import deep_gemm_unsupported_reason

    config = DSV4AttentionConfig(compress_ratios=RATIOS)
    hi, di = config.index_n_heads, config.index_head_dim
    device = torch.device("cuda" if ON_GPU else "cpu")
    probe = IndexerKeyCache(64, di, "fp8", device=device)  # the state's geometry, one page
    why = deep_gemm_unsupported_reason(device, probe, hi, di, "fp8")
    if why is not None:
        print(f"--against deep_gemm: {why}; nothing compared")
        return
    print(
        f"indexer scores against deep_gemm.fp8_paged_mqa_logits: context={context} HI={hi} DI={di}"
    )
    print(f"{'batch':>5} {'ours us':>9} {'deep_gemm us':>13} {'max |diff| / max |score|':>26}")
    for batch in batches:
        ours_s, theirs_s, diff = _compare_batch(config, batch, context, reps)
        print(f"{batch:5d} {ours_s * 1e6:9.1f} {theirs_s * 1e6:13.1f} {diff:26.2e}")


def _compare_batch(
    config: DSV4AttentionConfig, batch: int, context: int, reps: int
) -> tuple[float, float, float]:
    """Seconds a call of our scores and of the DeepGEMM variant
    (``kernels/indexer/deep_gemm.py``), and their largest difference relative to the largest
    score, on one decode batch."""
    from dsv4_backend.kernels.cache_store.table import store_rows
    from dsv4_backend.kernels.indexer.bounded import row_scores_triton
    from dsv4_backend.kernels.indexer.common import IndexCall, c4_entry_slots
    from dsv4_backend.kernels.indexer.deep_gemm import index_scores_deep_gemm, paged_mqa_schedule
    from dsv4_backend.kernels.indexer.fp8 import e4m3_round_trip
    from dsv4_backend.kernels.variants import force_unverified

    hi, di = config.index_n_heads, config.index_head_dim
    generator = torch.Generator().manual_seed(0)
    pool = PagedRequestPool(config, [context] * batch, generator=generator, device="cuda")
    state = AttentionState.allocate(
        config, num_full_slots=pool.num_full_slots, num_swa_slots=pool.num_full_slots,
        num_request_slots=batch + 1, fmt="fp8", dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    metadata = plan(config, pool.decode(list(range(batch)), [context] * batch))
    assert metadata.c4 is not None  # RATIOS has c4 layers
    cache, num = state.pools.indexer(1), metadata.c4.topk_lengths_raw
    page_table, width = metadata.page_table, int(num.max())
    entries = torch.arange(width, device="cuda").expand(batch, width)
    valid = entries < num[:, None]
    slots = c4_entry_slots(page_table, torch.where(valid, entries, -1))
    store_rows(cache, torch.randn(slots.numel(), di, device="cuda"), slots.reshape(-1))
    # e4m3 values on sglang's per-(row, head) scale, as indexer_selection="fp8" hands them
    # over: the variant's own quantisation keeps them, so both score the same queries.
    q = e4m3_round_trip(torch.randn(batch, hi, di, device="cuda"))
    weights = torch.rand(batch, hi, device="cuda") * (hi * di) ** -0.5
    ours = torch.empty(batch, width, device="cuda")
    schedule = paged_mqa_schedule(num, width)  # built once a forward, as sglang does

    call = IndexCall.of(q, weights, cache, page_table, num, width)

    def run_ours() -> None:
        row_scores_triton(call, ours)

    def run_deep_gemm() -> torch.Tensor:
        return index_scores_deep_gemm(call, schedule=schedule)

    with force_unverified(True):
        run_ours()
        theirs = run_deep_gemm()
        diff = float((ours - theirs).abs()[valid].max() / theirs.abs()[valid].max())
        return _time(run_ours, reps), _time(run_deep_gemm, reps), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32] if ON_GPU else [1, 8])
    parser.add_argument("--context", type=int, default=4096 if ON_GPU else 600)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--against", choices=["deep_gemm"], help="compare the indexer with another library"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.against == "deep_gemm":
        compare_deep_gemm(args.batch, args.context, args.reps)
        return
    if ON_GPU:
        config = DSV4AttentionConfig(compress_ratios=RATIOS)
        device, fmt, paths = "cuda", "fp8", [TRITON]
    else:
        config = DSV4AttentionConfig.tiny(compress_ratios=RATIOS)
        device, fmt, paths = "cpu", "dense", [TORCH, TRITON_INTERPRETER]
    name = torch.cuda.get_device_name() if ON_GPU else "cpu"
    print(
        f"device={name} fmt={fmt} context={args.context} H={config.num_heads} "
        f"D={config.head_dim} topk={config.index_topk} threads={torch.get_num_threads()}"
    )
    print(f"{'op':24} {'batch':>5} {'path':>18} {'us/call':>12} {'rows/s':>12}  launches")
    for batch in args.batch:
        ops = _ops(config, batch, args.context, device, fmt)
        for op, fn in ops.items():
            for path in paths:
                with force_path(path):
                    seconds = _time(fn, args.reps)
                    with LaunchCounter() as launches:
                        fn()
                print(f"{op:24} {batch:5d} {path:>18} {seconds * 1e6:12.1f} "
                      f"{batch / seconds:12.0f}  {launches.summary()}")  # fmt: skip


if __name__ == "__main__":
    main()
