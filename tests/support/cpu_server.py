"""What the server tests share: prompts of token ids, the agreement check of two runs' greedy
outputs, and sglang's own HTTP server on the CPU (``python -m dsv4_backend serve``: sglang's
``launch_server`` with the CPU serving kit) in a subprocess of its own, answered over HTTP as
a user's client would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_backend.tools.cpu_server import runs


def prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Random token ids of the tiny checkpoints' vocabulary (no special token), one prompt of
    each length."""
    return runs.random_prompts(lengths, seed, vocab=512)


def assert_agree(
    expected: Sequence[runs.RequestResult],
    got: Sequence[runs.RequestResult],
    logprob_bound: float = runs.LOGPROB_BOUND,
) -> None:
    """Every prompt's tokens agree before the first narrow step, logprobs within the bound,
    and at least half of all steps were compared (the check cannot pass vacuously)."""
    found = [runs.agreement(a, b) for a, b in zip(expected, got, strict=True)]
    report = "\n".join(f"prompt {i}: {a.describe()}" for i, a in enumerate(found))
    assert all(a.equal for a in found), report
    assert all(a.max_logprob_difference <= logprob_bound for a in found), report
    assert sum(a.compared for a in found) >= sum(a.steps for a in found) / 2, report


#: Seconds a server may take to answer /health (a cold start on 2 busy cores).
START_TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class HttpServer:
    """A running server: its base ``url`` and the file its output goes to."""

    url: str
    log_path: Path
    process: subprocess.Popen[bytes]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> Any:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
            is_json = response.headers.get_content_type() == "application/json"
            return json.loads(body) if is_json else body.decode()

    def get(self, path: str, timeout: float = 30) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return json.loads(response.read())


@contextmanager
def http_server(
    model_path: Path, log_path: Path, args: Sequence[str] = (), env: dict[str, str] | None = None
) -> Iterator[HttpServer]:
    """``python -m dsv4_backend serve --model-path model_path ARGS`` on a free port, its output
    in ``log_path``; yields once it answers /health, stops it (and its children) on exit."""
    port = free_port()
    command = [
        sys.executable, "-m", "dsv4_backend", "serve", "--model-path", str(model_path),
        "--port", str(port), "--log-level", "info", *args,
    ]  # fmt: skip
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group: stopped with its children
        )
    server = HttpServer(f"http://127.0.0.1:{port}", log_path, process)
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(process)


def _wait_healthy(server: HttpServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited ({server.process.returncode}):\n" + server.log())
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise RuntimeError(f"no /health answer within {START_TIMEOUT} s:\n" + server.log()[-5000:])


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
