"""The sparse-attention kernels' table (``kernels/attention_choice.py``): one record per kernel
``DSV4_ATTENTION_KERNEL`` can name, and an explicit choice that cannot run refused when the
backend is built, with a line naming the kernel and why."""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention_choice import ATTENTION_VARIANTS, explicit_choice_reason
from dsv4_backend.kernels.report import describe_paths
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool

CONFIG = DSV4AttentionConfig.tiny()
#: the backend is built on sglang's model-runner stand-ins
pytestmark = pytest.mark.sglang


def _build(cache_format: str = "dense") -> DSV4AttentionBackend:
    pool = PagedRequestPool(CONFIG, [40], generator=torch.Generator().manual_seed(0))
    runner = harness.mock_runner(pool, harness.tiny_hf_config(CONFIG))
    return DSV4AttentionBackend(runner, cache_format=cache_format)  # type: ignore[arg-type]


def test_the_table_declares_every_kernel_once() -> None:
    assert tuple(ATTENTION_VARIANTS) == dispatch.ATTENTION_KERNELS
    default = ATTENTION_VARIANTS[dispatch.ATTENTION_KERNELS[0]]
    assert default.gpu_verified is not None  # the only one that has run on a GPU
    assert all(v.gpu_verified is None for v in list(ATTENTION_VARIANTS.values())[1:])


@pytest.mark.parametrize("kernel", ["ws", "flashmla", "pipelined"])
def test_an_explicit_kernel_that_cannot_run_is_refused_when_built(
    kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU (dense caches) none of the opt-in kernels runs: the build names it and why."""
    monkeypatch.setenv(dispatch.ATTENTION_KERNEL_ENV, kernel)
    with pytest.raises(ConfigError, match=f"DSV4_ATTENTION_KERNEL={kernel}: ") as error:
        _build()
    assert "\n" not in str(error.value)
    monkeypatch.delenv(dispatch.ATTENTION_KERNEL_ENV)
    assert _build().state is not None  # the default builds


def test_the_reason_names_what_is_missing() -> None:
    backend = _build("fp8")
    pools = backend.state.pools
    window, extra = pools.window(0), pools.compressed(1)
    cpu = torch.device("cpu")
    with dispatch.force_attention_kernel("pipelined"):
        # tiny: head dim 128 with 64 rope channels on fp8 caches is what pipelined takes
        assert explicit_choice_reason(cpu, window, extra, 8, 128) is None
        assert "head_dim 96" in (explicit_choice_reason(cpu, window, extra, 8, 96) or "")
    with dispatch.force_attention_kernel("ws"):
        reason = explicit_choice_reason(cpu, window, extra, 8, 128)
        assert reason is not None and "ws kernel cannot run here" in reason
    assert explicit_choice_reason(cpu, window, extra, 8, 96) is None  # the default


def test_info_describes_the_chosen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ATTENTION_KERNEL_ENV, "flashmla")
    rows = {op: (path, why) for op, path, why in describe_paths("cpu")}
    kernel, why = rows["attention_kernel"]
    assert kernel == "flashmla" and "FlashMLA" in why and "never run on a GPU" in why
