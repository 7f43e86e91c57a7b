"""DeepSeek-V4.1 through sglang's own ``Engine`` on the CPU: the tiny V4.1 checkpoint (window
128, layers of ratios 0 / 2 / 2 / 1 / 1 / 1 sharing the kv and index sources' caches, fp4 index
keys, two-level top-k) answers three prompts (3, 140 and 300 tokens: past the window, several
c2 pairs and 256-token pages) with 12 greedy tokens. Sent together (cold, then from radix-cache
hits) and one at a time, they answer the same (``runs.agreement``); under ``DSV4_STRESS`` the
backend's Triton kernels in the interpreter answer as its torch kernels.
"""

from __future__ import annotations

import pytest
from cpu_server import assert_agree, prompts

from dsv4_backend.tools.cpu_server import runs
from dsv4_backend.tools.cpu_server.checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.server

NEW_TOKENS = 12
LENGTHS = (3, 140, 300)
PROMPTS = prompts(LENGTHS, seed=3)
QUIET = {"log_level": "error"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-v41"), variant="v41")


@pytest.fixture(scope="module")
def outputs(checkpoint) -> dict[str, tuple[runs.RequestResult, ...]]:
    with runs.engine(checkpoint, runs.cpu_config(**QUIET)) as engine:
        together = runs.generate(engine, PROMPTS, NEW_TOKENS, together=True)
        hits = runs.generate(engine, PROMPTS, NEW_TOKENS, together=True)
        engine.flush_cache()
        single = runs.generate(engine, PROMPTS, NEW_TOKENS, together=False)
    return {"together": together, "hits": hits, "single": single}


def test_v41_radix_hits_answer_as_cold_prefills(outputs) -> None:
    assert outputs["hits"][-1].cached_tokens >= 256
    assert_agree(outputs["together"], outputs["hits"])


def test_v41_one_request_at_a_time_answers_as_a_batch(outputs) -> None:
    assert_agree(outputs["together"], outputs["single"])


@pytest.mark.stress
def test_v41_triton_kernels_answer_as_the_torch_kernels(checkpoint, outputs) -> None:
    got = runs.run(checkpoint, runs.cpu_config(**QUIET, triton=True), PROMPTS, NEW_TOKENS)
    assert_agree(outputs["together"], got.results)
