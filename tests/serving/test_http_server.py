"""sglang's own HTTP server on the CPU through this backend, as a user runs it: ``python -m
dsv4_backend serve`` (sglang's ``launch_server``, the CPU serving kit) with the tiny DeepSeek-V4
checkpoint, answered by the ``openai`` client and plain HTTP.

One server for the module (torch kernels, radix cache, the default chunked prefill); what its
clients see: chat and text completions, streams, ``/generate`` with logprobs, aborted and
abandoned requests, a burst of 64 requests, and the backend's caches as views of sglang's pool.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import time
import urllib.parse

import openai
import pytest
from cpu_server import HttpServer, http_server
from tokenizers import Tokenizer

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory) -> HttpServer:
    log = tmp_path_factory.mktemp("http-server") / "server.log"
    with http_server(tiny_checkpoint, log) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: HttpServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300)


def test_a_chat_completion_is_answered(client: openai.OpenAI, tiny_checkpoint) -> None:
    content = "Hello, who are you?"
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=8,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert reply.usage.completion_tokens == 8 and choice.finish_reason == "length"
    # The prompt went through sglang's DeepSeek-V4 chat encoder: the text's tokens and at
    # least the user and assistant tokens around them.
    text = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json")).encode(content)
    assert reply.usage.prompt_tokens >= len(text.ids) + 2


def test_a_stream_carries_the_completion_of_the_same_request(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 12


def test_generate_returns_greedy_tokens_with_their_logprobs(server: HttpServer) -> None:
    reply = server.post(
        "/generate",
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    )
    meta = reply["meta_info"]
    chosen, top = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(reply["output_ids"]) == len(chosen) == len(top) == 8
    for (logprob, token, _), candidates in zip(chosen, top, strict=True):
        # Greedy: a most likely token (bf16 logits may tie: then any of them).
        assert logprob <= 0 and logprob == candidates[0][0] >= candidates[1][0]
        assert token == candidates[0][1] or candidates[1][0] == logprob
    assert [token for _, token, _ in chosen] == reply["output_ids"]


def _load(server: HttpServer, field: str) -> int:
    """``field`` of sglang's ``/v1/loads`` (summed over DP ranks)."""
    return sum(int(load[field]) for load in server.get("/v1/loads")["loads"])


def _used_tokens_when_idle(server: HttpServer) -> int:
    """Token slots the scheduler holds with nothing running, the radix cache flushed."""
    assert _load(server, "num_running_reqs") == 0
    server.post("/flush_cache", {})
    return _load(server, "num_used_tokens")


def test_aborted_and_abandoned_requests_leave_the_server_serving(server: HttpServer) -> None:
    before = _used_tokens_when_idle(server)
    # A client that disconnects mid-stream.
    url = urllib.parse.urlparse(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 400}, "stream": True}
    connection.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data:")
    connection.close()
    # A request aborted by id while it runs.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            server.post,
            "/generate",
            {"text": PROMPT, "sampling_params": {"max_new_tokens": 400}, "rid": "to-abort"},
        )
        deadline = time.monotonic() + 60
        while _load(server, "num_running_reqs") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.post("/abort_request", {"rid": "to-abort"})
        aborted = running.result(timeout=120)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    # Still serving, and every slot back once idle.
    reply = server.post("/generate", {"text": "again", "sampling_params": {"max_new_tokens": 4}})
    assert len(reply["output_ids"]) == 4
    deadline = time.monotonic() + 60
    while _load(server, "num_running_reqs") and time.monotonic() < deadline:
        time.sleep(0.1)  # the disconnected stream's request ends by abort or length
    assert _used_tokens_when_idle(server) == before


def test_a_burst_of_64_short_requests_is_answered(server: HttpServer) -> None:
    def ask(i: int) -> list[int]:
        body = {
            "text": f"request {i}: " + "abc " * (i % 7),
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        }
        return server.post("/generate", body, timeout=600)["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        outputs = list(pool.map(ask, range(64)))
    assert [len(o) for o in outputs] == [3] * 64


def test_the_backends_caches_are_views_of_sglangs_pool(server: HttpServer) -> None:
    """The checkpoint's ``compress_ratios`` carries the MTP slot; the backend aliases sglang's
    pool anyway and allocates no second copy of the caches."""
    log = server.log()
    aliased = re.findall(
        r"dsv4 backend: aliased (\d+) bytes .*?(\d+) of (\d+) compressor rings", log
    )
    assert aliased, log[-3000:]
    assert all(int(n) > 0 and ok == total for n, ok, total in aliased)
    assert "bytes of caches, rings and RoPE table" not in log
