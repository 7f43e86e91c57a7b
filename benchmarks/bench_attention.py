"""Decode sparse attention: torch path vs Triton path, time and memory bandwidth (a script).

One decode row per request, a c4 layer: ``window`` keys (the request's last 128 tokens) plus
``topk`` random c4 entries of its context. Shapes:

* GPU: DeepSeek-V4-Flash, H = 64, D = 512 (448 nope + 64 rope), window 128 + top-k 512,
  bf16 dense and fp8 caches; times with ``triton.testing.do_bench`` (median).
* CPU: the tiny config, H = 8, D = 128, window 128 + top-k 16. The Triton path runs in the
  interpreter (this script sets ``TRITON_INTERPRET=1`` when no GPU is visible, before triton is
  imported), so its CPU time says nothing about GPU speed.

Bandwidth = bytes of the keys gathered (each row's valid keys once; fp8: data + scale bytes) +
q + the fp32 output, divided by the time; on a GPU also as a fraction of the device's peak
(``PEAK_BANDWIDTH``, 'unknown' for devices not listed).

    python benchmarks/bench_attention.py [--batch 1 8 32 128] [--fmt dense fp8] [--reps 3]
        [--threads 1]
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

from dsv4_backend.cache import TokenCache  # noqa: E402
from dsv4_backend.kernels import dispatch  # noqa: E402
from dsv4_backend.kernels.cache_store import store_rows  # noqa: E402
from dsv4_backend.kernels.sparse_attention import (  # noqa: E402
    sparse_attention_torch,
    sparse_attention_triton,
)

#: Peak HBM bandwidth in bytes/s, matched as a substring of ``torch.cuda.get_device_name``
#: (first match wins, so the more specific names come first).
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM
    ("H800", 3.35e12),
    ("H20", 4.0e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # 40 GB
    ("L40S", 0.864e12),
)
WINDOW = 128


def peak_bandwidth(name: str) -> float | None:
    return next((peak for key, peak in PEAK_BANDWIDTH if key in name), None)


def make_inputs(batch: int, fmt: str, shapes: dict, device: str, g: torch.Generator):
    """Arguments of the op for ``batch`` decode rows and the bytes one call must move."""
    heads, dim, topk, context = shapes["heads"], shapes["dim"], shapes["topk"], shapes["context"]
    entries = context // 4
    win = TokenCache(batch * WINDOW, dim, 64, 128, fmt, torch.bfloat16, device)
    ext = TokenCache(batch * entries, dim, 64, 64, fmt, torch.bfloat16, device)
    with dispatch.force_path("torch"):  # filling the caches is not what is timed
        slots = torch.arange(win.num_slots, device=device)
        store_rows(win, torch.randn(win.num_slots, dim, device=device), slots)
        for r0 in range(0, ext.num_slots, 1 << 16):
            slots = torch.arange(r0, min(r0 + (1 << 16), ext.num_slots), device=device)
            store_rows(ext, torch.randn(len(slots), dim, device=device), slots)
    # Row b: window slots of its positions p ... p-127, then top-k of its own c4 entries.
    rows = torch.arange(batch)[:, None]
    swa_idx = (rows * WINDOW + torch.arange(WINDOW - 1, -1, -1)).int()
    picks = torch.rand(batch, entries, generator=g).argsort(dim=1)[:, :topk]
    ext_idx = (rows * entries + picks).int()
    q = torch.randn(batch, heads, dim, generator=g).bfloat16()
    sink = torch.randn(heads, generator=g)
    swa_len = torch.full((batch,), WINDOW, dtype=torch.int32)
    ext_len = torch.full((batch,), topk, dtype=torch.int32)
    args = (q, win, swa_idx, swa_len, ext, ext_idx, ext_len, sink, dim**-0.5)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    key_bytes = win.layout.bytes_per_token if fmt == "fp8" else dim * 2
    moved = batch * ((WINDOW + topk) * key_bytes + heads * dim * (q.element_size() + 4))
    return args, moved


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+")
    parser.add_argument("--fmt", nargs="+", default=["dense", "fp8"], choices=["dense", "fp8"])
    parser.add_argument("--reps", type=int, default=3, help="CPU timing calls")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = "cuda" if ON_GPU else "cpu"
    if ON_GPU:
        shapes = dict(heads=64, dim=512, topk=512, context=8192)
        batches = opts.batch or [1, 8, 32, 128]
        name = torch.cuda.get_device_name()
    else:
        shapes = dict(heads=8, dim=128, topk=16, context=256)
        batches = opts.batch or [1, 4, 16]
        name = "CPU (Triton path = interpreter)"
    peak = peak_bandwidth(name)
    print(f"device: {name}; peak bandwidth: {f'{peak / 1e12:.2f} TB/s' if peak else 'unknown'}")
    print(f"shapes: {shapes}, window {WINDOW}; dense caches are bf16")
    print(
        f"{'batch':>5} {'fmt':>5} {'path':>6} {'time us':>10} {'GB/s':>9} {'of peak':>8}  max|diff|"
    )
    g = torch.Generator().manual_seed(0)
    for fmt in opts.fmt:
        for batch in batches:
            args, moved = make_inputs(batch, fmt, shapes, device, g)
            outs = {}
            for path, fn in (
                ("torch", sparse_attention_torch),
                ("triton", sparse_attention_triton),
            ):
                outs[path] = fn(*args)
                sec = time_call(lambda fn=fn, args=args: fn(*args), opts.reps)
                frac = f"{moved / sec / peak:8.1%}" if peak else f"{'unknown':>8}"
                diff = (outs[path] - outs["torch"]).abs().max().item()
                print(
                    f"{batch:>5} {fmt:>5} {path:>6} {sec * 1e6:10.1f} {moved / sec / 1e9:9.3g} "
                    f"{frac}  {diff:.2e}"
                )


if __name__ == "__main__":
    main()
