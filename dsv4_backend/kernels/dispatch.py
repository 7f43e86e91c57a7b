"""One dispatch point per op: which implementation runs for tensors on a device.

* ``triton`` — tensors on a CUDA device (compiled Triton kernels);
* ``triton-interpreter`` — CPU tensors with ``TRITON_INTERPRET=1`` set before Triton was
  imported (how the test suite exercises every kernel on the CPU);
* ``torch`` — CPU tensors otherwise, and meta tensors (the plain torch implementation beside
  each kernel).

``force_path`` pins one path inside a ``with`` block (tests and the A/B tool use it).

Sparse attention on the two Triton paths runs one of :data:`ATTENTION_KERNELS`: ``triton``
(the default), ``pipelined``, ``ws`` or ``flashmla`` (none has run on a GPU, so none is the
default), chosen by ``DSV4_ATTENTION_KERNEL`` or pinned by ``force_attention_kernel``;
``kernels/attention_choice.py`` declares them (``ATTENTION_VARIANTS``) and runs the choice.

Kernels that have not yet passed ``scripts/gpu_check.sh`` (``UNVERIFIED_OPS``) replace the
verified ones in the interpreter (where the tests run them) but on CUDA only with
``DSV4_UNVERIFIED_KERNELS=1``; ``force_unverified`` pins the choice in a ``with`` block.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

from dsv4_backend.errors import ConfigError

TRITON = "triton"
TRITON_INTERPRETER = "triton-interpreter"
TORCH = "torch"
PATHS = (TRITON, TRITON_INTERPRETER, TORCH)

#: Ops that have a Triton kernel beside their torch implementation.
TRITON_OPS = (
    "row_compression_metadata",
    "cache_store",
    "compressor",
    "indexer",
    "sparse_attention",
)

#: Ops whose new kernels have not yet run on a GPU (issue 22: the length-bounded lightning
#: indexer, the one-launch compressor); a change that shows them passing
#: ``scripts/gpu_check.sh`` empties this and removes the kernels they replace.
UNVERIFIED_OPS = ("indexer", "compressor")
#: Set to ``1`` to run ``UNVERIFIED_OPS``' new kernels on CUDA devices.
UNVERIFIED_ENV = "DSV4_UNVERIFIED_KERNELS"

_forced: list[str] = []
_forced_unverified: list[bool] = []

#: Sparse-attention kernels of the Triton paths (``attention_choice.ATTENTION_VARIANTS``
#: declares each); the first is the default.
ATTENTION_KERNELS = ("triton", "pipelined", "ws", "flashmla")
#: Environment variable naming the sparse-attention kernel.
ATTENTION_KERNEL_ENV = "DSV4_ATTENTION_KERNEL"
_forced_attention: list[str] = []


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def default_path(device: torch.device) -> tuple[str, str]:
    """``(path, reason)``: the path ops take for tensors on ``device`` when none is forced."""
    if device.type == "meta":
        return TORCH, "meta tensors (shape-only tracing)"
    if importlib.util.find_spec("triton") is None:
        return TORCH, "triton is not installed"
    if device.type == "cuda":
        return TRITON, "CUDA device"
    if interpreter_enabled():
        return TRITON_INTERPRETER, "CPU tensors with TRITON_INTERPRET=1"
    return TORCH, "CPU tensors and TRITON_INTERPRET is not 1"


def select_path(device: torch.device | str) -> str:
    """The path every Triton-backed op takes for tensors on ``device``."""
    device = torch.device(device)
    if _forced:
        forced = _forced[-1]
        if forced == TRITON and device.type != "cuda":
            raise ConfigError(
                f"path {TRITON!r} was forced for tensors on {device}; compiled Triton kernels "
                f"need a CUDA device (use {TRITON_INTERPRETER!r} on the CPU)"
            )
        if forced == TRITON_INTERPRETER and not interpreter_enabled():
            raise ConfigError(
                f"path {TRITON_INTERPRETER!r} was forced but needs TRITON_INTERPRET=1 set before "
                "triton is imported"
            )
        return forced
    return default_path(device)[0]


def use_triton(device: torch.device | str) -> bool:
    return select_path(device) != TORCH


@contextlib.contextmanager
def force_path(path: str) -> Iterator[None]:
    """Run every op on ``path`` inside the block."""
    if path not in PATHS:
        raise ConfigError(f"unknown kernel path {path!r}; expected one of {PATHS}")
    _forced.append(path)
    try:
        yield
    finally:
        _forced.pop()


def attention_kernel() -> tuple[str, str]:
    """``(kernel, reason)``: the sparse-attention kernel the Triton paths run. Raises
    ``ConfigError`` for an unknown ``DSV4_ATTENTION_KERNEL``."""
    if _forced_attention:
        return _forced_attention[-1], "pinned by force_attention_kernel"
    name = os.environ.get(ATTENTION_KERNEL_ENV, "")
    if not name:
        return ATTENTION_KERNELS[0], f"the default ({ATTENTION_KERNEL_ENV} is not set)"
    if name not in ATTENTION_KERNELS:
        raise ConfigError(f"{ATTENTION_KERNEL_ENV}={name!r}; expected one of {ATTENTION_KERNELS}")
    return name, f"{ATTENTION_KERNEL_ENV}={name}"


@contextlib.contextmanager
def force_attention_kernel(name: str) -> Iterator[None]:
    """Run sparse attention with kernel ``name`` inside the block (on the Triton paths)."""
    if name not in ATTENTION_KERNELS:
        raise ConfigError(f"unknown attention kernel {name!r}; expected one of {ATTENTION_KERNELS}")
    _forced_attention.append(name)
    try:
        yield
    finally:
        _forced_attention.pop()


def use_unverified(op: str, device: torch.device | str) -> bool:
    """Whether ``op`` (one of ``UNVERIFIED_OPS``) runs its new kernel for tensors on
    ``device`` (on the Triton paths: the interpreter by default, CUDA with
    ``DSV4_UNVERIFIED_KERNELS=1``)."""
    if op not in UNVERIFIED_OPS:
        raise ConfigError(f"unknown op {op!r}; expected one of {UNVERIFIED_OPS}")
    if _forced_unverified:
        return _forced_unverified[-1]
    if select_path(device) == TRITON:
        return os.environ.get(UNVERIFIED_ENV) == "1"
    return True


@contextlib.contextmanager
def force_unverified(enabled: bool) -> Iterator[None]:
    """Run ``UNVERIFIED_OPS``' new kernels (``True``) or the ones they replace inside the block."""
    _forced_unverified.append(enabled)
    try:
        yield
    finally:
        _forced_unverified.pop()


def topk_path(device: torch.device | str) -> tuple[str, str]:
    """``(path, reason)`` of the indexer's top-k: flashinfer on CUDA, torch otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return TORCH, "flashinfer's top-k needs a CUDA device"
    if importlib.util.find_spec("flashinfer") is None:
        return TORCH, "flashinfer is not installed"
    return "flashinfer", "CUDA device with flashinfer"
