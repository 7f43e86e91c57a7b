"""Reading a DeepSeek-V4 model config into :class:`~dsv4_backend.config.DSV4AttentionConfig`:
the hub ``config.json`` mapping, a transformers ``DeepseekV4Config`` or sglang's runtime config
object (``model_config.hf_config``), one rule per field (:func:`read_hf_config`), and
:func:`config_from_hf`. ``config.py`` holds the config itself; this module is its reader."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from dsv4_backend.config import DSV4AttentionConfig, V41Sources
from dsv4_backend.errors import ConfigError

#: Fields only compressed layers, their compressors and the indexer read (see ``read_hf_config``).
COMPRESSED_ONLY_FIELDS = frozenset(
    {"index_n_heads", "index_head_dim", "rms_norm_eps", "rope_theta", "compress_rope_theta"}
)
#: transformers' ``layer_types`` label of a window-only layer (the others map through
#: ``compress_rates``).
SLIDING_LAYER_TYPE = "sliding_attention"


def _field(hf: Any, key: str) -> Any:
    """``hf[key]`` of a mapping or ``hf.key`` of a config object; None when absent."""
    if isinstance(hf, Mapping):
        return hf.get(key)
    return getattr(hf, key, None)


def _required(hf: Any, *keys: str) -> Any:
    """The first of ``keys`` present in ``hf``; ``ConfigError`` naming them all otherwise."""
    for key in keys:
        value = _field(hf, key)
        if value is not None:
            return value
    raise ConfigError(
        f"config has no {' / '.join(keys)}; expected a DeepSeek-V4 config (hub config.json, "
        "transformers DeepseekV4Config or sglang's model_config.hf_config)"
    )


def _layer_ratios(hf: Any) -> list[int]:
    """``compress_ratios`` when present, else ``layer_types`` mapped through ``compress_rates``."""
    ratios = _field(hf, "compress_ratios")
    if ratios is None:
        types, rates = _field(hf, "layer_types"), _field(hf, "compress_rates")
        if types is None or rates is None:
            raise ConfigError(
                "config has neither compress_ratios nor layer_types + compress_rates; expected "
                "a DeepSeek-V4 config"
            )
        unknown = sorted({t for t in types if t != SLIDING_LAYER_TYPE and t not in rates})
        if unknown:
            raise ConfigError(f"layer_types {unknown} have no entry in compress_rates {rates}")
        ratios = [0 if t == SLIDING_LAYER_TYPE else rates[t] for t in types]
    if isinstance(ratios, (str, bytes)) or not isinstance(ratios, Sequence):
        raise ConfigError(
            f"compress_ratios={ratios!r}; expected a list of integers (one ratio per layer)"
        )
    ratios = [_integer(f"compress_ratios[{i}]", r) for i, r in enumerate(ratios)]
    layers = _field(hf, "num_hidden_layers")
    if layers is not None and len(ratios) > _integer("num_hidden_layers", layers):
        # The draft layers' slots: V4's MTP layer, V4.1's DSpark stages.
        ratios = ratios[: _integer("num_hidden_layers", layers)]
    return ratios


def _rope_sections(hf: Any) -> tuple[Mapping[str, Any], Mapping[str, Any], bool]:
    """``(main, compress, nested)``: RoPE parameter mappings (either may be empty), and whether
    they are transformers' nested sections (only those carry the compressed layers' theta).

    transformers nests ``rope_parameters`` as ``{"main": ..., "compress": ...}``; sglang's
    config object (transformers 5 standardisation of the hub's ``rope_scaling``) keeps one flat
    ``rope_parameters`` holding the main ``rope_theta`` and the YaRN values; the hub
    ``config.json`` has ``rope_scaling`` and top-level thetas.
    """
    params = _field(hf, "rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get("main"), Mapping):
        return params["main"], params.get("compress") or {}, True
    if isinstance(params, Mapping):
        return params, params, False
    scaling = _field(hf, "rope_scaling")
    return {}, scaling if isinstance(scaling, Mapping) else {}, False


def read_hf_config(hf: Any, fallbacks: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``DSV4AttentionConfig`` keyword values from a DeepSeek-V4 model config.

    ``hf`` is a mapping (the hub ``config.json``) or a config object (transformers'
    ``DeepseekV4Config``, sglang's ``model_config.hf_config``); fields are keys of the mapping
    or attributes of the object (never ``to_dict()``, which drops what sglang computes).
    ``fallbacks`` maps a value name to the host's own reading of it (sglang's
    ``model_config.sliding_window_size``), used when ``hf`` has none of its sources.

    One rule per field (first source found wins; none found: ``ConfigError`` naming it):

    ===========================  =================================================================
    field                        source
    ===========================  =================================================================
    compress_ratios              ``compress_ratios``; else ``layer_types`` mapped through
                                 ``compress_rates`` (``sliding_attention`` = 0). Ratios past
                                 ``num_hidden_layers`` (the draft layers' slots: V4's MTP
                                 layer, V4.1's DSpark stages) are dropped
    num_heads                    ``num_attention_heads``
    head_dim                     ``head_dim``
    rope_dim                     ``qk_rope_head_dim``
    window_size                  ``sliding_window``, else ``window_size``
    index_topk / index_n_heads   ``index_topk`` / ``index_n_heads`` / ``index_head_dim``
    / index_head_dim
    rms_norm_eps                 ``rms_norm_eps``
    rope_theta                   ``rope_parameters["main"]["rope_theta"]`` (transformers), else
                                 flat ``rope_parameters["rope_theta"]`` (sglang), else
                                 ``rope_theta``
    compress_rope_theta          ``rope_parameters["compress"]["rope_theta"]``, else
                                 ``compress_rope_theta``
    v41                          ``kv_source_layer_ids`` (non-empty: DeepSeek-V4.1),
                                 ``index_source_layer_ids``, ``candidate_source_layer_id``
                                 (default -1), ``candidate_topk_blocks``,
                                 ``candidate_block_size`` (default 0)
    yarn_*                       the compressed layers' scaling: ``rope_parameters["compress"]``,
                                 else flat ``rope_parameters``, else ``rope_scaling``. YaRN is on
                                 when it has ``original_max_position_embeddings`` > 0 (sglang's
                                 rule); then ``factor`` (default 1.0), ``beta_fast`` (32),
                                 ``beta_slow`` (1) as sglang's model reads them. No scaling: no
                                 YaRN (``yarn_original_max_position = 0``)
    ===========================  =================================================================

    A model without compressed layers (every ratio 0) has no use for ``COMPRESSED_ONLY_FIELDS``
    (the host applies the window layers' RoPE): absent, they keep ``DSV4AttentionConfig``'s
    defaults.
    """
    fallbacks = fallbacks or {}
    ratios = tuple(_layer_ratios(hf))
    optional = not any(ratios)
    main, compress, nested = _rope_sections(hf)
    rope_theta = main.get("rope_theta")
    compress_theta = compress.get("rope_theta") if nested else None
    original = _integer(
        "original_max_position_embeddings", compress.get("original_max_position_embeddings") or 0
    )
    values: dict[str, Any] = dict(compress_ratios=ratios, yarn_original_max_position=original)

    def read(name: str, convert: Any, given: Any, *keys: str) -> None:
        """``values[name]`` from ``given`` (an already found source), else the first of
        ``keys`` in ``hf``, else ``fallbacks[name]``; left out when optional and absent."""
        if given is None:
            given = next((v for v in (_field(hf, k) for k in keys) if v is not None), None)
        if given is None:
            given = fallbacks.get(name)
        if given is None:
            if optional and name in COMPRESSED_ONLY_FIELDS:
                return
            given = _required(hf, *keys)  # raises, naming the keys
        values[name] = convert(keys[0], given)

    read("num_heads", _integer, None, "num_attention_heads")
    read("head_dim", _integer, None, "head_dim")
    read("rope_dim", _integer, None, "qk_rope_head_dim")
    read("window_size", _integer, None, "sliding_window", "window_size")
    read("index_topk", _integer, None, "index_topk")
    read("index_n_heads", _integer, None, "index_n_heads")
    read("index_head_dim", _integer, None, "index_head_dim")
    read("rms_norm_eps", _real, None, "rms_norm_eps")
    read("rope_theta", _real, rope_theta, "rope_theta")
    read("compress_rope_theta", _real, compress_theta, "compress_rope_theta")
    if original > 0:
        values.update(
            yarn_factor=_real("factor", compress.get("factor", 1.0)),
            yarn_beta_fast=_real("beta_fast", compress.get("beta_fast", 32.0)),
            yarn_beta_slow=_real("beta_slow", compress.get("beta_slow", 1.0)),
        )
    kv_sources = _field(hf, "kv_source_layer_ids")
    if kv_sources:  # DeepSeek-V4.1 (sglang's DeepseekV41Config defaults it to ())
        values["v41"] = V41Sources(
            kv_source_layers=_layer_ids("kv_source_layer_ids", kv_sources),
            index_source_layers=_layer_ids(
                "index_source_layer_ids", _field(hf, "index_source_layer_ids") or ()
            ),
            candidate_source_layer=_integer(
                "candidate_source_layer_id", _field(hf, "candidate_source_layer_id") or -1
            ),
            candidate_topk_blocks=_integer(
                "candidate_topk_blocks", _field(hf, "candidate_topk_blocks") or 0
            ),
            candidate_block_size=_integer(
                "candidate_block_size", _field(hf, "candidate_block_size") or 0
            ),
        )
    return values


def _layer_ids(name: str, values: Any) -> tuple[int, ...]:
    """``values`` (a list of layer ids) as a tuple of ints; ``ConfigError`` naming ``name``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigError(f"{name}={values!r}; expected a list of layer ids")
    return tuple(_integer(f"{name}[{i}]", v) for i, v in enumerate(values))


def _integer(name: str, value: Any) -> int:
    """``value`` as an int; ``ConfigError`` naming ``name`` for anything else (floats with a
    fraction, strings, booleans included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name}={value!r}; expected an integer")
    if isinstance(value, numbers.Integral):
        return int(value)
    as_float = float(value)
    if not as_float.is_integer():  # also false for inf and nan
        raise ConfigError(f"{name}={value!r}; expected an integer")
    return int(as_float)


def _real(name: str, value: Any) -> float:
    """``value`` as a finite float; ``ConfigError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{name}={value!r}; expected a finite number")
    return float(value)


def config_from_hf(
    hf: Any, fallbacks: Mapping[str, Any] | None = None, **overrides: Any
) -> DSV4AttentionConfig:
    """Build from a DeepSeek-V4 model config, read by :func:`read_hf_config` (its rules).

    ``hf`` is the hub ``config.json`` mapping, a transformers ``DeepseekV4Config`` or
    sglang's runtime config object (``model_config.hf_config``). ``fallbacks`` are the
    host's readings of fields ``hf`` lacks; ``overrides`` replace read values. Raises
    ``ConfigError`` naming the field that cannot be found.
    """
    values = read_hf_config(hf, fallbacks)
    values.update(overrides)
    return DSV4AttentionConfig(**values)
