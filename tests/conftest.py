"""Shared test set-up.

Triton reads ``TRITON_INTERPRET`` once, when it is first imported, so it is set here before any
test module can import triton: on a machine without a GPU the Triton kernels then run in the
interpreter. A caller may set it first (``TRITON_INTERPRET=0`` on a GPU machine runs them
compiled).

The markers (declared in pyproject.toml) select tests (``scripts/test.sh -m compiled``); two
also skip: ``gpu`` tests without a CUDA device, ``stress`` tests without ``DSV4_STRESS=1``.
The helpers the test files share are in ``tests/support/`` (on ``sys.path``: pyproject.toml).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread: on a 2-core machine torch's default thread pool oversubscribes the cores
# (the suite ran several times slower with it); set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Strict mode: device-side batch checks are read at planning, before anything is written
# (dsv4_backend/planning/checks.py). Free on the CPU; on a GPU it makes every test raise at once.
os.environ.setdefault("DSV4_STRICT_CHECKS", "1")

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from stress import STRESS

from dsv4_backend.kernels.dispatch import TORCH, force_path
from dsv4_backend.testing.interpreter import patch_language_once

if os.environ["TRITON_INTERPRET"] == "1":
    patch_language_once()

# CI runs the same examples every time (a red run is reproducible); locally hypothesis explores.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

#: The costliest files (ahead-of-time compiles, sglang subprocesses, long interpreter runs),
#: costliest first, by file name. They run first, and scripts/test.sh hands files to its
#: workers in this order (``--no-loadscope-reorder``), so the short files fill in around them
#: and the workers finish together.
COSTLIEST_FIRST = (
    "test_engine_outputs.py",
    "test_sparse_attention_sm90.py",
    "test_indexer_compressor_sass.py",
    "test_http_server.py",
    "test_ab.py",
    "test_registration.py",
    "test_ab_server.py",
    "test_engine_v41.py",
    "test_prefix_cache.py",
    "test_compressor.py",
    "test_sparse_attention_pipelined_sm90.py",
    "test_compress_plan_cuda.py",
    "test_multi_gpu.py",
    "test_region_copying.py",
    "test_serving_modes.py",
    "test_eagle_loop.py",
    "test_sparse_attention.py",
    "test_launch_budget.py",
    "test_gpu_verdict.py",
    "test_precompiled.py",
    "test_planner.py",
    "test_self_check.py",
)
#: Markers that skip a test where what it needs is missing, and the reason.
SKIPPED_WITHOUT = {
    "gpu": (not torch.cuda.is_available(), "needs a CUDA device"),
    "stress": (not STRESS, "long randomized variant: DSV4_STRESS=1"),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept
    for item in items:
        for marker, (skip, reason) in SKIPPED_WITHOUT.items():
            if skip and item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def torch_path() -> Iterator[None]:
    """Every kernel on the torch path (the fast one in the interpreter session); a file of
    serving or host tests takes it with ``pytestmark = pytest.mark.usefixtures("torch_path")``.
    """
    with force_path(TORCH):
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-V4 checkpoint (variant ``v4``: one MTP layer), written once per
    worker."""
    from dsv4_backend.tools.cpu_server.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-v4"), variant="v4")
