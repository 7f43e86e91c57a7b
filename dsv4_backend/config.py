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
from dataclasses import dataclass, field
from typing import Any

from dsv4_backend.errors import ConfigError

SUPPORTED_RATIOS = (0, 4, 128)
#: DeepSeek-V4.1's ratios: window only, and its low-ratio compressed layers (1: every token an
#: entry; 2: token pairs), which share the caches of their kv-source layers (``V41Sources``).
V41_RATIOS = (0, 1, 2)
#: ``DSV4AttentionConfig.indexer_selection`` values: exact scores, or sglang's fp8 ones, or
#: sglang's fp4 ones (``--enable-deepseek-v4-fp4-indexer``: the c4 indexer keys in fp4 pages).
INDEXER_SELECTIONS = ("exact", "fp8", "fp4")
#: The selections that rotate the indexer's queries and keys by a Hadamard matrix.
QUANTISED_SELECTIONS = ("fp8", "fp4")
#: Ratios with compressed caches, state rings and per-ratio metadata (0 is window only).
COMPRESSED_RATIOS = (4, 128)
#: DeepSeek-V4.1's low ratios: compressed caches owned by kv-source layers, entries selected by
#: its indexer (``planning.low_ratio``, ``compute.low_ratio``).
LOW_RATIOS = (1, 2)
REQUIRED_PAGE_SIZE = 256
#: The sliding window W (the name is historical: it is not the window cache's page size).
SWA_PAGE_SIZE = 128
#: Tokens per window-cache page: sglang's SWA page (``swa_page_size``, the KV page size), so the
#: fp8 window cache is byte for byte sglang's (all 256 tokens' data, then their scales).
WINDOW_PAGE_TOKENS = REQUIRED_PAGE_SIZE
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
    c4 (also the indexer keys), 2 for c128; DeepSeek-V4.1's 256 for c1, 128 for c2."""
    if ratio not in COMPRESSED_RATIOS + LOW_RATIOS:
        raise ConfigError(
            f"compressed cache ratio={ratio}; expected one of {COMPRESSED_RATIOS + LOW_RATIOS}"
        )
    return REQUIRED_PAGE_SIZE // ratio


@dataclass(frozen=True, kw_only=True)
class V41Sources:
    """DeepSeek-V4.1's cache sharing (``config.json``: ``kv_source_layer_ids``,
    ``index_source_layer_ids``, ``candidate_source_layer_id``, ``candidate_topk_blocks``,
    ``candidate_block_size``), checked against the layers' ratios by ``DSV4AttentionConfig``.

    * kv sources: the ratio-1 / ratio-2 layers that compress; every other layer of that ratio
      reads the compressed cache of the nearest kv source at or before it, of its own ratio;
    * index sources: the low-ratio layers that run the indexer (their own queries); the
      ones that are kv sources also write the index keys their later index sources score;
    * the candidate source (-1: none): an index source that also publishes, per row, its
      ``candidate_topk_blocks`` best blocks of ``candidate_block_size`` entries; the index
      sources after it that read its kv source (the candidate consumers) select among those
      blocks' entries only.
    """

    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0


