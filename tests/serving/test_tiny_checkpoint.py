"""The tiny DeepSeek-V4 checkpoint (``dsv4_backend/tools/cpu_server/checkpoint.py``).

The files are deterministic, the tokenizer is DeepSeek's layout, sglang's DeepSeek-V4 chat
encoder renders conversations with it, and sglang's own models load it with sglang's real
weight loader: ``DeepseekV4ForCausalLM`` (V4, V4.1), the EAGLE draft
``DeepseekV4ForCausalLMNextN`` and the DSpark draft ``DeepseekV4ForCausalLMDSpark``, each built
on the CPU in this process (no server). The loader check fills every parameter with a sentinel
first; afterwards every element of every parameter must hold checkpoint values, each
checkpoint tensor must sit where sglang's conventions put it (the expectations below are
written from them, not read from the loader: renames, the fused ``wqkv_a`` / ``wkv_gate``
rows, stacked expert weights, the ratio-4 ``ape`` layout), the tensors a model leaves must be
exactly the other model's, and sglang's loaders must warn about nothing.
"""

# DeepSeek's special tokens are spelled with FULLWIDTH VERTICAL LINE (U+FF5C).
# ruff: noqa: RUF001

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import pathlib
import socket
from collections.abc import Callable, Iterator

import pytest
import torch

