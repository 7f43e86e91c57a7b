"""The DSpark draft runner's backend (``sglang_adapter/dspark.py``) through the simulated sglang
host: sglang's TARGET_VERIFY batches of the draft worker (``seq_lens = L``, no host lengths, the
verify's slots), DP padding by sglang's own ``_pad_inputs_to_size``, attention TP ranks, eager
and graph plans, against the reference of the window-only draft stage; and its refusals."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.environ import envs
from sglang_pool import CONFIG as FLASH_WIDTH
from sglang_pool import inside, make_pool

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ConfigError
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.planning import ForwardKind
from dsv4_backend.sglang_adapter import batch_read
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.sglang_adapter.dspark import DSparkDraftBackend
from dsv4_backend.sglang_adapter.factory import create_dsv4_backend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import DSparkDraft, PagedRequestPool

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
#: The draft checkpoint's config: DeepSeek-V4 fields and three DSpark stages.
HF = harness.tiny_hf_config(CONFIG, num_nextn_predict_layers=3)
ATOL = 2e-5


def draft_runner(pool: PagedRequestPool, block: int, **kwargs) -> SimpleNamespace:
    return harness.mock_runner(
        pool, HF, topk=0, num_draft_tokens=block + 1, is_draft_worker=True,
        speculative_algorithm="DSPARK", **kwargs,
    )  # fmt: skip


def run_block(
    backend: DSparkDraftBackend, runner, draft: DSparkDraft, requests, lens, *, seed: int,
    graph: bool, dp_pad: int, tp: harness.AttentionTPRank | None = None,
) -> float:  # fmt: skip
    """One draft block as sglang's DSpark worker runs it; the largest error of the real rows.

    The model's own pool writes (block keys at ``get_swa_out_cache_loc``) are stood in for by
    writing the backend's window cache, which is what they reach when the cache is aliased."""
    g = draft.block_size
    step = harness.BatchBuilder(draft.pool).verify(requests, lens, g)
    step.batch.seq_lens_cpu = None  # the worker passes none (needs_cpu_seq_lens is False)
    if dp_pad:
        step = harness.BatchBuilder.pad(step, runner, dp_pad, g)
    if graph:
        backend.init_forward_metadata_out_graph(step.batch)
    else:
        backend.init_forward_metadata(step.batch)
    assert backend.forward_metadata.kind is ForwardKind.DSPARK_BLOCK
    real = len(requests) * g
    worst = 0.0
    for stage, inputs in enumerate(draft.block_inputs(requests, lens, seed=seed)):
        padded = inputs.padded(len(step.rows))
        slots = backend.get_swa_out_cache_loc(step.batch)
        store_rows(backend.state.pools.window(stage), padded.kv, slots)
        q, sink, expected = padded.q, inputs.sink, inputs.expected
        if tp is not None:
            q, sink = tp.local(q, sink)
            heads = CONFIG.num_heads // tp.size
            expected = expected[:, tp.rank * heads : (tp.rank + 1) * heads]
        heads = expected.shape[1]
        layer = SimpleNamespace(layer_id=stage, tp_q_head_num=heads, v_head_dim=CONFIG.head_dim)
        out = backend.forward(
            q=q, k=padded.kv, v=padded.kv, layer=layer, forward_batch=step.batch,
            compress_ratio=0, attn_sink=sink, save_kv_cache=False,
        )  # fmt: skip
        worst = max(worst, (out[:real, :heads] - expected).abs().max().item())
    return worst


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_dspark_draft_rounds_through_the_adapter(graph: bool, tp_size: int) -> None:
    """Rounds of draft blocks with random accepted counts and KV inject in between."""
    block, lens = 3, [60, 126]
    generator = torch.Generator().manual_seed(tp_size)
    pool = PagedRequestPool(CONFIG, [n + 4 * (block + 1) for n in lens], generator=generator)
    runner = draft_runner(pool, block, tp_size=tp_size)
    backend = runner.attn_backend = DSparkDraftBackend(runner, cache_format="dense")
    assert backend.config.compress_ratios == (0, 0, 0)
    if graph:
        backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8 * block)
    draft = DSparkDraft(CONFIG, pool, block_size=block, generator=generator, state=backend.state)
    requests = [0, 1]
    for r, n in enumerate(lens):
        draft.inject(r, range(n))
    tp = harness.AttentionTPRank(rank=1, size=2, pad_to=8) if tp_size == 2 else None
    for round_id, accepted in enumerate([[3, 0], [1, 2], [0, 3]]):
        error = run_block(
            backend, runner, draft, requests, lens, seed=round_id, graph=graph,
            dp_pad=round_id % 2, tp=tp,
        )  # fmt: skip
        assert error <= ATOL, (round_id, error)
        for r, a in enumerate(accepted):
            draft.inject(r, range(lens[r], lens[r] + a + 1))
            lens[r] += a + 1


def test_factory_builds_the_dspark_draft_backend_and_its_refusals() -> None:
    generator = torch.Generator().manual_seed(0)
    pool = PagedRequestPool(CONFIG, [64], generator=generator)
    runner = draft_runner(pool, 3)
    # The fp8 default on a pool whose buffers cannot be aliased: sglang's model would write
    # the draft's keys where the backend never reads.
    with pytest.raises(ConfigError, match="straight into the draft runner"):
        create_dsv4_backend(runner)
    deferred = envs.SGLANG_DSPARK_DEFER_CONTEXT_KV.override(True)
    with deferred, pytest.raises(ConfigError, match="SGLANG_DSPARK_DEFER_CONTEXT_KV"):
        DSparkDraftBackend(draft_runner(pool, 3), cache_format="dense")
    # sglang's compact ragged verify: the draft's blocks stay g rows a request, served.
    with envs.SGLANG_RAGGED_VERIFY_MODE.override("compact"):
        assert not DSparkDraftBackend(draft_runner(pool, 3), cache_format="dense").ragged_verify
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens=1"):
        DSparkDraftBackend(draft_runner(pool, 0), cache_format="dense")
    # g + 1 query rows a request (the anchor's too): refused at build, not at the first block.
    no_anchor = draft_runner(pool, 3)
    no_anchor.model_config.hf_config = {**HF, "sample_from_anchor": False}
    with pytest.raises(ConfigError, match="sample_from_anchor=false"):
        create_dsv4_backend(no_anchor)


