"""Plain float32 torch reference of DeepSeek-V4 attention (docs/design.md §2-3), and of
DeepSeek-V4.1's low-ratio compressors, indexer and fp4 rounding (§8; not served yet).

One request at a time, tokens at positions ``0 ... S-1``; small loops, no cleverness. Every
kernel test compares against these functions.
"""

from dsv4_backend.testing.reference.attention import (
    reference_attention,
    sink_attention,
    visible_entries,
)
from dsv4_backend.testing.reference.compressor import (
    compress_entries,
    entry_slots,
    finish_entries,
    overlap,
    pool_slots,
)
from dsv4_backend.testing.reference.dspark import reference_dspark_block
from dsv4_backend.testing.reference.fp4 import fake_quant_e4m3, fake_quant_ue8m0, round_e2m1
from dsv4_backend.testing.reference.indexer import indexer_scores, indexer_select
from dsv4_backend.testing.reference.layer import (
    LayerInputs,
    LayerParams,
    ReferenceResult,
    make_random_layer,
    reference_layer,
)
from dsv4_backend.testing.reference.low_ratio import (
    candidate_blocks,
    index_head_weights,
    index_keys,
    index_queries,
    index_scores,
    low_ratio_entries,
    select_entries,
    select_from_candidates,
)
from dsv4_backend.testing.reference.norm import rms_norm
from dsv4_backend.testing.reference.rope import (
    RopeParams,
    Yarn,
    apply_rope,
    rope_cos_sin,
    rope_for_ratio,
)
from dsv4_backend.testing.reference.v41_model import V41LayerInputs, V41Result, reference_v41

__all__ = [
    "LayerInputs",
    "LayerParams",
    "ReferenceResult",
    "RopeParams",
    "V41LayerInputs",
    "V41Result",
    "Yarn",
    "apply_rope",
    "candidate_blocks",
    "compress_entries",
    "entry_slots",
    "fake_quant_e4m3",
    "fake_quant_ue8m0",
    "finish_entries",
    "index_head_weights",
    "index_keys",
    "index_queries",
    "index_scores",
    "indexer_scores",
    "indexer_select",
    "low_ratio_entries",
    "make_random_layer",
    "overlap",
    "pool_slots",
    "reference_attention",
    "reference_dspark_block",
    "reference_layer",
    "reference_v41",
    "rms_norm",
    "rope_cos_sin",
    "rope_for_ratio",
    "round_e2m1",
    "select_entries",
    "select_from_candidates",
    "sink_attention",
    "visible_entries",
]
