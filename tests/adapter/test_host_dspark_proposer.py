"""The DSpark draft runner's backend under sglang 0.5.23's own draft-block proposer, on the CPU.

sglang code that runs here, called, not re-implemented (``sglang/srt/speculative/
dspark_components/`` unless named otherwise):

* ``DraftBlockProposer.__init__`` and ``_run_forward`` (dspark_draft.py): the draft block's
  TARGET_VERIFY ``ForwardBatch`` (``seq_lens = L``, ``g`` rows a request, host lengths only when
  the backend asks, ``needs_cpu_seq_lens``), its slots bound from the iteration's verify window
  (``KVLocPlan.bind``, columns ``0 ... g-1``), ``_fill_dp_moe_sync_metadata``, then
  ``ModelRunner.forward`` (model_executor/model_runner.py) -> the eager runner's copy (planned
  there) -> the model;
* ``alloc_verify_window`` (dspark_planner.py): the verify window's ``g + 1`` slots a request
  from ``KVIndexTranslator.plan_uniform_extend`` (mem_cache/kv_index_translator.py), whose
  ``assign_extend_cache_locs_uniform_func`` runs as its CUDA branch does
  (``eagle_host.assign_extend_cache_locs_uniform_on_cpu``: sglang's kernel in the interpreter).

Stand-ins: the draft model (``DSparkModel``: sglang's ``DeepseekV4ForCausalLMDSpark`` cannot be
built on the CPU; it writes each stage's block keys at ``get_swa_out_cache_loc`` as sglang's
``DSparkAttention._store_block_kv`` does and runs the backend's ``forward``, against
``testing.simulation.DSparkDraft``'s reference), the embedding, and the ``ScheduleBatch`` fields
the proposer reads. The runner and its server are ``eagle_host.py``'s (a real ``ModelRunner``
with its ``EagerRunner``), published as a DSpark server.

Verdicts: every block row equals the reference over rounds of accepted tokens, and the block
the backend was handed is what sglang's proposer built (its slots the verify window's first
``g`` columns).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from eagle_host import (
    HIDDEN,
    VOCAB,
    assign_extend_cache_locs_uniform_on_cpu,
    eagle_server,
    model_runner,
    untranslating_translator,
)
from sglang.kernels.ops.speculative import cache_locs
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.speculative.dspark_components.dspark_draft import DraftBlockProposer
from sglang.srt.speculative.dspark_components.dspark_planner import alloc_verify_window
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.planning import ForwardKind
from dsv4_backend.sglang_adapter.dspark import DSparkDraftBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import DSparkDraft, PagedRequestPool

pytestmark = pytest.mark.sglang

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
#: The draft checkpoint's config: DeepSeek-V4 fields and three DSpark stages.
HF = harness.tiny_hf_config(CONFIG, num_nextn_predict_layers=3)
BLOCK = 3  # g: draft tokens a block (speculative_num_draft_tokens = g + 1)
ATOL = 2e-5


class DSparkModel:
    """Stand-in for sglang's DSpark draft model (module docstring). ``requests``, ``lens`` and
    ``seed``: the block the next forward drafts, set by the test."""

    sample_from_anchor = True
    shared_experts_config = None

    def __init__(self, draft: DSparkDraft) -> None:
        self.draft = draft
        self.requests: list[int] = []
        self.lens: list[int] = []
        self.seed = 0
        self.batches: list[Any] = []
        self.errors: list[float] = []

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any, **_: Any
    ) -> LogitsProcessorOutput:
        backend = get_attn_backend()
        self.batches.append(forward_batch)
        rows, real = input_ids.shape[0], len(self.requests) * BLOCK
        expected_positions = [n + i for n in self.lens for i in range(BLOCK)]
        assert positions.tolist()[:real] == expected_positions
        inputs = self.draft.block_inputs(self.requests, self.lens, seed=self.seed)
        for stage, stage_inputs in enumerate(inputs):
            padded = stage_inputs.padded(rows)
            slots = backend.get_swa_out_cache_loc(forward_batch)
            store_rows(backend.state.pools.window(stage), padded.kv, slots)
            heads = stage_inputs.expected.shape[1]
            layer = SimpleNamespace(layer_id=stage, tp_q_head_num=heads, v_head_dim=CONFIG.head_dim)
            out = backend.forward(
                q=padded.q, k=padded.kv, v=padded.kv, layer=layer, forward_batch=forward_batch,
                compress_ratio=0, attn_sink=stage_inputs.sink, save_kv_cache=False,
            )  # fmt: skip
            self.errors.append((out[:real] - stage_inputs.expected).abs().max().item())
        return LogitsProcessorOutput(
            next_token_logits=torch.zeros(rows, VOCAB), hidden_states=torch.zeros(rows, HIDDEN)
        )


def schedule_batch(pool: PagedRequestPool, requests: Sequence[int], lens: Sequence[int]) -> Any:
    """The ``ScheduleBatch`` fields the proposer and ``alloc_verify_window`` read."""
    seq_lens = torch.tensor(list(lens), dtype=torch.int64)
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=torch.tensor([pool.pool_index(r) for r in requests]),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        can_run_decode_cuda_graph=False,
        is_extend_in_batch=False,
        dp_spec_prefill_coordination_applied=False,
        global_num_tokens=None,
    )


def test_dspark_blocks_through_sglangs_proposer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of draft blocks with accepted tokens injected in between, each block built and
    run by sglang's proposer through the draft runner's eager path."""
    lens = [60, 126]
    requests = [0, 1]
    server = eagle_server(
        monkeypatch, speculative_algorithm="DSPARK", speculative_num_draft_tokens=BLOCK + 1
    )
    monkeypatch.setattr(
        cache_locs, "assign_extend_cache_locs_uniform_func", assign_extend_cache_locs_uniform_on_cpu
    )
    with server:
        generator = torch.Generator().manual_seed(0)
        pool = PagedRequestPool(CONFIG, [n + 4 * (BLOCK + 1) for n in lens], generator=generator)
        ns = harness.mock_runner(
            pool, HF, topk=0, num_draft_tokens=BLOCK + 1, is_draft_worker=True,
            speculative_algorithm="DSPARK",
        )  # fmt: skip
        backend = DSparkDraftBackend(ns, cache_format="dense")
        draft = DSparkDraft(
            CONFIG, pool, block_size=BLOCK, generator=generator, state=backend.state
        )
        model = DSparkModel(draft)
        runner = model_runner(ns, backend, model, is_draft_worker=True)
        runner.spec_algorithm = SpeculativeAlgorithm.DSPARK
        runner.kv_index_translator = untranslating_translator(runner)
        proposer = DraftBlockProposer(
            draft_model=model, draft_model_runner=runner, gamma=BLOCK, mask_token_id=0,
            draft_block_spec_info=SimpleNamespace(), tp_sync=None, random_seed=0,
            greedy_draft=True,
        )  # fmt: skip
        for r, n in enumerate(lens):
            draft.inject(r, range(n))
        for round_id, accepted in enumerate([[3, 0], [1, 2], [0, 3]]):
            batch = schedule_batch(pool, requests, lens)
            window = alloc_verify_window(
                batch=batch, bs=len(requests), device="cpu", verify_num_draft_tokens=BLOCK + 1,
                block_pos_offsets=torch.arange(BLOCK + 1), model_runner=runner,
                seq_lens_cpu=batch.seq_lens_cpu,
            )  # fmt: skip
            verify = harness.BatchBuilder(pool).verify(requests, lens, BLOCK + 1).batch
            assert torch.equal(window.verify_cache_loc.long(), verify.out_cache_loc.long())
            model.requests, model.lens, model.seed = list(requests), list(lens), round_id
            result = proposer._run_forward(
                batch=batch, draft_input=SimpleNamespace(bonus_tokens=torch.zeros(2)),
                verify_window=window, bs=len(requests), device="cpu",
                embed_module=lambda ids: torch.zeros(*ids.shape, HIDDEN),
            )  # fmt: skip
            assert not result.can_run_graph
            handed = model.batches[-1]
            assert handed.forward_mode == ForwardMode.TARGET_VERIFY
            assert torch.equal(handed.seq_lens, batch.seq_lens)
            assert handed.seq_lens_cpu is None  # needs_cpu_seq_lens is False
            loc = window.verify_cache_loc_2d[:, :BLOCK].reshape(-1)
            assert torch.equal(handed.out_cache_loc.long(), loc.long())
            assert backend.forward_metadata.kind is ForwardKind.DSPARK_BLOCK
            assert len(model.errors) == len(backend.config.compress_ratios) == 3  # the stages
            worst = max(model.errors)
            assert worst <= ATOL, (round_id, worst)
            model.errors.clear()
            for r, a in enumerate(accepted):
                draft.inject(r, range(lens[r], lens[r] + a + 1))
                lens[r] += a + 1
        assert len(model.batches) == 3
