"""What ``python -m dsv4_backend info`` reports of the kernels: the path and kernel each op
takes for tensors on a device, and why (``kernels/dispatch.py`` chooses;
``kernels/attention_choice.py`` declares the attention kernels)."""

from __future__ import annotations

import importlib.util

import torch

from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention_choice import ATTENTION_VARIANTS


def describe_paths(device: torch.device | str = "cpu") -> list[tuple[str, str, str]]:
    """``(op, path, reason)`` for each op, as ``python -m dsv4_backend info`` prints them."""
    device = torch.device(device)
    path, reason = dispatch.default_path(device)
    rows = [(op, path, reason) for op in dispatch.TRITON_OPS]
    if path != dispatch.TORCH:
        for i, (op, _, _) in enumerate(rows):
            if op in dispatch.UNVERIFIED_OPS:
                kernel = "new kernel" if dispatch.use_unverified(op, device) else "verified kernel"
                rows[i] = (op, path, f"{reason}; {kernel} ({dispatch.UNVERIFIED_ENV})")
        kernel, why = dispatch.attention_kernel()
        rows.append(("attention_kernel", kernel, attention_kernel_note(kernel, why)))
    rows.append(("compress_plan", *_tvm_path(device)))
    rows.append(("indexer_topk", *dispatch.topk_path(device)))
    return rows


def _tvm_path(device: torch.device) -> tuple[str, str]:
    # (imported here: reading the TVM module's state should not import tvm for every report)
    from dsv4_backend.planning.kernels.compress_plan_tvm import (
        cuda_unavailable_reason,
        tvm_available,
    )

    if device.type == "cuda":
        reason = cuda_unavailable_reason()
        if reason is not None:
            return dispatch.TORCH, reason
        return "tvm-cuda", "TVM-generated CUDA source with symbolic shapes, built by tvm-ffi"
    if importlib.util.find_spec("tvm") is None:
        return dispatch.TORCH, "apache-tvm is not installed"
    if not tvm_available(device.type):
        return dispatch.TORCH, "the installed TVM runtime has no llvm support"
    return "tvm-llvm", "TVM kernel with symbolic shapes compiled for llvm"


def attention_kernel_note(kernel: str, why: str) -> str:
    """Why ``kernel`` runs, and what it takes when it has not passed the GPU check."""
    variant = ATTENTION_VARIANTS[kernel]
    if variant.gpu_verified is not None:
        return why
    return f"{why}; {variant.takes} (others run triton); has never run on a GPU"
