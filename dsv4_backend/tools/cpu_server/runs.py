"""Prompts through sglang's own ``Engine``, one server configuration at a time, and the
comparison of two such runs: what the server tests and ``ab --server`` share.

A :class:`ServerConfig` is a named set of ``Engine`` keywords and process environment (the
attention backend, the kernel path, speculative decoding, chunked prefill, ...). :func:`run`
starts an ``Engine`` of one, sends the prompts greedily (all at once, or one at a time) with
the top-2 logprobs of every step, and shuts it down. :func:`compare` says where two runs'
greedy tokens agree: bf16 rounding depends on the rows of each matmul, so two correct servers
batching differently may pick different tokens where the top two are within rounding; tokens
are compared up to the first step whose top-2 margin (in either run) is below a bound.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_backend.errors import ConfigError
from dsv4_backend.tools.cpu_server.environment import kit_environment
from dsv4_backend.tools.cpu_server.serve import CPU_SERVER_ARGS

#: Top-1 minus top-2 logprob below which a greedy step may flip under another batching: the
#: tiny checkpoint's steps differ by up to ~0.3 in a logprob between batchings (bf16 rounding,
#: an indexer top-k choice; docs/cpu-server.md); 11 of its 640 measured steps are below 0.5.
MARGIN_BOUND = 0.5
#: Largest |logprob difference| of a compared step between two runs of correct servers: measured
#: on the tiny checkpoint 0 (EAGLE, 256-token chunks, radix hits), 0.032 (the Triton kernels in
#: the interpreter against torch), 0.11 (64 steps batched against one at a time; V4.1 0.28).
LOGPROB_BOUND = 0.3


@dataclass(frozen=True)
class ServerConfig:
    """A server configuration: ``engine_args`` (``sglang.Engine`` keywords over
    ``CPU_SERVER_ARGS`` on the CPU) and ``env`` (environment of its processes)."""

    name: str
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


def cpu_config(name: str = "dsv4", *, triton: bool = False, **engine_args: Any) -> ServerConfig:
    """A CPU server through the CPU serving kit: this backend on its torch kernels, or its
    Triton kernels in Triton's interpreter (``triton``), with ``engine_args`` over
    ``CPU_SERVER_ARGS``."""
    return ServerConfig(name, {**CPU_SERVER_ARGS, **engine_args}, kit_environment(triton=triton))


@dataclass(frozen=True)
class RequestResult:
    """One request's greedy output: ``output_ids``, the chosen tokens' ``logprobs`` and the
    top-1 minus top-2 logprob ``margins`` of each step, its end-to-end ``latency_s``."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    margins: tuple[float, ...]
    latency_s: float
    cached_tokens: int


@dataclass(frozen=True)
class Run:
    """A configuration's results of every prompt, in prompt order, and the wall time."""

    config: ServerConfig
    results: tuple[RequestResult, ...]
    wall_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return sum(len(r.output_ids) for r in self.results) / self.wall_s


def random_prompts(lengths: Sequence[int], seed: int, vocab: int) -> list[list[int]]:
    """Prompts of random token ids below ``vocab``, past the tiny tokenizer's special tokens,
    one of each length in ``lengths`` (seeded by ``seed``)."""
    import torch

    from dsv4_backend.tools.cpu_server.checkpoint import SPECIAL_TOKENS

    generator = torch.Generator().manual_seed(seed)
    low = len(SPECIAL_TOKENS)
    return [torch.randint(low, vocab, (n,), generator=generator).tolist() for n in lengths]


@contextlib.contextmanager
def engine(model_path: str | Path, config: ServerConfig) -> Iterator[Any]:
    """An ``sglang.Engine`` of ``config`` serving ``model_path``, shut down on exit.

    ``config.env`` is set while the ``Engine`` starts (its scheduler process inherits it) and
    restored afterwards; the CPU serving kit loads in sglang's processes only, never in this
    one (``standins.enabled``). What the ``Engine`` changes in this process is put back on
    exit: sglang's runtime context (server arguments, parallel layout: sglang's own
    ``snapshot_context`` / ``restore_context``) and the root logger (its ``configure_logger``
    sets the level to ``log_level`` and replaces the handlers), so later code here sees
    sglang and logging as before.
    """
    import sglang
    from sglang.srt.runtime_context import restore_context, snapshot_context

    root = logging.getLogger()
    saved_logging = (root.level, list(root.handlers))
    saved_context = snapshot_context()

    def restore() -> None:
        restore_context(saved_context)
        root.setLevel(saved_logging[0])
        root.handlers[:] = saved_logging[1]

    saved_env = {key: os.environ.get(key) for key in config.env}
    os.environ.update(config.env)
    try:
        instance = sglang.Engine(model_path=str(model_path), **config.engine_args)
    except BaseException:
        restore()
        raise
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield instance
    finally:
        instance.shutdown()
        restore()


