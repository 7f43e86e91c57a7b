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
  columns (4 B per key) + q (bf16) + the fp32 output;
* FLOPs = 4 * rows * H * keys * D (q k^T and p v, one multiply-add = 2 FLOPs);
* roofline time = max(bytes / HBM bandwidth, FLOPs / dense bf16 tensor peak), peaks from
  ``PEAKS`` by device name (datasheet figures, dense, no sparsity); on the CPU the H200's.

The fraction of the roofline is roofline time / measured time.

    python benchmarks/bench_attention.py [--batch 1 8 32 64 128] [--fmt dense fp8]
        [--layer window ratio4 ratio128] [--splits N] [--reps 3] [--threads 1]
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


def cost(batch: int, layer: str, fmt: str, shapes: dict) -> tuple[float, float]:
    """Analytic ``(bytes, FLOPs)`` of one call (module docstring)."""
    heads, dim = shapes["heads"], shapes["dim"]
    keys = WINDOW + extra_keys(layer, shapes)
    key_bytes = dim - 64 + 2 * 64 + 8 if fmt == "fp8" else 2 * dim
    moved = batch * (keys * (key_bytes + 4) + heads * dim * (2 + 4))
    return moved, 4.0 * batch * heads * keys * dim


def make_inputs(batch: int, layer: str, fmt: str, shapes: dict, device: str, g: torch.Generator):
    """Arguments of the op for ``batch`` decode rows of a ``layer`` layer."""
    heads, dim = shapes["heads"], shapes["dim"]
    n_extra = extra_keys(layer, shapes)
    entries = shapes["context"] // (4 if layer == "ratio4" else 128)
    win = TokenCache(batch * WINDOW, dim, 64, 128, fmt, torch.bfloat16, device)
    caches = [win]
    if n_extra:
        page_tokens = 64 if layer == "ratio4" else 2
        caches.append(
            TokenCache(batch * entries, dim, 64, page_tokens, fmt, torch.bfloat16, device)
        )
    with dispatch.force_path("torch"):  # filling the caches is not what is timed
        for cache in caches:
            for r0 in range(0, cache.num_slots, 1 << 16):
                slots = torch.arange(r0, min(r0 + (1 << 16), cache.num_slots), device=device)
                store_rows(cache, torch.randn(len(slots), dim, device=device), slots)
    rows = torch.arange(batch)[:, None]
    swa_idx = (rows * WINDOW + torch.arange(WINDOW - 1, -1, -1)).int()
    swa_len = torch.full((batch,), WINDOW, dtype=torch.int32)
    extra = [None, None, None]
    if n_extra:  # ratio4: top-k of the row's own entries; ratio128: all of them
        picks = torch.rand(batch, entries, generator=g).argsort(dim=1)[:, :n_extra]
        ext_idx = (rows * entries + picks.sort(dim=1).values).int()
        extra = [caches[1], ext_idx, torch.full((batch,), n_extra, dtype=torch.int32)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+")
    parser.add_argument("--fmt", nargs="+", default=["dense", "fp8"], choices=["dense", "fp8"])
    parser.add_argument("--layer", nargs="+", default=list(LAYERS), choices=LAYERS)
    parser.add_argument("--splits", type=int, help="key splits (default: the launcher's choice)")
    parser.add_argument("--reps", type=int, default=3, help="CPU timing calls")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    opts = parser.parse_args()
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
    print(f"measured: shapes {shapes}, window {WINDOW}; dense caches are bf16")
    print(f"{'layer':>8} {'fmt':>5} {'batch':>5} {'path':>6} {'time us':>10} {'GB/s':>9} "
          f"{'TFLOP/s':>8} {'roofline':>8}  max|diff|")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for layer in opts.layer:
        for fmt in opts.fmt:
            for batch in batches:
                args = make_inputs(batch, layer, fmt, shapes, device, g)
                moved, fl = cost(batch, layer, fmt, shapes)
                reference = sparse_attention_torch(*args)
                for path, fn in (
                    ("torch", lambda a=args: sparse_attention_torch(*a)),
                    ("triton", lambda a=args: sparse_attention_triton(*a, num_splits=opts.splits)),
                ):
                    diff = (fn() - reference).abs().max().item()
                    sec = time_call(fn, opts.reps)
                    frac = "-"
                    if matched:
                        frac = f"{max(moved / matched[1], fl / matched[2]) / sec:.1%}"
                    print(f"{layer:>8} {fmt:>5} {batch:>5} {path:>6} {sec * 1e6:10.1f} "
                          f"{moved / sec / 1e9:9.3g} {fl / sec / 1e12:8.3g} {frac:>8}  "
                          f"{diff:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
