"""PD disaggregation and HiCache through sglang's own regions, on the CPU with sglang's real
``DeepSeekV4TokenToKVPool`` and host-pool classes.

PD:
A prefill-side backend (``--disaggregation-mode prefill``) serves a prompt that ends inside a
c4 block, a c128 block and the second page; ``testing.transfer`` copies the regions sglang
lists (``get_contiguous_buf_infos``, ``get_state_buf_infos``, ``get_request_state_buf_infos``),
page by page and region by region as its transfer engine does, into a second pool at other
pages, window pages and pool row; its decode-side backend (``--disaggregation-mode decode``)
then runs EAGLE rounds (draft steps, verify, draft extend, decode). Every row equals the
reference and, bit for bit, the same request continued on the prefill side (no transfer).

HiCache: a prompt's first two pages are written to sglang's host pools
(``testing.hicache.HostTier``: ``DeepSeekV4PagedHostPool`` per page region,
``DeepSeekV4StateHostPool`` per c4 state), evicted from the device, loaded into other device
pages; a request with the same prompt then hits them in the radix tree (prefix 512) and
continues: every row equals the reference and, bit for bit, the same radix hit served from the
device pages before eviction.

sglang's pool hard-codes the Flash geometry (448 nope + 64 rope, indexer dim 128); the backend
runs its torch path (the Triton kernels are checked elsewhere on these layouts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from configured_pool import configured_kv_pool
from hicache import HostTier, cpu_kvcacheio, page_slots
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from transfer import RequestSide, transfer_request

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.planning import per_step_draft_out_cache_loc
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.sglang_adapter.draft import DSV4MultiStepDraftBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

CONFIG = DSV4AttentionConfig(
    compress_ratios=(0, 4, 128), num_heads=8, index_topk=16, index_n_heads=4, speculative=True
)
HF = harness.tiny_hf_config(CONFIG)
NUM_STEPS, NUM_DRAFT = 3, 4
#: Ends inside the second page, a c4 block (381 % 4 = 1) and a c128 block (125 tokens pending,
#: completed by the first verify).
PROMPT = 381
MAX_LEN = 420
#: fp8 keys: the bound of the other fp8 serving tests (window-only layers, compressed layers).
FP8_BOUND = {0: 0.15, 4: 1.0, 128: 1.0}
LAYERS = range(len(CONFIG.compress_ratios))


def sglang_pool(paged: PagedRequestPool, stage: range | None = None) -> DeepSeekV4TokenToKVPool:
    """sglang's pool for ``paged``'s slots, as its configurator builds it under EAGLE
    (``stage``: a pipeline stage's pool, of those layers only)."""
    full = paged.num_full_slots
    slots = paged.num_requests + 1
    pool = configured_kv_pool(
        HF, full_size=full, swa_size=full, num_req_slots=slots,
        c4_state_pool_size=(full // 256 + 1) * CONFIG.ring_rows(4),
        c128_state_pool_size=slots * CONFIG.ring_rows(128), stage=stage,
        speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_steps=NUM_STEPS,
        speculative_num_draft_tokens=NUM_DRAFT,
    )  # fmt: skip
    pool.register_mapping(paged.full_to_swa)
    return pool


class Server:
    """One server: its own sglang pool, a runner over the shared page table, the target and
    multi-step draft backends; it serves any request of the model."""

    def __init__(self, paged: PagedRequestPool, model: RandomModel, **server_args: Any) -> None:
        self.pool = sglang_pool(paged)
        self.runner = harness.mock_runner(
            paged, HF, num_steps=NUM_STEPS, num_draft_tokens=NUM_DRAFT, **server_args
        )
        self.runner.token_to_kv_pool = self.pool
        self.target = DSV4AttentionBackend(self.runner)
        self.runner.attn_backend = self.target
        self.draft = DSV4MultiStepDraftBackend(self.runner, 1, NUM_STEPS)
        self.sim = harness.SimulatedModel(model)
        self.batches = harness.BatchBuilder(paged)
        self.paged = paged

    def side(self, request: int) -> RequestSide:
        row = self.paged.pool_index(request)
        return RequestSide(self.pool, self.paged.full_to_swa, self.paged.req_to_token[row], row)

    def run(self, backend: Any, step: harness.Step, layers: Sequence[int] = LAYERS) -> list[Any]:
        """Plan ``step``, run ``layers``: their outputs, each checked against the reference."""
        backend.init_forward_metadata(step.batch)
        return [self.checked(backend, step, layer) for layer in layers]

    def checked(self, backend: Any, step: harness.Step, layer: int) -> Any:
        """``layer``'s output on planned ``step``, checked against the reference."""
        out = self.sim.layer(backend, step, layer)
        error = self.sim.max_error(step.rows, layer, out)
        assert error < FP8_BOUND[CONFIG.compress_ratios[layer]], (layer, error)
        return out

    def prefill(self, request: int, length: int, prefix: int = 0) -> list[Any]:
        """EXTEND ``[prefix, length)`` (``prefix`` > 0: a radix hit of that many tokens)."""
        return self.run(self.target, self.batches.extend([request], [prefix], [length - prefix]))

    def decode(self, request: int, seq_len: int) -> list[Any]:
        """DECODE of the token at ``seq_len - 1``."""
        return self.run(self.target, self.batches.decode([request], [seq_len]))

    def round(self, request: int, seq_len: int, accepted: int) -> list[Any]:
        """Draft steps, verify, draft extend, decode from committed ``seq_len``; the outputs."""
        step = self.batches.draft([request], [seq_len], NUM_STEPS)
        self.draft.init_forward_metadata(step.batch)
        per_step = per_step_draft_out_cache_loc(step.batch.out_cache_loc, 1, 1, NUM_STEPS)
        outs = []
        for i in range(NUM_STEPS - 1):
            step.batch.out_cache_loc = per_step[i]
            outs += [self.checked(self.draft.attn_backends[i], step, layer) for layer in LAYERS]
            step = self.batches.advance(step)
        outs += self.run(self.target, self.batches.verify([request], [seq_len], NUM_DRAFT))
        outs += self.run(
            self.target, self.batches.draft_extend([request], [seq_len], NUM_DRAFT), [0]
        )
        return outs + self.run(
            self.target, self.batches.decode([request], [seq_len + accepted + 1])
        )


def same_prompts(
    seed: int, copies: int, max_len: int = MAX_LEN, **pages: Any
) -> tuple[PagedRequestPool, RandomModel]:
    """Requests 0 .. copies of the same tokens, each at its own pages and pool row."""
    generator = torch.Generator().manual_seed(seed)
    paged = PagedRequestPool(
        CONFIG, [max_len] * (copies + 1), generator=generator,
        same_tokens={i: (0, max_len) for i in range(1, copies + 1)}, **pages,
    )  # fmt: skip
    return paged, RandomModel(CONFIG, paged, generator=generator)


def assert_same(here: list[Any], there: list[Any]) -> None:
    assert len(here) == len(there)
    for a, b in zip(here, there, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ PD
def test_a_request_continues_on_the_decode_side_from_the_copied_regions() -> None:
    paged, model = same_prompts(0, 1)
    prefill = Server(paged, model, disaggregation_mode="prefill")
    decode = Server(paged, model, disaggregation_mode="decode")
    prefill.prefill(0, PROMPT)
    copied = transfer_request(prefill.side(0), decode.side(1), PROMPT, CONFIG.window_size)
    assert copied["request_state"] > 0  # the pending c128 block travels as request state
    assert copied["swa"] > 0 and copied["kv"] > 0
    seq_len = PROMPT
    for accepted in (NUM_DRAFT, 1):  # the second round ends inside another c4 block
        assert_same(prefill.round(0, seq_len, accepted), decode.round(1, seq_len, accepted))
        seq_len += accepted + 1


def test_without_the_request_state_the_decode_side_differs() -> None:
    """The check can fail: without the c128 request state the block the first verify
    completes pools other rows, and the decode side's c128 layer differs."""
    paged, model = same_prompts(1, 1)
    prefill = Server(paged, model, disaggregation_mode="prefill")
    decode = Server(paged, model, disaggregation_mode="decode")
    prefill.prefill(0, PROMPT)
    transfer_request(prefill.side(0), decode.side(1), PROMPT, CONFIG.window_size)
    decode.pool.clear_request_scoped_state(decode.side(1).req_pool_idx)
    c128 = CONFIG.compress_ratios.index(128)
    outs = []
    for server, request in ((prefill, 0), (decode, 1)):
        step = server.batches.verify([request], [PROMPT], NUM_DRAFT)
        server.target.init_forward_metadata(step.batch)
        outs.append([server.sim.layer(server.target, step, i) for i in range(c128 + 1)][-1])
    assert not torch.equal(*outs)


# ------------------------------------------------------------------------------- HiCache
HIT = 512  # two whole pages: what the radix tree holds of the prompt
#: Ends inside the third page and a c4 block; the hit's last c4 block overlaps the first after it.
HIT_PROMPT = 530


def evict(server: Server, request: int) -> None:
    """Free the request's device pages as eviction does, and let other data overwrite them."""
    pool, page = server.pool, server.pool.page_size
    full = page_slots(server.paged, request, HIT, swa=False)[::page] // page
    swa = page_slots(server.paged, request, HIT, swa=True)[::page] // page
    for kv_pool in pool.kv_pools.values():
        for buf in kv_pool.kv_buffer:
            buf[full] = 0xA5
    for index_pool in pool.index_pools.values():
        for buf in index_pool.index_k_with_scale_buffer:
            buf[full] = 0xA5
    for buf in pool.swa_kv_pool.kv_buffer:
        buf[swa] = 0xA5
    for states in (*pool.compress_state_pools, *pool.indexer_compress_state_pools):
        if states is not None and not states.request_scoped:
            ring = states.ring_size
            rows = (swa[:, None] * ring + torch.arange(ring)).flatten()
            states.kv_score_buffer.kv_score[rows] = 0.0


class LayerWaits:
    """sglang's ``LayerDoneCounter`` as the pool sees it: records the layers waited for."""

    def __init__(self) -> None:
        self.layers: list[int] = []

    def wait_until(self, layer: int) -> None:
        self.layers.append(layer)


@pytest.mark.parametrize("with_states", [True, False], ids=["all", "no-c4-state"])
def test_a_radix_hit_continues_from_pages_loaded_from_the_host(with_states: bool) -> None:
    # Request 2 hits request 0's device pages; request 1 the same pages after a host round trip.
    paged, model = same_prompts(2, 2, HIT_PROMPT + 1, shared_pages={2: (0, HIT // 256)})
    server = Server(paged, model, enable_hierarchical_cache=True)
    server.prefill(0, HIT_PROMPT)
    expected = server.prefill(2, HIT_PROMPT, prefix=HIT) + server.decode(2, HIT_PROMPT + 1)
    tier = HostTier(server.pool, num_host_pages=4)
    slots = {r: [page_slots(server.paged, r, HIT, swa) for swa in (False, True)] for r in (0, 1)}
    with cpu_kvcacheio():
        copy = tier.backup(*slots[0])
        evict(server, 0)
        tier.load(copy, *slots[1], with_states=with_states)
    waits = LayerWaits()
    server.pool.register_layer_transfer_counter(waits)
    if with_states:
        got = server.prefill(1, HIT_PROMPT, prefix=HIT) + server.decode(1, HIT_PROMPT + 1)
        assert_same(expected, got)
        # Every layer's caches were read only once HiCache's load of the layer was done.
        assert set(waits.layers) == set(LAYERS)
    else:  # the check can fail: the first c4 block after the hit pools the lost state rows
        step = server.batches.extend([1], [HIT], [HIT_PROMPT - HIT])
        server.target.init_forward_metadata(step.batch)
        for layer in LAYERS:
            server.sim.layer(server.target, step, layer)
    c4 = server.target.state.pools.compressed(CONFIG.compress_ratios.index(4))
    entries = [paged.req_to_token[paged.pool_index(r), HIT + 3].long() // 4 for r in (1, 2)]
    assert torch.equal(c4.gather(entries[0]), c4.gather(entries[1])) == with_states


# --------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "option", [{"disaggregation_mode": "decode"}, {"enable_hierarchical_cache": True}]
)
def test_region_copying_modes_need_the_aliased_layout(option: dict) -> None:
    paged = PagedRequestPool(CONFIG, [40], generator=torch.Generator().manual_seed(2))
    runner = harness.mock_runner(paged, HF, **option)
    runner.token_to_kv_pool = sglang_pool(paged)
    name = next(iter(option))
    with pytest.raises(ConfigError, match=rf"{name}=.*cache format 'dense'"):
        DSV4AttentionBackend(runner, cache_format="dense")
    state = DSV4AttentionBackend(runner).state  # fp8 over the pool: served
    assert (
        state.pools.window(0).storage.data_ptr()
        == runner.token_to_kv_pool.get_swa_raw_buffer(0).data_ptr()
    )


def test_pd_prefill_with_pipeline_and_context_parallelism_is_served() -> None:
    """A PD prefill server with two pipeline stages, prefill CP over two ranks and MTP (the
    launch of sglang PR 27831, DeepSeek-V4 widths), parsed by sglang's ``prepare_server_args``
    (``attn_cp_size`` resolved to the TP size, as its DeepSeek-V4 hook ``validate_deepseek_v4_cp``
    does): each stage's backend builds over its stage pool, every cache and ring a view of it,
    so the regions PD transfers carry all of its state."""
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.server_args import prepare_server_args

    from dsv4_backend.sglang_adapter.pool_alias import unmovable_reason

    command = (
        "--trust-remote-code --model-path deepseek-ai/DeepSeek-V4-Flash --tp 2 --pp-size 2 "
        "--enable-prefill-cp --cp-strategy interleave --disaggregation-mode prefill "
        f"--speculative-algorithm EAGLE --speculative-num-steps {NUM_STEPS} "
        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {NUM_DRAFT}"
    )
    args = prepare_server_args(command.split())
    args.attn_cp_size = args.tp_size
    paged = PagedRequestPool(CONFIG, [40], generator=torch.Generator().manual_seed(3))
    for stage in (range(0, 2), range(2, 3)):
        runner = harness.mock_runner(paged, HF)
        runner.server_args = args
        runner.token_to_kv_pool = sglang_pool(paged, stage)
        runner.layer_info = ModelLayerInfo(
            start_layer=stage.start, end_layer=stage.stop, num_effective_layers=len(stage)
        )
        backend = DSV4AttentionBackend(runner)  # fp8 over the stage pool
        assert backend.state.pools.layers == stage
        assert backend.local_heads == CONFIG.num_heads  # CP: attention TP 1
        assert unmovable_reason(backend.state, runner.token_to_kv_pool, None) is None