@dataclass(frozen=True, kw_only=True)
class DSV4AttentionConfig:
    """The attention-relevant part of a DeepSeek-V4 ``config.json``.

    ``compress_ratios`` holds one ratio per attention layer (0 = window only; 4 and 128 for
    DeepSeek-V4). DeepSeek-V4.1 (``v41`` set: its cache sharing) has the low ratios 1 and 2
    instead (docs/design.md §8). Every value is
    checked here, so an unsupported configuration is refused when the backend is built, never
    at the first forward.
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
    #: RMSNorm epsilon of the compressors (sglang reads each module's ``variance_epsilon``).
    rms_norm_eps: float = 1e-6
    #: Lightning-indexer scores: ``"exact"`` (fp32 queries and keys), ``"fp8"`` (sglang's
    #: built-in selection: Hadamard-rotated, e4m3-quantised; ``kernels.indexer.fp8``) or
    #: ``"fp4"`` (sglang's ``--enable-deepseek-v4-fp4-indexer``: Hadamard-rotated, fp4 with a
    #: ue8m0 scale per 32 values, the keys in fp4 pages; ``kernels.indexer.fp4``).
    indexer_selection: str = "exact"
    #: Speculative decoding doubles the compressor state rings.
    speculative: bool = False
    #: Draft tokens a verify forward appends per request (``speculative_num_draft_tokens``):
    #: DeepSeek-V4.1's ratio-2 pair rings keep them all (``ring_rows(2)``); 0 without drafts.
    num_draft_tokens: int = 0
    #: DeepSeek-V4.1's cache sharing; None for DeepSeek-V4.
    v41: V41Sources | None = None
    softmax_scale: float = field(init=False)

    def __post_init__(self) -> None:
        ratios = tuple(int(r) for r in self.compress_ratios)
        object.__setattr__(self, "compress_ratios", ratios)
        object.__setattr__(self, "softmax_scale", self.head_dim**-0.5)
        if not ratios:
            raise ConfigError("compress_ratios is empty; expected one ratio per layer")
        allowed = SUPPORTED_RATIOS if self.v41 is None else V41_RATIOS
        bad = sorted({r for r in ratios if r not in allowed})
        if bad:
            raise ConfigError(
                f"compress_ratios contains {bad}; this backend supports ratios "
                f"{SUPPORTED_RATIOS} (DeepSeek-V4)"
                + (
                    ". Low ratios belong to DeepSeek-V4.1, which is not supported"
                    if self.v41 is None
                    else f", and {V41_RATIOS} for DeepSeek-V4.1 (kv_source_layer_ids given)"
                )
            )
        if self.v41 is not None:
            _check_v41_sources(ratios, self.v41)
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
        if self.indexer_selection not in INDEXER_SELECTIONS:
            raise ConfigError(
                f"indexer_selection={self.indexer_selection!r}; expected one of "
                f"{INDEXER_SELECTIONS}"
            )
        di = self.index_head_dim
        fp4_short = self.indexer_selection == "fp4" and di < 32
        if self.indexer_selection in QUANTISED_SELECTIONS and (di & (di - 1) or fp4_short):
            raise ConfigError(
                f"indexer_selection={self.indexer_selection!r} with index_head_dim={di}; the "
                "Hadamard rotation needs a power of two (fp4: at least 32, a ue8m0 block)"
            )
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ConfigError(
                f"rope_dim={self.rope_dim}; expected an even number in (0, head_dim="
                f"{self.head_dim}]"
            )

    # ----------------------------------------------------------------------------- derived
    @property
    def ratios_present(self) -> frozenset[int]:
        """Compressed ratios (4 and/or 128) used by at least one layer."""
        return frozenset(r for r in self.compress_ratios if r in COMPRESSED_RATIOS)

    @property
    def low_ratios_present(self) -> frozenset[int]:
        """DeepSeek-V4.1's low ratios (1 and/or 2) used by at least one layer."""
        return frozenset(r for r in self.compress_ratios if r in LOW_RATIOS)

    @property
    def swa_index_width(self) -> int:
        """Columns of ``swa_page_indices``: the window rounded up to ``SWA_INDEX_ALIGN``."""
        return math.ceil(self.window_size / SWA_INDEX_ALIGN) * SWA_INDEX_ALIGN

    @property
    def nope_dim(self) -> int:
        """``D - R``: the head dims without RoPE (448 for Flash, 64 tiny)."""
        return self.head_dim - self.rope_dim

    def kv_source_of(self, layer: int) -> int:
        """DeepSeek-V4.1: the kv-source layer whose compressed cache ``layer`` (ratio 1 or 2)
        reads, the nearest at or before it (``ConfigError`` for a V4 config or another
        layer)."""
        if self.v41 is None or self.compress_ratios[layer] not in (1, 2):
            raise ConfigError(
                f"layer {layer} (ratio {self.compress_ratios[layer]}) reads no shared "
                "compressed cache; only DeepSeek-V4.1's ratio-1 / ratio-2 layers do"
            )
        return max(s for s in self.v41.kv_source_layers if s <= layer)

    @property
    def candidate_consumers(self) -> tuple[int, ...]:
        """DeepSeek-V4.1: the index sources after the candidate source that read its kv
        source; they select among its candidate blocks (empty without a candidate source)."""
        v41 = self.v41
        if v41 is None or v41.candidate_source_layer < 0:
            return ()
        source = self.kv_source_of(v41.candidate_source_layer)
        return tuple(
            layer
            for layer in v41.index_source_layers
            if layer > v41.candidate_source_layer and self.kv_source_of(layer) == source
        )

    @property
    def late_layer_start(self) -> int:
        """DeepSeek-V4.1's decoder SWA bounded replay: the first layer of the late-layer tail,
        the last kv source (``planning/tail.py``). ``ConfigError`` for a config the tail cannot
        serve (as sglang's model asserts): a V4 config; a last kv source that is not also the
        last index source's ratio's index and candidate source; a later layer that
        compresses (ratio other than 0 or 1)."""
        v41 = self.v41
        if v41 is None:
            raise ConfigError("the late-layer tail is DeepSeek-V4.1's; this is a V4 config")
        last = max(v41.kv_source_layers)
        late = set(self.compress_ratios[last + 1 :])
        if last not in v41.index_source_layers or v41.candidate_source_layer not in (-1, last):
            raise ConfigError(
                f"the decoder SWA bounded replay needs the last kv source (layer {last}) to be an "
                f"index source and the candidate source (index sources "
                f"{list(v41.index_source_layers)}, candidate source "
                f"{v41.candidate_source_layer}); start with "
                "--no-enable-decoder-swa-bounded-replay"
            )
        if not late <= {0, 1}:
            raise ConfigError(
                f"the decoder SWA bounded replay needs the layers after the last kv source "
                f"(layer {last}) to be of ratio 0 or 1, got {sorted(late)}; start with "
                "--no-enable-decoder-swa-bounded-replay"
            )
        return last

    @property
    def candidate_ratio(self) -> int | None:
        """DeepSeek-V4.1: the ratio whose entries the candidate blocks group (the candidate
        source's); None without a candidate source."""
        v41 = self.v41
        if v41 is None or v41.candidate_source_layer < 0:
            return None
        return self.compress_ratios[v41.candidate_source_layer]

    def ring_rows(self, ratio: int) -> int:
        """Rows of a compressor state ring: one span, c4 8 (16 speculative), c128 128 (256);
        DeepSeek-V4.1's ratio-2 pair ring 2 (the even token of a pair waits there), with
        speculation ``1 << (num_draft_tokens + 1).bit_length()`` (every verify row stays)."""
        if ratio == 2:
            if not self.speculative:
                return 2
            if self.num_draft_tokens < 1:
                raise ConfigError(
                    f"num_draft_tokens={self.num_draft_tokens} with speculative decoding: "
                    "DeepSeek-V4.1's ratio-2 pair rings are sized by the draft tokens of a "
                    "verify (speculative_num_draft_tokens)"
                )
            # sglang's size: a power of two above the verify rows and the pending pair token.
            return 1 << (self.num_draft_tokens + 1).bit_length()
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


