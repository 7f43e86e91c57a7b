"""The CPU serving kit (``tools/cpu_server/standins.py``): where it loads, and that its torch
stand-ins compute what sglang's own ports of the replaced kernels compute.

The oracles are sglang's Triton ports for other platforms, run in Triton's interpreter:
``apply_rotary_emb_triton`` (the RoPE its HIP / XPU branches run), ``silu_and_mul_clamp_triton``
(its HIP clamped SwiGLU) and ``mhc_combine`` (the Triton kernel the V4.1 path calls).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from marks import needs_interpreter

from dsv4_backend.errors import ConfigError
from dsv4_backend.tools.cpu_server import standins
from dsv4_backend.tools.cpu_server.environment import ENABLE_ENV

pytestmark = pytest.mark.sglang

T, H, D, R = 5, 3, 128, 64


def freqs(max_len: int = 32, rope: int = R) -> torch.Tensor:
    """``[max_len, rope / 2]`` complex64 rotations (DeepSeek-V4's ``freqs_cis``)."""
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2).float() / rope))
    angles = torch.outer(torch.arange(max_len).float(), inv)
    return torch.polar(torch.ones_like(angles), angles)


POSITIONS = torch.tensor([0, 3, 7, 30, 31])


def test_the_kit_loads_only_where_asked_in_sglangs_processes(monkeypatch) -> None:
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    assert not standins.enabled()  # not asked
    monkeypatch.setenv(ENABLE_ENV, "1")
    assert standins.enabled()
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: None)
    assert not standins.enabled()  # the process that starts a server or an Engine


def test_the_kit_refuses_a_machine_with_a_cuda_device(monkeypatch) -> None:
    monkeypatch.setenv(ENABLE_ENV, "1")
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="for CPU servers only"):
        standins.load()


def test_every_stand_in_names_the_sglang_place_it_replaces() -> None:
    for stand_in in standins.STAND_INS:
        assert ".py:" in stand_in.replaces and stand_in.why, stand_in.name


@needs_interpreter
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_equals_sglangs_triton_port(inverse: bool) -> None:
    from sglang.kernels.ops.attention.dsv4.rope import apply_rotary_emb_triton

    q = torch.randn(T, H, R, generator=torch.Generator().manual_seed(0)).bfloat16()
    k = torch.randn(T, R, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected_q, expected_k = q.clone(), k.clone()
    apply_rotary_emb_triton(expected_q, freqs(), positions=POSITIONS, inverse=inverse)
    apply_rotary_emb_triton(expected_k, freqs(), positions=POSITIONS, inverse=inverse)
    standins.fused_rope_inplace(q, k, freqs(), POSITIONS, inverse=inverse)
    torch.testing.assert_close(q.float(), expected_q.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k.float(), expected_k.float(), atol=1e-2, rtol=1e-2)
    assert not torch.equal(q, q.new_zeros(q.shape))


@needs_interpreter
def test_q_and_kv_norm_rope_are_rmsnorm_then_sglangs_rope() -> None:
    from sglang.kernels.ops.attention.dsv4.rope import apply_rotary_emb_triton

    generator = torch.Generator().manual_seed(2)
    q = (torch.randn(T, H, D, generator=generator) * 3).bfloat16()
    out = torch.empty_like(q)
    standins.fused_q_norm_rope(q, out, 1e-6, freqs(), POSITIONS)
    normed = (q.float() * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + 1e-6)).bfloat16()
    tail = normed[..., -R:].clone()
    apply_rotary_emb_triton(tail, freqs(), positions=POSITIONS)
    torch.testing.assert_close(out[..., :-R], normed[..., :-R], atol=0, rtol=0)
    torch.testing.assert_close(out[..., -R:].float(), tail.float(), atol=2e-2, rtol=2e-2)

    kv = (torch.randn(T, D, generator=generator) * 3).bfloat16()
    weight = torch.rand(D, generator=generator) + 0.5
    expected = kv.float() * torch.rsqrt(kv.float().square().mean(-1, keepdim=True) + 1e-6)
    expected = (expected * weight).bfloat16()
    tail = expected[:, -R:].clone()
    apply_rotary_emb_triton(tail, freqs(), positions=POSITIONS)
    standins.fused_norm_rope_inplace(kv, weight, 1e-6, freqs(), POSITIONS)
    torch.testing.assert_close(kv[:, :-R], expected[:, :-R], atol=0, rtol=0)
    torch.testing.assert_close(kv[:, -R:].float(), tail.float(), atol=2e-2, rtol=2e-2)


@needs_interpreter
def test_clamped_swiglu_equals_sglangs_triton_port() -> None:
    from sglang.kernels.ops.activation.silu_and_mul_clamp_hip import silu_and_mul_clamp_triton

    gate_up = (torch.randn(6, 2 * 96, generator=torch.Generator().manual_seed(3)) * 8).bfloat16()
    out = torch.empty(6, 96, dtype=torch.bfloat16)
    standins.silu_and_mul_clamp(gate_up, out, 10.0)
    expected = silu_and_mul_clamp_triton(gate_up, 10.0)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert gate_up[:, :96].float().max() > 10  # the clamp is exercised


@needs_interpreter
def test_hyper_connection_combine_equals_sglangs_kernel() -> None:
    from sglang.kernels.ops.layernorm.mhc import mhc_combine

    generator = torch.Generator().manual_seed(4)
    x_flat = torch.randn(7, 4 * 40, generator=generator).bfloat16()
    pre = torch.rand(7, 4, generator=generator)
    got = standins.mhc_combine(x_flat, pre, 4, torch.bfloat16)
    torch.testing.assert_close(got, mhc_combine(x_flat, pre, 4, torch.bfloat16))