def test_dspark_draft_reads_the_draft_pools_window_buffers() -> None:
    """On sglang's window-only draft pool (three stages, fp8) the draft's window caches are
    views of the pool's window buffers, where sglang's DSpark model writes the block keys and
    the injected context keys (``set_swa_key_buffer_radix_fused_norm_rope``)."""
    pool = PagedRequestPool(FLASH_WIDTH, [64], generator=torch.Generator().manual_seed(0))
    hf = harness.tiny_hf_config(FLASH_WIDTH, num_nextn_predict_layers=3)
    runner = harness.mock_runner(
        pool, hf, topk=0, num_draft_tokens=4, is_draft_worker=True,
        speculative_algorithm="DSPARK",
    )  # fmt: skip
    runner.token_to_kv_pool = draft_pool = make_pool(
        hf=hf, is_draft_worker=True, speculative_algorithm="DSPARK",
        speculative_num_draft_tokens=4,
    )  # fmt: skip
    assert list(draft_pool.compression_ratios) == [0, 0, 0]  # sglang's draft pool: its stages
    backend = create_dsv4_backend(runner)
    assert isinstance(backend, DSparkDraftBackend)
    for stage in range(3):
        window = backend.state.pools.window(stage).storage
        assert inside(window, draft_pool.get_swa_raw_buffer(stage))


@pytest.mark.parametrize("mode", ["static", "cap-accept", "compact"])
def test_compact_ragged_verify_on_the_target_and_its_refusals(mode: str) -> None:
    """The target runner's backend under DSpark reads per-request verify lengths in compact
    mode only (cap-accept hands it static verifies); compact is refused, when the backend is
    built, with context parallelism and with online c128 MTP, as sglang's own backend refuses
    them (``_resolve_verify_layout``)."""
    pool = PagedRequestPool(CONFIG, [64], generator=torch.Generator().manual_seed(0))

    def target(**flags):
        runner = harness.mock_runner(
            pool, harness.tiny_hf_config(CONFIG), topk=0, num_draft_tokens=4,
            speculative_algorithm="DSPARK", **flags,
        )  # fmt: skip
        return DSV4AttentionBackend(runner, cache_format="dense")

    with envs.SGLANG_RAGGED_VERIFY_MODE.override(mode):
        assert target().ragged_verify is (mode == "compact")
        assert target().supports_ragged_verify_graph
        refused = pytest.raises(ConfigError, match="SGLANG_RAGGED_VERIFY_MODE=compact")
        with refused if mode == "compact" else contextlib.nullcontext():
            target(attn_cp_size=2, enable_prefill_cp=True, tp_size=2)
        online = envs.SGLANG_OPT_USE_ONLINE_COMPRESS.override(True)
        mtp = envs.SGLANG_EXPERIMENTAL_ONLINE_C128_MTP.override(True)
        with online, mtp, refused if mode == "compact" else contextlib.nullcontext():
            target()


def test_the_targets_verify_reads_dsparks_committed_host_lengths() -> None:
    """sglang's DSpark worker raises ``seq_lens_cpu`` by the verify's tokens for a backend
    without ``make_forward_metadata_from_raw_verify`` (``dspark_verify.py``) and keeps the
    committed lengths in its verify input's ``live_seq_lens_cpu``; the target's backend plans
    from those, as from ``seq_lens``, so a verify ending on the context's last token is
    served (read as ``L + n`` and planned ``n`` further it would pass the context)."""
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    n = 4
    pool = PagedRequestPool(CONFIG, [256, 64], generator=torch.Generator().manual_seed(0))
    runner = harness.mock_runner(
        pool, harness.tiny_hf_config(CONFIG), topk=0, num_draft_tokens=n,
        speculative_algorithm="DSPARK",
    )  # fmt: skip
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    committed = [pool.req_to_token.shape[1] - n, 30]
    step = harness.BatchBuilder(pool).verify([0, 1], committed, n)
    fb = step.batch
    backend.init_forward_metadata(fb)  # as sglang's EAGLE worker hands it: seq_lens_cpu = L
    expected = backend.forward_metadata
    fb.seq_lens_cpu = torch.tensor(committed) + n
    fb.spec_info = DFlashVerifyInput(
        draft_token=torch.zeros(2 * n, dtype=torch.int64),
        positions=torch.zeros(2 * n, dtype=torch.int64),
        draft_token_num=n,
        live_seq_lens_cpu=torch.tensor(committed),
    )
    assert batch_read.host_seq_lens(fb) == committed
    backend.init_forward_metadata(fb)
    planned = backend.forward_metadata
    assert torch.equal(planned.page_table, expected.page_table)
    assert torch.equal(planned.positions_causal, expected.positions_causal)
    fb.spec_info.live_seq_lens_cpu = None  # the raised lengths alone: past the context
    with pytest.raises(BatchError, match="seq_len 260 exceeds req_to_token width 256"):
        backend.init_forward_metadata(fb)
