"""Host-agnostic metadata planning: batch view -> plan -> (graph buffers)."""

from dsv4_backend.planning.batch import (
    SUPPORTED_DRAFT_TOPK,
    BatchView,
    DraftStep,
    ForwardKind,
    seq_len_fill_value,
)
from dsv4_backend.planning.draft_slots import per_step_draft_out_cache_loc
from dsv4_backend.planning.dspark_block import dspark_swa_width, plan_dspark_block
from dsv4_backend.planning.graph_buffers import GraphMetadataBuffers, pad_plan, read_plan
from dsv4_backend.planning.kernels.compress_plan_call import CompressPlanCall
from dsv4_backend.planning.kernels.compress_plan_torch import compute_compress_plans
from dsv4_backend.planning.kernels.row_fields import RowFields, row_fields
from dsv4_backend.planning.metadata import PLAN_COLUMNS, AttentionMetadata, CompressedMetadata
from dsv4_backend.planning.planner import GRAPH_KINDS, PlanWidths, plan
from dsv4_backend.planning.tag import PlanInputs
from dsv4_backend.planning.tail import LateLayerTail, TailCPLayout, late_layer_tail, tail_cp_layout

__all__ = [
    "GRAPH_KINDS",
    "PLAN_COLUMNS",
    "SUPPORTED_DRAFT_TOPK",
    "AttentionMetadata",
    "BatchView",
    "CompressPlanCall",
    "CompressedMetadata",
    "DraftStep",
    "ForwardKind",
    "GraphMetadataBuffers",
    "LateLayerTail",
    "PlanInputs",
    "PlanWidths",
    "RowFields",
    "TailCPLayout",
    "compute_compress_plans",
    "dspark_swa_width",
    "late_layer_tail",
    "pad_plan",
    "per_step_draft_out_cache_loc",
    "plan",
    "plan_dspark_block",
    "read_plan",
    "row_fields",
    "seq_len_fill_value",
    "tail_cp_layout",
]
