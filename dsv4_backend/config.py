"""Attention configuration of a DeepSeek-V4 model, validated on construction.

Glossary (sizes for DeepSeek-V4-Flash, then the tiny test configuration):

==========  ===========================================  ========  =====
symbol      meaning                                      Flash     tiny
==========  ===========================================  ========  =====
H           query heads (one shared KV head, MQA)        64        8
D           head dim, K = V; RoPE on the last ``R``      512       128
R           RoPE dims                                    64        64
W           sliding window (keys p-127 ... p)            128       128
P           full-cache page size (tokens)                256       256
r           compress ratio of a layer: 0, 4 or 128       -         -
K           index_topk: c4 entries kept per query        512       16
HI, DI      indexer heads and head dim                   64, 128   4, 64
==========  ===========================================  ========  =====
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dsv4_backend.errors import ConfigError

SUPPORTED_RATIOS = (0, 4, 128)
#: Ratios with compressed caches, state rings and per-ratio metadata (0 is window only).
COMPRESSED_RATIOS = (4, 128)
REQUIRED_PAGE_SIZE = 256
SWA_PAGE_SIZE = 128
#: Window page indices are padded to a multiple of this many columns.
SWA_INDEX_ALIGN = 64


def check_compressed_ratio(ratio: int, what: str) -> None:
    """``ConfigError`` naming ``what`` unless ``ratio`` is a compressed ratio (4 or 128)."""
    if ratio not in COMPRESSED_RATIOS:
        raise ConfigError(f"{what} ratio={ratio}; expected one of {COMPRESSED_RATIOS}")


def compress_overlap(ratio: int) -> int:
    """``c``: the ``D``-wide halves of a compressor projection; 2 for ratio 4, whose entries
    overlap the previous block, else 1."""
    check_compressed_ratio(ratio, "compressor")
    return 2 if ratio == 4 else 1


def compress_span(ratio: int) -> int:
    """Tokens pooled into one compressed entry: 8 for ratio 4, 128 for ratio 128."""
    return compress_overlap(ratio) * ratio


def entries_per_page(ratio: int) -> int:
    """Compressed entries per full page (compressed caches reuse the full page table): 64 for
    c4 (also the indexer keys), 2 for c128."""
    check_compressed_ratio(ratio, "compressed cache")
    return REQUIRED_PAGE_SIZE // ratio


@dataclass(frozen=True, kw_only=True)
class DSV4AttentionConfig:
    """The attention-relevant part of a DeepSeek-V4 ``config.json``.

    ``compress_ratios`` holds one ratio per attention layer (0 = window only; a 1 in the
    source config is normalised to 0). Every value is checked here, so an unsupported
    configuration is refused when the backend is built, never at the first forward.
    """

    compress_ratios: tuple[int, ...]
    num_heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    window_size: int = 128
    page_size: int = REQUIRED_PAGE_SIZE
    index_topk: int = 512
    index_n_heads: int = 64
    index_head_dim: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_max_position: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    #: Speculative decoding doubles the compressor state rings.
    speculative: bool = False
    softmax_scale: float = field(init=False)

    def __post_init__(self) -> None:
        ratios = tuple(0 if int(r) == 1 else int(r) for r in self.compress_ratios)
        object.__setattr__(self, "compress_ratios", ratios)
        object.__setattr__(self, "softmax_scale", self.head_dim**-0.5)
        if not ratios:
            raise ConfigError("compress_ratios is empty; expected one ratio per layer")
        bad = sorted({r for r in ratios if r not in SUPPORTED_RATIOS})
        if bad:
            raise ConfigError(
                f"compress_ratios contains {bad}; this backend supports ratios "
                f"{SUPPORTED_RATIOS} (DeepSeek-V4). Low ratios belong to DeepSeek-V4.1, "
                "which is not supported"
            )
        if self.page_size != REQUIRED_PAGE_SIZE:
            raise ConfigError(
                f"page_size={self.page_size}; DeepSeek-V4 caches need page_size "
                f"{REQUIRED_PAGE_SIZE} (start sglang with --page-size 256)"
            )
        if self.window_size != SWA_PAGE_SIZE:
            raise ConfigError(f"window_size={self.window_size}; expected {SWA_PAGE_SIZE}")
        for name in ("num_heads", "head_dim", "index_topk", "index_n_heads", "index_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}; expected a positive integer")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ConfigError(
                f"rope_dim={self.rope_dim}; expected an even number in (0, head_dim="
                f"{self.head_dim}]"
            )

    # ----------------------------------------------------------------------------- derived
    @property
    def ratios_present(self) -> frozenset[int]:
        """Compressed ratios (4 and/or 128) used by at least one layer."""
        return frozenset(r for r in self.compress_ratios if r)

    @property
    def swa_index_width(self) -> int:
        """Columns of ``swa_page_indices``: the window rounded up to ``SWA_INDEX_ALIGN``."""
        return math.ceil(self.window_size / SWA_INDEX_ALIGN) * SWA_INDEX_ALIGN

    @property
    def nope_dim(self) -> int:
        """``D - R``: the head dims without RoPE (448 for Flash, 64 tiny)."""
        return self.head_dim - self.rope_dim

    def ring_rows(self, ratio: int) -> int:
        """Rows of a compressor state ring: one span, c4 8 (16 speculative), c128 128 (256)."""
        span = compress_span(ratio)
        return 2 * span if self.speculative else span

    # ------------------------------------------------------------------------ constructors
    @classmethod
    def tiny(cls, **overrides: Any) -> DSV4AttentionConfig:
        """The small configuration of docs/design.md §6 (every boundary, tiny widths)."""
        values: dict[str, Any] = dict(
            compress_ratios=(0, 4, 128, 4),
            num_heads=8,
            head_dim=128,
            rope_dim=64,
            index_topk=16,
            index_n_heads=4,
            index_head_dim=64,
        )
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides: Any) -> DSV4AttentionConfig:
        """Build from a DeepSeek-V4 ``config.json`` mapping.

        Raises ``ConfigError`` naming the missing keys when the mapping is not a DeepSeek-V4
        config. The MTP slot (the last ratio when there is one more ratio than layers) is kept
        out: it belongs to the draft model.
        """
        required = ("compress_ratios", "num_attention_heads", "head_dim", "index_topk")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ConfigError(
                f"config is missing DeepSeek-V4 fields {missing}; expected a DeepSeek-V4 "
                "config.json (with compress_ratios, index_topk, ...)"
            )
        ratios = list(hf["compress_ratios"])
        layers = hf.get("num_hidden_layers")
        if layers is not None and len(ratios) == layers + 1:
            ratios = ratios[:layers]
        scaling = hf.get("rope_scaling") or {}
        values: dict[str, Any] = dict(
            compress_ratios=tuple(ratios),
            num_heads=int(hf["num_attention_heads"]),
            head_dim=int(hf["head_dim"]),
            rope_dim=int(hf.get("qk_rope_head_dim", 64)),
            window_size=int(hf.get("sliding_window", 128)),
            index_topk=int(hf["index_topk"]),
            index_n_heads=int(hf.get("index_n_heads", 64)),
            index_head_dim=int(hf.get("index_head_dim", 128)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            compress_rope_theta=float(hf.get("compress_rope_theta", 160000.0)),
            yarn_factor=float(scaling.get("factor", 16.0)),
            yarn_original_max_position=int(scaling.get("original_max_position_embeddings", 65536)),
            yarn_beta_fast=float(scaling.get("beta_fast", 32.0)),
            yarn_beta_slow=float(scaling.get("beta_slow", 1.0)),
        )
        values.update(overrides)
        return cls(**values)
