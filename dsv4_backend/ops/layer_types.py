"""The inputs and parameters of one attention layer, as :func:`dsv4_backend.compute.forward_layer`
takes them (``T`` ragged rows of a planned batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class LayerInputs:
    """One forward's rows of one layer (any float dtype; ``T`` rows).

    Attributes
    ----------
    q : ``[T, H, D]`` queries, per-head normed and roped.
    kv : ``[T, D]`` window keys (= values), normed and roped.
    kv_proj, score_proj : ``[T, c*D]`` compressor projections (scores without ape);
        None on window-only layers.
    index_kv_proj, index_score_proj : ``[T, 2*DI]`` the indexer compressor's projections;
        ratio-4 layers only.
    index_q : ``[T, HI, DI]`` indexer queries, roped; ratio-4 layers only.
    index_weights : ``[T, HI]`` indexer head weights; ratio-4 layers only.
    """

    q: torch.Tensor
    kv: torch.Tensor
    kv_proj: torch.Tensor | None = None
    score_proj: torch.Tensor | None = None
    index_kv_proj: torch.Tensor | None = None
    index_score_proj: torch.Tensor | None = None
    index_q: torch.Tensor | None = None
    index_weights: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class LayerParams:
    """The learned parameters of one layer the backend reads.

    Attributes
    ----------
    sink : ``[H]`` per-head sink logit.
    ape : ``[r, c*D]`` compressor position bias; None on window-only layers.
    norm_weight : ``[D]`` compressor RMSNorm weight; None on window-only layers.
    index_ape, index_norm_weight : ``[4, 2*DI]`` and ``[DI]``, the indexer compressor's;
        ratio-4 layers only.
    """

    sink: torch.Tensor
    ape: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    index_ape: torch.Tensor | None = None
    index_norm_weight: torch.Tensor | None = None
