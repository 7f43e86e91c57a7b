"""DSpark speculative decoding (``--speculative-algorithm DSPARK``): the draft runner's backend.

sglang 0.5.23's DSpark worker drafts a block of ``g = speculative_num_draft_tokens - 1`` tokens
per request with the draft head's window-only stages (``DeepseekV4ForCausalLMDSpark``, layer
ids ``0 ... stages - 1``), handing the draft runner's backend (``ATTENTION_BACKENDS["dsv4"]``)
a TARGET_VERIFY ``ForwardBatch`` with ``seq_lens = L`` and the ``B * g`` slots the target's
verify of the block writes next. :class:`DSparkDraftBackend` plans it as a ``DSPARK_BLOCK``
(``planning.plan_dspark_block``: every row attends to the request's last
``min(L, W, L - swa_valid_from)`` committed keys and the whole block, as sglang's
``init_forward_metadata_dspark_draft_block`` plans it), eager and into the graph buffers;
everything else is the base backend's. A checkpoint with ``sample_from_anchor = false``
(``g + 1`` query rows a request) is refused when the backend is built.

What sglang's DSpark model writes itself: the block's window keys
(``DSparkAttention._store_block_kv``) and the committed tokens' keys injected from the target's
hidden states (``write_target_hidden_kv``) go straight into the draft runner's
``DeepSeekV4TokenToKVPool`` through ``set_swa_key_buffer_radix_fused_norm_rope`` at
``get_swa_out_cache_loc`` / the committed window slots, never through ``store_cache``. The
backend reads them only where its window caches are that pool's buffers (FP8, aliased:
``pool_alias``); otherwise it refuses to be built. The target's verify of a block is an
ordinary TARGET_VERIFY of ``g + 1`` tokens on the target runner's base backend; under
sglang's compact ragged verify (``SGLANG_RAGGED_VERIFY_MODE=compact``) a ragged one, each
request verifying its own count (``batch_read.ragged_verify``). The draft blocks stay ``g``
rows a request in every mode (sglang's proposer and the draft runner's graphs do not take the
ragged layout).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from sglang.srt.environ import envs

from dsv4_backend.cache.token_cache import CacheFormat
from dsv4_backend.errors import ConfigError
from dsv4_backend.planning import (
    AttentionMetadata,
    BatchView,
    ForwardKind,
    GraphMetadataBuffers,
    PlanWidths,
    dspark_swa_width,
    plan_dspark_block,
)
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.sglang_adapter.batch_read import forward_kind
from dsv4_backend.sglang_adapter.plan_session import PlanSession
from dsv4_backend.sglang_adapter.pool_alias import unaliasable_reason
from dsv4_backend.sglang_adapter.settings import RunnerSettings

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner


def dspark_stages(hf_config: Any) -> int:
    """The draft head's attention stages, as sglang's ``DeepseekV4ForCausalLMDSpark`` counts
    them: one per ``target_layer_ids`` entry of the DSpark config, else
    ``num_nextn_predict_layers`` (default 1)."""
    from sglang.srt.speculative.dspark_components.dspark_config import parse_dspark_draft_config

    target_layers = parse_dspark_draft_config(draft_hf_config=hf_config).target_layer_ids
    if target_layers is not None:
        return len(target_layers)
    if isinstance(hf_config, dict):
        return int(hf_config.get("num_nextn_predict_layers", 1) or 1)
    return int(getattr(hf_config, "num_nextn_predict_layers", 1) or 1)


class DSparkDraftBackend(DSV4AttentionBackend):
    """The DSpark draft runner's backend (module docstring).

    Parameters as ``DSV4AttentionBackend``. ``block_size`` is ``g``; ``needs_cpu_seq_lens`` is
    False, as on sglang's backend, so the worker hands no host lengths (with them it would pass
    ``L + g``, not the ``L`` of ``seq_lens``) and every block plans with fixed widths.

    Raises ``ConfigError`` (besides the base backend's) when the draft's window caches are not
    the draft pool's buffers in the fp8 format (sglang's model writes its keys there), with
    ``SGLANG_DSPARK_DEFER_CONTEXT_KV`` (sglang hooks the deferred commit's join into its own
    backend class only, so the staged key writes would race the block) and for a checkpoint
    whose ``sample_from_anchor`` is false (sglang's worker then queries ``g + 1`` rows a
    request, ``dspark_worker_v2.py`` ``query_token_num``; the block plan has ``g``).
    """

    needs_cpu_seq_lens = False

    def __init__(
        self,
        model_runner: ModelRunner,
        *args: Any,
        cache_format: CacheFormat = "fp8",
        **kwargs: Any,
    ) -> None:
        if envs.SGLANG_DSPARK_DEFER_CONTEXT_KV.get():
            raise ConfigError(
                "SGLANG_DSPARK_DEFER_CONTEXT_KV=1; the dsv4 backend does not join sglang's "
                "deferred DSpark context-KV commit (its hook targets sglang's own backend): "
                "leave it unset"
            )
        from sglang.srt.speculative.dspark_components.dspark_config import (
            get_dspark_sample_from_anchor,
        )

        if not get_dspark_sample_from_anchor(model_runner.model_config.hf_config):
            raise ConfigError(
                "the DSpark checkpoint sets sample_from_anchor=false: sglang's worker then "
                "queries speculative_num_draft_tokens rows a request (the anchor's too), and the "
                "dsv4 backend plans blocks of speculative_num_draft_tokens - 1 rows; serve a "
                "checkpoint that samples from the anchor, or sglang's own dsv4 backend "
                "(--attention-backend dsv4_builtin)"
            )
        super().__init__(model_runner, *args, cache_format=cache_format, **kwargs)
        # A block's rows per request; the views of its TARGET_VERIFY batches take this many.
        self.block_size = self.num_draft_tokens - 1
        self.num_draft_tokens = self.block_size
        if self.block_size < 1:
            raise ConfigError(
                f"speculative_num_draft_tokens={self.block_size + 1}; DSpark needs >= 2 "
                "(the anchor and at least one draft)"
            )
        reason = unaliasable_reason(
            model_runner.token_to_kv_pool, self.config, cache_format, self.state.pools.layers
        )
        if cache_format == "fp8" and reason is not None:
            raise ConfigError(
                "the DSpark draft's window keys are written by sglang's model straight into "
                "the draft runner's DeepSeekV4TokenToKVPool, so the dsv4 backend must read that "
                f"pool's buffers, and cannot: {reason}"
            )
        self.widths = PlanWidths.for_max_len(
            self.req_to_token_pool.req_to_token.shape[1], self.config.page_size
        )
        self.graph_swa_width = dspark_swa_width(self.config, self.block_size)
        self.session = PlanSession(self.config, self._plan_blocks)
        self.kind_of = dspark_kind

    @classmethod
    def runner_settings(cls, model_runner: ModelRunner, topk: int = 0) -> RunnerSettings:
        """The base settings with the draft head's stages as window-only layers."""
        settings = super().runner_settings(model_runner, topk)
        stages = dspark_stages(model_runner.model_config.hf_config)
        config = dataclasses.replace(settings.config, compress_ratios=(0,) * stages)
        return dataclasses.replace(settings, config=config)

    def _plan_blocks(
        self, view: BatchView, buffers: GraphMetadataBuffers | None
    ) -> AttentionMetadata:
        """The session's planner: a TARGET_VERIFY batch of the draft runner is a block of
        ``g`` rows per request; other batches plan as the base backend's."""
        if view.kind is not ForwardKind.TARGET_VERIFY:
            return self.plan_view(view, buffers)
        block = dataclasses.replace(view, kind=ForwardKind.DSPARK_BLOCK)
        # sglang's per-row mark of the first position whose draft key the request wrote (0
        # unless PD or a ring restart set it; None on pools without it).
        valid_from = getattr(self.token_to_kv_pool, "swa_valid_from", None)
        metadata = plan_dspark_block(self.config, block, widths=self.widths, valid_from=valid_from)
        return metadata if buffers is None else buffers.load(metadata)


def dspark_kind(forward_mode: ForwardMode) -> ForwardKind:
    """The draft runner's planner kind of an sglang mode: its TARGET_VERIFY batches are DSpark
    blocks."""
    kind = forward_kind(forward_mode)
    return ForwardKind.DSPARK_BLOCK if kind is ForwardKind.TARGET_VERIFY else kind
