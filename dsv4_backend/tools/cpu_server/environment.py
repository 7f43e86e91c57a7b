"""The environment of a CPU server's processes (light: no torch, no sglang import)."""

from __future__ import annotations

from dsv4_backend import envs

#: ``1`` loads the CPU serving kit (``standins.py``) in sglang's processes.
ENABLE_ENV = envs.CPU_SERVING_KIT.name
#: sglang's own environment switches from its TileLang / fused kernels to its torch code.
SGLANG_TORCH_SWITCHES = {
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_POST": "0",
    "SGLANG_OPT_USE_FUSED_HASH_TOPK": "0",
}


def kit_environment(*, triton: bool = False) -> dict[str, str]:
    """Environment variables of a CPU server's processes: the kit on, sglang's torch paths,
    and ``TRITON_INTERPRET`` (``1``: this backend's Triton kernels in Triton's interpreter,
    else its torch kernels)."""
    return {ENABLE_ENV: "1", **SGLANG_TORCH_SWITCHES, "TRITON_INTERPRET": "1" if triton else "0"}
