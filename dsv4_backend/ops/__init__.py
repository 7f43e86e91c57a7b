"""Runtime math shared by the kernels' torch paths and the adapter: RoPE (with a cached cos/sin
table), RMSNorm, the compressor's pooling and entry finishing, and the layer input types.

The test oracle (:mod:`dsv4_backend.testing.reference`) has its own plain implementations of the
same formulas and imports nothing from here, so a bug in one side shows up as a mismatch.
"""

from dsv4_backend.ops.compress import finish_entries, pool_slots
from dsv4_backend.ops.layer_types import LayerInputs, LayerParams
from dsv4_backend.ops.norm import rms_norm
from dsv4_backend.ops.rope import CosSin, RopeParams, RopeTable, Yarn, apply_rope, rope_for_ratio

__all__ = [
    "CosSin",
    "LayerInputs",
    "LayerParams",
    "RopeParams",
    "RopeTable",
    "Yarn",
    "apply_rope",
    "finish_entries",
    "pool_slots",
    "rms_norm",
    "rope_for_ratio",
]
