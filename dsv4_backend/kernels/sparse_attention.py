"""Sparse attention with a per-head sink over window keys plus compressed keys.

docs/design.md §2. Query row ``t`` attends, with all ``H`` heads, to the union of

* window keys: ``window`` cache slots ``swa_indices[t, c]`` for ``c < swa_lengths[t]``;
* extra keys (c4 top-k or c128 entries): ``extra`` cache slots ``extra_indices[t, c]`` for
  ``c < extra_lengths[t]``;

skipping slot ``-1``. K = V (one shared KV head, all ``D`` dims)::

    l = scale * q_h . k        o_h = sum exp(l) k / (sum exp(l) + exp(sink_h))

A row with no valid key outputs 0. Shapes: ``T`` rows, ``H`` heads, ``D`` head dim, ``Ws``
window index width, ``Ke`` extra index width, ``S`` key splits.

Triton kernel (flash decoding). Stage 1, grid ``(T, cdiv(H, BLOCK_H), S)``: a program takes
``BLOCK_H`` heads of one row (the M side of ``[BLOCK_H, D] x [D, BLOCK_N]``, so each key row is
loaded once per head block) and the ``s``-th of ``S`` equal chunks of the row's key list
(window columns, then extra columns), ``BLOCK_N`` keys at a time with an fp32 online softmax.
With ``S = 1`` it folds in the sink and writes the output; otherwise it writes an unnormalised
partial and stage 2, grid ``(T, H)``, merges the ``S`` partials with the sink.

Registers: ``D`` is not tiled. At ``D = 512`` a program holds fp32 ``[16, 512]`` q and
accumulator tiles and a ``[BLOCK_N, 512]`` fp32 key tile; 16 heads per program (sglang's grouped
MLA decode kernel uses the same) keeps that within 255 registers without spills at 8 warps
(``_launch_config``), where 64 heads could not. Key rows are then read once per head block,
from L2 after the first. Dots take fp32 operands (TF32 tensor cores on a GPU, exact in the
interpreter).

Every launch shape depends only on tensor shapes (no host reads of lengths), so the op can be
captured in a CUDA graph once compiled.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv4_backend.cache.token_cache import TokenCache
from dsv4_backend.errors import BatchError, ContractError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.fp8_device import load_dense_block, load_fp8_token_block

#: exp(x) = exp2(x * LOG2E): the kernels work in the log2 domain.
LOG2E = tl.constexpr(math.log2(math.e))
#: Heads per stage-1 program: the smallest ``tl.dot`` M tile; bounds registers at D = 512.
BLOCK_H = 16
#: Upper bound of key splits per row (stage 2 merges them in one tile).
MAX_SPLITS = 32
#: Rows per chunk of the torch path, so its gathered ``[rows, Ws + Ke, D]`` keys stay bounded.
_TORCH_CHUNK_ELEMENTS = 1 << 26


# --------------------------------------------------------------------------------- kernels
@triton.jit
def _load_keys(
    cache_ptr,  # dense: [num_slots, D] float; fp8: [num_pages, page_bytes] uint8
    stride_row,  # dense: elements per slot (fp8: unused)
    slots,  # [BLOCK_N] int32 cache slots, -1 = none
    mask_n,  # [BLOCK_N] bool columns inside the span
    offs_d,  # [BLOCK_D] int32 channel index
    D: tl.constexpr,
    FP8: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """Keys at ``slots`` as fp32 ``[BLOCK_N, BLOCK_D]``; 0 where masked or the slot is -1."""
    if FP8:
        k = load_fp8_token_block(
            cache_ptr, slots, offs_d, mask_n, NOPE_DIM, D - NOPE_DIM, PAGE_TOKENS
        )
    else:
        k = load_dense_block(cache_ptr, stride_row, slots, offs_d, mask_n, D)
    return k


@triton.jit
def _attend_span(
    q,  # [BLOCK_H, BLOCK_D] fp32
    acc,  # [BLOCK_H, BLOCK_D] fp32 unnormalised output
    m_i,  # [BLOCK_H] fp32 running max of log2-domain logits
    l_i,  # [BLOCK_H] fp32 running denominator
    cache_ptr,  # key cache storage (see _load_keys)
    stride_row,
    idx_ptr,  # [width] int32 slots of this row's span, -1 = none
    lo,  # first column of the span this program covers
    hi,  # one past its last column
    qk_scale,  # softmax scale * log2(e)
    offs_d,  # [BLOCK_D] int32
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
):
    """Online softmax over columns ``[lo, hi)`` of one index row; returns ``(acc, m_i, l_i)``."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        in_span = cols < hi
        slots = tl.load(idx_ptr + cols, mask=in_span, other=-1)
        k = _load_keys(cache_ptr, stride_row, slots, in_span, offs_d, D, FP8, NOPE_DIM, PAGE_TOKENS)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where((slots >= 0)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # While no key was seen m_new is -inf; subtract 0 then so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, k)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _sparse_attention_kernel(
    q_ptr,  # [T, H, D] fp32 / bf16
    win_ptr,  # window cache storage
    win_idx_ptr,  # [T, Ws] int32
    win_len_ptr,  # [T] int32
    ext_ptr,  # extra cache storage (window's when HAS_EXTRA is false)
    ext_idx_ptr,  # [T, Ke] int32
    ext_len_ptr,  # [T] int32
    sink_ptr,  # [H] fp32
    out_ptr,  # S == 1: [T, H, D] fp32 output; S > 1: [T, H, S, D] fp32 partial numerators
    m_ptr,  # [T, H, S] fp32 log2-domain max per split (S > 1 only)
    l_ptr,  # [T, H, S] fp32 denominator per split (S > 1 only)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_win_row,
    stride_win_idx_t,
    stride_ext_row,
    stride_ext_idx_t,
    stride_ot,
    stride_oh,
    stride_os,
    stride_mt,
    stride_mh,
    H,
    win_width,
    ext_width,
    qk_scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    WIN_FP8: tl.constexpr,
    WIN_PAGE_TOKENS: tl.constexpr,
    EXT_FP8: tl.constexpr,
    EXT_PAGE_TOKENS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < H
    hd_mask = h_mask[:, None] & (offs_d < D)[None, :]

    q_ptrs = q_ptr + row * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=hd_mask, other=0.0).to(tl.float32)

    # Lengths beyond the index width have no columns to read: clamp like the torch path.
    n_win = tl.minimum(tl.maximum(tl.load(win_len_ptr + row), 0), win_width)
    n_ext = 0
    if HAS_EXTRA:
        n_ext = tl.minimum(tl.maximum(tl.load(ext_len_ptr + row), 0), ext_width)
    # This split's chunk of the concatenated key list, whole blocks except at its end.
    chunk = tl.cdiv(tl.cdiv(n_win + n_ext, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_win + n_ext)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc, m_i, l_i = _attend_span(
        q, acc, m_i, l_i, win_ptr, stride_win_row, win_idx_ptr + row * stride_win_idx_t,
        lo, tl.minimum(hi, n_win), qk_scale, offs_d, D, BLOCK_N,
        WIN_FP8, NOPE_DIM, WIN_PAGE_TOKENS,
    )  # fmt: skip
    if HAS_EXTRA:
        acc, m_i, l_i = _attend_span(
            q, acc, m_i, l_i, ext_ptr, stride_ext_row, ext_idx_ptr + row * stride_ext_idx_t,
            tl.maximum(lo, n_win) - n_win, hi - n_win, qk_scale, offs_d, D, BLOCK_N,
            EXT_FP8, NOPE_DIM, EXT_PAGE_TOKENS,
        )  # fmt: skip

    out_ptrs = out_ptr + row * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * LOG2E
        m_fin = tl.maximum(m_i, sink)
        m_ref = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.exp2(m_i - m_ref)
        denom = l_i * alpha + tl.exp2(sink - m_ref)
        # denom is 0 only for a -inf sink and no key: output 0, not NaN.
        scale = alpha / tl.where(denom > 0, denom, 1.0)
        tl.store(out_ptrs, acc * scale[:, None], mask=hd_mask)
    else:
        tl.store(out_ptrs + split * stride_os, acc, mask=hd_mask)
        ml_off = row * stride_mt + offs_h * stride_mh + split
        tl.store(m_ptr + ml_off, m_i, mask=h_mask)
        tl.store(l_ptr + ml_off, l_i, mask=h_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr,  # [T, H, S, D] fp32 partial numerators
    m_ptr,  # [T, H, S] fp32 log2-domain max per split
    l_ptr,  # [T, H, S] fp32 denominator per split
    sink_ptr,  # [H] fp32
    out_ptr,  # [T, H, D] fp32
    stride_pt,
    stride_ph,
    stride_ps,
    stride_mt,
    stride_mh,
    stride_ot,
    stride_oh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    ml_ptrs = row * stride_mt + head * stride_mh + offs_s
    m = tl.load(m_ptr + ml_ptrs, mask=s_mask, other=float("-inf"))
    l_s = tl.load(l_ptr + ml_ptrs, mask=s_mask, other=0.0)
    sink = tl.load(sink_ptr + head) * LOG2E
    m_fin = tl.maximum(tl.max(m, axis=0), sink)
    m_ref = tl.where(m_fin == float("-inf"), 0.0, m_fin)
    w = tl.exp2(m - m_ref)  # [BLOCK_S]
    denom = tl.sum(w * l_s, axis=0) + tl.exp2(sink - m_ref)
    w = w / tl.where(denom > 0, denom, 1.0)
    part_ptrs = (
        part_ptr
        + row * stride_pt
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :]
    )
    part = tl.load(part_ptrs, mask=s_mask[:, None] & (offs_d < D)[None, :], other=0.0)
    out = tl.sum(part * w[:, None], axis=0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, out, mask=offs_d < D)


# ------------------------------------------------------------------------------- checks
def _check_inputs(
    q: torch.Tensor,
    window: TokenCache,
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra: TokenCache | None,
    extra_indices: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    sink: torch.Tensor,
    softmax_scale: float,
) -> None:
    """Raise ``BatchError`` / ``ContractError`` naming the first input that does not fit."""
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16):
        raise BatchError(
            f"q has shape {tuple(q.shape)} and dtype {q.dtype}; expected [T, H, D] float32 or "
            "bfloat16"
        )
    rows, heads, dim = q.shape
    if sink.shape != (heads,) or sink.dtype != torch.float32:
        raise BatchError(
            f"sink has shape {tuple(sink.shape)} and dtype {sink.dtype}; expected [{heads}] "
            "float32 (one logit per head of q)"
        )
    if not (
        isinstance(softmax_scale, (int, float))
        and math.isfinite(softmax_scale)
        and softmax_scale > 0
    ):
        raise BatchError(f"softmax_scale={softmax_scale!r}; expected a finite positive float")
    extra_given = [p is not None for p in (extra, extra_indices, extra_lengths)]
    if any(extra_given) and not all(extra_given):
        raise BatchError(
            "extra, extra_indices and extra_lengths must all be given (compressed layer) or all "
            f"be None (window-only layer); got given={extra_given}"
        )
    spans = [("window", window, "swa_indices", swa_indices, "swa_lengths", swa_lengths)]
    if extra is not None:
        spans.append(
            ("extra", extra, "extra_indices", extra_indices, "extra_lengths", extra_lengths)
        )
    tensors = {"sink": sink}
    for cache_name, cache, idx_name, idx, len_name, lengths in spans:
        if cache.dim != dim or cache.rope_dim != window.rope_dim:
            raise BatchError(
                f"the {cache_name} cache holds head_dim {cache.dim} (rope_dim "
                f"{cache.rope_dim}); q has D={dim} and the window cache rope_dim "
                f"{window.rope_dim}"
            )
        tensors[f"{cache_name} cache"] = cache.storage
        if idx.dim() != 2 or idx.dtype != torch.int32 or idx.shape[1] == 0:
            raise BatchError(
                f"{idx_name} has shape {tuple(idx.shape)} and dtype {idx.dtype}; expected "
                "[T, width] int32 with width >= 1"
            )
        if lengths.shape != (idx.shape[0],) or lengths.dtype != torch.int32:
            raise BatchError(
                f"{len_name} has shape {tuple(lengths.shape)} and dtype {lengths.dtype}; "
                f"expected [{idx.shape[0]}] int32 (one length per row of {idx_name})"
            )
        if idx.shape[0] != rows:
            raise ContractError(
                f"{idx_name} has {idx.shape[0]} rows but q has T={rows}: the attention "
                "metadata was planned for another batch (plan after the batch is padded)"
            )
        tensors[idx_name] = idx
        tensors[len_name] = lengths
    for name, tensor in tensors.items():
        if tensor.device != q.device:
            raise BatchError(f"{name} is on {tensor.device}; q is on {q.device}")
    for _, cache, idx_name, idx, _, _ in spans:
        cache.check_slots(idx, idx_name)  # slot range, checked on the CPU only (no GPU sync)


