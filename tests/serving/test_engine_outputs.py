"""Greedy outputs of sglang's own ``Engine`` on the CPU through this backend do not depend on
how the server is configured or how requests arrive.

The tiny DeepSeek-V4 checkpoint (window 128, layers of ratios 0 / 4 / 128 / 4, an MTP layer)
answers four prompts of 3, 11, 300 and 122 tokens (c128 blocks completed in prefill and in
decode, a prompt past the window and past one 256-token chunk) with 16 greedy tokens each. The
baseline (torch kernels, the four sent together, cold caches) is compared with the same
Engine's radix-cache hits, with the prompts sent one at a time, with 16 prompts at once, and
with another Engine: EAGLE (the MTP layer drafting 2 steps) with 256-token prefill chunks
(under ``DSV4_STRESS`` each on its own, and the backend's Triton kernels in Triton's
interpreter). Tokens are compared before the first step
either run decided by less than ``runs.MARGIN_BOUND`` (bf16 rounding follows the batch shape);
the chosen tokens' logprobs agree within ``runs.LOGPROB_BOUND`` there.
"""

from __future__ import annotations

import pytest
from cpu_server import assert_agree, prompts
from stress import STRESS

from dsv4_backend.tools.cpu_server import runs
from dsv4_backend.tools.cpu_server.serve import EAGLE_ARGS

pytestmark = pytest.mark.server

NEW_TOKENS = 16
LENGTHS = (3, 11, 300, 122)
#: Short prompts of the 16-at-once burst.
BURST_LENGTHS = tuple(5 + 7 * i for i in range(16))
QUIET = {"log_level": "error"}


PROMPTS = prompts(LENGTHS, seed=1)
BURST = prompts(BURST_LENGTHS, seed=2)


@pytest.fixture(scope="module")
def baseline(tiny_checkpoint) -> dict[str, tuple[runs.RequestResult, ...]]:
    """One Engine (torch kernels): the prompts together (cold, then radix hits), one at a
    time (cold), and the burst at once and one at a time."""
    with runs.engine(tiny_checkpoint, runs.cpu_config(**QUIET)) as engine:
        together = runs.generate(engine, PROMPTS, NEW_TOKENS, together=True)
        hits = runs.generate(engine, PROMPTS, NEW_TOKENS, together=True)
        engine.flush_cache()
        single = runs.generate(engine, PROMPTS, NEW_TOKENS, together=False)
        engine.flush_cache()
        burst = runs.generate(engine, BURST, 8, together=True)
        engine.flush_cache()
        burst_single = runs.generate(engine, BURST, 8, together=False)
    return {
        "together": together,
        "hits": hits,
        "single": single,
        "burst": burst,
        "burst_single": burst_single,
    }


def test_radix_hits_answer_as_cold_prefills(baseline) -> None:
    assert all(
        r.cached_tokens > 0 for r, n in zip(baseline["hits"], LENGTHS, strict=True) if n >= 256
    )
    assert_agree(baseline["together"], baseline["hits"])


def test_one_request_at_a_time_answers_as_a_batch(baseline) -> None:
    assert_agree(baseline["together"], baseline["single"])


def test_sixteen_concurrent_requests_answer_as_one_at_a_time(baseline) -> None:
    assert_agree(baseline["burst_single"], baseline["burst"])


#: The default suite's other Engine changes two things at once (each is its own Engine under
#: DSV4_STRESS, with the Triton kernels in the interpreter too; ``tests/tool/test_ab_server.py``
#: compares those with the torch kernels through ``ab --server`` in the default suite).
CONFIGS = {
    "eagle-chunked-prefill-256": runs.cpu_config(**QUIET, **EAGLE_ARGS, chunked_prefill_size=256),
    **(
        {
            "eagle": runs.cpu_config(**QUIET, **EAGLE_ARGS),
            "chunked-prefill-256": runs.cpu_config(**QUIET, chunked_prefill_size=256),
            "triton-interpreter": runs.cpu_config(**QUIET, triton=True),
        }
        if STRESS
        else {}
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_another_server_configuration_answers_as_the_baseline(
    tiny_checkpoint, baseline, name: str
) -> None:
    got = runs.run(tiny_checkpoint, CONFIGS[name], PROMPTS, NEW_TOKENS)
    assert_agree(baseline["together"], got.results)
