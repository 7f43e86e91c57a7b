"""A tiny, deterministic DeepSeek-V4 checkpoint that sglang 0.5.23 loads with its real loader.

:func:`write_tiny_checkpoint` writes ``config.json``, ``model.safetensors`` (the weights in
DeepSeek's own tensor names: the ones ``DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format``
maps from), ``tokenizer.json`` and ``tokenizer_config.json`` (a byte-level BPE with DeepSeek's
special tokens, built with ``tokenizers``; nothing is downloaded). No ``generation_config.json``:
sglang does not need one (``config.json`` carries ``bos_token_id`` / ``eos_token_id``), and one
would only add model sampling defaults to every request.

The variants (:data:`VARIANTS`, :class:`TinyVariant`):

``"v4"``
    ``DeepseekV4ForCausalLM``: 4 layers of compress ratios 0 / 4 / 128 / 4 (layer 0 hash
    routed) and one MTP block ``mtp.0.*``. Served plainly, or with its own MTP block as the
    EAGLE draft (sglang builds ``DeepseekV4ForCausalLMNextN`` from the same path).
``"dspark"``
    The same target with a bundled DSpark draft head, as DeepSeek-V4 DSpark checkpoints carry
    it: the ``dspark_*`` fields of ``config.json`` (sglang's ``checkpoint_bundles_dspark_draft``)
    and the stages ``mtp.0.*`` / ``mtp.1.*`` fed by target layers 1 and 3, with the Markov and
    confidence heads. Under ``--speculative-algorithm DSPARK`` sglang builds
    ``DeepseekV4ForCausalLMDSpark`` from the same path.
``"v41"``
    DeepSeek-V4.1 (``model_type`` ``deepseek_v41``): 6 layers of ratios 0 / 2 / 2 / 1 / 1 / 1;
    layers 1 and 3 are the kv sources (2 and 4 read theirs), 1 / 3 / 5 the index sources, 3 the
    candidate source. No hyper-connection head (V4.1 collapses the streams with the last FFN's
    pre-mix) and no draft head.

Every tensor is drawn from a ``torch.Generator`` seeded from ``(seed, tensor name)``: the same
``(variant, seed)`` writes byte-identical files.

Margins. Tests compare the greedy tokens of runs whose batches differ, and bf16 rounding
differs between batch shapes, so the weights are built for wide top-1 / top-2 logit margins:

* the logits are a prior plus a context-dependent random part (``head.weight[v] =
  (LOGIT_GAIN * r_v + PRIOR_GAIN * e_pred(v)) / sqrt(hidden_size)``, ``e`` the embedding
  rows, ``pred`` the inverse of :func:`successor`, a random cycle through the vocabulary). The
  prior picks the successor of the current token by a wide margin in most steps; the context
  (attention, experts) overrules it in the others. Near ties are then the prior's competition
  with the best random logit, whose spread is ``LOGIT_GAIN``, instead of the gap between the
  top two of 512 random logits (an order of magnitude narrower);
* every embedding's coordinate 0 is ``EMBED_OFFSET`` and no sublayer writes coordinate 0
  (row 0 of ``wo_b``, of the experts' ``w2`` and of ``h_proj`` is zero), so the final hidden
  state carries a near-constant coordinate; ``head.weight[:, 0] = -LOGIT_SHIFT`` subtracts
  about the same value from every logit, which moves the contenders' logits close to 0 where
  bf16 steps are finer (softmax, argmax and margins are unchanged);
* the routers' ``gate.bias`` is ``+ROUTER_BIAS`` on a fixed pair of experts per layer and
  ``-ROUTER_BIAS`` on the others, so the score-based top-k selection of the non-hash layers
  never flips on a rounding difference (the hash-routed layer routes by token id);
* the end-of-sentence row of ``head.weight`` is near zero: greedy decoding never stops by
  itself (``max_new_tokens`` decides the lengths).

Measured on sglang's CPU Engine (``"v4"``, seed 0; 10 prompts of 2 to 330 tokens, 64 greedy
steps each): the top-1 / top-2 logprob margin has p5 1.7 and median 13.9, 1 step in 640 below
0.1 and 11 below 0.5; the context overrules the prior in 7 % of the steps. The same prompts
batched together and one by one differ in a step's top-1 logprob by at most 0.11 (p99 0.05)
before their tokens part, and parted once, at a step of margin 0.18. A test comparing the
greedy tokens of two runs should compare them up to the first step whose margin (in either
run) is below about 0.5. ``PRIOR_GAIN`` trades margins for context dependence (4.5: p5 0.5,
the context decides 20 % of the steps). ``"v41"`` (its prior 8, the same prompts): p5 1.25,
median 14.3, 4 steps in 640 below 0.1, 11 below 0.5, the context deciding 9 % of the steps;
batched and one by one, 3 of the 10 prompts part, each at a step of margin below 0.07.
"""

