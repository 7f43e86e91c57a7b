"""A compiled kernel's main loop read for a roofline model: ``kernel_report``.

The main loop is the loop with the most MMAs (:mod:`dsv4_backend.tools.sass`: an attention
kernel's key-block loop). Per configuration and target the report adds to
:func:`.toolchain.compile_report`'s figures:

* the register counts warp-specialised partitions set (``setmaxnreg``; none for one
  partition);
* the main loop's instructions per iteration (one warp, the longest path through the body) and
  warp-instructions per key (times the warps, over the keys an iteration takes);
* its asynchronous global -> shared copies (``LDGSTS``: cp.async; ``UTMALDG`` / ``UBLKCP``:
  TMA), static counts in the body;
* ``issue ns/key``: the time an SM's 4 schedulers take to issue one key's warp-instructions at
  the boost clock (one instruction a scheduler a cycle), beside ``HBM ns/key``: one key's bytes
  over one SM's share of the HBM bandwidth (fp8: 584 B / (4.8 TB/s / 132 SMs) = 16 ns on an
  H200). A loop whose issue time exceeds its HBM share cannot reach the bandwidth roofline
  however well it hides latency; ``criteria`` says which of the checks below hold. A
  warp-specialised kernel's partitions share the schedulers: its issue time sums their key
  loops (``partitions``: each loop's role -- MMAs, copies or tensor memory --, instructions,
  warps, MMAs and copies).

Kernels are described by :data:`SPECS` (one entry a kernel: what an iteration of its main loop
consumes and which criteria it claims); a kernel without an entry still gets its registers,
spills, loop and MMAs. ``tests/compiled/test_sparse_attention_sm90.py`` and
``tests/compiled/test_sparse_attention_pipelined_sm90.py`` assert the claimed criteria:

* ``no-spills``: no spill stores or loads and no stack frame;
* ``async-gather``: the main loop gathers keys with asynchronous copies (a warp-specialised
  kernel: its copy partition's loop);
* ``qk-n64``: no MMA with N < 64 (attention: the q k^T dot's N is the key block; p v's is
  256, the head dim a warpgroup);
* ``issue-bound``: issue ns/key at or below the HBM share on sm_90a (every SM busy, as at
  batch 64 with 2 key splits).

The figures come from compiled code only; nothing here is timed on a device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from triton.compiler import ASTSource

from dsv4_backend.tools import sass
from dsv4_backend.tools.aot_compile import configurations, toolchain


@dataclass(frozen=True)
class Device:
    """A target's reference part: SMs, HBM bytes/s, boost clock (Hz), schedulers per SM."""

    name: str
    sms: int
    hbm_bytes_per_s: float
    clock_hz: float
    schedulers: int = 4


#: Datasheet figures of the reference part of each target.
DEVICES = {
    "sm_90a": Device("H200", 132, 4.8e12, 1.98e9),
    "sm_100a": Device("B200", 148, 8.0e12, 1.965e9),
}


def _no_claims(constexprs: dict, target: str) -> frozenset[str]:
    return frozenset()


@dataclass(frozen=True)
class KernelSpec:
    """What one iteration of a kernel's main loop consumes, from the launch's constexprs:
    ``keys`` per iteration and HBM ``bytes_per_key``; ``claims``: the criteria (module
    docstring) the kernel meets for given constexprs and target, asserted by the tests."""

    keys: Callable[[dict], int]
    bytes_per_key: Callable[[dict], int]
    claims: Callable[[dict, str], frozenset[str]] = field(default=_no_claims)
    #: Warp-specialised kernels: the warps of a partition by the role of its key loop
    #: (``sass.PARTITION_ROLES``: ``mma``, ``copy``, ``tmem``). Their partitions share the SM's
    #: schedulers, so the issue time a key sums every partition's loop
    #: (``sass.partition_loops``).
    partition_warps: Callable[[dict], dict[str, int]] | None = None


def _fp8_key_bytes(c: dict) -> int:
    """One fp8 cache row: 448 e4m3 + 64 bf16 rope + 8 ue8m0 scales = 584 B."""
    return c["NOPE_DIM"] + 2 * (c["D"] - c["NOPE_DIM"]) + 8


