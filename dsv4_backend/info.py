"""The ``info`` report: versions, which kernel paths can run here and why not, and whether
sglang's attention registry resolves ``dsv4`` to this package.

Reads package metadata for versions; imports torch (GPU check), tvm (llvm check) and sglang
(registry), and nothing that compiles a kernel.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata

from dsv4_backend import _versions, envs
from dsv4_backend.errors import ConfigError
from dsv4_backend.sglang_adapter import factory
from dsv4_backend.sglang_adapter.factory import BACKEND_NAME, BUILTIN_NAME

#: (label, distribution) of each package whose version the report prints.
PACKAGES = (
    ("torch", "torch"),
    ("triton", "triton"),
    ("tvm", "apache-tvm"),
    ("flashinfer", "flashinfer-python"),
    ("sglang", "sglang"),
)
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "dsv4_backend"
NO_GPU = "no CUDA GPU visible to torch"


def default_device() -> str:
    """The device ``info`` describes unless told: the first CUDA device, else the CPU."""
    return "cpu" if _cuda_device() is None else "cuda:0"


def report(device: str | None = None) -> list[str]:
    """Return the report's lines; the kernel choice is for tensors on ``device``."""
    gpu = _cuda_device()
    device = device or default_device()
    return [
        f"dsv4_backend {_versions.installed_version('dsv4-backend')} "
        f"on Python {platform.python_version()}",
        "",
        "Versions",
        *_version_lines(),
        "",
        "Kernel paths on this machine",
        *_table(_capabilities(gpu)),
        "",
        f"Kernel variant of each op for tensors on {device}",
        *_choice_lines(device),
        "",
        "Environment variables (dsv4_backend/envs.py; DSV4_<OP>_KERNEL names an op's variant)",
        *_table(_variable_rows()),
        "",
        "sglang attention registry (after sglang.srt.plugins.load_plugins())",
        *_registry_lines(),
    ]


def _variable_rows() -> list[tuple[str, str, str]]:
    rows = []
    for var in envs.VARIABLES.values():
        value = os.environ.get(var.name) or f"unset ({var.default or 'empty'})"
        rows.append((var.name, value, var.meaning))
    return rows


def _version_lines() -> list[str]:
    rows = []
    for label, distribution in PACKAGES:
        version = _versions.installed_version(distribution) or "not installed"
        if label == "sglang":
            version += f"   (supported: {_versions.SUPPORTED_SGLANG})"
        rows.append((label, version))
    return _table(rows)


