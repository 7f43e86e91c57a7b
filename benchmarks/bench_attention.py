"""Sparse attention: time, bytes/s, FLOP/s and fraction of the roofline, per layer kind (a script).

One decode row per request. Layer kinds: ``window`` (window-only: the request's last 128
tokens), ``ratio4`` (window + top-k c4 entries) and ``ratio128`` (window + every c128 entry of
the context). Formats: ``dense`` (bf16 caches) and ``fp8`` (sglang's 584-byte token layout).

* GPU: DeepSeek-V4-Flash shapes, H = 64, D = 512 (448 nope + 64 rope), window 128, top-k 512,
  context 8192; batches 1, 8, 32, 64, 128; ``triton.testing.do_bench`` (median, L2 flushed).
* CPU: the tiny config (H = 8, D = 128, top-k 16, context 256) through the Triton interpreter
  (this script sets ``TRITON_INTERPRET=1`` before triton is imported); the times say nothing
  about GPU speed, so only the analytic Flash-shape figures are meaningful there.

Per case, analytically:

* bytes = every row's valid keys once (fp8: 584 B per key; dense: 2 D bytes) + its index
  columns (4 B per key) + q and the output (bf16, the kernel's output for bf16 queries);
* FLOPs = 4 * rows * H * keys * D (q k^T and p v, one multiply-add = 2 FLOPs);
* roofline time = max(bytes / HBM bandwidth, FLOPs / dense bf16 tensor peak), peaks from
  ``PEAKS`` by device name (datasheet figures, dense, no sparsity); on the CPU the H200's.

The fraction of the roofline is roofline time / measured time.

Verify at attention TP: 16 and 32 heads a rank, ``draft`` rows per request (MTP verify /
draft extend) at context 8192, Flash shapes. The table (printed everywhere) gives the bytes
of three schedules: ``per-row`` (one row a program: every row gathers its own keys),
``grouped`` (the kernel's: a program takes a request's rows and walks their union list from
``kernels/attention/key_union.py``; the column counts come from running that rule on the rows' index
lists, plus 8 B of slot and row bits per union column) and ``ideal`` (a request's keys once:
window ``128 + draft - 1``, c128 entries once, c4 top-k sets identical). The c4 top-k lists
here are drawn independently per row (the worst case for sharing). FLOP/B says how far below
the ridge (bf16 peak / HBM bandwidth) a row is. ``--verify`` also times both schedules
(GPU: 16 heads at Flash shapes; CPU: the tiny config's 8 heads through the interpreter), with
the roofline fraction on the ideal bytes.

``--against flashmla``: FlashMLA's sparse fp8 decode through its variant of the op
(``kernels/attention/flashmla.py``: the sgl-flash-mla wheel sglang pins, ``use_legacy=True``
as sglang calls it for the DeepSeek-V4 layout; its time includes the variant's argument
preparation) on the same cache bytes, indices and sink, per fp8 case on a GPU: both times,
the ratio (ours / FlashMLA) and the largest output difference between the two. Where the
variant cannot run (no GPU, no ``flash_mla``, shapes it does not take) each case says why.

``--kernel`` names the attention kernels the measured and FlashMLA tables time (the default
``triton``; the opt-in ``pipelined`` and ``ws`` where they take the inputs, each skipped with
the reason elsewhere: dense caches, and for ws a CPU).

    python benchmarks/bench_attention.py [--batch 1 8 32 64 128] [--fmt dense fp8]
        [--layer window ratio4 ratio128] [--splits N] [--reps 3] [--threads 1] [--verify]
        [--kernel triton pipelined ws] [--against flashmla]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import statistics
import time
from collections.abc import Callable

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from dsv4_backend.cache import TokenCache  # noqa: E402
from dsv4_backend.config import WINDOW_PAGE_TOKENS  # noqa: E402
from dsv4_backend.kernels import dispatch  # noqa: E402
from dsv4_backend.kernels.attention.common import AttentionCall, group_rows  # noqa: E402
from dsv4_backend.kernels.attention.flashmla import (  # noqa: E402
    flashmla_schedule,
    flashmla_unsupported_reason,
    sparse_attention_flashmla,
)
from dsv4_backend.kernels.attention.key_union import key_union_torch  # noqa: E402
from dsv4_backend.kernels.attention.table import ATTENTION, variant_reason  # noqa: E402
from dsv4_backend.kernels.attention.torch import sparse_attention_torch  # noqa: E402
from dsv4_backend.kernels.attention.triton import sparse_attention_triton  # noqa: E402
from dsv4_backend.kernels.cache_store.table import store_rows  # noqa: E402

#: ``(name substring, HBM bytes/s, dense bf16 tensor FLOP/s)``, matched against
#: ``torch.cuda.get_device_name`` in order (more specific names first).
PEAKS = (
    ("H200", 4.8e12, 989e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100", 3.35e12, 989e12),  # SXM
    ("H800", 3.35e12, 989e12),
    ("H20", 4.0e12, 148e12),
    ("B200", 8.0e12, 2250e12),
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12),  # 40 GB
    ("L40S", 0.864e12, 362e12),
)
WINDOW = 128
FLASH = dict(heads=64, dim=512, topk=512, context=8192)
TINY = dict(heads=8, dim=128, topk=16, context=256)
LAYERS = ("window", "ratio4", "ratio128")


def peaks(name: str) -> tuple[str, float, float] | None:
    """``(matched key, bytes/s, FLOP/s)`` of the device ``name``, or None if not listed."""
    return next(((key, bw, fl) for key, bw, fl in PEAKS if key in name), None)


def extra_keys(layer: str, shapes: dict) -> int:
    """Compressed keys per row besides the window."""
    return {"window": 0, "ratio4": shapes["topk"], "ratio128": shapes["context"] // 128}[layer]


def key_bytes(fmt: str, dim: int) -> int:
    """Bytes one key costs: its cache row (fp8: 448 e4m3 + 64 bf16 rope + 8 scales; dense:
    bf16) and its int32 index column."""
    return (dim - 64 + 2 * 64 + 8 if fmt == "fp8" else 2 * dim) + 4


def cost(batch: int, layer: str, fmt: str, shapes: dict) -> tuple[float, float]:
    """Analytic ``(bytes, FLOPs)`` of one call (module docstring)."""
    heads, dim = shapes["heads"], shapes["dim"]
    keys = WINDOW + extra_keys(layer, shapes)
    moved = batch * (keys * key_bytes(fmt, dim) + heads * dim * (2 + 2))
    return moved, 4.0 * batch * heads * keys * dim


def verify_lists(requests: int, draft: int, layer: str, shapes: dict, g: torch.Generator):
    """Index lists of ``requests`` verify requests of ``draft`` rows each, as the planner and
    the indexer lay them out: ``(swa_idx, swa_len, ext_idx, ext_len, entries)``, request
    ``b``'s window keys at slots ``b (W + draft) ...`` and its compressed entries at
    ``b entries ...`` (``ext_*`` None on a window-only layer)."""
    rows = requests * draft
    request = torch.arange(rows) // draft
    newest = WINDOW - 1 + torch.arange(rows) % draft  # a row's own position in its window run
    swa_idx = (request[:, None] * (WINDOW + draft) + newest[:, None] - torch.arange(WINDOW)).int()
    swa_len = torch.full((rows,), WINDOW, dtype=torch.int32)
    n_extra = extra_keys(layer, shapes)
    entries = shapes["context"] // (4 if layer == "ratio4" else 128)
    if not n_extra:
        return swa_idx, swa_len, None, None, entries
    if layer == "ratio4":  # each row's own top-k, ascending entry order (the indexer's)
        picks = torch.rand(rows, entries, generator=g).argsort(dim=1)[:, :n_extra].sort(dim=1)
        ext = picks.values
    else:  # every entry
        ext = torch.arange(entries).expand(rows, entries)
    ext_idx = (request[:, None] * entries + ext).int()
    return swa_idx, swa_len, ext_idx, torch.full((rows,), n_extra, dtype=torch.int32), entries


def verify_cost(
    requests: int, draft: int, heads: int, layer: str, fmt: str, shapes: dict, g: torch.Generator
) -> dict[str, float]:
    """Analytic bytes of the three schedules of the module docstring, and the FLOPs."""
    shapes = dict(shapes, heads=heads)
    rows = requests * draft
    per_row, flops = cost(rows, layer, fmt, shapes)
    q_out = rows * heads * shapes["dim"] * (2 + 2)
    lists = verify_lists(requests, draft, layer, shapes, g)[:4]
    group = group_rows(heads, draft)
    union = key_union_torch(*lists, group)
    columns = int(union.lengths.sum())
    key = key_bytes(fmt, shapes["dim"]) - 4  # the cache row; index bytes counted apart
    grouped = columns * (key + 8) + q_out
    ideal_keys = WINDOW + draft - 1 + extra_keys(layer, shapes)
    ideal = requests * ideal_keys * key_bytes(fmt, shapes["dim"]) + q_out
    return dict(per_row=per_row, grouped=grouped, ideal=ideal, flops=flops, group=group)


def print_verify_table(bandwidth: float, flops_peak: float, formats: list[str]) -> None:
    """The verify-at-attention-TP table of the module docstring."""
    print(f"verify at attention TP, Flash shapes, analytic, roofline on the peaks above "
          f"(ridge {flops_peak / bandwidth:.0f} FLOP/B):")  # fmt: skip
    print(f"{'layer':>8} {'fmt':>5} {'heads':>5} {'reqs':>4} {'draft':>5} {'G':>2} "
          f"{'per-row MB':>10} {'grouped MB':>10} {'ideal MB':>8} {'FLOP/B':>6} "
          f"{'per-row us':>10} {'grouped us':>10} {'ideal us':>8}")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for layer in LAYERS:
        for fmt in formats:
            for heads in (16, 32):
                for requests, draft in ((8, 4), (64, 4)):
                    c = verify_cost(requests, draft, heads, layer, fmt, FLASH, g)
                    t_fl = c["flops"] / flops_peak
                    schedules = ("per_row", "grouped", "ideal")
                    t = {k: max(c[k] / bandwidth, t_fl) * 1e6 for k in schedules}
                    print(f"{layer:>8} {fmt:>5} {heads:>5} {requests:>4} {draft:>5} "
                          f"{c['group']:>2} {c['per_row'] / 1e6:10.2f} "
                          f"{c['grouped'] / 1e6:10.2f} {c['ideal'] / 1e6:8.2f} "
                          f"{c['flops'] / c['per_row']:6.0f} {t['per_row']:10.2f} "
                          f"{t['grouped']:10.2f} {t['ideal']:8.2f}")  # fmt: skip


def filled_cache(num: int, dim: int, page_tokens: int, fmt: str, device: str) -> TokenCache:
    """A ``num``-slot token cache of random keys (filling it is not what is timed)."""
    cache = TokenCache(num, dim, 64, page_tokens, fmt, torch.bfloat16, device)
    with dispatch.force_path("torch"):
        for r0 in range(0, num, 1 << 16):
            slots = torch.arange(r0, min(r0 + (1 << 16), num), device=device)
            store_rows(cache, torch.randn(len(slots), dim, device=device), slots)
    return cache


def make_verify_inputs(
    requests: int, draft: int, heads: int, layer: str, fmt: str, shapes: dict, device: str,
    g: torch.Generator,
):  # fmt: skip
    """Arguments of the op for ``requests`` verify requests of ``draft`` rows."""
    dim = shapes["dim"]
    swa_idx, swa_len, ext_idx, ext_len, entries = verify_lists(requests, draft, layer, shapes, g)
    win = filled_cache(requests * (WINDOW + draft), dim, WINDOW_PAGE_TOKENS, fmt, device)
    extra = [None, None, None]
    if ext_idx is not None:
        cache = filled_cache(requests * entries, dim, 64 if layer == "ratio4" else 2, fmt, device)
        extra = [cache, ext_idx, ext_len]
    q = torch.randn(requests * draft, heads, dim, generator=g).bfloat16()
    sink = torch.randn(heads, generator=g)
    args = (q, win, swa_idx, swa_len, *extra, sink, dim**-0.5)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def make_inputs(batch: int, layer: str, fmt: str, shapes: dict, device: str, g: torch.Generator):
    """Arguments of the op for ``batch`` decode rows of a ``layer`` layer."""
    heads, dim = shapes["heads"], shapes["dim"]
    n_extra = extra_keys(layer, shapes)
    entries = shapes["context"] // (4 if layer == "ratio4" else 128)
    win = filled_cache(batch * WINDOW, dim, WINDOW_PAGE_TOKENS, fmt, device)
    rows = torch.arange(batch)[:, None]
    swa_idx = (rows * WINDOW + torch.arange(WINDOW - 1, -1, -1)).int()
    swa_len = torch.full((batch,), WINDOW, dtype=torch.int32)
    extra = [None, None, None]
    if n_extra:  # ratio4: top-k of the row's own entries; ratio128: all of them
        cache = filled_cache(batch * entries, dim, 64 if layer == "ratio4" else 2, fmt, device)
        picks = torch.rand(batch, entries, generator=g).argsort(dim=1)[:, :n_extra]
        ext_idx = (rows * entries + picks.sort(dim=1).values).int()
        extra = [cache, ext_idx, torch.full((batch,), n_extra, dtype=torch.int32)]
    q = torch.randn(batch, heads, dim, generator=g).bfloat16()
    sink = torch.randn(heads, generator=g)
    args = (q, win, swa_idx, swa_len, *extra, sink, dim**-0.5)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def time_call(fn: Callable[[], object], reps: int) -> float:
    """Median seconds per call (GPU: ``do_bench`` over ~100 ms, L2 flushed; CPU: ``reps`` calls)."""
    if ON_GPU:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()  # warm-up (interpreter: kernel parsing)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    fn: Callable[[], torch.Tensor],
    reference: torch.Tensor,
    reps: int,
    moved: float,
    flops: float,
    matched: tuple[str, float, float] | None,
) -> tuple[float, str, float]:
    """``(seconds per call, fraction of the roofline of moved bytes and flops or "-" without
    device peaks, max |output - reference|)``."""
    diff = (fn() - reference).abs().max().item()
    sec = time_call(fn, reps)
    frac = f"{max(moved / matched[1], flops / matched[2]) / sec:.1%}" if matched else "-"
    return sec, frac, diff


def kernel_call(kernel: str, args: tuple, splits: int | None) -> tuple[Callable | None, str]:
    """``(call, "")``: attention variant ``kernel`` (``attention.table.ATTENTION``) on the
    op's ``args`` (with ``splits`` where it takes key splits); ``(None, why)`` where it does
    not run here or take them, so a table never times another variant in its place."""
    q, window, extra = args[0], args[1], args[4]
    variant = ATTENTION[kernel]
    why = variant_reason(variant, q.device, window, extra, q.shape[1], q.shape[2])
    if why is not None:
        return None, why
    takes_splits = "num_splits" in inspect.signature(variant.entry).parameters
    return functools.partial(
        variant.entry, *args, **({"num_splits": splits} if takes_splits else {})
    ), ""


def flashmla_call(args: tuple) -> Callable[[], torch.Tensor]:
    """The FlashMLA variant (``kernels/attention/flashmla.py``) on the op's ``args``, one
    schedule shared by every call (same shapes and lengths; the first call fills it)."""
    return functools.partial(sparse_attention_flashmla, *args, schedule=flashmla_schedule())


def compare_flashmla(opts, shapes: dict, device: str, g: torch.Generator) -> None:
    """The ``--against flashmla`` table (module docstring)."""
    print("against flashmla (sparse fp8 decode, use_legacy=True): ratio = ours / flashmla")
    print(f"{'layer':>8} {'batch':>5} {'kernel':>16} {'ours us':>9} {'flashmla us':>11} "
          f"{'ratio':>6} {'max|ours-fm|':>12} {'max|fm-ref|':>11}")  # fmt: skip
    for layer in opts.layer:
        for batch in opts.batch or [8, 64, 128]:
            args = make_inputs(batch, layer, "fp8", shapes, device, g)
            q, window, extra = args[0], args[1], args[4]
            why = flashmla_unsupported_reason(q.device, window, extra, q.shape[1], q.shape[2])
            if why is not None:
                print(f"{layer:>8} {batch:>5} {'flashmla':>16}  skipped: {why}")
                continue
            theirs = flashmla_call(args)
            fm = theirs().float()
            ref_diff = (fm - sparse_attention_torch(AttentionCall.of(*args))).abs().max().item()
            t_fm = time_call(theirs, opts.reps)
            for kernel in opts.kernel:
                ours, why = kernel_call(kernel, args, opts.splits)
                if ours is None:
                    print(f"{layer:>8} {batch:>5} {kernel:>16}  skipped: {why}")
                    continue
                diff = (ours().float() - fm).abs().max().item()
                t_ours = time_call(ours, opts.reps)
                print(f"{layer:>8} {batch:>5} {kernel:>16} {t_ours * 1e6:9.1f} {t_fm * 1e6:11.1f} "
                      f"{t_ours / t_fm:6.2f} {diff:12.2e} {ref_diff:11.2e}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+")
    parser.add_argument("--fmt", nargs="+", default=["dense", "fp8"], choices=["dense", "fp8"])
    parser.add_argument("--layer", nargs="+", default=list(LAYERS), choices=LAYERS)
    parser.add_argument("--splits", type=int, help="key splits (default: the launcher's choice)")
    parser.add_argument("--reps", type=int, default=3, help="CPU timing calls")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--verify", action="store_true", help="also time verify rows at TP")
    parser.add_argument("--against", choices=["flashmla"], help="also time FlashMLA's kernel")
    parser.add_argument("--kernel", nargs="+", default=[ATTENTION.names[0]],
                        choices=[*ATTENTION.names, "all"],
                        help="attention variants to time (default: the first of the table; "
                             "all: every one)")  # fmt: skip
    opts = parser.parse_args()
    if "all" in opts.kernel:
        opts.kernel = list(ATTENTION.names)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = "cuda" if ON_GPU else "cpu"
    name = torch.cuda.get_device_name() if ON_GPU else "CPU (Triton path = interpreter)"
    shapes = FLASH if ON_GPU else TINY
    batches = opts.batch or ([1, 8, 32, 64, 128] if ON_GPU else [1, 4])
    matched = peaks(name) if ON_GPU else peaks("H200")
    if matched:
        key, bandwidth, flops = matched
        print(f"device: {name}; roofline peaks of '{key}': {bandwidth / 1e12:.2f} TB/s HBM, "
              f"{flops / 1e12:.0f} TFLOP/s dense bf16")  # fmt: skip
    else:
        print(f"device: {name}; not in PEAKS: no roofline fraction")
    if not ON_GPU:
        print("Flash shapes, analytic (no GPU here), roofline on an H200:")
        print(
            f"{'layer':>8} {'fmt':>5} {'batch':>5} {'MB':>8} {'GFLOP':>8} {'roofline us':>11} bound"
        )
        for layer in opts.layer:
            for fmt in opts.fmt:
                for batch in [1, 8, 32, 64, 128]:
                    moved, fl = cost(batch, layer, fmt, FLASH)
                    t_mem, t_fl = moved / bandwidth, fl / flops
                    bound = "memory" if t_mem > t_fl else "tensor"
                    print(f"{layer:>8} {fmt:>5} {batch:>5} {moved / 1e6:8.2f} {fl / 1e9:8.2f} "
                          f"{max(t_mem, t_fl) * 1e6:11.2f} {bound}")  # fmt: skip
        matched = None  # interpreter times have no roofline
    table_peaks = matched or peaks("H200")
    if table_peaks:
        print_verify_table(table_peaks[1], table_peaks[2], opts.fmt)
    print(f"measured: shapes {shapes}, window {WINDOW}; dense caches are bf16")
    print(f"{'layer':>8} {'fmt':>5} {'batch':>5} {'path':>16} {'time us':>10} {'GB/s':>9} "
          f"{'TFLOP/s':>8} {'roofline':>8}  max|diff|")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for layer in opts.layer:
        for fmt in opts.fmt:
            for batch in batches:
                args = make_inputs(batch, layer, fmt, shapes, device, g)
                moved, fl = cost(batch, layer, fmt, shapes)
                reference = sparse_attention_torch(AttentionCall.of(*args))
                calls = [("torch", functools.partial(sparse_attention_torch, *args), "")]
                calls += [(k, *kernel_call(k, args, opts.splits)) for k in opts.kernel]
                for path, fn, why in calls:
                    if fn is None:
                        print(f"{layer:>8} {fmt:>5} {batch:>5} {path:>16}  skipped: {why}")
                        continue
                    sec, frac, diff = measure(fn, reference, opts.reps, moved, fl, matched)
                    print(f"{layer:>8} {fmt:>5} {batch:>5} {path:>16} {sec * 1e6:10.1f} "
                          f"{moved / sec / 1e9:9.3g} {fl / sec / 1e12:8.3g} {frac:>8}  "
                          f"{diff:.2e}")  # fmt: skip
    if opts.verify:
        time_verify(opts, shapes, device, matched, g)
    if opts.against == "flashmla":
        compare_flashmla(opts, shapes, device, g)


def time_verify(opts, shapes: dict, device: str, matched, g: torch.Generator) -> None:
    """Verify rows at attention TP, one row a program against a request's rows together."""
    heads = 16 if ON_GPU else shapes["heads"]
    requests, draft = (64, 4) if ON_GPU else (2, 4)
    print(f"measured verify: {requests} requests x {draft} rows, {heads} heads; roofline on "
          "the ideal bytes")  # fmt: skip
    print(f"{'layer':>8} {'fmt':>5} {'schedule':>8} {'time us':>10} {'roofline':>8}  max|diff|")
    for layer in opts.layer:
        for fmt in opts.fmt:
            args = make_verify_inputs(requests, draft, heads, layer, fmt, shapes, device, g)
            c = verify_cost(requests, draft, heads, layer, fmt, shapes, g)
            reference = sparse_attention_torch(AttentionCall.of(*args))
            for schedule, rows in (("per-row", 1), ("grouped", draft)):
                fn = functools.partial(
                    sparse_attention_triton, *args, num_splits=opts.splits, rows_per_group=rows
                )
                sec, frac, diff = measure(fn, reference, opts.reps, c["ideal"], c["flops"], matched)
                print(f"{layer:>8} {fmt:>5} {schedule:>8} {sec * 1e6:10.1f} {frac:>8}  "
                      f"{diff:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
