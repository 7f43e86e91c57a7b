"""The torch planner's kernel op as a variant table (``kernels/variants.py``) and its entry
point: the compress / write plans (:data:`COMPRESS_PLANS`, :func:`build_compress_plans`).

The fused Triton planner (``plan_fields.py``) plans every kind on the Triton paths
(``planning/planner.py``'s :data:`~dsv4_backend.planning.planner.PLAN` table), so this runs
where the torch planner does: on the torch path. The torch planner's per-row fields have one
implementation (``row_fields.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4_backend.config import REQUIRED_PAGE_SIZE
from dsv4_backend.kernels.variants import OpTable, Target, Variant, custom, resolve
from dsv4_backend.planning.kernels.compress_plan_call import CompressPlanCall
from dsv4_backend.planning.kernels.compress_plan_torch import compute_compress_plans
from dsv4_backend.planning.kernels.compress_plan_tvm import (
    compress_plans_tvm,
    tvm_unavailable_reason,
)


def _tvm_unmet(target: Target) -> str | None:
    """Why the TVM kernel cannot run on ``target``: this machine's probe
    (``compress_plan_tvm.tvm_unavailable_reason``), or for a described CUDA host
    (``Target.cuda_host``: sglang's libraries and the nvcc its JIT kernels need) whether it
    lists tvm-ffi."""
    if target.hypothetical and target.device_type == "cuda":
        return None if "tvm_ffi" in target.libraries else "apache-tvm-ffi is not installed"
    return tvm_unavailable_reason(target.device_type)


#: The variants: each entry takes a ``CompressPlanCall`` to its two plans.
COMPRESS_PLANS: OpTable[Callable[[CompressPlanCall], tuple[torch.Tensor, torch.Tensor]]] = OpTable(
    "compress_plans",
    "compress / write plans of one ratio (the torch planner)",
    (
        Variant(
            "tvm",
            compress_plans_tvm,
            (custom("apache-tvm llvm (CPU) or tvm-ffi + nvcc (CUDA)", _tvm_unmet),),
            "symbolic row count: one compiled kernel for every batch",
            baseline=True,
        ),
        Variant("torch", compute_compress_plans, (), "every batch", baseline=True),
    ),
)


def build_compress_plans(
    row_batch_ids: torch.Tensor,
    positions: torch.Tensor,
    first_new_positions: torch.Tensor,
    request_seq_lens: torch.Tensor,
    ratio: int,
    page_size: int = REQUIRED_PAGE_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress and write plans on the :data:`COMPRESS_PLANS` variant for the device.

    Arguments and results as ``compress_plan_tvm.compress_plans_tvm``; every variant gives
    identical plans. The TVM kernel compiles on its first call per process (warm up before a
    CUDA graph capture).
    """
    call = CompressPlanCall(
        row_batch_ids, positions, first_new_positions, request_seq_lens, ratio, page_size
    )
    return resolve(COMPRESS_PLANS, positions.device).variant.entry(call)
