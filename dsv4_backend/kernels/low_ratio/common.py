"""The calls of DeepSeek-V4.1's low-ratio ops, checked when made (``ContractError`` naming the
first argument that does not fit): :class:`PairCall` (the pair pooling) and :class:`RowsCall`
(the fp4 rows); every variant of the op takes one (``table.py``). The index scores take the
lightning indexer's ``IndexCall`` with the ratio's entries a page."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache, Fp4Scale
from dsv4_backend.cache.state import CompressorState
from dsv4_backend.errors import ContractError


@dataclass(frozen=True)
class PairCall:
    """One call of the ratio-2 pair pooling (``torch.pair_pool`` describes the contract).

    Attributes
    ----------
    rings : the kv source's pair ring ``[slots, R, 2 * D]`` float32 rows ``[kv | score]``.
    kv, score : ``[T, D]`` float32.
    req_rows : ``[T]`` int request pool row of each row.
    positions : ``[T]`` int position of each row.
    valid : ``[T]`` bool (False: a graph bucket's padding row).
    """

    rings: CompressorState
    kv: torch.Tensor
    score: torch.Tensor
    req_rows: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor

    def __post_init__(self) -> None:
        if self.kv.dim() != 2 or self.score.shape != self.kv.shape:
            raise ContractError(
                f"pair pooling: kv {tuple(self.kv.shape)} and score {tuple(self.score.shape)}; "
                "expected the same [T, D]"
            )
        rows, d = self.kv.shape
        for name in ("req_rows", "positions", "valid"):
            tensor = getattr(self, name)
            if tuple(tensor.shape) != (rows,):
                raise ContractError(
                    f"pair pooling: {name} has shape {tuple(tensor.shape)}; expected [{rows}]"
                )
        if self.valid.dtype != torch.bool:
            raise ContractError(f"pair pooling: valid has dtype {self.valid.dtype}; expected bool")
        ring = self.rings.ring
        if ring.dim() != 3 or ring.shape[2] != 2 * d:
            raise ContractError(
                f"pair pooling: the pair ring has shape {tuple(ring.shape)}; expected "
                f"[slots, R, {2 * d}]"
            )


@dataclass(frozen=True)
class RowsCall:
    """One call of the fp4 rows (``table.low_ratio_rows`` describes the contract).

    Attributes
    ----------
    x : ``[N, D]`` or ``[N, H, D]`` float (bf16 values).
    cos, sin : ``[N, R/2]`` of each row's position (every head of a row at it).
    scale : the fp4 block scales, ``"e4m3"`` or ``"ue8m0"``.
    norm : ``(weight [D], eps)`` of an RMSNorm before RoPE; None: none.
    store : ``(cache, slots [N])``: the rows also written at ``slots`` (-1: the padding slot 0).
    """

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    scale: Fp4Scale
    norm: tuple[torch.Tensor, float] | None = None
    store: tuple[Fp4IndexKeyCache, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.x.dim() not in (2, 3):
            raise ContractError(
                f"fp4 rows: x has shape {tuple(self.x.shape)}; expected [N, D] or [N, H, D]"
            )
        if self.cos.dim() != 2 or self.sin.shape != self.cos.shape:
            raise ContractError(
                f"fp4 rows: cos {tuple(self.cos.shape)} and sin {tuple(self.sin.shape)}; "
                "expected the same [N, R/2]"
            )
        if self.scale not in ("e4m3", "ue8m0"):
            raise ContractError(f"fp4 rows: scale {self.scale!r}; expected 'e4m3' or 'ue8m0'")
