"""The kernel path of a device: which family of implementations the ops' variant tables
(``kernels/variants.py``) may choose from for tensors there.

* ``triton`` — tensors on a CUDA device (compiled Triton kernels);
* ``triton-interpreter`` — CPU tensors with ``TRITON_INTERPRET=1`` set before Triton was
  imported (how the test suite exercises every kernel on the CPU);
* ``torch`` — CPU tensors otherwise, and meta tensors (the plain torch implementation beside
  each kernel).

``force_path`` pins one path inside a ``with`` block (tests and the A/B tool use it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

import torch

from dsv4_backend import envs
from dsv4_backend.errors import ConfigError

TRITON = "triton"
TRITON_INTERPRETER = "triton-interpreter"
TORCH = "torch"
PATHS = (TRITON, TRITON_INTERPRETER, TORCH)

_forced: list[str] = []


def interpreter_enabled() -> bool:
    return envs.TRITON_INTERPRET.get() == "1"


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def default_path(device: torch.device) -> tuple[str, str]:
    """``(path, reason)``: the path ops take for tensors on ``device`` when none is forced."""
    if device.type == "meta":
        return TORCH, "meta tensors (shape-only tracing)"
    if not triton_installed():
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