# The special tokens are DeepSeek's spellings, with FULLWIDTH VERTICAL LINE (U+FF5C).
# ruff: noqa: RUF001

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from dsv4_backend.errors import ConfigError

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
#: The DSpark draft's mask (``dspark_noise_token_id``).
DSPARK_NOISE = "<｜dspark_noise｜>"
#: The tokenizer's added tokens, in id order: begin of sentence 0, end of sentence 1 and pad 2
#: as in DeepSeek's tokenizers; then what sglang's DeepSeek-V4 chat path looks up (the
#: ``SpecialTokens`` of ``deepseek-recipe``, whose encoder refuses a conversation using one
#: that the tokenizer lacks, and sglang's quick-instruction task tokens,
#: ``srt/parser/deepseek_recipe_renderer.py``), and the DSpark mask.
SPECIAL_TOKENS = (
    BOS,
    EOS,
    PAD,
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜System｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜latest_reminder｜>",
    "<｜deepseek_image｜>",
    "<｜ref｜>",
    "<｜/ref｜>",
    "<｜box｜>",
    "<｜/box｜>",
    "<｜point｜>",
    "<｜/point｜>",
    "<｜polygon｜>",
    "<｜/polygon｜>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
    DSPARK_NOISE,
)
#: Added tokens that are not special: decoding keeps them (``skip_special_tokens``), so the
#: reasoning and tool-call parsers see them in the output text.
TEXT_TOKENS = frozenset({"<think>", "</think>", "｜DSML｜"})

#: See "Margins" in the module docstring.
LOGIT_GAIN = 6.0
PRIOR_GAIN = 6.0
EMBED_OFFSET = 8.0
LOGIT_SHIFT = 7.0
ROUTER_BIAS = 5.0