def generate(
    instance: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, together: bool
) -> tuple[RequestResult, ...]:
    """Greedy outputs of ``prompts`` (token ids) from a running ``Engine``: sent in one call
    (``together``: sglang batches them as it schedules) or one request at a time."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    batches = [list(prompts)] if together else [[p] for p in prompts]
    outputs: list[dict[str, Any]] = []
    for batch in batches:
        outputs += instance.generate(
            input_ids=[list(p) for p in batch],
            sampling_params=sampling,
            return_logprob=True,
            top_logprobs_num=2,
        )
    return tuple(_result(output) for output in outputs)


def _result(output: Mapping[str, Any]) -> RequestResult:
    meta = output["meta_info"]
    chosen = meta["output_token_logprobs"]  # [(logprob, token id, text)] a step
    top = meta["output_top_logprobs"]  # [[(logprob, token id, text)] * 2] a step
    return RequestResult(
        output_ids=tuple(int(t) for t in output["output_ids"]),
        logprobs=tuple(float(step[0]) for step in chosen),
        margins=tuple(float(step[0][0] - step[1][0]) for step in top),
        latency_s=float(meta["e2e_latency"]),
        cached_tokens=int(meta.get("cached_tokens", 0)),
    )


def run(
    model_path: str | Path,
    config: ServerConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    together: bool = True,
) -> Run:
    """Start an ``Engine`` of ``config``, run ``prompts`` greedily, shut it down."""
    with engine(model_path, config) as instance:
        start = time.perf_counter()
        results = generate(instance, prompts, max_new_tokens, together=together)
        return Run(config, results, time.perf_counter() - start)


@dataclass(frozen=True)
class Agreement:
    """Two runs' greedy outputs of one prompt, compared before the first step either run
    decided by less than the margin bound (``compared`` of ``steps``; all if none): the first
    differing step there, and the largest difference of the chosen tokens' logprobs."""

    compared: int
    steps: int
    first_difference: int | None
    max_logprob_difference: float

    @property
    def equal(self) -> bool:
        return self.first_difference is None

    def describe(self) -> str:
        where = "" if self.equal else f", first difference at step {self.first_difference}"
        return (
            f"{self.compared} of {self.steps} steps compared{where}, max |logprob "
            f"difference| {self.max_logprob_difference:.3g}"
        )


def agreement(a: RequestResult, b: RequestResult, margin_bound: float = MARGIN_BOUND) -> Agreement:
    """Where ``a`` and ``b`` (outputs of the same prompt) agree (:class:`Agreement`)."""
    steps = min(len(a.output_ids), len(b.output_ids))
    compared = next(
        (i for i in range(steps) if min(a.margins[i], b.margins[i]) < margin_bound), steps
    )
    differ = [i for i in range(compared) if a.output_ids[i] != b.output_ids[i]]
    return Agreement(
        compared=compared,
        steps=steps,
        first_difference=differ[0] if differ else None,
        max_logprob_difference=max(
            (abs(a.logprobs[i] - b.logprobs[i]) for i in range(compared)), default=0.0
        ),
    )


def compare(a: Run, b: Run, margin_bound: float = MARGIN_BOUND) -> tuple[Agreement, ...]:
    """The :func:`agreement` of every prompt of two runs of the same prompts."""
    if len(a.results) != len(b.results):
        raise ConfigError(
            f"runs of {len(a.results)} and {len(b.results)} prompts; expected the same prompts"
        )
    return tuple(agreement(x, y, margin_bound) for x, y in zip(a.results, b.results, strict=True))