from dsv4_backend.errors import ConfigError
from dsv4_backend.tools.cpu_server import checkpoint
from dsv4_backend.tools.cpu_server.checkpoint import (
    SPECIAL_TOKENS,
    TEXT_TOKENS,
    VARIANTS,
    tiny_variant,
    write_tiny_checkpoint,
)
from dsv4_backend.tools.cpu_server.standins import unscaled_rope_fallback

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Every variant written once (seed 0)."""
    root = tmp_path_factory.mktemp("tiny")
    return {v: write_tiny_checkpoint(root / v, v) for v in VARIANTS}


def digests(path: pathlib.Path) -> dict[str, str]:
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in FILES}


def load_tensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_unknown_variant_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=r"'v5'.*v4, dspark, v41"):
        write_tiny_checkpoint(tmp_path, "v5")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("variant", VARIANTS)
def test_same_variant_and_seed_write_identical_files(
    variant: str, written: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    again = write_tiny_checkpoint(tmp_path / "again", variant, seed=0)
    assert digests(again) == digests(written[variant])
    other = write_tiny_checkpoint(tmp_path / "other", variant, seed=1)
    changed = {f for f in FILES if digests(other)[f] != digests(again)[f]}
    assert changed == {"model.safetensors"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_carries_the_real_checkpoint_fields(
    variant: str, written: dict[str, pathlib.Path]
) -> None:
    config = json.loads((written[variant] / "config.json").read_text())
    spec = tiny_variant(variant)
    layers, draft = config["num_hidden_layers"], config["num_nextn_predict_layers"]
    assert config["compress_ratios"] == [*spec.compress_ratios, *[0] * draft]
    assert len(config["compress_ratios"]) == layers + draft
    assert config["rope_scaling"]["type"] == "yarn"
    assert {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow"} <= set(
        config["rope_scaling"]
    )
    assert config["swiglu_limit"] == 10.0
    assert config["sliding_window"] == config["window_size"] == 128
    assert config["hc_mult"] == 4
    assert config["num_hash_layers"] == config["n_hash_layers"] >= 1
    assert (config["head_dim"], config["qk_rope_head_dim"], config["index_head_dim"]) == (
        512,
        64,
        128,
    )
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    tensors = load_tensors(written[variant])
    floats = {t.dtype for t in tensors.values() if t.dtype.is_floating_point}
    assert floats <= {torch.bfloat16, torch.float32}
    assert tensors["embed.weight"].dtype == torch.bfloat16
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert "layers.1.ffn.gate.tid2eid" not in tensors
    if variant == "v41":
        assert config["model_type"] == "deepseek_v41"
        assert config["kv_source_layer_ids"] == [1, 3]
    if variant == "dspark":
        assert config["dspark_target_layer_ids"] == [1, 3] and draft == 2
        assert config["dspark_noise_token_id"] < config["vocab_size"]


def test_tokenizer_is_byte_level_with_deepseek_special_tokens(
    written: dict[str, pathlib.Path],
) -> None:
    from transformers import AutoTokenizer

    path = written["v4"]
    config = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.bos_token_id == config["bos_token_id"] == 0
    assert tokenizer.eos_token_id == config["eos_token_id"] == 1
    assert tokenizer.pad_token_id == 2
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == i
    text = "Grüße, 世界! \t\n<｜User｜>hi<think>x</think>｜DSML｜"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<｜User｜>") in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.replace("<｜User｜>", "")
    assert all(token in tokenizer.get_vocab() for token in TEXT_TOKENS)
    assert max(tokenizer.encode("the capital of France", add_special_tokens=False)) >= 282


@pytest.mark.sglang
@pytest.mark.parametrize("variant", VARIANTS)
def test_sglang_deepseek_chat_encoder_renders_a_conversation(
    variant: str, written: dict[str, pathlib.Path]
) -> None:
    """sglang's DeepSeek-V4 chat path (``deepseek-recipe``) renders with the tokenizer: the
    spec sglang picks for the config, thinking on and off, a system turn, history and tools."""
    from types import SimpleNamespace

    from sglang.srt.entrypoints.openai.chat_encoding import resolve_chat_encoding_spec
    from sglang.srt.parser.deepseek_recipe_renderer import DeepSeekRecipe
    from transformers import AutoTokenizer

    path = written[variant]
    config = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    # sglang's config classes turn DeepseekV41ForCausalLM into DeepseekV4ForCausalLM.
    hf = SimpleNamespace(architectures=["DeepseekV4ForCausalLM"], model_type=config["model_type"])
    spec = resolve_chat_encoding_spec(hf_config=hf, tokenizer=tokenizer)
    assert spec == ("dsv41" if variant == "v41" else "dsv4")
    recipe = DeepSeekRecipe.from_hf_tokenizer(spec, tokenizer)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look a word up.",
                "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is a tiny model?"},
    ]
    for thinking in (False, True):
        ids = recipe.encode({"messages": messages, "thinking": thinking, "tools": tools})
        assert max(ids) < config["vocab_size"]
        text = str(tokenizer.decode(ids))
        assert text.startswith("<｜begin▁of▁sentence｜>")
        assert text.count("<｜User｜>") == 2 and "What is a tiny model?" in text
        assert "｜DSML｜" in text and "lookup" in text
        assert text.endswith("<｜Assistant｜>" + ("<think>" if thinking else "</think>"))


# --- sglang's loader ---------------------------------------------------------------------------

#: The warnings of sglang's DeepSeek-V4 weight loaders about a tensor without a parameter, a
#: parameter without a tensor, or an unexpected tensor.
LOADER_LOGGERS = ("sglang.srt.models.deepseek_v4", "sglang.srt.models.deepseek_v4_dspark")


@dataclasses.dataclass
class Loaded:
    model: torch.nn.Module
    #: Every parameter (by sglang name) after the load; a sentinel where nothing was loaded.
    params: dict[str, torch.Tensor]
    #: The checkpoint tensors sglang's weight iterator handed the model.
    seen: list[str]
    warnings: list[str]


@contextlib.contextmanager
def sglang_cpu_process(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What a CPU scheduler process sets up before it builds a model: sglang's runtime context
    for ``path`` and a one-rank gloo process group; the CPU rotary embeddings the serving kit
    supplies (sglang's asks vllm for a non-YaRN one and refuses one without scaling); no
    TileLang hyper-connection kernels."""
    from sglang.srt.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.rotary_embedding import base, factory
    from sglang.srt.runtime_context import (
        SpawnRanks,
        publish,
        reset_context,
        restore_context,
        snapshot_context,
    )
    from sglang.srt.server_args import ServerArgs

    for name in ("PRE", "POST"):
        monkeypatch.setenv(f"SGLANG_OPT_USE_TILELANG_MHC_{name}", "0")
    monkeypatch.setenv("SGLANG_OPT_USE_FUSED_HASH_TOPK", "0")
    monkeypatch.setattr(base, "_is_cpu", True)
    monkeypatch.setattr(factory, "get_rope_cpu", unscaled_rope_fallback(factory.get_rope_cpu))
    server_args = ServerArgs(model_path=str(path), device="cpu", attention_backend="dsv4")
    saved = snapshot_context()
    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    initialize_moe_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        backend="gloo", world_size=1, rank=0, local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    try:
        initialize_model_parallel()
        initialize_dp_attention(server_args=server_args)
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
        restore_context(saved)