# ------------------------------------------------------------------------------ launcher
def _launch_config(dim: int, fp8: bool) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` of stage 1.

    Chosen from ptxas register reports for sm_90 (Triton 3.8, ahead-of-time compiled; not yet
    timed on a GPU): at D = 512 four warps need 226+ registers (dense) and the fp8 dequantise
    path spills even at 8 warps unless it runs unpipelined with 16-key blocks (184 registers);
    dense at 8 warps, 32 keys, 2 stages uses 130. D <= 256: 4 warps, no spills.
    """
    if dim <= 256:
        return 32, 4, 2
    return (16, 8, 1) if fp8 else (32, 8, 2)


def _default_num_splits(
    rows: int, heads: int, width: int, block_n: int, device: torch.device
) -> int:
    """Key splits per row: about two stage-1 programs per SM on a GPU (at least one key block
    per split), one split elsewhere (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(1, rows * triton.cdiv(heads, BLOCK_H))  # rows may be 0 (nothing to split)
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(width, block_n), MAX_SPLITS))


def sparse_attention_triton(
    q: torch.Tensor,
    window: TokenCache,
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra: TokenCache | None,
    extra_indices: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    sink: torch.Tensor,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton path of :func:`sparse_attention_with_sink`.

    ``num_splits`` (1 ... ``MAX_SPLITS``) splits each row's key list across that many
    programs; None picks it from the shapes and the device.
    """
    _check_inputs(
        q,
        window,
        swa_indices,
        swa_lengths,
        extra,
        extra_indices,
        extra_lengths,
        sink,
        softmax_scale,
    )
    rows, heads, dim = q.shape
    has_extra = extra is not None
    if not has_extra:  # the kernel never reads these; any valid pointers do
        extra, extra_indices, extra_lengths = window, swa_indices, swa_lengths
    for name, cache in (("window", window), ("extra", extra)):
        if not cache.storage.is_contiguous():
            raise BatchError(
                f"the {name} cache storage has strides {cache.storage.stride()}; the kernel "
                "needs it contiguous"
            )
    # The kernel steps index columns, lengths and sink with unit stride (no-ops when so).
    swa_indices, swa_lengths = swa_indices.contiguous(), swa_lengths.contiguous()
    extra_indices, extra_lengths = extra_indices.contiguous(), extra_lengths.contiguous()
    sink = sink.contiguous()
    block_n, num_warps, num_stages = _launch_config(dim, "fp8" in (window.fmt, extra.fmt))
    width = swa_indices.shape[1] + (extra_indices.shape[1] if has_extra else 0)
    if num_splits is None:
        splits = _default_num_splits(rows, heads, width, block_n, q.device)
    else:
        splits = num_splits
    if not 1 <= splits <= MAX_SPLITS:
        raise BatchError(f"num_splits={splits}; expected 1 ... {MAX_SPLITS}")

    out = torch.empty((rows, heads, dim), dtype=torch.float32, device=q.device)
    if rows == 0:
        return out
    if splits == 1:
        part, m, l_s = out, out, out  # m / l unused when the kernel finalises
        stride_ps = stride_mt = stride_mh = 0
    else:
        part = torch.empty((rows, heads, splits, dim), dtype=torch.float32, device=q.device)
        m = torch.empty((rows, heads, splits), dtype=torch.float32, device=q.device)
        l_s = torch.empty_like(m)
        stride_ps, stride_mt, stride_mh = part.stride(2), m.stride(0), m.stride(1)
    block_d = max(16, triton.next_power_of_2(dim))  # tl.dot needs K >= 16 on a GPU
    grid = (rows, triton.cdiv(heads, BLOCK_H), splits)
    _sparse_attention_kernel[grid](
        q, window.storage, swa_indices, swa_lengths,
        extra.storage, extra_indices, extra_lengths, sink,
        part, m, l_s,
        q.stride(0), q.stride(1), q.stride(2),
        window.storage.stride(0), swa_indices.stride(0),
        extra.storage.stride(0), extra_indices.stride(0),
        part.stride(0), part.stride(1), stride_ps, stride_mt, stride_mh,
        heads, swa_indices.shape[1], extra_indices.shape[1], softmax_scale * LOG2E.value,
        D=dim, BLOCK_D=block_d, BLOCK_H=BLOCK_H, BLOCK_N=block_n,
        NUM_SPLITS=splits, HAS_EXTRA=has_extra, NOPE_DIM=dim - window.rope_dim,
        WIN_FP8=window.fmt == "fp8", WIN_PAGE_TOKENS=window.page_tokens,
        EXT_FP8=extra.fmt == "fp8", EXT_PAGE_TOKENS=extra.page_tokens,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(rows, heads)](
            part, m, l_s, sink, out,
            part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1),
            out.stride(0), out.stride(1),
            D=dim, BLOCK_D=block_d, NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------- torch path
def sparse_attention_torch(
    q: torch.Tensor,
    window: TokenCache,
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra: TokenCache | None,
    extra_indices: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    sink: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Torch path of :func:`sparse_attention_with_sink`: gather, then one masked softmax."""
    _check_inputs(
        q,
        window,
        swa_indices,
        swa_lengths,
        extra,
        extra_indices,
        extra_lengths,
        sink,
        softmax_scale,
    )
    spans = [(window, swa_indices, swa_lengths)]
    if extra is not None:
        spans.append((extra, extra_indices, extra_lengths))
    rows, heads, dim = q.shape
    out = torch.empty((rows, heads, dim), dtype=torch.float32, device=q.device)
    width = sum(idx.shape[1] for _, idx, _ in spans)
    step = max(1, _TORCH_CHUNK_ELEMENTS // (width * max(dim, heads)))
    for r0 in range(0, rows, step):
        keys, valid = [], []
        for cache, idx, lengths in spans:
            idx = idx[r0 : r0 + step].long()
            cols = torch.arange(idx.shape[1], device=idx.device)
            ok = (cols[None, :] < lengths[r0 : r0 + step, None]) & (idx >= 0)
            keys.append(cache.gather(torch.where(ok, idx, -1)))  # [t, width, D] fp32
            valid.append(ok)
        k = torch.cat(keys, dim=1)
        logits = torch.einsum("thd,tnd->thn", q[r0 : r0 + step].float(), k) * softmax_scale
        logits = logits.masked_fill(~torch.cat(valid, dim=1)[:, None, :], float("-inf"))
        m = torch.maximum(logits.amax(dim=-1), sink[None, :])  # [t, H]
        m = m.masked_fill(m == float("-inf"), 0.0)
        p = torch.exp(logits - m[..., None])
        denom = p.sum(dim=-1) + torch.exp(sink[None, :] - m)
        denom = denom.masked_fill(denom == 0, 1.0)  # -inf sink and no key: output 0
        out[r0 : r0 + step] = torch.einsum("thn,tnd->thd", p, k) / denom[..., None]
    return out


# ---------------------------------------------------------------------------- public op
def sparse_attention_with_sink(
    q: torch.Tensor,
    window: TokenCache,
    swa_indices: torch.Tensor,
    swa_lengths: torch.Tensor,
    extra: TokenCache | None,
    extra_indices: torch.Tensor | None,
    extra_lengths: torch.Tensor | None,
    sink: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Attention of each query row over its window keys plus its compressed keys, with sink.

    Parameters
    ----------
    q : ``[T, H, D]`` float32 or bfloat16, already normed and roped.
    window : this layer's window cache (dense or fp8), addressed by window slot.
    swa_indices : ``[T, Ws]`` int32 window slots (-1 = none).
    swa_lengths : ``[T]`` int32 valid leading columns of ``swa_indices``.
    extra : this layer's c4 or c128 cache, or None for a window-only layer.
    extra_indices : ``[T, Ke]`` int32 compressed slots (-1 = none): c4 top-k or c128 entries;
        None with ``extra``.
    extra_lengths : ``[T]`` int32 valid leading columns of ``extra_indices``; None with
        ``extra``.
    sink : ``[H]`` float32 finite per-head sink logit (adds ``exp(sink)`` to the denominator).
    softmax_scale : logit scale, ``head_dim ** -0.5``.

    Returns
    -------
    ``[T, H, D]`` float32 (the caller casts). Rows without a valid key are 0.
    """
    impl = sparse_attention_triton if dispatch.use_triton(q.device) else sparse_attention_torch
    return impl(
        q,
        window,
        swa_indices,
        swa_lengths,
        extra,
        extra_indices,
        extra_lengths,
        sink,
        softmax_scale,
    )
