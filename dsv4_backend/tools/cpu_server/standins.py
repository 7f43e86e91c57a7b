"""The CPU serving kit: what lets sglang 0.5.23's own DeepSeek-V4 server run on CPU tensors.

sglang's generic (non-CUDA) path serves a DeepSeek-V4 checkpoint on the CPU through its own
scheduler, tokenizer manager, ``ModelRunner``, pool, ``DeepseekV4ForCausalLM`` and this
package's backend, except for a few ops outside attention that only have CUDA (JIT, TileLang,
sgl-kernel) kernels on that path. :data:`STAND_INS` lists each replacement: the sglang place it
replaces, why, and the torch (or sglang's own torch / Triton) code that serves it. None touches
attention, planning, the backend's kernels or sglang's runners.

Loaded in every sglang process by the plugin entry point ``dsv4_cpu_server`` (group
``sglang.srt.plugins``), and only when ``DSV4_CPU_SERVING_KIT=1`` is set (``scripts/dsv4
serve`` and the server tests set it); with a CUDA device visible it refuses to load. sglang's
own switches to its torch paths go with it (:data:`SGLANG_TORCH_SWITCHES`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dsv4_backend import envs
from dsv4_backend.errors import ConfigError
from dsv4_backend.tools.cpu_server.environment import ENABLE_ENV, SGLANG_TORCH_SWITCHES

logger = logging.getLogger("sglang.srt.plugins.dsv4_backend")


@dataclass(frozen=True)
class StandIn:
    """One replacement: ``replaces`` (sglang file:line), ``why`` it cannot run on the CPU,
    ``install`` (patches sglang in this process)."""

    name: str
    replaces: str
    why: str
    install: Callable[[], None]


# ----------------------------------------------------------------------------------- RoPE
def unscaled_rope_fallback(cpu_rope: Callable[..., Any]) -> Callable[..., Any]:
    """sglang's CPU RoPE factory ``cpu_rope`` (YaRN only) that builds sglang's generic RoPE
    object for a layer without scaling (DeepSeek-V4's ratio-0 layers)."""
    from sglang.srt.layers.rotary_embedding import factory

    def get_rope_cpu(*args: Any) -> Any:
        # get_rope_wrapper's call: (head_size, rotary_dim, max_position, base, is_neox_style,
        # rope_scaling, dtype, partial_rotary_factor, device); get_rope takes the first 8.
        return factory.get_rope(*args[:8]) if args[5] is None else cpu_rope(*args)

    return get_rope_cpu


def _window_layer_rope() -> None:
    from sglang.srt.layers.rotary_embedding import base, factory

    factory.get_rope_cpu = unscaled_rope_fallback(factory.get_rope_cpu)
    # RotaryEmbedding picks vllm's kernel off CUDA unless it is on the CPU engine; the model
    # calls its own fused RoPE (below), never this object's forward.
    base._is_cpu = True


# ------------------------------------------------------------------------- hyper-connections
def _hyper_connections() -> None:
    from sglang.kernels.ops.layernorm.mhc import _mhc_pre_torch
    from sglang.srt.models import deepseek_v4

    def hc_pre(
        self: Any,
        x: torch.Tensor,
        hc_fn: torch.Tensor,
        hc_scale: torch.Tensor,
        hc_base: torch.Tensor,
        norm: Any = None,
        forward_batch: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        post, comb, y = _mhc_pre_torch(
            x,
            hc_fn,
            hc_scale,
            hc_base,
            self.rms_norm_eps,
            self.hc_eps,
            self.hc_eps,
            deepseek_v4.MHC_POST_MULT_VALUE,
            self.hc_sinkhorn_iters,
        )
        return y, post.squeeze(-1), comb, False

    def hc_head(
        self: Any, x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: Any
    ) -> torch.Tensor:
        return deepseek_v4.hc_head_torch(
            x, hc_fn, hc_scale, hc_base, norm_eps=self.norm_eps, hc_eps=self.hc_eps
        )

    deepseek_v4.DeepseekV4DecoderLayerBase.hc_pre = hc_pre
    deepseek_v4.DeepseekV4Model.hc_head = hc_head


def mhc_combine(
    x_flat: torch.Tensor, pre: torch.Tensor, hc: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """sglang's ``mhc_combine``: ``y[m, h] = sum_k pre[m, k] * x_flat[m, k * H + h]`` in fp32.

    ``x_flat`` ``[M, hc * H]``, ``pre`` ``[M, hc]`` -> ``[M, H]`` of ``out_dtype``."""
    streams = x_flat.float().unflatten(1, (hc, -1))  # [M, hc, H]
    return (pre.float().unsqueeze(-1) * streams).sum(dim=1).to(out_dtype)


def _sinkhorn_split_and_combine() -> None:
    from sglang.kernels.ops.layernorm import mhc
    from sglang.test.kernels.mhc import hc_split_sinkhorn_torch

    # Both are imported from the module at call time by their callers.
    mhc.hc_split_sinkhorn = hc_split_sinkhorn_torch
    mhc.mhc_combine = mhc_combine


# ----------------------------------------------------------------- q / kv RMSNorm + RoPE
def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool) -> torch.Tensor:
    """DeepSeek-V4's interleaved RoPE: ``x`` ``[T, H, R]`` fp32 as ``R / 2`` complex pairs
    times ``freqs_cis`` ``[T, R / 2]`` complex64 (conjugated when ``inverse``)."""
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
    freqs = freqs_cis.conj() if inverse else freqs_cis
    return torch.view_as_real(pairs * freqs[:, None, :]).flatten(-2)


def _rope_tail_(x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor) -> None:
    """RoPE of the last ``2 * freqs_cis.shape[-1]`` dims of ``x`` ``[T, (H,) D]`` fp32, in
    place, at ``positions`` ``[T]``."""
    rope = 2 * freqs_cis.shape[-1]
    heads = x.view(x.shape[0], -1, x.shape[-1])
    heads[..., -rope:] = _rotate(heads[..., -rope:], freqs_cis[positions.long()], False)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def fused_rope_inplace(
    q: torch.Tensor,
    k: torch.Tensor | None,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
    inverse: bool = False,
) -> None:
    """sglang's ``fused_rope_inplace``: RoPE of ``q`` (and ``k``) ``[T, (H,) R]`` in place at
    ``positions`` ``[T]``, ``freqs_cis`` ``[max_len, R / 2]`` complex64 (``inverse``: undo)."""
    freqs = freqs_cis[positions.long()]
    for t in (q, k):
        if t is not None:
            heads = t if t.ndim == 3 else t.unsqueeze(1)
            heads.copy_(_rotate(heads.float(), freqs, inverse).to(t.dtype))


def fused_norm_rope_inplace(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    freq_cis: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """sglang's ``fused_norm_rope_inplace``: ``kv`` ``[T, D]`` RMS-normed with ``weight``
    ``[D]``, its last ``R`` dims roped, in place."""
    # The kernel rounds the normed row to the activation dtype before its RoPE.
    x = (_rms(kv.float(), eps) * weight.float()).to(kv.dtype).float()
    _rope_tail_(x, freq_cis, positions)
    kv.copy_(x.to(kv.dtype))


def fused_q_norm_rope(
    q_input: torch.Tensor,
    q_output: torch.Tensor,
    eps: float | None,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """sglang's ``fused_q_norm_rope``: each head of ``q_input`` ``[T, H, D]`` RMS-normed
    without weight (unless ``eps`` is None), its last ``R`` dims roped, into ``q_output``
    (bf16, or fp8 rounded through bf16 as the kernel's fp8 path does)."""
    x = q_input.float()
    if eps is not None:
        x = _rms(x, eps).to(q_input.dtype).float()
    _rope_tail_(x, freqs_cis, positions)
    q_output.copy_(x.to(q_input.dtype))


def _norm_rope() -> None:
    from sglang.srt.models import deepseek_v4, deepseek_v4_dspark

    replacements = {
        "fused_rope_inplace": fused_rope_inplace,
        "fused_norm_rope_inplace": fused_norm_rope_inplace,
        "fused_q_norm_rope": fused_q_norm_rope,
    }
    for module in (deepseek_v4, deepseek_v4_dspark):
        for name, function in replacements.items():
            if hasattr(module, name):
                setattr(module, name, function)


# ------------------------------------------------------------------------ shared experts
def silu_and_mul_clamp(input: torch.Tensor, output: torch.Tensor, limit: float) -> None:
    """sglang's ``silu_and_mul_clamp``: ``input`` ``[M, 2N]`` (gate | up) ->
    ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` into ``output`` ``[M, N]``."""
    gate, up = input.float().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    output.copy_(act.to(output.dtype))


def _swiglu_clamp() -> None:
    from sglang.srt.models import deepseek_v2

    deepseek_v2.silu_and_mul_clamp = silu_and_mul_clamp


# ----------------------------------------------------------- sglang's Triton host kernels
def _triton_in_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return  # every @triton.jit is an InterpretedFunction already
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def interpreted(fn: JITFunction) -> InterpretedFunction:
        found = fn.__dict__.get("_dsv4_interpreted")
        if found is None:
            found = fn.__dict__["_dsv4_interpreted"] = InterpretedFunction(fn.fn)
        return found

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return interpreted(self).run(*args, grid=grid, warmup=warmup, **kwargs)

    def call(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
        return interpreted(self)(*args, **kwargs)  # a device helper inside a kernel

    JITFunction.run = run
    JITFunction.__call__ = call


def _eagle_tree_kernels() -> None:
    from sglang.kernels.ops.speculative import spec_tree

    spec_tree._is_xpu = True


def _device_empty_cache() -> None:
    torch.cpu.empty_cache = lambda: None  # type: ignore[attr-defined]


STAND_INS: tuple[StandIn, ...] = (
    StandIn(
        "window-layer RoPE object",
        "srt/layers/rotary_embedding/factory.py:478 (get_rope_cpu), base.py:138",
        "ratio-0 layers build their RoPE without scaling and the CPU factory asserts YaRN; "
        "the RotaryEmbedding it builds imports vllm's kernel off the CPU engine",
        _window_layer_rope,
    ),
    StandIn(
        "hyper-connection pre / head",
        "srt/models/deepseek_v4.py:3345 (hc_pre: hc_split_sinkhorn at 3483), :3916 (hc_head)",
        "TileLang / JIT kernels; sglang's own _mhc_pre_torch (kernels/ops/layernorm/mhc.py) "
        "and hc_head_torch (models/deepseek_v4.py) serve them",
        _hyper_connections,
    ),
    StandIn(
        "hyper-connection Sinkhorn split and combine (DeepSeek-V4.1)",
        "kernels/ops/layernorm/mhc.py:427 (hc_split_sinkhorn: a TileLang kernel at :453) and "
        ":2743 (mhc_combine), called by V4.1's hc_pre_from_prev_sublayer path "
        "(models/deepseek_v4_mhc.py:322, :517)",
        "TileLang only, and a Triton kernel that takes 70 % of a V4.1 step in the interpreter; "
        "sglang's own torch reference hc_split_sinkhorn_torch (sglang/test/kernels/mhc.py:6) "
        "and the combine's sum in torch",
        _sinkhorn_split_and_combine,
    ),
    StandIn(
        "q / kv RMSNorm + RoPE",
        "kernels/ops/attention/dsv4/norm_rope.py:142, :173, :193 (as bound in "
        "models/deepseek_v4.py and deepseek_v4_dspark.py)",
        "CUDA JIT kernels; the same math in torch (DeepSeek-V4's interleaved RoPE)",
        _norm_rope,
    ),
    StandIn(
        "shared experts' clamped SwiGLU",
        "srt/models/deepseek_v2.py:490 (silu_and_mul_clamp)",
        "a CUDA JIT kernel (swiglu_limit of DeepSeek-V4 checkpoints); the same math in torch",
        _swiglu_clamp,
    ),
    StandIn(
        "sglang's Triton host kernels",
        "srt/mem_cache/allocation.py (assign_req_to_token_pool, get_last_loc), "
        "kernels/ops/speculative/spec_tree.py:52, :210 (EAGLE tree build / greedy verify)",
        "Triton has no CPU driver: kernels launched on CPU tensors run in Triton's "
        "interpreter (as under TRITON_INTERPRET=1)",
        _triton_in_interpreter,
    ),
    StandIn(
        "EAGLE tree build / greedy verify branch",
        "kernels/ops/speculative/spec_tree.py:412, :510 (the CPU engine's sgl-kernel ops)",
        "off CUDA and the CPU engine these return unverified buffers; the XPU branch runs "
        "sglang's own Triton ports",
        _eagle_tree_kernels,
    ),
    StandIn(
        "torch.cpu.empty_cache",
        "srt/models/deepseek_v4.py:5656 (set_embed_and_head)",
        "torch.cpu has no empty_cache; nothing to free",
        _device_empty_cache,
    ),
)


def enabled() -> bool:
    """Whether this process is to load the kit: ``DSV4_CPU_SERVING_KIT=1``, in a process
    sglang started (its scheduler, where the model runs; detokenizer, ...). The process that
    starts the server or an ``Engine`` runs no model and keeps sglang unpatched, so a test
    process that starts an ``Engine`` serves its other tests sglang's own code."""
    return envs.CPU_SERVING_KIT.get() == "1" and multiprocessing.parent_process() is not None


_installed = False


def load() -> None:
    """The plugin entry point: install every stand-in when :func:`enabled`, once per process.

    Raises
    ------
    ConfigError
        When a CUDA device is visible: the kit is for CPU servers only.
    """
    global _installed
    if not enabled() or _installed:
        return
    if torch.cuda.is_available():
        raise ConfigError(
            f"{ENABLE_ENV}=1 with a CUDA device visible: the CPU serving kit replaces CUDA "
            "kernels outside attention with torch code and is for CPU servers only; unset it"
        )
    for name, value in SGLANG_TORCH_SWITCHES.items():
        os.environ.setdefault(name, value)
    for stand_in in STAND_INS:
        stand_in.install()
    _installed = True
    # A warning (shown before sglang configures this process's logging): a server with
    # stand-ins is a test bed, not a deployment.
    logger.warning(
        "dsv4 CPU serving kit in this process: %d sglang ops outside attention replaced (%s)",
        len(STAND_INS),
        ", ".join(s.name for s in STAND_INS),
    )
