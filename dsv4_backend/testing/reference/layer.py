"""One attention layer end to end: random inputs and the full causal reference pass.

Every kernel and serving-mode test in the project compares against ``reference_layer``: a
request's tokens sit at positions ``0 ... S-1`` and every query sees exactly what
docs/design.md §2 says it sees. The pass is, for a layer of compress ratio ``r``:

1. ratio 4 or 128: ``compressed = compress_entries(kv_proj, score_proj, ape, norm_weight)``;
2. ratio 4: ``index_keys`` = the indexer compressor's entries (head dim ``DI``, ratio 4, the
   Hadamard rotation skipped since it leaves ``q . k`` unchanged) and
   ``selected = indexer_select(index_q, index_weights, index_keys, K)``;
3. ``out = reference_attention(q, kv, compressed, selected, sink)``.

The output is the attention output before the inverse RoPE and output projection (those are
the host model's, outside this backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.testing.reference.attention import reference_attention
from dsv4_backend.testing.reference.compressor import compress_entries, overlap
from dsv4_backend.testing.reference.indexer import indexer_select
from dsv4_backend.testing.reference.norm import rms_norm
from dsv4_backend.testing.reference.rope import apply_rope, rope_for_ratio


@dataclass(frozen=True, kw_only=True)
class LayerInputs:
    """Per-token inputs of one layer for one request (float32, tokens at ``0 ... S-1``).

    Attributes
    ----------
    q : ``[S, H, D]`` queries, per-head normed and roped.
    kv : ``[S, D]`` window keys = values, normed and roped.
    kv_proj, score_proj : ``[S, c*D]`` compressor projections (scores without ape);
        None for ratio 0.
    index_kv_proj, index_score_proj : ``[S, 2*DI]`` indexer-compressor projections;
        ratio 4 only.
    index_q : ``[S, HI, DI]`` indexer queries, roped; ratio 4 only.
    index_weights : ``[S, HI]`` indexer head weights; ratio 4 only.
    """

    q: torch.Tensor
    kv: torch.Tensor
    kv_proj: torch.Tensor | None = None
    score_proj: torch.Tensor | None = None
    index_kv_proj: torch.Tensor | None = None
    index_score_proj: torch.Tensor | None = None
    index_q: torch.Tensor | None = None
    index_weights: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        return self.q.shape[0]


@dataclass(frozen=True, kw_only=True)
class LayerParams:
    """Learned parameters of one layer (float32).

    Attributes
    ----------
    sink : ``[H]`` per-head sink logit.
    ape : ``[r, c*D]`` compressor position bias; None for ratio 0.
    norm_weight : ``[D]`` compressor RMSNorm weight; None for ratio 0.
    index_ape : ``[4, 2*DI]``, index_norm_weight ``[DI]``: the indexer compressor's; ratio 4 only.
    """

    sink: torch.Tensor
    ape: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    index_ape: torch.Tensor | None = None
    index_norm_weight: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class ReferenceResult:
    """``out [S, H, D]``; ``compressed [S//r, D]`` (None for ratio 0); ``index_keys
    [S//4, DI]`` and ``selected [S, K]`` int64 (ascending, -1 padded) for ratio 4 only."""

    out: torch.Tensor
    compressed: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    selected: torch.Tensor | None = None


def _check_ratio(config: DSV4AttentionConfig, ratio: int) -> None:
    if ratio not in (0, 4, 128):
        raise ConfigError(f"ratio={ratio}; expected 0, 4 or 128")


def make_random_layer(
    config: DSV4AttentionConfig, ratio: int, seq_len: int, generator: torch.Generator
) -> tuple[LayerInputs, LayerParams]:
    """Random, well-scaled float32 inputs and parameters of a ratio-``ratio`` layer.

    Scaling: queries and keys have unit RMS per channel, so attention logits have std ~1 and
    softmaxes are far from one-hot; sinks are ``2 + N(0, 1)`` so they visibly shrink short
    rows; compressor scores are ``N(0, 1)`` plus ape ``N(0, 0.25)``; indexer ``q . k`` is
    O(1) and mostly positive and head weights are positive, so scores are continuous and
    non-zero (top-k boundaries are not exact ties; relative gaps can still be ~1e-5, so tests
    of quantized indexers should compare selections by score, not by index).
    """
    _check_ratio(config, ratio)
    s, h, d = seq_len, config.num_heads, config.head_dim
    hi, di = config.index_n_heads, config.index_head_dim

    def randn(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std + mean

    cos, sin = rope_for_ratio(config, ratio).cos_sin(torch.arange(s))
    q = apply_rope(rms_norm(randn(s, h, d), None), cos, sin)
    kv = apply_rope(rms_norm(randn(s, d), randn(d, std=0.1, mean=1.0)), cos, sin)
    sink = randn(h, mean=2.0)
    if ratio == 0:
        return LayerInputs(q=q, kv=kv), LayerParams(sink=sink)
    c = overlap(ratio)
    inputs = dict(q=q, kv=kv, kv_proj=randn(s, c * d), score_proj=randn(s, c * d))
    params = dict(
        sink=sink, ape=randn(ratio, c * d, std=0.5), norm_weight=randn(d, std=0.1, mean=1.0)
    )
    if ratio == 4:
        # Indexer queries and keys share a direction in the 16 slowest-rotating dims, so ~90%
        # of q . k are positive: relu still matters, but no score is exactly 0 and ties
        # at the top-k boundary (which any top-k may break differently) do not occur.
        shared = torch.zeros(di)
        shared[-16:] = randn(min(16, di)).sign()
        inputs.update(
            index_kv_proj=randn(s, 2 * di) + shared.repeat(2),
            index_score_proj=randn(s, 2 * di),
            index_q=apply_rope((randn(s, hi, di) + 0.5 * shared) * di**-0.5, cos, sin),
            index_weights=(0.1 + torch.rand(s, hi, generator=generator)) * hi**-0.5,
        )
        params.update(
            index_ape=randn(4, 2 * di, std=0.5), index_norm_weight=randn(di, mean=1.0, std=0.1)
        )
    return LayerInputs(**inputs), LayerParams(**params)


def reference_layer(
    config: DSV4AttentionConfig, ratio: int, inputs: LayerInputs, params: LayerParams
) -> ReferenceResult:
    """The full causal pass of one layer over one request (module docstring)."""
    _check_ratio(config, ratio)
    if ratio == 0:
        out = reference_attention(config, 0, inputs.q, inputs.kv, None, None, params.sink)
        return ReferenceResult(out=out)
    rope = rope_for_ratio(config, ratio)
    compressed = compress_entries(
        inputs.kv_proj,
        inputs.score_proj,
        params.ape,
        params.norm_weight,
        ratio,
        rope,
        config.head_dim,
        config.rms_norm_eps,
    )
    index_keys = selected = None
    if ratio == 4:
        index_keys = compress_entries(
            inputs.index_kv_proj,
            inputs.index_score_proj,
            params.index_ape,
            params.index_norm_weight,
            4,
            rope,
            config.index_head_dim,
            config.rms_norm_eps,
        )
        selected = indexer_select(
            inputs.index_q, inputs.index_weights, index_keys, config.index_topk
        )
    out = reference_attention(config, ratio, inputs.q, inputs.kv, compressed, selected, params.sink)
    return ReferenceResult(out=out, compressed=compressed, index_keys=index_keys, selected=selected)
