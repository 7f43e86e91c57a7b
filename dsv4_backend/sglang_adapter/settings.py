"""What the backend serves of an sglang model runner: :class:`RunnerSettings`, read and
validated once when a backend is built (page size, EAGLE top-k, the refusal table, the
region-copying options, the indexer selection (and sglang's fp4 indexer, on SM100 / SM120
only), the model config, DeepSeek-V4.1's context
parallelism, the pipeline stage's layers, the attention TP / DP / CP sizes); a setting that
cannot be served is a ``ConfigError`` naming the option."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from sglang.srt.runtime_context import derive_attn_tp_size

from dsv4_backend import envs
from dsv4_backend.cache import stage_layers
from dsv4_backend.config import REQUIRED_PAGE_SIZE, DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.hf_config import config_from_hf
from dsv4_backend.planning import SUPPORTED_DRAFT_TOPK
from dsv4_backend.sglang_adapter.late_layer_tail import bounded_replay
from dsv4_backend.sglang_adapter.refusals import check_ragged_verify, check_served

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

#: Server options that copy the pool's regions (``get_contiguous_buf_infos``,
#: ``get_state_buf_infos``, ``get_request_state_buf_infos``) between pools or to host memory:
#: ``(ServerArgs field, value that is off, CLI flag)``. Served only where every cache and ring
#: of the backend is a view of those regions (``pool_alias.unmovable_reason``), refused otherwise.
REGION_COPYING_OPTIONS = (
    ("disaggregation_mode", "null", "--disaggregation-mode"),
    ("enable_hierarchical_cache", False, "--enable-hierarchical-cache"),
)
#: DeepSeek-V4.1 under prefill CP: sglang's model all-gathers the window keys and writes them
#: into its pool (``set_swa_key_buffer_radix_fused_norm_rope``), not through ``store_cache``,
#: so the backend's window cache must be a view of that pool, like the region-copying options.
V41_CP_WINDOW_WRITES = (
    "--attention-context-parallel-size with DeepSeek-V4.1 (its model writes the window keys "
    "into the pool itself)"
)
#: Environment variable choosing ``DSV4AttentionConfig.indexer_selection`` (default "exact";
#: "fp8" reproduces sglang's built-in quantised top-k, for A/B runs against it).
INDEXER_SELECTION_ENV = envs.INDEXER_SELECTION.name
#: Compute capability majors sglang 0.5.23 serves ``--enable-deepseek-v4-fp4-indexer`` on
#: (``arg_groups/serving_hook.py``: SM100 or SM120; its gfx95 is HIP, where the plugin leaves
#: ``dsv4`` to sglang). The flag selects ``indexer_selection="fp4"``.
FP4_INDEXER_MAJORS = (10, 12)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device`` (None off CUDA); the one platform probe of
    the settings (tests replace it to build a CUDA host's settings on the CPU)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def indexer_selection(fp4_indexer: bool, capability: tuple[int, int] | None) -> str:
    """``DSV4AttentionConfig.indexer_selection``: ``"fp4"`` with sglang's
    ``--enable-deepseek-v4-fp4-indexer`` (``fp4_indexer``; ``ConfigError`` off SM100 / SM120,
    where sglang refuses it, and with ``INDEXER_SELECTION_ENV`` set to another selection),
    else ``INDEXER_SELECTION_ENV``'s."""
    selection = envs.INDEXER_SELECTION.get()
    if not fp4_indexer:
        return selection
    if capability is None or capability[0] not in FP4_INDEXER_MAJORS:
        where = (
            "a device without CUDA"
            if capability is None
            else f"compute capability {capability[0]}.{capability[1]}"
        )
        majors = " / ".join(f"{m}.x" for m in FP4_INDEXER_MAJORS)
        raise ConfigError(
            f"enable_deepseek_v4_fp4_indexer=True on {where}: --enable-deepseek-v4-fp4-indexer "
            f"needs SM100 or SM120 (compute capability {majors}), as sglang refuses it "
            "elsewhere; leave it off"
        )
    if envs.INDEXER_SELECTION.is_set():  # it names exact or fp8
        raise ConfigError(
            f"{INDEXER_SELECTION_ENV}={selection!r} with --enable-deepseek-v4-fp4-indexer: the "
            "flag lays sglang's c4 indexer pool out in fp4 and selects the fp4 indexer; unset "
            f"{INDEXER_SELECTION_ENV} (or leave the flag off)"
        )
    return "fp4"


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """What the backend reads from an sglang model runner, validated."""

    config: DSV4AttentionConfig
    draft_topk: int
    num_draft_tokens: int
    device: torch.device
    #: Attention tensor-parallel ranks: each serves ``config.num_heads // attn_tp_size`` heads.
    attn_tp_size: int = 1
    #: The ``REGION_COPYING_OPTIONS`` set, as ``"option=value (flag)"``.
    region_copying: tuple[str, ...] = ()
    #: The model layer ids this runner serves: its pipeline stage's ``[start_layer,
    #: end_layer)`` (every layer without pipeline parallelism, and on a draft worker).
    layers: range | None = None
    #: ``--enable-cp-decode-attn-tp``: the prefill-CP ranks split the query heads of every
    #: batch that is not a CP prefill over themselves (sglang's ``CpDecodeAttnTpContext``).
    decode_attn_tp_size: int = 1
    #: DeepSeek-V4.1's decoder SWA bounded replay: extends plan their late-layer tail
    #: (``sglang_adapter/late_layer_tail.py``).
    bounded_replay: bool = False
    #: The server's speculative algorithm is DSpark.
    dspark: bool = False
    #: DSpark's compact ragged verify (``SGLANG_RAGGED_VERIFY_MODE=compact``) on the target
    #: runner: its verifies carry per-request lengths (``refusals.check_ragged_verify``).
    ragged_verify: bool = False

    @property
    def local_heads(self) -> int:
        """Query heads of this rank (sglang's ``n_local_heads``)."""
        return self.config.num_heads // self.attn_tp_size

    @property
    def split_heads(self) -> int:
        """Query heads of this rank in a batch that is not a CP prefill: ``local_heads``, or
        a ``decode_attn_tp_size``-th of them under ``--enable-cp-decode-attn-tp``."""
        return self.local_heads // self.decode_attn_tp_size

    @classmethod
    def from_runner(cls, runner: ModelRunner, topk: int = 0) -> RunnerSettings:
        """Read and validate ``runner``; ``ConfigError`` names the option that cannot be served.

        Reads ``page_size``, ``device``, ``is_draft_worker``, ``layer_info`` (the pipeline
        stage's ``start_layer`` / ``end_layer``), ``model_config.hf_config`` and
        ``server_args`` (``speculative_algorithm``, ``speculative_eagle_topk``,
        ``speculative_num_draft_tokens``, ``tp_size``, ``attn_dp_size`` (or
        ``enable_dp_attention`` with ``dp_size``), every option of the refusal table
        (``refusals.REFUSED``), the ``REGION_COPYING_OPTIONS`` and
        ``enable_deepseek_v4_fp4_indexer`` (:func:`indexer_selection`, with the device's
        :func:`device_capability`), the environment variables ``INDEXER_SELECTION_ENV`` and
        the kernel tables' ``DSV4_<OP>_KERNEL`` (``compute/kernel_choice.py``) and, under
        DSpark, sglang's ragged verify mode and what it is refused with
        (``refusals.check_ragged_verify``).
        """
        if runner.page_size != REQUIRED_PAGE_SIZE:
            raise ConfigError(
                f"page_size={runner.page_size}; the dsv4 backend needs page_size "
                f"{REQUIRED_PAGE_SIZE} (--page-size {REQUIRED_PAGE_SIZE})"
            )
        args = runner.server_args
        draft_topk = max(int(topk or 0), int(getattr(args, "speculative_eagle_topk", 0) or 0))
        if draft_topk and draft_topk not in SUPPORTED_DRAFT_TOPK:
            raise ConfigError(
                f"speculative_eagle_topk={draft_topk}; the dsv4 backend serves EAGLE with "
                f"--speculative-eagle-topk {max(SUPPORTED_DRAFT_TOPK)} only (no draft trees)"
            )
        hf = runner.model_config.hf_config
        check_served(args, hf)
        region_copying = tuple(
            f"{option}={getattr(args, option)!r} ({flag})"
            for option, off, flag in REGION_COPYING_OPTIONS
            if getattr(args, option, off) not in (off, None)
        )
        selection = indexer_selection(
            bool(getattr(args, "enable_deepseek_v4_fp4_indexer", False)),
            device_capability(torch.device(runner.device)),
        )
        speculative = getattr(args, "speculative_algorithm", None) is not None
        # The config object itself (not to_dict()): its attributes are what sglang's model reads.
        # sglang's own reading of the window (its model config resolves the same keys).
        window = getattr(runner.model_config, "sliding_window_size", None)
        num_draft_tokens = int(getattr(args, "speculative_num_draft_tokens", 0) or 0)
        config = config_from_hf(
            hf,
            {"window_size": window},
            speculative=speculative,
            num_draft_tokens=num_draft_tokens if speculative else 0,
            indexer_selection=selection,
        )
        layers = None
        if config.v41 is not None:
            check_served(args, hf, v41=True)
            # sglang's V4.1 model writes a CP prefill's window keys into its pool itself
            # (--enable-prefill-cp before attn_cp_size resolves, as its V4.1 hook reads it).
            if getattr(args, "enable_prefill_cp", False) or (
                int(getattr(args, "attn_cp_size", 1) or 1) > 1
            ):
                region_copying += (V41_CP_WINDOW_WRITES,)
        if getattr(runner, "is_draft_worker", False):
            # The draft (MTP) model has one window-only layer, layer_id 0.
            config = dataclasses.replace(config, compress_ratios=(0,), v41=None)
        elif getattr(runner, "layer_info", None) is not None:  # sglang's ModelLayerInfo
            info = runner.layer_info
            layers = stage_layers(config, range(info.start_layer, info.end_layer))
        attn_dp_size = int(getattr(args, "attn_dp_size", 1) or 1)
        if attn_dp_size == 1 and getattr(args, "enable_dp_attention", False):
            # The deprecated spelling, before sglang resolves it to attn_dp_size.
            attn_dp_size = int(getattr(args, "dp_size", 1) or 1)
        attn_cp_size = int(getattr(args, "attn_cp_size", 1) or 1)
        if attn_cp_size > 1 and not getattr(args, "enable_prefill_cp", False):
            raise ConfigError(
                f"attn_cp_size={attn_cp_size} without --enable-prefill-cp: the dsv4 backend "
                "serves context parallelism as sglang's DeepSeek-V4 prefill CP (--enable-prefill-"
                "cp --cp-strategy interleave, --attention-context-parallel-size)"
            )
        attn_tp_size = derive_attn_tp_size(
            tp_size=int(getattr(args, "tp_size", 1) or 1),
            attn_cp_size=attn_cp_size,
            attn_dp_size=attn_dp_size,
        )
        decode_attn_tp_size = (
            attn_cp_size if getattr(args, "enable_cp_decode_attn_tp", False) else 1
        )
        if attn_tp_size < 1 or config.num_heads % (attn_tp_size * decode_attn_tp_size):
            raise ConfigError(
                f"num_attention_heads={config.num_heads} cannot be split over an attention "
                f"tensor-parallel group of {attn_tp_size} ranks (tp_size / attn_dp_size)"
                + (
                    f" and then over {decode_attn_tp_size} CP ranks (--enable-cp-decode-attn-tp)"
                    if decode_attn_tp_size > 1
                    else ""
                )
                + "; choose --tp-size / --attention-data-parallel-size so that it divides the "
                "heads"
            )
        algorithm = getattr(args, "speculative_algorithm", None)
        dspark = str(getattr(algorithm, "name", algorithm)).upper() == "DSPARK"
        compact = dspark and check_ragged_verify(args)
        return cls(
            config=config,
            draft_topk=draft_topk,
            num_draft_tokens=num_draft_tokens,
            device=torch.device(runner.device),
            attn_tp_size=attn_tp_size,
            region_copying=region_copying,
            layers=layers,
            decode_attn_tp_size=decode_attn_tp_size,
            bounded_replay=not getattr(runner, "is_draft_worker", False)
            and bounded_replay(args, config),
            dspark=dspark,
            ragged_verify=compact and not getattr(runner, "is_draft_worker", False),
        )