@dataclass(frozen=True)
class TinyDims:
    """The widths every variant shares. sglang's DeepSeek-V4 KV pool fixes ``head_dim`` 512,
    ``rope_dim`` 64 and ``index_head_dim`` 128; the rest is small. ``max_position_embeddings``
    4096 holds prompts of a few hundred tokens and their generations; YaRN (factor 4 over 1024
    positions) scales the compressed layers' RoPE beyond position 1024."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_heads: int = 8
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 64
    o_lora_rank: int = 64
    o_groups: int = 2
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_topk: int = 16
    window_size: int = 128
    n_routed_experts: int = 4
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    num_hash_layers: int = 1
    hc_mult: int = 4
    max_position_embeddings: int = 4096
    yarn_factor: float = 4.0
    yarn_original_max_position: int = 1024


@dataclass(frozen=True)
class TinyVariant:
    """One checkpoint layout.

    ``compress_ratios``: one per main layer (``config.json`` appends a 0 per draft block).
    ``draft``: ``"mtp"`` (``num_draft_blocks`` MTP blocks ``mtp.{i}``), ``"dspark"`` (one DSpark
    stage ``mtp.{i}`` per entry of ``dspark_target_layers``) or ``"none"``. ``v41_sources``: the
    DeepSeek-V4.1 source fields of ``config.json`` (empty for DeepSeek-V4). ``prior_gain``: the
    logits' prior (module docstring, "Margins").
    """

    name: str
    model_type: str
    compress_ratios: tuple[int, ...]
    draft: str
    num_draft_blocks: int = 0
    dspark_target_layers: tuple[int, ...] = ()
    dspark_block_size: int = 3
    dspark_markov_rank: int = 16
    v41_sources: tuple[tuple[str, Any], ...] = ()
    prior_gain: float = PRIOR_GAIN
    dims: TinyDims = field(default_factory=TinyDims)

    @property
    def is_v41(self) -> bool:
        return self.model_type == "deepseek_v41"


_V4_RATIOS = (0, 4, 128, 4)
_VARIANTS = {
    "v4": TinyVariant("v4", "deepseek_v4", _V4_RATIOS, draft="mtp", num_draft_blocks=1),
    "dspark": TinyVariant(
        "dspark",
        "deepseek_v4",
        _V4_RATIOS,
        draft="dspark",
        num_draft_blocks=2,
        dspark_target_layers=(1, 3),
    ),
    "v41": TinyVariant(
        "v41",
        "deepseek_v41",
        (0, 2, 2, 1, 1, 1),
        draft="none",
        v41_sources=(
            ("kv_source_layer_ids", (1, 3)),
            ("index_source_layer_ids", (1, 3, 5)),
            ("candidate_source_layer_id", 3),
            ("candidate_topk_blocks", 2),
            ("candidate_block_size", 8),
        ),
        # Its cross-batch differences are larger (more top-k selections); 6 lets the context
        # decide 19 % of the steps, 8 about 9 % as V4's 6 does.
        prior_gain=8.0,
    ),
}
#: The variant names :func:`write_tiny_checkpoint` takes.
VARIANTS: tuple[str, ...] = tuple(_VARIANTS)


def tiny_variant(name: str) -> TinyVariant:
    """The variant ``name``; :class:`ConfigError` naming it and the choices if there is none."""
    try:
        return _VARIANTS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"tiny checkpoint variant {name!r} is not one of {', '.join(VARIANTS)}"
        ) from None


def write_tiny_checkpoint(
    directory: str | os.PathLike[str], variant: str = "v4", seed: int = 0
) -> pathlib.Path:
    """Write the checkpoint ``variant`` (one of :data:`VARIANTS`) of weights ``seed`` into
    ``directory`` (created if missing; files of the same names are replaced) and return it.

    Raises :class:`ConfigError` for an unknown ``variant``.
    """
    from safetensors.torch import save_file

    spec = tiny_variant(variant)
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / "config.json", config_json(spec))
    _write_tokenizer(path, spec)
    tensors = checkpoint_tensors(spec, seed)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def config_json(spec: TinyVariant) -> dict[str, Any]:
    """``config.json`` of ``spec``: DeepSeek-V4's fields (V4.1: ``DeepseekV41Config``'s)."""
    d = spec.dims
    n_draft = spec.num_draft_blocks
    config: dict[str, Any] = {
        # V4.1 checkpoints name their own class; sglang's DeepseekV41Config maps it to V4's.
        "architectures": ["DeepseekV41ForCausalLM" if spec.is_v41 else "DeepseekV4ForCausalLM"],
        "model_type": spec.model_type,
        "vocab_size": d.vocab_size,
        "hidden_size": d.hidden_size,
        "num_hidden_layers": len(spec.compress_ratios),
        "num_nextn_predict_layers": n_draft,
        "compress_ratios": [*spec.compress_ratios, *([0] * n_draft)],
        "num_attention_heads": d.num_heads,
        "num_key_value_heads": 1,
        "head_dim": d.head_dim,
        "qk_nope_head_dim": d.head_dim - d.rope_dim,
        "qk_rope_head_dim": d.rope_dim,
        "v_head_dim": d.head_dim,
        "kv_lora_rank": d.head_dim,
        "q_lora_rank": d.q_lora_rank,
        "o_lora_rank": d.o_lora_rank,
        "o_groups": d.o_groups,
        "index_n_heads": d.index_n_heads,
        "index_head_dim": d.index_head_dim,
        "index_topk": d.index_topk,
        "sliding_window": d.window_size,
        "window_size": d.window_size,
        "n_routed_experts": d.n_routed_experts,
        "n_shared_experts": d.n_shared_experts,
        "num_experts_per_tok": d.num_experts_per_tok,
        "moe_intermediate_size": d.moe_intermediate_size,
        "intermediate_size": 2 * d.moe_intermediate_size,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "num_hash_layers": d.num_hash_layers,
        "n_hash_layers": d.num_hash_layers,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "hc_mult": d.hc_mult,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": d.yarn_factor,
            "original_max_position_embeddings": d.yarn_original_max_position,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": d.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    for key, value in spec.v41_sources:
        config[key] = list(value) if isinstance(value, tuple) else value
    if spec.draft == "dspark":
        config.update(
            dspark_block_size=spec.dspark_block_size,
            dspark_markov_rank=spec.dspark_markov_rank,
            dspark_noise_token_id=SPECIAL_TOKENS.index(DSPARK_NOISE),
            dspark_target_layer_ids=list(spec.dspark_target_layers),
            enable_confidence_head=True,
        )
    return config


class TensorSpec(NamedTuple):
    """One checkpoint tensor: DeepSeek's ``name``, ``shape``, ``dtype`` and how it is drawn.

    ``init``: ``"normal"`` ``scale * N(0, 1)``; ``"writer"`` the same with row 0 zero (it never
    writes the hidden state's coordinate 0); ``"identity"`` ``I + scale * N(0, 1)``;
    ``"norm"`` ``1 + scale * N(0, 1)``; ``"embed"`` ``N(0, 1)`` with column 0
    ``EMBED_OFFSET``; ``"route"`` ``±scale`` (``+`` on two neighbouring experts);
    ``"tid2eid"`` ``shape[1]`` distinct experts of ``scale`` per row; ``"head"`` see
    :func:`checkpoint_tensors`.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str = "normal"
    scale: float = 1.0


def tensor_specs(spec: TinyVariant) -> list[TensorSpec]:
    """Every tensor of ``spec``'s ``model.safetensors``, in DeepSeek's checkpoint spelling.

    Dtypes are those of the sglang parameters they load into: bf16 for the projections, the
    embeddings and most norms; fp32 for the hyper-connection mixes (``hc_*``), ``attn_sink``,
    the compressors' ``ape`` (and V4's compressor norms), the routers' ``gate.bias`` and the
    DSpark heads; int32 for ``gate.tid2eid`` (``[vocab_size, num_experts_per_tok]``) of the
    hash-routed layer.
    """
    d = spec.dims
    h = d.hidden_size
    out = [
        TensorSpec("embed.weight", (d.vocab_size, h), torch.bfloat16, "embed"),
        TensorSpec("head.weight", (d.vocab_size, h), torch.bfloat16, "head"),
        _norm("norm.weight", h),
    ]
    if not spec.is_v41:
        out += _hc_head("", d)
    for layer, ratio in enumerate(spec.compress_ratios):
        prefix = f"layers.{layer}."
        out += _block(prefix, d, hash_routed=layer < d.num_hash_layers)
        out += _attention_sources(prefix + "attn.", spec, layer, ratio)
    if spec.draft == "mtp":
        for block in range(spec.num_draft_blocks):
            prefix = f"mtp.{block}."
            out += _block(prefix, d, hash_routed=False)
            # The draft reads the next token's embedding nearly unchanged: it predicts what
            # the target's prior predicts (accepted when the prior decides the step).
            out.append(_square(f"{prefix}e_proj.weight", h, "identity", 0.1 / math.sqrt(h)))
            out += _linear(prefix + "h_proj", h, h, init="writer")
            out += [_norm(f"{prefix}{norm}.weight", h) for norm in ("enorm", "hnorm", "norm")]
            out += _hc_head(prefix, d)
    elif spec.draft == "dspark":
        out += _dspark(spec)
    return out


def _norm(name: str, width: int, dtype: torch.dtype = torch.bfloat16) -> TensorSpec:
    return TensorSpec(name, (width,), dtype, "norm", 0.1)


def _fp32(
    name: str, shape: tuple[int, ...], init: str = "normal", scale: float = 1.0
) -> TensorSpec:
    return TensorSpec(name, shape, torch.float32, init, scale)


def _square(name: str, width: int, init: str, scale: float) -> TensorSpec:
    return TensorSpec(name, (width, width), torch.bfloat16, init, scale)


def _linear(
    name: str,
    fan_out: int,
    fan_in: int,
    *,
    init: str = "normal",
    dtype: torch.dtype = torch.bfloat16,
) -> list[TensorSpec]:
    """``{name}.weight`` ``[fan_out, fan_in]`` of entries ``N(0, 1 / fan_in)``."""
    return [TensorSpec(f"{name}.weight", (fan_out, fan_in), dtype, init, 1 / math.sqrt(fan_in))]


def _hc_head(prefix: str, d: TinyDims) -> list[TensorSpec]:
    """The hyper-connection head collapsing the ``hc_mult`` streams (fp32): ``hc_head_fn``
    ``[hc, hc * hidden]``, ``hc_head_base`` ``[hc]``, ``hc_head_scale`` ``[1]``."""
    hc_dim = d.hc_mult * d.hidden_size
    return [
        _fp32(f"{prefix}hc_head_fn", (d.hc_mult, hc_dim), scale=1 / math.sqrt(hc_dim)),
        _fp32(f"{prefix}hc_head_base", (d.hc_mult,), scale=0.5),
        _norm(f"{prefix}hc_head_scale", 1, torch.float32),
    ]


def _block(prefix: str, d: TinyDims, *, hash_routed: bool) -> list[TensorSpec]:
    """A decoder block's tensors but its compressor / indexer (:func:`_attention_sources`).

    The hyper-connection mixes (fp32) ``hc_{attn,ffn}_fn`` ``[(2 + hc) * hc, hc * hidden]``,
    ``hc_{attn,ffn}_base`` ``[(2 + hc) * hc]``, ``hc_{attn,ffn}_scale`` ``[3]``; the norms
    ``attn_norm`` / ``ffn_norm``; the attention's ``attn_sink`` ``[heads]`` (fp32), ``wq_a``
    ``[q_lora, hidden]`` and ``wkv`` ``[head_dim, hidden]`` (sglang fuses them into
    ``wqkv_a``), ``q_norm``, ``wq_b`` ``[heads * head_dim, q_lora]``, ``kv_norm``, ``wo_a``
    ``[o_groups * o_lora, heads * head_dim / o_groups]``, ``wo_b`` ``[hidden, o_groups *
    o_lora]``; the MoE's router ``gate`` ``[experts, hidden]`` with ``gate.tid2eid`` (hash
    routed) or ``gate.bias`` ``[experts]`` (fp32), and ``w1`` / ``w3`` ``[inter, hidden]``
    (sglang stacks them into ``w13`` / ``gate_up_proj``), ``w2`` ``[hidden, inter]`` of every
    routed and the shared expert.
    """
    h, hc_dim = d.hidden_size, d.hc_mult * d.hidden_size
    mix = (2 + d.hc_mult) * d.hc_mult
    out: list[TensorSpec] = []
    for part in ("attn", "ffn"):
        out += [
            _fp32(f"{prefix}hc_{part}_fn", (mix, hc_dim), scale=1 / math.sqrt(hc_dim)),
            _fp32(f"{prefix}hc_{part}_base", (mix,), scale=0.5),
            _norm(f"{prefix}hc_{part}_scale", 3, torch.float32),
            _norm(f"{prefix}{part}_norm.weight", h),
        ]
    attn = prefix + "attn."
    out.append(_fp32(f"{attn}attn_sink", (d.num_heads,)))
    out += _linear(attn + "wq_a", d.q_lora_rank, h)
    out.append(_norm(f"{attn}q_norm.weight", d.q_lora_rank))
    out += _linear(attn + "wq_b", d.num_heads * d.head_dim, d.q_lora_rank)
    out += _linear(attn + "wkv", d.head_dim, h)
    out.append(_norm(f"{attn}kv_norm.weight", d.head_dim))
    group_width = d.num_heads * d.head_dim // d.o_groups
    out += _linear(attn + "wo_a", d.o_groups * d.o_lora_rank, group_width)
    out += _linear(attn + "wo_b", h, d.o_groups * d.o_lora_rank, init="writer")
    ffn, experts = prefix + "ffn.", d.n_routed_experts
    out += _linear(ffn + "gate", experts, h)
    if hash_routed:
        routes = (d.vocab_size, d.num_experts_per_tok)
        out.append(TensorSpec(f"{ffn}gate.tid2eid", routes, torch.int32, "tid2eid", experts))
    else:
        out.append(_fp32(f"{ffn}gate.bias", (experts,), "route", ROUTER_BIAS))
    inter = d.moe_intermediate_size
    for expert in [*(f"{ffn}experts.{e}." for e in range(experts)), f"{ffn}shared_experts."]:
        out += _linear(expert + "w1", inter, h)
        out += _linear(expert + "w2", h, inter, init="writer")
        out += _linear(expert + "w3", inter, h)
    return out


def _compressor(prefix: str, d: TinyDims, ratio: int, width: int, v41: bool) -> list[TensorSpec]:
    """A compressor of ``ratio`` writing entries of ``width``: ``wkv`` / ``wgate`` ``[coff *
    width, hidden]`` (``coff`` 2 for the overlapping ratio 4; sglang fuses them into
    ``wkv_gate``), ``ape`` ``[ratio, coff * width]`` (fp32) and ``norm`` ``[width]`` (fp32;
    V4.1: bf16, and no ``ape``; its ratio 1 has no ``wgate``)."""
    coff = 2 if ratio == 4 else 1
    out = _linear(prefix + "wkv", coff * width, d.hidden_size)
    if ratio != 1:
        out += _linear(prefix + "wgate", coff * width, d.hidden_size)
    if not v41:
        out.append(_fp32(f"{prefix}ape", (ratio, coff * width), scale=0.5))
    out.append(_norm(f"{prefix}norm.weight", width, torch.bfloat16 if v41 else torch.float32))
    return out


def _attention_sources(attn: str, spec: TinyVariant, layer: int, ratio: int) -> list[TensorSpec]:
    """A main layer's compressor (V4: ratios 4 and 128; V4.1: the kv sources) and indexer (V4:
    ratio 4; V4.1: the index sources): ``wq_b`` ``[index_heads * index_head_dim, q_lora]``,
    ``weights_proj`` ``[index_heads, hidden]``, and (V4) a ratio-4 compressor of
    ``index_head_dim`` entries, (V4.1 kv sources) ``wk`` ``[index_head_dim, head_dim]`` and
    ``k_norm``."""
    d = spec.dims
    if spec.is_v41:
        sources = dict(spec.v41_sources)
        kv_source = layer in sources["kv_source_layer_ids"]
        indexed = layer in sources["index_source_layer_ids"]
    else:
        kv_source, indexed = ratio in (4, 128), ratio == 4
    out: list[TensorSpec] = []
    if kv_source:
        out += _compressor(attn + "compressor.", d, ratio, d.head_dim, spec.is_v41)
    if indexed:
        out += _linear(attn + "indexer.wq_b", d.index_n_heads * d.index_head_dim, d.q_lora_rank)
        out += _linear(attn + "indexer.weights_proj", d.index_n_heads, d.hidden_size)
        if not spec.is_v41:
            out += _compressor(attn + "indexer.compressor.", d, ratio, d.index_head_dim, False)
        elif kv_source:
            out += _linear(attn + "indexer.wk", d.index_head_dim, d.head_dim)
            out.append(_norm(f"{attn}indexer.k_norm.weight", d.index_head_dim))
    return out


def _dspark(spec: TinyVariant) -> list[TensorSpec]:
    """The DSpark stages ``mtp.{s}.*``: a window-only decoder block each; stage 0 also
    ``main_proj`` ``[hidden, hidden * len(target layers)]`` and ``main_norm``; the last stage
    ``norm``, the hyper-connection head, the Markov head (``markov_head.embed`` and
    ``markov_head.head`` ``[vocab, rank]``, fp32) and the confidence head
    (``confidence_head.proj`` ``[1, hidden + rank]``, fp32)."""
    d = spec.dims
    h, rank, last = d.hidden_size, spec.dspark_markov_rank, spec.num_draft_blocks - 1
    out: list[TensorSpec] = []
    for stage in range(spec.num_draft_blocks):
        prefix = f"mtp.{stage}."
        out += _block(prefix, d, hash_routed=False)
        if stage == 0:
            fan_in = h * len(spec.dspark_target_layers)
            out += _linear(prefix + "main_proj", h, fan_in, init="writer")
            out.append(_norm(f"{prefix}main_norm.weight", h))
        if stage == last:
            out.append(_norm(f"{prefix}norm.weight", h))
            out += _hc_head(prefix, d)
            out.append(_fp32(f"{prefix}markov_head.embed.weight", (d.vocab_size, rank)))
            out += _linear(prefix + "markov_head.head", d.vocab_size, rank, dtype=torch.float32)
            out += _linear(prefix + "confidence_head.proj", 1, h + rank, dtype=torch.float32)
    return out


def successor(vocab_size: int, seed: int = 0) -> list[int]:
    """``successor(...)[t]``: the token the logits' prior favours after ``t``. One random cycle
    through every token but the end of sentence (its own successor), a function of ``seed``."""
    eos = SPECIAL_TOKENS.index(EOS)
    order = torch.randperm(vocab_size, generator=_generator(seed, "successor")).tolist()
    order = [token for token in order if token != eos]
    nxt = list(range(vocab_size))
    for i, token in enumerate(order):
        nxt[token] = order[(i + 1) % len(order)]
    return nxt


def checkpoint_tensors(spec: TinyVariant, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of :func:`tensor_specs`, drawn for ``seed``: each a function of ``(seed,
    name)`` only, ``head.weight`` also of the embedding and :func:`successor` (module docstring,
    "Margins")."""
    tensors = {t.name: _draw(t, seed) for t in tensor_specs(spec)}
    d = spec.dims
    embed = tensors["embed.weight"].float()
    embed[:, 0] = 0.0
    pred = torch.empty(d.vocab_size, dtype=torch.long)
    pred[torch.tensor(successor(d.vocab_size, seed))] = torch.arange(d.vocab_size)
    random = torch.randn(embed.shape, generator=_generator(seed, "head.weight"))
    head = (LOGIT_GAIN * random + spec.prior_gain * embed[pred]) / math.sqrt(d.hidden_size)
    head[SPECIAL_TOKENS.index(EOS)] *= 0.01
    head[:, 0] = -LOGIT_SHIFT
    tensors["head.weight"] = head.to(torch.bfloat16).contiguous()
    return tensors


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _draw(t: TensorSpec, seed: int) -> torch.Tensor:
    """``t``'s values: a function of ``(seed, t.name)`` (``"head"``: zeros, replaced by
    :func:`checkpoint_tensors`)."""
    g = _generator(seed, t.name)
    if t.init == "head":
        return torch.zeros(t.shape, dtype=t.dtype)
    if t.init == "tid2eid":
        experts = torch.rand((t.shape[0], int(t.scale)), generator=g).argsort(dim=-1)
        return experts[:, : t.shape[1]].to(t.dtype).contiguous()
    if t.init == "route":
        first = int(torch.randint(t.shape[0], (1,), generator=g))
        bias = torch.full(t.shape, -t.scale)
        bias[[first, (first + 1) % t.shape[0]]] = t.scale
        return bias.to(t.dtype)
    x = torch.randn(t.shape, generator=g) * t.scale
    if t.init == "norm":
        x += 1.0
    elif t.init == "embed":
        x[:, 0] = EMBED_OFFSET
    elif t.init == "identity":
        x += torch.eye(*t.shape)
    elif t.init == "writer":
        x[0] = 0.0
    return x.to(t.dtype).contiguous()


def _write_json(path: pathlib.Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


#: The text the tokenizer's merges are learned from (fixed: the merges are part of the
#: checkpoint).
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A tiny model of DeepSeek writes the same "
    "tokens every time it is asked the same question, and the attention of every layer reads "
    "what the window and the compressed caches hold. Hello world! What is the capital of "
    "France? Paris is the capital of France. Please write a short poem about the sea, the sun "
    "and the stars. def main():\n    print('hello, world')\n    return 0\n"
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 100 200 1000 2024 3.14159 "
    "<html><body>tokens, merges, and bytes</body></html> user assistant system thinking "
)


def _tokenizer_merges(vocab: dict[str, int], size: int) -> list[tuple[str, str]]:
    """Byte-level BPE merges learned greedily from :data:`_CORPUS` (most frequent pair first,
    ties by spelling) until ``vocab`` has ``size`` entries; the merged tokens join ``vocab``."""
    from tokenizers import pre_tokenizers

    words: dict[tuple[str, ...], int] = {}
    for word, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(_CORPUS):
        words[tuple(word)] = words.get(tuple(word), 0) + 1
    merges: list[tuple[str, str]] = []
    while len(vocab) < size:
        counts: dict[tuple[str, str], int] = {}
        for word, n in words.items():
            for pair in itertools.pairwise(word):
                counts[pair] = counts.get(pair, 0) + n
        if not counts:
            raise ValueError(f"the corpus has too few pairs for a vocabulary of {size}")
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        words = {_merge(word, best): n for word, n in words.items()}
    return merges


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if word[i : i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _write_tokenizer(path: pathlib.Path, spec: TinyVariant) -> None:
    """``tokenizer.json`` (ids: :data:`SPECIAL_TOKENS`, the 256 byte-level tokens, then the
    merged tokens up to ``vocab_size``) and ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for byte in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[byte] = len(vocab)
    merges = _tokenizer_merges(vocab, spec.dims.vocab_size)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=t not in TEXT_TOKENS, normalized=False) for t in SPECIAL_TOKENS]
    # add_special_tokens marks every token it takes special, whatever its AddedToken says.
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])
    (path / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": spec.dims.max_position_embeddings,
        },
    )