def load_with_sglang(path: pathlib.Path, draft: str | None) -> Loaded:
    """The model sglang builds from ``path`` (``draft``: as the draft of that speculative
    algorithm), every parameter first set to a sentinel, then loaded by sglang's default
    loader (its safetensors iterator and the model's ``load_weights``)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import (
        DefaultModelLoader,
        _get_quantization_config,
        _initialize_model,
        get_model_loader,
    )
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    model_config = ModelConfig(
        model_path=str(path), is_draft_model=draft is not None, speculative_algorithm=draft
    )
    load_config = LoadConfig(load_format="auto")
    loader = get_model_loader(load_config, model_config)
    assert type(loader) is DefaultModelLoader
    with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        quant_config = _get_quantization_config(model_config, load_config)
        model = _initialize_model(model_config, load_config, quant_config)
    params = dict(model.named_parameters())
    for param in params.values():
        param.data.fill_(float("nan") if param.dtype.is_floating_point else -7)
    seen: list[str] = []

    def tap(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            seen.append(name)
            yield name, tensor

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in LOADER_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:  # whatever this process's logging was set to
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
    try:
        weights = loader._get_all_weights(model_config, model)
        DefaultModelLoader.load_weights_only(model, tap(weights), torch.device("cpu"))
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    return Loaded(model, params, seen, records)


def is_sentinel(t: torch.Tensor) -> torch.Tensor:
    return t.isnan() if t.dtype.is_floating_point else t == -7


RENAMES = (
    (".attn.", ".self_attn."),
    (".ffn.", ".mlp."),
    (".attn_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".gate.bias", ".gate.e_score_correction_bias"),
    (".gate.tid2eid", ".topk.tid2eid"),
)
Place = tuple[str, Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


def place(name: str, draft: str | None, params: dict[str, torch.Tensor]) -> Place | None:
    """Where sglang's ``draft`` model (None: the target) keeps checkpoint tensor ``name``:
    ``(parameter, view of the parameter, transform of the tensor)``; None if it keeps none."""
    if draft is None:
        if name.startswith("mtp."):
            return None
        top = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight"}
        target = top.get(name, "model." + name)
    else:
        if not name.startswith("mtp."):
            return None
        _, stage, rest = name.split(".", 2)
        if draft == "EAGLE":
            spec = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "hc_head_")
            if rest == "norm.weight":
                target = "model.shared_head.norm.weight"
            elif rest.startswith(spec):
                target = "model." + rest
            else:
                target = "model.decoder." + rest
        elif rest.startswith("markov_head."):
            kind = {"embed": "markov_w1", "head": "markov_w2"}[rest.split(".")[1]]
            target = f"markov_head.{kind}.weight"
        elif rest.startswith("confidence_head."):
            # Built only for ragged verifies; the static ones (sglang's default, the only mode
            # the dsv4 backend serves) have no confidence head and skip its tensors.
            if not any(p.startswith("confidence_head.") for p in params):
                return None
            target = rest
        else:
            target = f"stages.{stage}.{rest}"
    target = "." + target
    for old, new in RENAMES:
        target = target.replace(old, new)
    target = target[1:]

    same: Callable[[torch.Tensor], torch.Tensor] = lambda t: t  # noqa: E731

    def rows(param: str, first: bool) -> Place:
        """The first or the second half of ``param``'s rows (a fused or stacked tensor)."""
        half = params[param].shape[0] // 2
        return param, (lambda p: p[:half]) if first else (lambda p: p[half:]), same

    fused_qkv = target.replace(".wq_a.", ".wqkv_a.").replace(".wkv.", ".wqkv_a.")
    if ".compressor." not in target and fused_qkv in params and fused_qkv != target:
        # [q_lora | head_dim] rows; the q half is q_lora_rank wide.
        q_lora = tiny_variant("v4").dims.q_lora_rank
        if ".wq_a." in target:
            return fused_qkv, lambda p: p[:q_lora], same
        return fused_qkv, lambda p: p[q_lora:], same
    fused_kv_gate = target.rsplit(".", 2)[0] + ".wkv_gate.weight"
    if ".compressor.w" in target and fused_kv_gate in params:
        return rows(fused_kv_gate, ".wkv." in target)
    if ".mlp.experts." in target:
        layer, _, tail = target.partition(".experts.")
        expert, proj, _ = tail.split(".")
        if proj == "w2":
            return f"{layer}.experts.w2_weight", lambda p: p[int(expert)], same
        inter = params[f"{layer}.experts.w13_weight"].shape[1] // 2
        half = slice(None, inter) if proj == "w1" else slice(inter, None)
        return f"{layer}.experts.w13_weight", lambda p: p[int(expert)][half], same
    if ".shared_experts." in target:
        shared, proj = target.rsplit(".", 2)[0], target.split(".")[-2]
        if proj == "w2":
            return shared + ".down_proj.weight", lambda p: p, same
        return rows(shared + ".gate_up_proj.weight", proj == "w1")
    if target.endswith(".ape") and params[target].shape[0] == 4:
        # sglang's "ape hotfix" of the overlapping ratio 4: the halves [4, d] | [4, d] of each
        # row become the rows of [8, d], viewed as [4, 2 * d].
        return target, lambda p: p, lambda t: torch.cat(t.chunk(2, dim=-1)).view(t.shape)
    return target, lambda p: p, same


