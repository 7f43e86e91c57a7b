"""The torch planner's two kernel ops as variant tables (``kernels/variants.py``), and their
entry points: the per-row compression fields (:data:`ROW_FIELDS`, :func:`row_fields`) and the
compress / write plans (:data:`COMPRESS_PLANS`, :func:`build_compress_plans`).

The fused Triton planner (``plan_fields.py``) plans every kind on the Triton paths
(``planning/planner.py``'s :data:`~dsv4_backend.planning.planner.PLAN` table), so these run
where the torch planner does: on the torch path.
"""

from __future__ import annotations

import torch

from dsv4_backend.config import REQUIRED_PAGE_SIZE
from dsv4_backend.kernels.variants import TRITON_PATHS, OpTable, Variant, custom, resolve
from dsv4_backend.planning.kernels.compress_plan_torch import compute_compress_plans
from dsv4_backend.planning.kernels.compress_plan_tvm import (
    compress_plans_tvm,
    tvm_unavailable_reason,
)
from dsv4_backend.planning.kernels.row_fields import (
    RowFields,
    check_row_field_inputs,
    row_fields_torch,
    row_fields_triton,
)

ROW_FIELDS = OpTable(
    "row_fields",
    "per-row compression fields of one ratio (the torch planner)",
    (
        Variant(
            "triton", row_fields_triton, (TRITON_PATHS,),
            "every ratio; one launch", baseline=True,
        ),
        Variant("torch", row_fields_torch, (), "every ratio", baseline=True),
    ),
)  # fmt: skip

COMPRESS_PLANS = OpTable(
    "compress_plans",
    "compress / write plans of one ratio (the torch planner)",
    (
        Variant(
            "tvm", compress_plans_tvm,
            (custom("apache-tvm llvm (CPU) or tvm-ffi + nvcc (CUDA)",
                    lambda target: tvm_unavailable_reason(target.device_type)),),
            "symbolic row count: one compiled kernel for every batch", baseline=True,
        ),
        Variant("torch", compute_compress_plans, (), "every batch", baseline=True),
    ),
)  # fmt: skip


def row_fields(
    positions: torch.Tensor,
    raw_out_loc: torch.Tensor,
    page_table: torch.Tensor,
    *,
    ratio: int,
    index_topk: int,
    c128_width: int,
) -> RowFields:
    """The per-row fields of ``ratio`` on the :data:`ROW_FIELDS` variant for the device.

    Arguments, shapes and result as ``row_fields.row_fields_torch`` (the reference); every
    variant gives identical tensors.
    """
    check_row_field_inputs(positions, raw_out_loc, page_table, ratio, index_topk, c128_width)
    entry = resolve(ROW_FIELDS, positions.device).variant.entry
    return entry(
        positions, raw_out_loc, page_table, ratio=ratio, index_topk=index_topk,
        c128_width=c128_width,
    )  # fmt: skip


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
    entry = resolve(COMPRESS_PLANS, positions.device).variant.entry
    return entry(row_batch_ids, positions, first_new_positions, request_seq_lens, ratio, page_size)
