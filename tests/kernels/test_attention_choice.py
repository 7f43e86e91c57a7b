"""The sparse-attention op's table (``kernels/attention/table.py``): one record per variant
``DSV4_ATTENTION_KERNEL`` can name, and a named variant that cannot run refused when the
backend is built, with one line naming the variant and why."""

from __future__ import annotations

import pytest
import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention.table import ATTENTION
from dsv4_backend.kernels.variants import Target, choose, force_variant, named_rejection
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


def test_only_the_baselines_are_defaults_on_cuda() -> None:
    """Nothing has passed the GPU check yet: the CUDA choice is the baseline triton kernel on
    Hopper and Blackwell, and each opt-in variant runs only when named."""
    assert ATTENTION.env == "DSV4_ATTENTION_KERNEL"
    assert {v.name for v in ATTENTION.variants if v.baseline} == {"triton", "torch"}
    assert all(v.gpu_verified is None for v in ATTENTION.variants)
    for capability in ((9, 0), (10, 0)):
        hopper_or_blackwell = Target.cuda_host(capability)
        assert choose(ATTENTION, hopper_or_blackwell, None).name == "triton"
        for name in ("pipelined", "ws", "flashmla"):
            chosen = choose(ATTENTION, hopper_or_blackwell, (name, f"named {name}"))
            assert chosen.explicit and chosen.name == name
    with pytest.raises(ConfigError, match=r"ws attention variant cannot run.*not 8\.0"):
        choose(ATTENTION, Target.cuda_host((8, 0)), ("ws", "DSV4_ATTENTION_KERNEL=ws"))


@pytest.mark.parametrize("kernel", ["ws", "flashmla", "pipelined", "fastest"])
def test_a_named_variant_that_cannot_run_is_refused_when_built(
    kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU (dense caches) none of the opt-in variants runs, and an unknown name is
    refused: the build names it and why, in one line."""
    monkeypatch.setenv(ATTENTION.env, kernel)
    with pytest.raises(ConfigError, match=f"DSV4_ATTENTION_KERNEL={kernel}: ") as error:
        _build()
    message = str(error.value)
    assert "\n" not in message
    assert ("unknown attention variant" if kernel == "fastest" else f"the {kernel} ") in message
    monkeypatch.delenv(ATTENTION.env)
    backend = _build()  # the default builds, and records what every op runs
    assert backend.kernels["attention"].name == "triton"


def test_the_reason_names_what_is_missing() -> None:
    backend = _build("fp8")
    pools = backend.state.pools
    window, extra = pools.window(0), pools.compressed(1)
    cpu = torch.device("cpu")
    with force_variant(ATTENTION, "pipelined"), dispatch.force_path(dispatch.TRITON_INTERPRETER):
        # tiny: head dim 128 with 64 rope channels on fp8 caches is what pipelined takes
        assert named_rejection(ATTENTION, cpu, window, extra, 8, 128) is None
        assert "head_dim 96" in (named_rejection(ATTENTION, cpu, window, extra, 8, 96) or "")
    with force_variant(ATTENTION, "ws"), pytest.raises(ConfigError, match="triton path"):
        named_rejection(ATTENTION, cpu, window, extra, 8, 128)
    assert named_rejection(ATTENTION, cpu, window, extra, 8, 96) is None  # the default