def _check_v41_sources(ratios: tuple[int, ...], v41: V41Sources) -> None:
    """``ConfigError`` naming the first of DeepSeek-V4.1's source fields that does not fit the
    layers' ``ratios`` (``V41Sources``' rules)."""
    low = [layer for layer, r in enumerate(ratios) if r in (1, 2)]
    for name in ("kv_source_layers", "index_source_layers"):
        layers = getattr(v41, name)
        if list(layers) != sorted(set(layers)) or not set(layers) <= set(low):
            raise ConfigError(
                f"{name}={list(layers)}; expected increasing ids of ratio-1 / ratio-2 layers "
                f"(those are {low})"
            )
    for layer in low:
        earlier = [s for s in v41.kv_source_layers if s <= layer]
        if not earlier or ratios[earlier[-1]] != ratios[layer]:
            raise ConfigError(
                f"layer {layer} has compress ratio {ratios[layer]} but its nearest kv source "
                f"at or before it is {earlier[-1] if earlier else None} (kv_source_layers="
                f"{list(v41.kv_source_layers)}); a layer reads the cache of a source of its ratio"
            )
    source, blocks, size = (
        v41.candidate_source_layer,
        v41.candidate_topk_blocks,
        v41.candidate_block_size,
    )
    if source >= 0 and (source not in v41.index_source_layers or blocks < 1 or size < 1):
        raise ConfigError(
            f"candidate_source_layer_id={source} with candidate_topk_blocks={blocks}, "
            f"candidate_block_size={size}; expected an index source layer "
            f"({list(v41.index_source_layers)}) and positive block counts"
        )
    if source < -1:
        raise ConfigError(f"candidate_source_layer_id={source}; expected -1 (none) or a layer id")
    for layer in v41.index_source_layers:
        owner = max(s for s in v41.kv_source_layers if s <= layer)
        if owner not in v41.index_source_layers:
            raise ConfigError(
                f"index source layer {layer} scores the index keys of kv source {owner}, which "
                f"is not an index source (index_source_layers={list(v41.index_source_layers)}); "
                "only a kv source that runs the indexer writes index keys"
            )