#: (variant, the draft algorithm whose model loads it: None for the target).
LOADS = [("v4", None), ("v4", "EAGLE"), ("dspark", None), ("dspark", "DSPARK"), ("v41", None)]
#: Parameters a draft shares with its target at run time instead of loading them: the EAGLE
#: worker hands the NextN draft the target's embedding and head (``set_embed_and_head``).
SHARED = {"EAGLE": {"model.embed_tokens.weight", "lm_head.weight"}}


@pytest.mark.sglang
@pytest.mark.parametrize("variant", ["v4", "dspark", "v41"])
def test_sglang_loads_every_parameter_from_the_checkpoint(
    variant: str, written: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = written[variant]
    tensors = load_tensors(path)
    kept: dict[str | None, set[str]] = {}
    with sglang_cpu_process(path, monkeypatch):
        for draft in [d for v, d in LOADS if v == variant]:
            loaded = load_with_sglang(path, draft)
            assert loaded.warnings == [], (draft, loaded.warnings)
            assert sorted(loaded.seen) == sorted(tensors), draft
            params = loaded.params
            covered = {name: torch.zeros_like(p, dtype=torch.int32) for name, p in params.items()}
            kept[draft] = set()
            for name, tensor in tensors.items():
                where = place(name, draft, params)
                if where is None:
                    continue
                param, view, transform = where
                assert param in params, (draft, name, param)
                got, want = view(params[param]), transform(tensor).to(params[param].dtype)
                assert got.shape == want.shape and torch.equal(got, want), (draft, name)
                view(covered[param]).add_(1)
                kept[draft].add(name)
            for name, p in params.items():
                if name in SHARED.get(draft or "", set()):
                    assert is_sentinel(p).all(), name
                    continue
                assert not is_sentinel(p).any(), (draft, name)
                assert torch.equal(covered[name], torch.ones_like(covered[name])), (draft, name)
    # Each tensor is kept by exactly one of the models, the target or its draft, but the
    # DSpark confidence head the static verifies skip (test_dspark_confidence_head_fits...).
    unused = [n for n in tensors if ".confidence_head." in n]
    assert sorted([*(n for names in kept.values() for n in names), *unused]) == sorted(tensors)
    if variant == "v4":
        assert kept["EAGLE"] == {n for n in tensors if n.startswith("mtp.0.")}


@pytest.mark.sglang
def test_loader_check_catches_a_missing_and_a_misnamed_tensor(
    written: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: a checkpoint without one tensor and with another misspelled leaves
    their parameters at the sentinel, and sglang's loader warns about both."""
    import shutil

    from safetensors.torch import save_file

    path = pathlib.Path(shutil.copytree(written["v4"], tmp_path / "broken"))
    tensors = load_tensors(path)
    del tensors["layers.2.attn.compressor.norm.weight"]
    tensors["layers.3.ffn.gate.biass"] = tensors.pop("layers.3.ffn.gate.bias")
    save_file(tensors, str(path / "model.safetensors"))
    with sglang_cpu_process(path, monkeypatch):
        loaded = load_with_sglang(path, None)
    missing = ("model.layers.2.self_attn.compressor.norm.weight", "model.layers.3.mlp.gate.e_score_correction_bias")  # fmt: skip  # noqa: E501
    for name in missing:
        assert is_sentinel(loaded.params[name]).all(), name
        assert any(name in w for w in loaded.warnings), (name, loaded.warnings)
    assert any("gate.e_score_correction_biass not found" in w for w in loaded.warnings)


@pytest.mark.sglang
def test_dspark_confidence_head_fits_sglang_module(written: dict[str, pathlib.Path]) -> None:
    """The confidence head the static verifies skip (above) fits sglang's module, as a ragged
    verify mode builds it (``build_dspark_v4_confidence_head``: with the Markov features, no
    bias)."""
    from sglang.srt.models.dspark import DSparkConfidenceHead

    config = json.loads((written["dspark"] / "config.json").read_text())
    tensors = load_tensors(written["dspark"])
    head = DSparkConfidenceHead(
        hidden_size=config["hidden_size"], markov_rank=config["dspark_markov_rank"], bias=False
    )
    prefix = f"mtp.{config['num_nextn_predict_layers'] - 1}.confidence_head."
    state = {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}
    head.load_state_dict(state, strict=True)


def test_margin_design_constants_are_what_the_docstring_says() -> None:
    """The logits' prior favours the successor of the current token (one cycle, the end of
    sentence out of it) and the end-of-sentence row is silent."""
    spec = tiny_variant("v4")
    nxt = checkpoint.successor(spec.dims.vocab_size)
    eos = SPECIAL_TOKENS.index(checkpoint.EOS)
    assert nxt[eos] == eos and sorted(nxt) == list(range(spec.dims.vocab_size))
    token, seen = 0, set()
    while token not in seen:
        seen.add(token)
        token = nxt[token]
    assert len(seen) == spec.dims.vocab_size - 1
    tensors = checkpoint.checkpoint_tensors(spec)
    head = tensors["head.weight"].float()
    assert (head[:, 0] == -checkpoint.LOGIT_SHIFT).all()
    assert head[eos, 1:].abs().max() < 0.05
    assert (tensors["embed.weight"][:, 0] == checkpoint.EMBED_OFFSET).all()
    for name, t in tensors.items():
        if name.endswith(("attn.wo_b.weight", ".w2.weight", "h_proj.weight")):
            assert (t[0] == 0).all(), name
        if name.endswith("gate.bias"):
            assert sorted(t.tolist()) == [-5.0, -5.0, 5.0, 5.0], name