def _ws_key_bytes(c: dict) -> int:
    """One cache row of a ws kernel: fp8 (:func:`_fp8_key_bytes`), dense bf16 2 D."""
    return _fp8_key_bytes(c) if c["FP8"] else 2 * c["D"]


def _attention_key_bytes(c: dict) -> int:
    """One cache row: fp8 (:func:`_fp8_key_bytes`), dense bf16 2 D."""
    return _fp8_key_bytes(c) if c["WIN_FP8"] else 2 * c["D"]


def _triton_attention_claims(c: dict, target: str) -> frozenset[str]:
    """Today's Triton kernel. Dense keys reach the dots through shared memory: cp.async
    stages; the fp8 gather feeds in-register dequantisation, which Triton does not pipeline.
    No spills, except on sm_100a for fp8 keys at 64 M lines writing partials (8-28 B; the
    same kernel holds in 243-250 registers on sm_90a). The dense key loop issues within the
    dense HBM share on sm_90a (1 KiB a key); QK's N is the key block (8-32) and the fp8 loop's
    issue time exceeds the fp8 HBM share: figures, not claims."""
    fp8 = c["WIN_FP8"] or c["EXT_FP8"]
    wide = c["BLOCK_H"] * c["BLOCK_G"] >= 64
    claims = set()
    if target == "sm_90a" or not fp8 or c["NUM_SPLITS"] == 1 or not wide:
        claims.add("no-spills")
    if not fp8:
        claims |= {"async-gather", "issue-bound"} if target == "sm_90a" else {"async-gather"}
    return frozenset(claims)


def _pipelined_attention_claims(c: dict, target: str) -> frozenset[str]:
    """The opt-in pipelined kernel: the fp8 gather as cp.async on both targets; no spills on
    sm_90a (sm_100a spills the dequantised block)."""
    return frozenset({"async-gather", "no-spills"} if target == "sm_90a" else {"async-gather"})


def _ws_attention_claims(c: dict, target: str) -> frozenset[str]:
    """The opt-in Gluon ws kernel (sm_90a only): no spills, the producer's gather as cp.async,
    q k^T at N = 64 (one warpgroup a block), and its three partitions' loops issue a key
    within the HBM share."""
    return frozenset({"no-spills", "async-gather", "qk-n64", "issue-bound"})


def _ws_sm100_attention_claims(c: dict, target: str) -> frozenset[str]:
    """The opt-in Gluon ws kernel for Blackwell (sm_100a only): the producer's cp.async gather
    and q k^T at N = 64 (tcgen05 m64n64); its prologue spills 8 B (warp indices kept across
    the tensor-memory allocation and setmaxnreg, outside the key loops): a figure."""
    return frozenset({"async-gather", "qk-n64"})


#: Kernel (Triton function name) -> how to read its main loop.
SPECS: dict[str, KernelSpec] = {
    "_sparse_attention_kernel": KernelSpec(
        keys=lambda c: c["BLOCK_N"],
        bytes_per_key=_attention_key_bytes,
        claims=_triton_attention_claims,
    ),
    "_pipelined_attention_kernel": KernelSpec(
        keys=lambda c: c["BLOCK_N"],
        bytes_per_key=_fp8_key_bytes,
        claims=_pipelined_attention_claims,
    ),
    "_ws_attention_kernel": KernelSpec(
        keys=lambda c: c["BLOCK_N"],
        bytes_per_key=_ws_key_bytes,
        claims=_ws_attention_claims,
        partition_warps=lambda c: dict(mma=c["CONSUMER_WARPS"], copy=c["PRODUCER_WARPS"]),
    ),
    "_ws_attention_kernel_sm100": KernelSpec(
        keys=lambda c: c["BLOCK_N"],
        bytes_per_key=_ws_key_bytes,
        claims=_ws_sm100_attention_claims,
        partition_warps=lambda c: dict(mma=1, copy=c["PRODUCER_WARPS"], tmem=4),
    ),
}

CRITERIA = ("no-spills", "async-gather", "qk-n64", "issue-bound")


def _mma_n(shape: str) -> int:
    return int(shape.split("n", 1)[1].split("k", 1)[0])