def _cuda_device() -> str | None:
    """Return the name of the first CUDA device torch sees, or ``None``."""
    if _versions.installed_version("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def _capabilities(gpu: str | None) -> list[tuple[str, str, str]]:
    """Return ``(path, "yes" or "no", reason)`` for each kernel path."""
    checks = [
        ("torch kernels", _torch_path()),
        ("triton (GPU)", _on_gpu("triton", gpu, NO_GPU)),
        ("triton interpreter", _triton_interpreter()),
        ("tvm (llvm, CPU)", _tvm_llvm()),
        ("flashinfer", _on_gpu("flashinfer-python", gpu, f"needs a CUDA GPU; {NO_GPU}")),
    ]
    return [(path, "yes" if ok else "no", reason) for path, (ok, reason) in checks]


def _torch_path() -> tuple[bool, str]:
    if _versions.installed_version("torch") is None:
        return False, "torch not installed"
    return True, "the kernels' torch twins, any device (A/B backend dsv4-torch)"


def _on_gpu(package: str, gpu: str | None, no_gpu: str) -> tuple[bool, str]:
    """Whether ``package`` is installed and a GPU (``gpu``, its name) is visible; ``no_gpu``
    says why not without one."""
    if _versions.installed_version(package) is None:
        return False, f"{package} not installed"
    if gpu is None:
        return False, no_gpu
    return True, f"on {gpu}"


def _triton_interpreter() -> tuple[bool, str]:
    if _versions.installed_version("triton") is None:
        return False, "triton not installed"
    if envs.TRITON_INTERPRET.get() != "1":
        return False, "TRITON_INTERPRET is not 1 (set it before triton is imported)"
    return True, "TRITON_INTERPRET=1: kernels run on the CPU, slowly"


def _tvm_llvm() -> tuple[bool, str]:
    """Whether tvm imports and was built with its llvm (CPU code generation) target."""
    if _versions.installed_version("apache-tvm") is None:
        return False, "apache-tvm not installed"
    try:
        import tvm
    except Exception as exc:  # a broken native library surfaces as any exception type
        return False, f"import tvm failed: {type(exc).__name__}: {exc}"
    if not tvm.runtime.enabled("llvm"):
        return False, "this tvm build has no llvm target"
    return True, "tvm imports with the llvm target"


def _self_check(device: str) -> str:
    """Run the start-up self-check for ``device`` where a backend built there would
    (``DSV4_SELF_CHECK``; DeepSeek-V4-Flash's widths, fp8 caches; its cached verdicts when it
    ran before), so the choice shown is the one a backend makes; one line saying what ran."""
    import torch

    from dsv4_backend.self_check.check import PRESETS, SELF_CHECK_ENV, runs_on, self_check, setting

    chosen, where = setting(), torch.device(device)
    if not runs_on(where):
        return f"self-check: not run for {device} ({SELF_CHECK_ENV}={chosen})"
    report = self_check(
        PRESETS["flash" if where.type == "cuda" else "tiny"], where, use_cache=chosen != "force"
    )
    return report.lines()[0]


def _choice_lines(device: str) -> list[str]:
    """Each op's chosen variant here and on CUDA 9.0 / 10.0, then every variant's status in
    preference order (with the self-check's verdict here when one ran)."""
    from dsv4_backend.compute.kernel_choice import describe
    from dsv4_backend.self_check.check import CHECKED

    checked = _self_check(device)
    kernels = describe(device, {table.op for table in CHECKED})
    labels = [label for label in next(iter(kernels["ops"].values()))["chosen"] if label != "here"]
    chosen = [("op", "here", *labels, "why (here)")]
    variants = []
    for op, entry in kernels["ops"].items():
        picks = [c["variant"] or "refused" for c in entry["chosen"].values()]
        here = entry["chosen"]["here"]
        chosen.append((op, *picks, here.get("why") or here.get("error") or ""))
        for v in entry["variants"]:
            evidence = "gpu-verified" if v["gpu_verified"] else "baseline" if v["baseline"] else ""
            status = "runs here" if v["runs_here"] else f"not here: {v['reason']}"
            if v["self_check"]:
                status += f"; self-check {v['self_check']['outcome']}"
            if v["setting"]:
                status += f"; needs {v['setting']}"
            variants.append((f"{op}/{v['name']}", evidence or "-", status))
    return [
        f"  {kernels['target']}; {checked}",
        "  CUDA columns: a CUDA host of that capability with sglang's libraries; for the ops the "
        "self-check decides, the first variant in preference order that runs there (the "
        "default once it passes the self-check)",
        *_table(chosen),
        "",
        "  Variants in preference order (baseline: a CUDA default without a self-check; "
        "gpu-verified: passed scripts/gpu_check.sh)",
        *_table(variants),
    ]


def json_report(device: str | None = None) -> dict[str, object]:
    """``info --json``: versions, the registry's resolution and the kernel choice."""
    from dsv4_backend.compute.kernel_choice import describe
    from dsv4_backend.self_check.check import CHECKED

    return {
        "dsv4_backend": _versions.installed_version("dsv4-backend"),
        "python": platform.python_version(),
        "versions": {
            label: _versions.installed_version(distribution) for label, distribution in PACKAGES
        },
        "gpu": _cuda_device(),
        "environment": {name: os.environ.get(name) for name in envs.VARIABLES},
        "self_check": _self_check(device or default_device()),
        "kernels": describe(device or default_device(), {table.op for table in CHECKED}),
    }


def _registry_lines() -> list[str]:
    if _versions.installed_version("sglang") is None:
        return ["  sglang is not installed"]
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins import load_plugins

    load_plugins()
    serving = ATTENTION_BACKENDS.get(BACKEND_NAME)
    ours = serving is factory.create_dsv4_backend
    owner = "this package" if ours else "sglang's own"
    rows = [
        (BACKEND_NAME, f"{_qualified(serving)}   ({owner})"),
        (BUILTIN_NAME, _qualified(ATTENTION_BACKENDS.get(BUILTIN_NAME))),
    ]
    if not ours:
        rows.append(("why", _why_not_registered()))
    return _table(rows)


def _why_not_registered() -> str:
    """Explain why ``dsv4`` is not served by this package after loading sglang's plugins."""
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    if allowed and ENTRY_POINT_NAME not in {name.strip() for name in allowed.split(",")}:
        return f"SGLANG_PLUGINS={allowed} does not name {ENTRY_POINT_NAME}"
    if not any(
        ep.name == ENTRY_POINT_NAME for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
    ):
        return f"no entry point {ENTRY_POINT_NAME} in {ENTRY_POINT_GROUP}: install this package"
    try:
        _versions.check_sglang_version(metadata.version("sglang"))
    except ConfigError as exc:
        return str(exc)
    return "register() failed; see sglang's log above"


def _qualified(function: Callable[..., object] | None) -> str:
    if function is None:
        return "not registered"
    return f"{function.__module__}.{function.__qualname__}"


def _table(rows: Iterable[Sequence[str]]) -> list[str]:
    """Format rows of text columns as indented lines; all but the last column are padded."""
    rows = [tuple(row) for row in rows]
    if not rows:
        return []
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    return ["  " + "  ".join([*map(str.ljust, row[:-1], widths), row[-1]]).rstrip() for row in rows]
