"""FP8 sparse attention with sink, warp-specialised in Gluon: the ``ws`` attention kernel.

The design plain Triton cannot express (``kernels/attention/pipelined.py``), after
FlashMLA's SM90 sparse FP8 decode, for H = 64 heads a program row and D = 512 (448 e4m3 + 64
bf16 channels, 584-byte tokens; or dense bf16 rows). Three one-warpgroup partitions on
Hopper (sm_90a, this module):

* the producer (``kernels/attention/ws_parts.py``, shared with Blackwell's kernel)
  streams each 64-key block into a ring of ``NUM_BUF`` bf16 key buffers with cp.async,
  dequantising fp8 units as they land, and leaves the keys' validity beside them;
* warpgroup 0 (``_softmax_partition``) runs ``s = q k^T`` once a block over all 64 keys
  (wgmma m64n64 from shared memory), the online softmax and ``acc += p k`` over the first 256
  output channels (``p`` from registers); it hands ``p`` (bf16) and the rescale to warpgroup 1
  through shared memory (``p_ready`` / ``p_free``);
* warpgroup 1 (``_value_partition``) runs ``acc += p k`` over the other 256 channels (``p``
  from shared memory) and stores its half of the output;
* so dequantisation overlaps the MMAs, q k^T is computed once, and the accumulators and a
  dequantised block never share registers; no empty splits, the merge in the last split and
  bf16 output.

On Blackwell (sm_100a) :func:`sparse_attention_ws` runs ``kernels/attention/ws_sm100.py``
(tcgen05 into tensor memory) instead. Gluon does not run in the Triton interpreter: both are
compiled ahead of time on the CPU (``python -m dsv4_backend.tools.aot_compile``) and have
never run, so they are checked from their SASS only.

Both use Gluon APIs of Triton 3.8 (:data:`GLUON_APIS`). Under an older Triton the launcher runs
a kernel precompiled with 3.8 (``kernels/device/precompiled.py``, from
``DSV4_PRECOMPILED_DIR``; built by ``python -m dsv4_backend.tools.precompile``) where one
exists for the launch, and
:func:`ws_unsupported_reason` names the missing kernel where none does.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.errors import BatchError
from dsv4_backend.kernels.attention import ws_sm100 as sm100
from dsv4_backend.kernels.attention.common import (
    MAX_SPLITS,
    AttentionCall,
    KeySpans,
    key_spans,
    launch_num_splits,
    page_geometry,
    pipelined_unsupported_reason,
)
from dsv4_backend.kernels.attention.device import LOG2E, split_blocks
from dsv4_backend.kernels.attention.ws_parts import (
    BLOCK_M,
    BLOCK_N,
    HEAD_DIM,
    NUM_BUF,
    NUM_STAGES,
    PRODUCER_REGS,
    PRODUCER_WARPS,
    final_scale,
    finish_splits,
    producer_partition,
    q_to_shared,
    ring_buffers,
)
from dsv4_backend.kernels.device import precompiled

#: Warps of each consumer partition (one warpgroup each).
CONSUMER_WARPS = 4
#: Registers a thread of warpgroup 1 (``p k`` only) keeps (warpgroup 0, which also runs
#: ``q k^T`` and the softmax, gets what the producer and it leave).
VALUE_REGS = 160


@gluon.jit
def _softmax_partition(
    q_smem, k_ring, valid_ring, p_smem, alpha_smem, scale_smem, ready, empty, p_ready, p_free,
    done, num_blocks, qk_scale, sink_ptr, H, splits,
    BLOCK_M: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
):  # fmt: skip
    """Warpgroup 0: ``s = q k^T`` once a block over all its keys (m64n64), the online softmax,
    ``p`` (bf16) and the rescale ``alpha`` handed to warpgroup 1 through shared memory, and
    ``acc += p k`` over output channels ``[0, D/2)``. Returns ``(acc [M, D/2] fp32, m [M],
    l [M])``; before returning it leaves the lines' final output scale (one split) for
    warpgroup 1 in ``scale_smem`` and arrives on ``done``."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16]
    )
    LINES: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    acc = gl.zeros([BLOCK_M, D // 2], gl.float32, layout=ACC)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=LINES)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=LINES)
    for i in range(num_blocks):
        buf = i % NUM_BUF
        mbarrier.wait(ready.index(buf), (i // NUM_BUF) & 1)
        k = k_ring.index(buf)
        s = warpgroup_mma(
            q_smem, k.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT),
            use_acc=False,
        )  # fmt: skip
        valid = valid_ring.index(buf).load(gl.SliceLayout(0, S_LAYOUT)) != 0
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        p_fp32 = gl.exp2(s - m_ref[:, None])
        alpha = gl.exp2(m_i - m_ref)
        l_i = l_i * alpha + gl.sum(p_fp32, axis=1)
        m_i = m_new
        p = p_fp32.to(gl.bfloat16)
        # Warpgroup 1 has read the previous block's p and alpha (a fresh barrier passes).
        mbarrier.wait(p_free, (i & 1) ^ 1)
        p_smem.store(p)
        alpha_smem.store(alpha)
        gl.barrier()  # every thread's stores, then one arrive
        fence_async_shared()  # p's generic-proxy stores before warpgroup 1's wgmma reads
        mbarrier.arrive(p_ready)
        alpha_acc = gl.convert_layout(alpha, gl.SliceLayout(1, ACC))
        acc = warpgroup_mma(
            gl.convert_layout(p, P_OPERAND), k.slice(0, D // 2, dim=1), acc * alpha_acc[:, None]
        )
        gl.barrier()  # the (synchronous) wgmma has read the buffer; then one arrive
        mbarrier.arrive(empty.index(buf))
    lines = gl.arange(0, BLOCK_M, layout=LINES)
    sink = gl.load(sink_ptr + lines, mask=lines < H, other=0.0) * LOG2E
    if splits == 1:
        scale_smem.store(final_scale(m_i, l_i, sink))
        gl.barrier()
        mbarrier.arrive(done)
    return acc, m_i, l_i


@gluon.jit
def _gpu_fence(WARPS: gl.constexpr):
    """``fence.acq_rel.gpu`` once a thread (of a ``WARPS``-warp partition): its global stores
    are ordered before a release that another partition's thread makes after the join."""
    token = gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    gl.inline_asm_elementwise(
        "fence.acq_rel.gpu;\n mov.b32 $0, $1;",
        "=r,r",
        [token],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _value_partition(
    k_ring, p_smem, alpha_smem, scale_smem, ready, empty, p_ready, p_free, done, out_ptr,
    part_ptr, row, stride_ot, stride_pt, H, split, splits, num_blocks, BLOCK_M: gl.constexpr,
    D: gl.constexpr, NUM_BUF: gl.constexpr,
):  # fmt: skip
    """Warpgroup 1: ``acc += p k`` over output channels ``[D/2, D)``, with ``p`` and ``alpha``
    from warpgroup 0's shared memory, then that half of the output (one split: bf16, scaled by
    warpgroup 0's final scale) or of the partial numerator (fp32)."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16]
    )
    LINES: gl.constexpr = gl.SliceLayout(1, ACC)
    acc = gl.zeros([BLOCK_M, D // 2], gl.float32, layout=ACC)
    for i in range(num_blocks):
        buf = i % NUM_BUF
        mbarrier.wait(ready.index(buf), (i // NUM_BUF) & 1)
        mbarrier.wait(p_ready, i & 1)
        alpha = alpha_smem.load(LINES)
        acc = warpgroup_mma(p_smem, k_ring.index(buf).slice(D // 2, D // 2, dim=1),
                            acc * alpha[:, None])  # fmt: skip
        gl.barrier()  # the (synchronous) wgmma has read p and the buffer; then one arrive each
        mbarrier.arrive(p_free)
        mbarrier.arrive(empty.index(buf))
    lines = gl.arange(0, BLOCK_M, layout=LINES)
    chans = D // 2 + gl.arange(0, D // 2, layout=gl.SliceLayout(0, ACC))
    line_ok = (lines < H)[:, None]
    if splits == 1:
        mbarrier.wait(done, 0)
        out = (acc * scale_smem.load(LINES)[:, None]).to(gl.bfloat16)
        gl.store(out_ptr + row * stride_ot + lines[:, None] * D + chans[None, :], out, mask=line_ok)
    else:
        part_rows = row * stride_pt + lines * (gl.num_programs(1) * D)
        gl.store(part_ptr + part_rows[:, None] + split * D + chans[None, :], acc, mask=line_ok)
        _gpu_fence(4)  # before warpgroup 0's release of the split count


@gluon.jit
def _ws_attention_kernel(
    q_ptr,  # [T, H, D] bf16
    win_ptr,  # uint8 window cache pages (dense: [slots, D] bf16 rows)
    win_idx_ptr,  # [T, Ws] int32
    win_len_ptr,  # [T] int32
    ext_ptr,  # the extra cache, as win_ptr (the window's on a window-only layer)
    ext_idx_ptr,  # [T, Ke] int32
    ext_len_ptr,  # [T] int32
    sink_ptr,  # [H] fp32
    out_ptr,  # [T, H, D] bf16
    part_ptr,  # [T, H, S, D] fp32 partial numerators (S > 1)
    ml_ptr,  # [T, H, S, 2] fp32 (log2-domain max, denominator) per split (S > 1)
    count_ptr,  # [T] int32 finished splits, zeroed by the launcher (S > 1)
    stride_qt,
    stride_win_idx_t,
    stride_ext_idx_t,
    stride_ot,
    stride_pt,
    stride_mt,
    H,
    win_width,
    ext_width,
    win_page_shift,
    win_page_bytes,
    win_scale_region,
    ext_page_shift,
    ext_page_bytes,
    ext_scale_region,
    qk_scale,
    D: gl.constexpr,
    NOPE_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_S: gl.constexpr,
    HAS_EXTRA: gl.constexpr,
    FP8: gl.constexpr,
    NUM_BUF: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CONSUMER_WARPS: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
    VALUE_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = 64
    row = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    n_win, n_ext, win_blocks, splits, first, num_blocks = split_blocks(
        win_len_ptr, ext_len_ptr, row, split, gl.num_programs(1), win_width, ext_width,
        HAS_EXTRA, BLOCK_N,
    )  # fmt: skip
    if split >= splits:  # no empty splits: this one has no block
        return
    q_smem = q_to_shared(q_ptr, row, stride_qt, H, BLOCK_M, D)
    k_ring, valid_ring, p_smem = ring_buffers(NUM_BUF, BLOCK_M, BLOCK_N, D)
    LINE_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], LINE_SMEM)
    scale_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], LINE_SMEM)
    ready = mbarrier.allocate_mbarrier(batch=NUM_BUF)
    empty = mbarrier.allocate_mbarrier(batch=NUM_BUF)
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(empty.index(b), count=2)  # both warpgroups' p k
    p_ready = mbarrier.allocate_mbarrier()
    p_free = mbarrier.allocate_mbarrier()
    done = mbarrier.allocate_mbarrier()
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(done, count=1)
    fence_async_shared()  # q and the barriers, before any partition's wgmma or wait
    gl.barrier()

    win_idx_row = win_idx_ptr + row * stride_win_idx_t
    ext_idx_row = ext_idx_ptr + row * stride_ext_idx_t
    acc, m_i, l_i = gl.warp_specialize(
        [
            (_softmax_partition, (q_smem, k_ring, valid_ring, p_smem, alpha_smem, scale_smem,
                                  ready, empty, p_ready, p_free, done, num_blocks, qk_scale,
                                  sink_ptr, H, splits, BLOCK_M, D, BLOCK_N, NUM_BUF)),
            (_value_partition, (k_ring, p_smem, alpha_smem, scale_smem, ready, empty, p_ready,
                                p_free, done, out_ptr, part_ptr, row, stride_ot, stride_pt, H,
                                split, splits, num_blocks, BLOCK_M, D, NUM_BUF)),
            (producer_partition, (win_ptr, ext_ptr, win_idx_row, ext_idx_row, n_win, n_ext,
                                  win_blocks, first, num_blocks, win_page_shift, win_page_bytes,
                                  win_scale_region, ext_page_shift, ext_page_bytes,
                                  ext_scale_region, k_ring, valid_ring, ready, empty, FP8, D,
                                  NOPE_DIM, BLOCK_N, NUM_BUF, NUM_STAGES)),
        ],
        [CONSUMER_WARPS, PRODUCER_WARPS],
        [VALUE_REGS, PRODUCER_REGS],
    )  # fmt: skip

    # Warpgroup 0's half of the output channels (warpgroup 1 stored the other half).
    ACC: gl.constexpr = acc.type.layout
    ML: gl.constexpr = gl.SliceLayout(1, ACC)
    m_i = gl.convert_layout(m_i, ML)
    l_i = gl.convert_layout(l_i, ML)
    lines = gl.arange(0, BLOCK_M, layout=ML)
    offs_d = gl.arange(0, D // 2, layout=gl.SliceLayout(0, ACC))
    line_ok = (lines < H)[:, None]
    if splits == 1:
        out = (acc * scale_smem.load(ML)[:, None]).to(gl.bfloat16)
        gl.store(
            out_ptr + row * stride_ot + lines[:, None] * D + offs_d[None, :], out, mask=line_ok
        )
    else:
        part_rows = row * stride_pt + lines * (gl.num_programs(1) * D)
        gl.store(part_ptr + part_rows[:, None] + split * D + offs_d[None, :], acc, mask=line_ok)
        finish_splits(m_i, l_i, sink_ptr, part_ptr, ml_ptr, count_ptr, out_ptr, row, split,
                       splits, stride_pt, stride_mt, stride_ot, H, D, BLOCK_M, BLOCK_S)  # fmt: skip


# ------------------------------------------------------------------------------ launcher
#: The Gluon APIs of Triton 3.8 the ws kernels call which Triton 3.6 lacks: ``(module, name,
#: label)``, probed by :func:`missing_gluon_apis`.
GLUON_APIS = (
    (mbarrier, "allocate_mbarrier", "mbarrier.allocate_mbarrier"),
    (async_copy, "async_load", "async_copy.async_load"),
    (gl, "barrier", "gl.barrier"),
)
#: ``BLOCK_S`` of every split count a launch can take (``next_power_of_2`` of 1 ...
#: ``MAX_SPLITS``): the ws kernels a precompiled package holds for each layer kind.
BLOCK_S_VALUES = tuple(sorted({triton.next_power_of_2(s) for s in range(1, MAX_SPLITS + 1)}))


def missing_gluon_apis() -> tuple[str, ...]:
    """The :data:`GLUON_APIS` the installed Triton lacks (empty: it compiles the ws kernels).
    A probe of the APIs rather than a version test: it names what is missing, and judges a
    nightly or vendor build (``3.7.0+git...``) by what it has, not by its version string."""
    return tuple(label for module, name, label in GLUON_APIS if not hasattr(module, name))


def ws_target(capability: tuple[int, int]) -> str:
    """The compile target of a device of compute ``capability``: ``sm_90a`` for 9.0 (the
    architecture-specific one: wgmma and tcgen05 need it)."""
    return f"sm_{capability[0]}{capability[1]}a"


def ws_unsupported_reason(
    device: torch.device,
    window: TokenCache,
    extra: TokenCache | None,
    heads: int,
    dim: int,
    splits: int | None = None,
) -> str | None:
    """Why the ws kernel cannot run here (None when it can): a compiled GPU kernel (Gluon has
    no interpreter) for Hopper or Blackwell (:func:`ws_arch_reason`), the caches and shapes
    :func:`ws_inputs_reason` takes, and a Triton that compiles it or else a precompiled kernel
    for the launch of ``splits`` key splits (None: for every count the launcher may pick)."""
    if device.type != "cuda":
        return "Gluon kernels run on CUDA devices only (no interpreter)"
    capability = torch.cuda.get_device_capability(device)
    reason = ws_arch_reason(capability) or ws_inputs_reason(window, extra, heads, dim)
    missing = missing_gluon_apis()
    if reason is not None or not missing:
        return reason
    return _precompiled_reason(
        missing, triton.__version__, precompiled.precompiled_directory(), capability, dim,
        dim - window.rope_dim, extra is not None, window.fmt == "fp8", splits,
    )  # fmt: skip


@functools.cache
def _precompiled_reason(
    missing: tuple[str, ...],
    version: str,
    directory: Path | None,
    capability: tuple[int, int],
    dim: int,
    nope_dim: int,
    has_extra: bool,
    fp8: bool,
    splits: int | None,
) -> str | None:
    """Why a Triton ``version`` lacking the Gluon APIs ``missing`` has no precompiled ws
    kernel in ``directory`` for these launches (:func:`ws_unsupported_reason`'s arguments);
    None when it has them all. Memoised: the reason is asked every layer of every forward."""
    target = ws_target(capability)
    for block_s in BLOCK_S_VALUES if splits is None else (triton.next_power_of_2(splits),):
        kernel, launch = ws_kernel(capability[0], dim, nope_dim, block_s, has_extra, fp8)
        if precompiled.find(directory, kernel, launch, target) is not None:
            continue
        key = precompiled.kernel_key(kernel, launch, target)
        where = (
            f"{precompiled.DIRECTORY_ENV} is not set"
            if directory is None
            else f"{precompiled.DIRECTORY_ENV}={directory} has no {key}.json"
        )
        constexprs = ", ".join(f"{k}={v}" for k, v in launch.items())
        return (
            f"Triton {version} cannot compile the Gluon ws kernels (it lacks "
            f"{', '.join(missing)}; they need Triton 3.8) and no precompiled "
            f"{kernel.fn.__name__} for {target} with {constexprs} was found ({where}); build "
            f"one with Triton 3.8: python -m dsv4_backend.tools.precompile --target {target} "
            "--out DIR"
        )
    return None


def precompiled_ws_kernel(
    capability: tuple[int, int], kernel: gluon.GluonJITFunction, launch: Mapping[str, Any]
) -> precompiled.PrecompiledKernel | None:
    """``kernel`` precompiled for a device of ``capability`` with the keyword arguments
    ``launch`` (:func:`ws_kernel`'s), from ``DSV4_PRECOMPILED_DIR`` (None without one)."""
    directory = precompiled.precompiled_directory()
    return precompiled.find(directory, kernel, launch, ws_target(capability))


def ws_arch_reason(capability: tuple[int, int]) -> str | None:
    """Why a device of compute ``capability`` has no ws kernel: Hopper (9.x) runs wgmma, data
    center Blackwell (10.x) tcgen05."""
    if capability[0] in (9, 10):
        return None
    major, minor = capability
    return f"compute capability {major}.{minor}; the ws kernels need 9.x (wgmma) or 10.x (tcgen05)"


def ws_inputs_reason(
    window: TokenCache, extra: TokenCache | None, heads: int, dim: int
) -> str | None:
    """Why the ws kernel cannot take these caches and shapes (None when it can): caches of one
    format, fp8 (as the pipelined kernel takes them) or dense bf16, at most 64 heads and head
    dim 512."""
    caches = [("window", window)] + ([("extra", extra)] if extra is not None else [])
    if extra is not None and extra.fmt != window.fmt:
        return f"window cache {window.fmt}, extra {extra.fmt}; the ws kernel takes one format"
    reason = None
    if window.fmt == "fp8":
        reason = pipelined_unsupported_reason(window, extra, dim)
    for name, cache in caches:
        if cache.fmt == "dense" and cache.storage.dtype != torch.bfloat16:
            reason = f"the {name} cache stores {cache.storage.dtype}; dense caches must be bf16"
    if reason is None and (heads > BLOCK_M or dim != HEAD_DIM):
        reason = f"{heads} heads of dim {dim}; the ws kernel takes <= {BLOCK_M} heads of {HEAD_DIM}"
    return reason


def _geometry(cache: TokenCache) -> tuple[int, int, int]:
    """The fp8 page geometry (``page_geometry``); zeros for a dense cache (rows of D)."""
    return page_geometry(cache) if cache.fmt == "fp8" else (0, 0, 0)


def sparse_attention_ws(
    call: AttentionCall,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The ws kernel's path of ``sparse_attention_with_sink``: ``[T, H, D]`` bf16, one row
    a program (heads padded to 64 M lines; ``rows_per_group``, the op's argument, is not
    used). Raises ``BatchError`` where
    :func:`ws_unsupported_reason` names a reason."""
    q, window, swa_indices, swa_lengths, extra_span, sink, softmax_scale = call.parts()
    extra = call.extra_cache
    rows, heads, dim = q.shape
    spans = key_spans(window, swa_indices, swa_lengths, extra_span, heads)
    splits = launch_num_splits(num_splits, rows, heads, spans.width, BLOCK_N, q.device)
    reason = ws_unsupported_reason(q.device, window, extra, heads, dim, splits)
    if reason is not None:
        raise BatchError(reason)
    if rows == 0:
        return torch.empty((0, heads, dim), dtype=torch.bfloat16, device=q.device)
    capability = torch.cuda.get_device_capability(q.device)
    kernel, launch = ws_kernel(
        capability[0], dim, dim - window.rope_dim, splits, spans.has_extra, window.fmt == "fp8"
    )
    if not missing_gluon_apis():
        args, out = ws_arguments(q.contiguous(), window, spans, sink, softmax_scale, splits)
        kernel[(rows, splits)](*args, **launch)
        return out
    compiled = precompiled_ws_kernel(capability, kernel, launch)
    assert compiled is not None  # ws_unsupported_reason found it
    # The kernel rounds q to bf16 as it loads it, so converting first gives the same bits and
    # the package holds one q dtype.
    q = q.to(torch.bfloat16).contiguous()
    args, out = ws_arguments(q, window, spans, sink, softmax_scale, splits)
    compiled.launch((rows, splits), args)
    return out


def ws_arguments(
    q: torch.Tensor,
    window: TokenCache,
    spans: KeySpans,
    sink: torch.Tensor,
    softmax_scale: float,
    splits: int,
) -> tuple[tuple[object, ...], torch.Tensor]:
    """The ws kernels' runtime arguments in their parameter order (:func:`ws_signature` gives
    their kinds) for ``q`` ``[T, H, D]`` (contiguous) over ``spans`` in ``splits`` key splits,
    and the ``[T, H, D]`` bf16 output they write. Allocates the partials (``[T, H, S, D]``
    fp32), their ``(max, denominator)`` (``[T, H, S, 2]`` fp32; both ``[1]`` for one split)
    and the zeroed ``[T]`` int32 split counters."""
    rows, heads, dim = q.shape
    out = torch.empty((rows, heads, dim), dtype=torch.bfloat16, device=q.device)
    part = torch.empty((rows, heads, splits, dim) if splits > 1 else (1,), device=q.device)
    ml = torch.empty((rows, heads, splits, 2) if splits > 1 else (1,), device=q.device)
    count = torch.zeros(rows, dtype=torch.int32, device=q.device)
    win_idx, ext_idx = spans.swa_indices, spans.ext_indices
    args = (
        q, window.storage, win_idx, spans.swa_lengths, spans.ext_cache.storage, ext_idx,
        spans.ext_lengths, sink.contiguous(), out, part, ml, count,
        q.stride(0), win_idx.stride(0), ext_idx.stride(0), out.stride(0),
        part.stride(0), ml.stride(0), heads, win_idx.shape[1], ext_idx.shape[1],
        *_geometry(window), *_geometry(spans.ext_cache), softmax_scale * LOG2E.value,
    )  # fmt: skip
    return args, out


def ws_signature(
    kernel: gluon.GluonJITFunction, launch: Mapping[str, Any]
) -> tuple[dict[str, str], frozenset[str]]:
    """The Triton kind of each runtime argument :func:`ws_arguments` passes ``kernel`` for the
    keyword arguments ``launch`` (:func:`ws_kernel`'s), and the arguments it makes multiples
    of 16, which a precompiled kernel is compiled to assume: every pointer (torch allocations
    and the contiguous index copies are 16-byte aligned), q's and the output's rows (H x 512),
    fp8 page and scale-region bytes (of 576-byte tokens) and, with several splits, the
    partials' rows (H x S x 512). No other integer (the index widths are the caller's)."""
    cache = "*u8" if launch["FP8"] else "*bf16"
    pointers = dict(
        q_ptr="*bf16", win_ptr=cache, win_idx_ptr="*i32", win_len_ptr="*i32", ext_ptr=cache,
        ext_idx_ptr="*i32", ext_len_ptr="*i32", sink_ptr="*fp32", out_ptr="*bf16",
        part_ptr="*fp32", ml_ptr="*fp32", count_ptr="*i32",
    )  # fmt: skip
    kinds = {
        name: pointers.get(name, "fp32" if name == "qk_scale" else "i32")
        for name in kernel.arg_names
        if name not in launch
    }
    aligned = {*pointers, "stride_qt", "stride_ot"}
    aligned |= {f"{c}_{f}" for c in ("win", "ext") for f in ("page_bytes", "scale_region")}
    if launch["BLOCK_S"] > 1:
        aligned.add("stride_pt")
    return kinds, frozenset(aligned)


def ws_kernel(
    major: int, dim: int, nope_dim: int, splits: int, has_extra: bool, fp8: bool
) -> tuple[gluon.GluonJITFunction, dict]:
    """The ws kernel for a device of compute capability ``major`` (10: Blackwell's, else
    Hopper's) and its constexprs and ``num_warps`` for a launch of ``splits`` key splits."""
    constexprs = dict(
        D=dim, NOPE_DIM=nope_dim, BLOCK_N=BLOCK_N, BLOCK_S=triton.next_power_of_2(splits),
        HAS_EXTRA=has_extra, FP8=fp8, NUM_BUF=NUM_BUF, NUM_STAGES=NUM_STAGES,
        PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
    )  # fmt: skip
    if major == 10:
        blackwell = dict(MMA_REGS=sm100.MMA_REGS, num_warps=sm100.SOFTMAX_WARPS)
        return sm100._ws_attention_kernel_sm100, {**constexprs, **blackwell}
    hopper = dict(CONSUMER_WARPS=CONSUMER_WARPS, VALUE_REGS=VALUE_REGS, num_warps=CONSUMER_WARPS)
    return _ws_attention_kernel, {**constexprs, **hopper}
