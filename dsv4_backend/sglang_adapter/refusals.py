"""Every sglang 0.5.23 configuration the dsv4 backend does not serve, as one table.

Each row of ``REFUSED`` is one configuration: where its value is read (a ``ServerArgs`` field,
an environment variable or the model config), when the value is refused, the flag (or model
type) the error names, and why it is not served. ``check_served`` raises ``ConfigError`` for
the first row that matches, when the backend is built, so nothing that would be served wrong
starts. A configuration that becomes served loses its row (one line), nothing else.

The rows cover what changes the calls the backend gets (forward modes, draft models, batch
splitting, CUDA-graph kinds) or the layout of the KV pool and its state (layouts of other
attention kernels, state kept or moved outside the backend, layers split over ranks).
``V41_REFUSED`` adds what DeepSeek-V4.1 is not served with yet (checked for a V4.1 model).
Checked elsewhere because they need more than the arguments: ``page_size`` (the runner's),
EAGLE ``topk`` (the draft factory's too) and heads that the attention TP group must divide
(``settings.RunnerSettings``); ``--enable-deepseek-v4-fp4-indexer`` off SM100 / SM120
(``settings.indexer_selection``); compress ratios (``DSV4AttentionConfig``); the platform
(``registration``: on HIP, NPU and the other non-CUDA platforms sglang keeps ``dsv4``); PD
disaggregation and HiCache (``settings.REGION_COPYING_OPTIONS``: served where every cache and
ring is a view of sglang's pool, refused otherwise); the DSpark draft's own conditions
(``sglang_adapter.dspark``); DSpark's compact ragged verify (``RAGGED_VERIFY_REFUSED``, under
DSpark only).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from dsv4_backend.errors import ConfigError

Source = Literal["server_args", "env", "hf_config"]


@dataclass(frozen=True)
class Refused:
    """One configuration that is not served.

    ``option``: the ``ServerArgs`` field, environment variable or ``hf_config`` attribute
    read (``source``); ``matches(value)``: whether its value is this configuration (an unset
    option reads as None); ``flag``: what the error names (the CLI flag and value, the
    variable, the model type); ``why``: what would go wrong.
    """

    option: str
    matches: Callable[[Any], bool]
    flag: str
    why: str
    source: Source = "server_args"


def _set(value: Any) -> bool:
    return bool(value)


def _above_one(value: Any) -> bool:
    return int(value or 1) > 1


def _name(value: Any) -> str:
    """A string option's value, or an enum member's name, in lower case."""
    return str(getattr(value, "name", value)).lower()


def _one_of(*values: str) -> Callable[[Any], bool]:
    return lambda value: value is not None and _name(value) in values


def _other_than(*values: str) -> Callable[[Any], bool]:
    return lambda value: value is not None and _name(value) not in values


def _prefill_graph(value: Any) -> bool:
    """Whether a ``cuda_graph_config`` (the ``--cuda-graph-config`` JSON, or sglang's resolved
    ``CudaGraphConfig``) captures prefill graphs."""

    def field(holder: Any, name: str) -> Any:
        return holder.get(name) if isinstance(holder, Mapping) else getattr(holder, name, None)

    backend = field(field(value, "prefill"), "backend")
    return backend is not None and _name(backend) in ("full", "breakable")


_PREFILL_GRAPH = "prefill (EXTEND) batches run eagerly; the backend has no prefill CUDA graph"
_STATE = "not verified to carry the backend's caches and compressor rings"
_RADIX = "; the backend serves sglang's device radix cache only"
_SESSION = "a session resumes at an unaligned length in a fresh pool row (empty c128 ring)"
_REPLAY = "DeepSeek-V4.1's encoder SWA bounded replay keeps the window in a request ring"
_SPLIT = "splits a request's keys over ranks"

#: One row per refused configuration (module docstring).
REFUSED: tuple[Refused, ...] = (
    # Calls the backend does not serve.
    Refused(
        "speculative_algorithm",
        _other_than("eagle", "nextn", "dspark"),
        "--speculative-algorithm (only EAGLE / NEXTN / DSPARK)",
        "its verify batches are draft trees or come from another draft model; the backend "
        "plans linear EAGLE drafts (topk 1)",
    ),
    Refused(
        "cuda_graph_backend_prefill",
        _one_of("full", "breakable"),
        "--cuda-graph-backend-prefill full|breakable",
        _PREFILL_GRAPH,
    ),
    Refused(
        "cuda_graph_config",
        _prefill_graph,
        "--cuda-graph-config with a prefill backend full|breakable",
        _PREFILL_GRAPH,
    ),
    Refused(
        "enable_encoder_swa_bounded_replay", _set, "--enable-encoder-swa-bounded-replay", _REPLAY
    ),
    # Pool layouts of other attention kernels.
    Refused(
        "dsv4_attn_backend",
        _one_of("trtllm"),
        "--dsv4-attn-backend trtllm",
        "it lays the pool out in trtllm's uniform FP8 pages, which the backend's caches "
        "do not read (they would be allocated beside sglang's, twice the memory)",
    ),
    Refused(
        "dsv4_attn_backend",
        _one_of("flashmla_mega"),
        "--dsv4-attn-backend flashmla_mega",
        "it lays the pool out in DeepSeek-V4.1's MegaAttention layouts",
    ),
    Refused(
        "SGLANG_DSV4_KV_LAYOUT",
        _one_of("v41", "v41_new"),
        "SGLANG_DSV4_KV_LAYOUT=v41|v41_new",
        "DeepSeek-V4.1's packed KV layouts",
        source="env",
    ),
    # State kept or moved outside the backend.
    Refused(
        "enable_hisparse",
        _set,
        "--enable-hisparse",
        "HiSparse offloads the c4 cache through sglang's own sparse path, which this "
        "backend replaces (its c4 cache and top-k are its own)",
    ),
    Refused(
        "enable_lmcache",
        _set,
        "--enable-lmcache",
        f"LMCache offloads and reloads pool pages, {_STATE}",
    ),
    Refused(
        "enable_flexkv",
        _set,
        "--enable-flexkv",
        f"FlexKV moves prefixes through external storage{_RADIX}",
    ),
    Refused(
        "enable_unified_cache_external_linker",
        _set,
        "--enable-unified-cache-external-linker",
        f"an external KV cache linker moves prefixes{_RADIX}",
    ),
    Refused(
        "radix_cache_backend",
        _set,
        "--radix-cache-backend",
        f"a custom radix cache backend{_RADIX}",
    ),
    Refused("enable_session_radix_cache", _set, "--enable-session-radix-cache", _SESSION),
    Refused("enable_streaming_session", _set, "--enable-streaming-session", _SESSION),
    # Layers or sequences split over ranks.
    Refused(
        "dcp_size",
        _above_one,
        "--decode-context-parallel-size",
        f"decode context parallelism {_SPLIT}",
    ),
    Refused(
        "cp_strategy",
        _one_of("zigzag"),
        "--cp-strategy zigzag",
        "the backend plans the interleave prefill CP layout (sglang runs zigzag on NPUs only)",
    ),
)


_V41 = "sglang 0.5.23 does not serve DeepSeek-V4.1 with it (arg_groups/deepseek_v4_hook.py)"
#: What DeepSeek-V4.1 (a model config with ``kv_source_layer_ids``) is not served with, on top
#: of ``REFUSED`` (docs/design.md §8): what sglang's own V4.1 check refuses (other speculative
#: algorithms, pipeline parallelism, two-batch overlap).
V41_REFUSED: tuple[Refused, ...] = (
    Refused(
        "speculative_algorithm",
        _other_than("dspark"),
        "--speculative-algorithm (only DSPARK with DeepSeek-V4.1)",
        "DSpark is DeepSeek-V4.1's speculative algorithm (it has no MTP layers)",
    ),
    Refused(
        "pp_size",
        _above_one,
        "--pipeline-parallel-size",
        f"{_V41}: a stage may start after the kv source whose caches it reads",
    ),
    Refused("enable_two_batch_overlap", _set, "--enable-two-batch-overlap", _V41),
)


_RAGGED = (
    "sglang 0.5.23's DeepSeek-V4 backend refuses its compact ragged verify with it "
    "(deepseek_v4_backend.py _resolve_verify_layout)"
)
#: What DSpark's compact ragged verify (``SGLANG_RAGGED_VERIFY_MODE=compact``) is not served
#: with, on top of ``REFUSED`` (checked under DSpark, ``check_ragged_verify``): what sglang's
#: own DeepSeek-V4 backend refuses it with. ``cap-accept`` hands the backend static verifies
#: (sglang's worker caps the accepted drafts only) and is served as ``static`` is.
RAGGED_VERIFY_REFUSED: tuple[Refused, ...] = (
    Refused(
        "attn_cp_size",
        _above_one,
        "--attention-context-parallel-size with SGLANG_RAGGED_VERIFY_MODE=compact",
        _RAGGED,
    ),
    Refused(
        "enable_prefill_cp",
        _set,
        "--enable-prefill-cp with SGLANG_RAGGED_VERIFY_MODE=compact",
        _RAGGED,
    ),
    Refused(
        "SGLANG_EXPERIMENTAL_ONLINE_C128_MTP",
        lambda _: _online_c128_mtp(),
        "SGLANG_OPT_USE_ONLINE_COMPRESS=1 SGLANG_EXPERIMENTAL_ONLINE_C128_MTP=1 with "
        "SGLANG_RAGGED_VERIFY_MODE=compact (online c128 MTP)",
        _RAGGED,
        source="env",
    ),
)


def _online_c128_mtp() -> bool:
    """sglang's online c128 MTP switch (``OnlineC128MTPController.enabled`` under
    speculation): both of its environment variables, read as sglang reads them."""
    from sglang.srt.environ import envs

    return bool(
        envs.SGLANG_OPT_USE_ONLINE_COMPRESS.get() and envs.SGLANG_EXPERIMENTAL_ONLINE_C128_MTP.get()
    )


def check_ragged_verify(server_args: Any) -> bool:
    """Under DSpark: whether sglang's compact ragged verify is on (``SGLANG_RAGGED_VERIFY_MODE``
    read by sglang's ``read_ragged_verify_mode``); ``ConfigError`` naming the flag when it is,
    with a configuration of ``RAGGED_VERIFY_REFUSED``."""
    from sglang.srt.speculative.ragged_verify import RaggedVerifyMode, read_ragged_verify_mode

    if read_ragged_verify_mode() is not RaggedVerifyMode.COMPACT:
        return False
    for row in RAGGED_VERIFY_REFUSED:
        value = _value(row, server_args, None)
        if row.matches(value):
            _refuse(row, value)
    return True


def _value(row: Refused, server_args: Any, hf_config: Any) -> Any:
    if row.source == "env":
        return os.environ.get(row.option)
    source = server_args if row.source == "server_args" else hf_config
    if isinstance(source, Mapping):  # a config.json mapping
        return source.get(row.option)
    return getattr(source, row.option, None)


def refused_row(server_args: Any, hf_config: Any) -> tuple[Refused, Any] | None:
    """The first row of ``REFUSED`` that ``server_args`` / ``hf_config`` / the environment
    match, with the value read; None when the configuration is served."""
    for row in REFUSED:
        value = _value(row, server_args, hf_config)
        if row.matches(value):
            return row, value
    return None


def check_served(server_args: Any, hf_config: Any, *, v41: bool = False) -> None:
    """``ConfigError`` naming the flag (or model type) of the first refused configuration;
    ``v41``: a DeepSeek-V4.1 model, also checked against ``V41_REFUSED``."""
    found = refused_row(server_args, hf_config)
    if found is None and v41:
        found = next(
            (
                (row, value)
                for row in V41_REFUSED
                if row.matches(value := _value(row, server_args, hf_config))
            ),
            None,
        )
    if found is None:
        return
    _refuse(*found)


def _refuse(row: Refused, value: Any) -> NoReturn:
    raise ConfigError(
        f"{row.option}={value!r}: the dsv4 backend does not serve {row.flag}: {row.why}. "
        f"Leave it off, or serve this configuration with --attention-backend dsv4_builtin"
    )
