"""``DSV4MultiStepDraftBackend``: the EAGLE multi-step draft decode backend (one backend per step).

sglang's ``EagleWorkerV2.draft_forward`` runs step ``i`` with ``attn_backends[i]`` published as
the forward context's backend; every step sees the same batch, whose ``out_cache_loc`` holds
all ``bs * topk * num_steps`` write slots. Step backend ``i`` plans its own slice of them
(``DraftStep``; the planner slices, nothing here does). Steps ``0 ... n-2`` are planned; the
last step only samples and never runs attention.

CUDA graphs: sglang's ``EAGLEDraftCudaGraphRunner`` replays an idle data-parallel rank
(``raw_bs = 0``) in the DECODE draft graph of the largest rank's bucket, but the view it hands
over keeps the live ``forward_mode`` IDLE (``execute``: ``SimpleNamespace(**vars(forward_batch),
num_padding=bs - raw_bs)``, speculative/eagle_draft_cuda_graph_runner.py). Planned as IDLE, the
graph buffers would keep the previous replay's plan and the graph would write with it; the step
backends plan it as DECODE with ``actual_forward_mode`` IDLE instead (every request padding),
as sglang's own multi-step backend rewrites its inner view.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from dsv4_backend.cache.token_cache import CacheFormat
from dsv4_backend.planning import seq_len_fill_value
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


class DSV4MultiStepDraftBackend(AttentionBackend):
    """Holds ``attn_backends[i] = DSV4AttentionBackend(runner, speculative_step_id=i, ...)``.

    Parameters
    ----------
    model_runner : the draft model runner.
    topk : EAGLE topk (1; the step backends refuse more).
    speculative_num_steps : draft steps per round.
    cache_format : passed to the step backends.
    """

    #: Its step backends plan from host lengths (``DSV4AttentionBackend.needs_cpu_seq_lens``).
    needs_cpu_seq_lens = True

    def __init__(
        self,
        model_runner: ModelRunner,
        topk: int,
        speculative_num_steps: int,
        *,
        cache_format: CacheFormat = "fp8",
    ) -> None:
        super().__init__()
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [
            DSV4AttentionBackend(
                model_runner,
                speculative_step_id=i,
                topk=topk,
                speculative_num_steps=speculative_num_steps,
                cache_format=cache_format,
            )
            for i in range(speculative_num_steps)
        ]
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token_pool = model_runner.req_to_token_pool

    @property
    def attending_backends(self) -> list[DSV4AttentionBackend]:
        """Steps ``0 ... n-2``: the ones that run attention (the last only samples)."""
        return self.attn_backends[:-1]

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        for backend in self.attending_backends:
            backend.init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> None:
        view = idle_replay_as_decode(forward_batch)
        for backend in self.attending_backends:
            backend.init_forward_metadata_out_graph(view, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Graph buffers for the attending steps only (the last step never plans)."""
        for backend in self.attending_backends:
            backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return seq_len_fill_value

    def on_after_cuda_graph_warmup(self) -> None:
        for backend in self.attn_backends:
            backend.on_after_cuda_graph_warmup()


def idle_replay_as_decode(forward_batch: Any) -> Any:
    """An idle rank's replay view (IDLE, ``num_padding``, ``batch_size > 0``) as a DECODE view
    with ``actual_forward_mode`` IDLE (module docstring); any other batch as it is."""
    if (
        forward_batch.forward_mode.is_idle()
        and getattr(forward_batch, "num_padding", None) is not None
        and forward_batch.batch_size > 0
    ):
        fields = {**vars(forward_batch), "forward_mode": ForwardMode.DECODE}
        return SimpleNamespace(**fields, actual_forward_mode=ForwardMode.IDLE)
    return forward_batch