def loop_figures(
    listing: str, spec: KernelSpec | None, constexprs: dict, warps: int, device: Device
) -> dict:
    """The main loop of one SASS ``listing`` (module docstring); per-key figures with a spec."""
    loop = sass.main_loop(listing)
    if loop is None:
        return dict(main_loop=None)
    out: dict = dict(
        main_loop=dict(
            instructions=len(loop.path),
            body=len(loop.instructions),
            classes=loop.classes(),
            async_copies=loop.opcodes(sass.ASYNC_COPY_CLASSES),
            mma_ops=loop.opcodes(sass.MMA_CLASSES),
            global_loads=loop.opcodes(("ldg",)),
            conversions=loop.opcodes(("cvt",)),
        )
    )
    if spec is not None:
        keys, key_bytes = spec.keys(constexprs), spec.bytes_per_key(constexprs)
        per_key = len(loop.path) * warps / keys
        if spec.partition_warps is not None:
            out["partitions"] = _partition_figures(listing, spec.partition_warps(constexprs))
            per_key = sum(p["instructions"] * p["warps"] for p in out["partitions"]) / keys
        out["main_loop"].update(
            keys=keys,
            warp_instructions_per_key=round(per_key, 1),
            issue_ns_per_key=round(per_key / device.schedulers / device.clock_hz * 1e9, 2),
            hbm_ns_per_key=round(key_bytes * device.sms / device.hbm_bytes_per_s * 1e9, 2),
        )
    return out


def _partition_figures(listing: str, warps: dict[str, int]) -> list[dict]:
    """Per partition key loop (``sass.partition_loops``): its header, role, instructions an
    iteration (the longest path), warps (``warps`` by role), MMAs, asynchronous copies and
    global loads."""
    out = []
    for role, loop in sass.partition_loops(listing):
        out.append(
            dict(
                header=hex(loop.header),
                role=role,
                instructions=len(loop.path),
                warps=warps[role],
                mma_ops=loop.opcodes(sass.MMA_CLASSES),
                async_copies=loop.opcodes(sass.ASYNC_COPY_CLASSES),
                global_loads=loop.opcodes(("ldg",)),
            )
        )
    return out


def criteria(report: dict) -> dict[str, bool]:
    """Which of :data:`CRITERIA` a report meets (``issue-bound`` is judged on sm_90a only)."""
    loop = report["main_loop"] or {}
    met = {
        "no-spills": report["spill_stores"] == report["spill_loads"] == report["stack"] == 0,
        # A warp-specialised kernel gathers in its copy partition's loop.
        "async-gather": bool(loop.get("async_copies"))
        or any(p["async_copies"] and not p["mma_ops"] for p in report.get("partitions", ())),
        "qk-n64": bool(report["mma_shapes"]) and min(map(_mma_n, report["mma_shapes"])) >= 64,
    }
    if "issue_ns_per_key" in loop and report["target"] == "sm_90a":
        met["issue-bound"] = loop["issue_ns_per_key"] <= loop["hbm_ns_per_key"]
    return met


def kernel_report(name: str, src: ASTSource, options: dict, target: str) -> dict:
    """Everything the module docstring lists for one configuration on one target, with
    :func:`.toolchain.compile_report`'s figures."""
    kernel = toolchain.compile_kernel(src, options, target)
    listing = toolchain.sass_listing(kernel.asm["cubin"])
    report = toolchain.compile_report(name, src, options, target, kernel, listing)
    constexprs = {src.fn.arg_names[k[0]]: v for k, v in src.constants.items()}
    spec = SPECS.get(src.name)
    report.update(
        kernel=src.name,
        setmaxnreg=sass.set_max_registers(listing),
        **loop_figures(listing, spec, constexprs, options["num_warps"], DEVICES[target]),
    )
    report["criteria"] = criteria(report)
    report["claims"] = sorted(spec.claims(constexprs, target)) if spec else []
    return report


def reports(only: Sequence[str], targets: Iterable[str]) -> Iterator[dict]:
    """:func:`kernel_report` of each configuration :func:`.configurations.selected` picks by
    ``only``, target by target."""
    for target in targets:
        for name, src, options in configurations.selected(only, target):
            yield kernel_report(name, src, options, target)
