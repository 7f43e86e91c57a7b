"""``read_hf_config``: one rule per field for the hub ``config.json``, transformers' config
object and sglang's config object (what ``model_config.hf_config`` is at runtime)."""

from __future__ import annotations

from typing import Any

import pytest
from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY
from transformers import DeepseekV4Config

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.hf_config import config_from_hf, read_hf_config

#: YaRN values unlike the dataclass defaults, so a fallback to a default cannot pass.
YARN = {
    "type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 16.0,
    "beta_slow": 2.0,
}


def hub(**overrides: Any) -> dict[str, Any]:
    """A hub ``config.json`` of a tiny DeepSeek-V4 (one MTP slot after the 4 layers)."""
    values: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_hidden_layers": 4,
        "compress_ratios": [0, 4, 128, 4, 0],
        "num_attention_heads": 8,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "sliding_window": 128,
        "index_topk": 16,
        "index_n_heads": 4,
        "index_head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 20000.0,
        "compress_rope_theta": 40000.0,
        "rope_scaling": dict(YARN),
        "max_position_embeddings": 32768,
    }
    values.update(overrides)
    return values


def sglang_object(values: dict[str, Any]) -> Any:
    """sglang's runtime config object for ``model_type: deepseek_v4``."""
    return _CONFIG_REGISTRY["deepseek_v4"](**values)


def transformers_object(values: dict[str, Any]) -> Any:
    return DeepseekV4Config(**values)


EXPECTED = DSV4AttentionConfig(
    compress_ratios=(0, 4, 128, 4),
    num_heads=8,
    head_dim=128,
    index_topk=16,
    index_n_heads=4,
    index_head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=20000.0,
    compress_rope_theta=40000.0,
    yarn_factor=8.0,
    yarn_original_max_position=4096,
    yarn_beta_fast=16.0,
    yarn_beta_slow=2.0,
)

FORMS = {"hub": lambda v: v, "transformers": transformers_object, "sglang": sglang_object}


@pytest.mark.sglang
@pytest.mark.parametrize("form", FORMS)
def test_every_form_gives_the_same_config(form: str) -> None:
    assert config_from_hf(FORMS[form](hub())) == EXPECTED


@pytest.mark.sglang
def test_sglang_object_has_no_rope_scaling_key_in_to_dict_yet_yarn_is_read() -> None:
    obj = sglang_object(hub())
    assert "rope_scaling" not in obj.to_dict()  # why reading to_dict() fell back to defaults
    assert read_hf_config(obj)["yarn_factor"] == 8.0


def test_transformers_layer_types_and_compress_rates() -> None:
    types = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    obj = transformers_object(hub(compress_ratios=None, num_hidden_layers=3, layer_types=types))
    assert not hasattr(obj, "compress_ratios")
    assert read_hf_config(obj)["compress_ratios"] == (0, 4, 128)


@pytest.mark.sglang
@pytest.mark.parametrize("form", FORMS)
def test_no_scaling_means_no_yarn(form: str) -> None:
    values = hub()
    del values["rope_scaling"]
    config = config_from_hf(FORMS[form](values))
    assert config.yarn_original_max_position == 0
    assert (config.rope_theta, config.compress_rope_theta) == (20000.0, 40000.0)


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("form", "missing"),
    [
        *(("hub", f) for f in ("index_topk", "qk_rope_head_dim", "rms_norm_eps")),
        ("hub", "compress_rope_theta"),
        # sglang's config class has its own defaults for qk_rope_head_dim and rms_norm_eps.
        ("sglang", "index_topk"),
        ("sglang", "compress_rope_theta"),
    ],
)
def test_a_missing_field_is_refused_by_name(form: str, missing: str) -> None:
    values = hub()
    del values[missing]
    with pytest.raises(ConfigError, match=missing):
        read_hf_config(FORMS[form](values))


def test_a_config_without_layer_ratios_is_refused() -> None:
    with pytest.raises(ConfigError, match="compress_ratios nor layer_types"):
        read_hf_config({"num_attention_heads": 32, "head_dim": 128})


@pytest.mark.sglang
def test_a_rope_scaling_edited_by_transformers_keeps_the_hub_thetas() -> None:
    """transformers writes the main ``rope_theta`` into the hub dict's ``rope_scaling``; the
    compressed theta still comes from ``compress_rope_theta``."""
    values = hub()
    sglang_object(values)
    assert values["rope_scaling"].get("rope_theta") == 20000.0
    assert config_from_hf(values) == EXPECTED


def test_main_theta_missing_everywhere_is_refused() -> None:
    values = hub()
    del values["rope_theta"]
    with pytest.raises(ConfigError, match="rope_theta"):
        read_hf_config(values)


def test_a_window_only_model_needs_no_compressed_fields() -> None:
    """Without compressed layers the indexer, compressor and RoPE-theta fields are unused: absent,
    they keep the defaults; ``fallbacks`` stand in for a window the config does not name."""
    values = {
        "compress_ratios": [0],
        "num_attention_heads": 64,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "index_topk": 512,
    }
    with pytest.raises(ConfigError, match="sliding_window / window_size"):
        read_hf_config(values)
    config = config_from_hf(values, {"window_size": 128})
    assert config == DSV4AttentionConfig(compress_ratios=(0,), yarn_original_max_position=0)
    with pytest.raises(ConfigError, match="index_n_heads"):
        read_hf_config({**values, "compress_ratios": [0, 4]}, {"window_size": 128})
