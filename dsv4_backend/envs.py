"""Every environment variable this package reads, in one table (:data:`VARIABLES`), each read
through its :class:`EnvVar` (``tests/tool/test_envs.py`` checks that no other ``DSV4_*`` name
appears in the package). ``scripts/dsv4 info`` prints them with their values.

The op tables add one more per op: ``DSV4_<OP>_KERNEL`` names a variant of that op
(:func:`kernel_variable`; ``kernels/variants.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dsv4_backend.errors import ConfigError


@dataclass(frozen=True)
class EnvVar:
    """One variable: its ``name``, the ``default`` when unset or empty, the ``values`` it may
    take (empty: any), what it does (``meaning``) and where it is read (``read_by``)."""

    name: str
    default: str
    values: tuple[str, ...]
    meaning: str
    read_by: str

    def get(self) -> str:
        """The value (the default when unset or empty); ``ConfigError`` naming the variable
        and what it takes for any other value."""
        value = os.environ.get(self.name, "") or self.default
        if self.values and value not in self.values:
            raise ConfigError(f"{self.name}={value!r}; expected one of {self.values}")
        return value

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, ""))


SELF_CHECK = EnvVar(
    "DSV4_SELF_CHECK",
    "auto",
    ("auto", "0", "1", "force"),
    "the start-up self-check: auto (on CUDA devices), 0 (never), 1 (every device), force "
    "(every device, the cache ignored)",
    "self_check/check.py",
)
SELF_CHECK_DIR = EnvVar(
    "DSV4_SELF_CHECK_DIR",
    "",
    (),
    "where the self-check keeps its verdicts (default $XDG_CACHE_HOME/dsv4_backend/self-check)",
    "self_check/check.py",
)
UNVERIFIED_KERNELS = EnvVar(
    "DSV4_UNVERIFIED_KERNELS",
    "0",
    (),
    "1: variants without GPU evidence may be CUDA defaults without the self-check",
    "kernels/variants.py",
)
STRICT_CHECKS = EnvVar(
    "DSV4_STRICT_CHECKS",
    "0",
    (),
    "1: the planning checks read on the device are read at once (one host sync a plan)",
    "planning/checks.py",
)
INDEXER_SELECTION = EnvVar(
    "DSV4_BACKEND_INDEXER_SELECTION",
    "exact",
    ("exact", "fp8"),
    "the indexer's scores: exact (fp32, the reference's) or fp8 (sglang's built-in); "
    "--enable-deepseek-v4-fp4-indexer selects fp4 (sglang's fp4 indexer)",
    "sglang_adapter/settings.py",
)
PRECOMPILED_DIR = EnvVar(
    "DSV4_PRECOMPILED_DIR",
    "",
    (),
    "a folder of kernels compiled ahead of time, for a host whose Triton cannot build them",
    "kernels/device/precompiled.py",
)
CPU_SERVING_KIT = EnvVar(
    "DSV4_CPU_SERVING_KIT",
    "0",
    (),
    "1: sglang's processes load the CPU serving kit (scripts/dsv4 serve sets it)",
    "tools/cpu_server/standins.py",
)
TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET",
    "0",
    (),
    "1 (set before triton is imported): CPU tensors run the Triton kernels in its interpreter",
    "kernels/dispatch.py",
)

#: Every variable, by name.
VARIABLES: dict[str, EnvVar] = {
    var.name: var
    for var in (
        SELF_CHECK,
        SELF_CHECK_DIR,
        UNVERIFIED_KERNELS,
        STRICT_CHECKS,
        INDEXER_SELECTION,
        PRECOMPILED_DIR,
        CPU_SERVING_KIT,
        TRITON_INTERPRET,
    )
}


def kernel_variable(op: str) -> str:
    """``DSV4_<OP>_KERNEL``: the variable naming a variant of ``op``."""
    return f"DSV4_{op.upper()}_KERNEL"
