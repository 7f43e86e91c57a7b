"""DeepSeek-V4.1 under PD disaggregation and HiCache, through sglang's own regions, on the CPU
with its V4.1 ``DeepSeekV4TokenToKVPool`` (the V4 layout: the c1 / c2 caches and fp4 index keys
of the kv sources, the request-scoped c2 pair rings) and host-pool classes; the model is
sglang's V4.1 compressor / indexer modules (``testing.v41_host``), DSpark's block of 5.

PD: a prefill-side backend serves a prompt ending on an even position (its pair waits in the
ring) and inside a page; ``testing.transfer`` copies the regions sglang lists (the c1 / c2 pages
and index keys with the KV pages, the pair ring as request state) into a second pool at other
pages and pool row; the decode-side backend continues with DSpark verifies and decodes. Every
output equals, bit for bit, the same request continued on the prefill side; without the pair
ring the decode side differs.

HiCache: a prompt's first two pages go through sglang's host pools of the V4.1 regions
(``_dsv4_low_ratio_regions``), are evicted and loaded into other device pages; a request with
the same prompt hits them (prefix 512: no pair pending, sglang keeps no pair ring on the host)
and continues bit for bit as the same hit served from the device pages before eviction.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hicache import HostTier, cpu_kvcacheio, page_slots
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _dsv4_low_ratio_regions
from transfer import RequestSide, transfer_request
from v41_host import SglangV41Model, v41_hf_config, v41_sglang_pool

from dsv4_backend.self_check.requests import PagedRequestPool
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation.v41 import tiny_v41

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

DRAFT = 5  # DSpark's block
CONFIG = tiny_v41(head_dim=512, index_head_dim=128, num_heads=8, speculative=True,
                  num_draft_tokens=DRAFT)  # fmt: skip
LAYERS = range(len(CONFIG.compress_ratios))
#: Ends on an even position (380): its pair with 381 waits in the c2 ring.
PROMPT = 381
#: fp8 window keys and entries: the relative error of the other V4.1 fp8 tests.
FP8_RELATIVE = 0.1


class Server:
    """One server over its own sglang V4.1 pool and the shared page table ``paged``."""

    def __init__(self, paged: PagedRequestPool, model: SglangV41Model, **server_args: Any):
        self.paged, self.model = paged, model
        self.pool = v41_sglang_pool(CONFIG, paged, DRAFT)
        self.runner = harness.mock_runner(
            paged, v41_hf_config(CONFIG), topk=0, speculative_algorithm="DSPARK",
            num_draft_tokens=DRAFT, **server_args,
        )  # fmt: skip
        self.runner.token_to_kv_pool = self.pool
        self.backend = self.runner.attn_backend = DSV4AttentionBackend(self.runner)  # fp8
        self.batches = harness.BatchBuilder(paged)

    def side(self, request: int) -> RequestSide:
        row = self.paged.pool_index(request)
        return RequestSide(self.pool, self.paged.full_to_swa, self.paged.req_to_token[row], row)

    def run(self, step: harness.Step) -> list[torch.Tensor]:
        """Plan ``step`` and run every layer: the outputs, each near the reference."""
        self.backend.init_forward_metadata(step.batch)
        outs = []
        for layer in LAYERS:
            out = self.model.layer(self.backend, step, layer)
            want = torch.stack([self.model.expected[r].outputs[layer][p] for r, p in step.rows])
            error = (out.float() - want).abs().mean() / want.abs().mean()
            assert error < FP8_RELATIVE, (layer, float(error))
            outs.append(out)
        return outs

    def rounds(self, request: int, seq_len: int) -> list[torch.Tensor]:
        """Two DSpark verifies (every draft accepted), then a decode, from ``seq_len``."""
        outs = []
        for _ in range(2):
            outs += self.run(self.batches.verify([request], [seq_len], DRAFT))
            seq_len += DRAFT
        return outs + self.run(self.batches.decode([request], [seq_len + 1]))


def same_prompts(copies: int, length: int, **pages: Any) -> tuple[PagedRequestPool, SglangV41Model]:
    """Requests 0 .. ``copies`` of the same activations, each at its own pages and pool row."""
    paged = PagedRequestPool(
        CONFIG, [length] * (copies + 1), generator=torch.Generator().manual_seed(5), **pages
    )
    model = SglangV41Model(CONFIG, [length])
    model.activations *= copies + 1
    model.expected *= copies + 1
    return paged, model


def assert_same(here: list[torch.Tensor], there: list[torch.Tensor]) -> None:
    assert len(here) == len(there)
    for a, b in zip(here, there, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ PD
@pytest.mark.parametrize("with_pair_ring", [True, False], ids=["regions", "no-pair-ring"])
def test_a_v41_request_continues_on_the_decode_side_from_the_copied_regions(
    with_pair_ring: bool,
) -> None:
    paged, model = same_prompts(1, PROMPT + 2 * DRAFT + 2)
    prefill = Server(paged, model, disaggregation_mode="prefill")
    decode = Server(paged, model, disaggregation_mode="decode")
    prefill.run(prefill.batches.extend([0], [0], [PROMPT]))
    copied = transfer_request(prefill.side(0), decode.side(1), PROMPT, CONFIG.window_size)
    assert copied["request_state"] > 0 and copied["kv"] > 0  # the pair ring, the c1 / c2 pages
    if with_pair_ring:
        assert_same(prefill.rounds(0, PROMPT), decode.rounds(1, PROMPT))
    else:  # the check can fail: the first verify pools (380, 381) from an empty ring row
        decode.pool.clear_request_scoped_state(decode.side(1).req_pool_idx)
        for server, request in ((prefill, 0), (decode, 1)):
            step = server.batches.verify([request], [PROMPT], DRAFT)
            server.backend.init_forward_metadata(step.batch)
            for layer in LAYERS:
                server.model.layer(server.backend, step, layer)
    c2_source = CONFIG.compress_ratios.index(2)
    entries = [
        server.backend.state.pools.compressed(c2_source).gather(
            paged.req_to_token[paged.pool_index(request), PROMPT].long().view(1) // 2
        )
        for server, request in ((prefill, 0), (decode, 1))
    ]
    assert torch.equal(*entries) == with_pair_ring


# ------------------------------------------------------------------------------- HiCache
HIT = 512  # two whole pages: what the radix tree holds of the prompt
HIT_PROMPT = 530


def evict(server: Server, request: int) -> None:
    """Free the request's device pages as eviction does, and let other data overwrite them:
    its window pages, and its full pages of every V4.1 region (views of whole full pages)."""
    pool, page = server.pool, server.pool.page_size
    full = page_slots(server.paged, request, HIT, swa=False)[::page] // page
    swa = page_slots(server.paged, request, HIT, swa=True)[::page] // page
    for _, _, buffers, _ in _dsv4_low_ratio_regions(pool, page):
        for buf in buffers:
            buf[full] = 0xA5
    for buf in pool.swa_kv_pool.kv_buffer:
        buf[swa] = 0xA5


def test_a_v41_radix_hit_continues_from_pages_loaded_from_the_host() -> None:
    # Request 2 hits request 0's device pages; request 1 the same pages after a host round trip.
    paged, model = same_prompts(2, HIT_PROMPT + 1, shared_pages={2: (0, HIT // 256)})
    server = Server(paged, model, enable_hierarchical_cache=True)
    server.run(server.batches.extend([0], [0], [HIT_PROMPT]))
    hit = [server.run(server.batches.extend([2], [HIT], [HIT_PROMPT - HIT]))]
    hit.append(server.run(server.batches.decode([2], [HIT_PROMPT + 1])))
    tier = HostTier(server.pool, num_host_pages=4)
    slots = {r: [page_slots(server.paged, r, HIT, swa) for swa in (False, True)] for r in (0, 1)}
    with cpu_kvcacheio():
        copy = tier.backup(*slots[0])
        evict(server, 0)
        tier.load(copy, *slots[1])
    got = [server.run(server.batches.extend([1], [HIT], [HIT_PROMPT - HIT]))]
    got.append(server.run(server.batches.decode([1], [HIT_PROMPT + 1])))
    for a, b in zip(hit, got, strict=True):
        assert_same(a, b)
