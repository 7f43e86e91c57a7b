"""Host-side parts the compressor's paths share: the op's call, checked when made
(:class:`CompressCall`), the store's check (:func:`check_store`), the RoPE tables the entry
kernels read (:func:`entry_cos_sin`), the pooling tile bound and :func:`ring_write_is_safe`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_backend.cache.state import CompressorState
from dsv4_backend.cache.token_cache import SlotCache
from dsv4_backend.config import check_compressed_ratio, compress_overlap, compress_span
from dsv4_backend.errors import ContractError
from dsv4_backend.ops.rope import CosSin, RopeTable

#: Upper bound on the ``[BLOCK_S, 2 * BLOCK_P]`` elements of one pooling step.
POOL_TILE = 4096


@dataclass(frozen=True)
class CompressCall:
    """One call of the compressor op (``table.compress_forward``'s arguments, which its
    docstring describes), checked when made (``ContractError`` naming the first that does not
    fit); every variant of the op takes one."""

    state: CompressorState
    kv_proj: torch.Tensor
    score_proj: torch.Tensor
    ape: torch.Tensor
    norm_weight: torch.Tensor
    rope: CosSin
    req_pool_indices: torch.Tensor
    window_slots: torch.Tensor
    positions: torch.Tensor
    compress_plan: torch.Tensor
    write_plan: torch.Tensor
    norm_eps: float = 1e-6
    store: tuple[SlotCache, torch.Tensor] | None = None
    max_rows_per_request: int | None = None

    @property
    def sources(self) -> tuple[torch.Tensor, ...]:
        """``(kv_proj, score_proj, ape, ring, req_pool_indices, window_slots)``: the tensors
        every compressor kernel reads first, in its parameters' order."""
        return (
            self.kv_proj,
            self.score_proj,
            self.ape,
            self.state.ring,
            self.req_pool_indices,
            self.window_slots,
        )

    @property
    def source_strides(self) -> tuple[int, ...]:
        """The row strides of :attr:`sources` (the ring's slot and row strides), as every
        compressor kernel takes them."""
        ring = self.state.ring
        rows = (self.kv_proj, self.score_proj, self.ape)
        return (
            *(x.stride(0) for x in rows),
            ring.stride(0),
            ring.stride(1),
            self.window_slots.stride(0),
        )

    def __post_init__(self) -> None:
        ratio, d = self.state.ratio, self.state.head_dim
        check_compressed_ratio(ratio, "compressor")
        t, cd = self.kv_proj.shape[0], compress_overlap(ratio) * d
        want = {
            "kv_proj": (t, cd),
            "score_proj": (t, cd),
            "ape": (ratio, cd),
            "norm_weight": (d,),
            "positions": (t,),
            "compress_plan": (t, 4),
            "write_plan": (t, 4),
            "state.ring": (self.state.ring.shape[0], self.state.ring.shape[1], 2 * cd),
        }
        got = {
            "kv_proj": self.kv_proj,
            "score_proj": self.score_proj,
            "ape": self.ape,
            "norm_weight": self.norm_weight,
            "positions": self.positions,
            "compress_plan": self.compress_plan,
            "write_plan": self.write_plan,
            "state.ring": self.state.ring,
        }
        for name, tensor in got.items():
            if tuple(tensor.shape) != want[name]:
                raise ContractError(
                    f"compressor (ratio {ratio}, D={d}): {name} has shape {tuple(tensor.shape)}, "
                    f"expected {want[name]}"
                )
        for name in ("compress_plan", "write_plan"):
            if got[name].dtype != torch.int32:
                raise ContractError(
                    f"compressor: {name} has dtype {got[name].dtype}, expected int32"
                )
        ring = self.state.ring
        if ring.dtype != torch.float32:
            raise ContractError(f"compressor: state.ring has dtype {ring.dtype}, expected fp32")
        rows = self.req_pool_indices
        if rows.dim() != 1:
            raise ContractError(
                f"compressor: req_pool_indices has shape {tuple(rows.shape)}, expected [B]"
            )
        lags = compress_span(ratio) if self.state.window_page else 0  # columns the kernels read
        slots = self.window_slots
        if slots.dim() != 2 or slots.shape[0] != t or slots.shape[1] < lags:
            raise ContractError(
                f"compressor: window_slots has shape {tuple(slots.shape)}, expected "
                f"({t}, >= {lags}) (window slots of positions p, p - 1, ...)"
            )
        devices = {x.device for x in (*got.values(), rows, slots)}
        if len(devices) != 1:
            raise ContractError(
                f"compressor: tensors on several devices {sorted(map(str, devices))}"
            )


def check_store(state: CompressorState, rows: int, cache: SlotCache, out_loc: torch.Tensor) -> None:
    cache.check_slots(out_loc, "out_loc")
    if cache.dim != state.head_dim or tuple(out_loc.shape) != (rows,):
        raise ContractError(
            f"compressor (D={state.head_dim}): store into a cache of dim {cache.dim} at "
            f"out_loc {tuple(out_loc.shape)}; expected dim {state.head_dim} and ({rows},)"
        )


def entry_cos_sin(
    rope: CosSin, positions: torch.Tensor, ratio: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables the entry kernels read: a ``RopeTable``'s own (row = entry position),
    or any other ``CosSin`` evaluated at the entry position of each row (``positions``
    ``[T]``; torch ops, tests only)."""
    if isinstance(rope, RopeTable):
        return rope.cos, rope.sin
    entry_positions = (positions.long() + 1) // ratio * ratio - ratio
    cos, sin = (x.contiguous() for x in rope.cos_sin(entry_positions))
    return cos, sin


def ring_write_is_safe(state: CompressorState, max_rows_per_request: int | None) -> bool:
    """Whether no ring row a forward writes can replace one its entries read: a row written
    at ``p' = p + k`` (``k < n``, ``n`` rows a request) replaces position ``p' - R``, which an
    entry ending at ``p`` reads from the ring only if ``p' - R > p - span``; so never while
    ``n <= R - span + 1`` (decode, draft steps, verify with the doubled speculative rings).
    ``None``: not known (extend), not safe. Where it is not safe, ``_compress_fused_kernel``
    defers the writes that wait for a read (``DEFER_WRITES``)."""
    if max_rows_per_request is None:
        return False
    return max_rows_per_request <= state.ring_rows - compress_span(state.ratio) + 1
