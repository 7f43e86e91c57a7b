"""The adapter against what sglang's DeepSeek-V4 model actually hands over: the multi-stream
indexer handshake (``q_lora_ready``, ``alt_streams``), sglang's config object, and batches
that data-parallel attention padded with whole tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ContractError
from dsv4_backend.hf_config import config_from_hf
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel

pytestmark = [pytest.mark.usefixtures("torch_path"), pytest.mark.sglang]

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
HF = harness.tiny_hf_config(CONFIG)
C4_LAYER = 1


@pytest.fixture
def pool() -> PagedRequestPool:
    pool = PagedRequestPool(CONFIG, [140, 270], generator=torch.Generator().manual_seed(0))
    return pool


def make_backend(pool: PagedRequestPool, hf: Any = HF) -> DSV4AttentionBackend:
    runner = harness.mock_runner(pool, hf)
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    runner.attn_backend = backend
    return backend


# ------------------------------------------------------------------------------ streams
class Event:
    def __init__(self, name: str) -> None:
        self.name = name


class Stream:
    """Records ``wait_stream`` / ``wait_event`` / ``record_event`` calls into a shared log."""

    def __init__(self, name: str, log: list[tuple[str, ...]]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: Stream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: Event) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def record_event(self) -> Event:
        event = Event(f"{self.name}:event")
        self.log.append(("record_event", self.name, event.name))
        return event


class RecordingStreams:
    """``backend.streams`` stand-in: the model's indexer stream is current at the call."""

    def __init__(self, log: list[tuple[str, ...]]) -> None:
        self.stack = [Stream("indexer", log)]

    def current(self) -> Stream:
        return self.stack[-1]

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[Stream]:
        self.stack.append(stream)
        try:
            yield stream
        finally:
            self.stack.pop()


def _recorded_indexer(indexer: Any, streams: RecordingStreams, log: list) -> None:
    """Log on which stream the indexer reads q_lora, x (weights) and runs its compressor."""
    wq_b, weights, kv_score = (
        indexer.wq_b, indexer.compute_weights, indexer.compressor.compute_kv_score
    )  # fmt: skip

    def logged(what: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            log.append((what, streams.current().name))
            return fn(*args, **kwargs)

        return call

    indexer.wq_b = logged("wq_b(q_lora)", wq_b)
    indexer.compute_weights = logged("compute_weights(x)", weights)
    indexer.compressor.compute_kv_score = logged("compressor", kv_score)


def _indexer_run(pool: PagedRequestPool, **stream_kwargs: Any) -> tuple[torch.Tensor, list]:
    """One chunk of prefill through ``forward_c4_indexer``: (top-k slots, stream log)."""
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(1))
    backend = make_backend(pool)
    log: list[tuple[str, ...]] = []
    backend.streams = RecordingStreams(log)
    sim = harness.SimulatedModel(model)
    step = harness.BatchBuilder(pool).extend([0, 1], [0, 0], [37, 60])
    backend.init_forward_metadata(step.batch)
    feed = sim.feed(step.rows, C4_LAYER)
    indexer = sim.indexers[C4_LAYER]
    indexer.feed = indexer.compressor.feed = feed
    _recorded_indexer(indexer, backend.streams, log)
    alt = [Stream("q", log), Stream("weights", log)]
    backend.forward_c4_indexer(
        x=feed.x, q_lora=feed.x, forward_batch=step.batch, c4_indexer=indexer,
        alt_streams=alt, **stream_kwargs,
    )  # fmt: skip
    return backend.forward_metadata.c4.page_indices.clone(), log


def test_multi_stream_indexer_waits_for_q_lora_as_sglangs_backend(pool) -> None:
    selected, log = _indexer_run(pool, enable_multi_stream=True, q_lora_ready=Event("q_lora"))
    assert log == [
        ("wait_stream", "q", "indexer"),
        ("wait_stream", "weights", "indexer"),
        ("compressor", "indexer"),
        ("compute_weights(x)", "weights"),
        ("record_event", "weights", "weights:event"),
        ("wait_event", "q", "q_lora"),  # before q_lora is read
        ("wait_event", "q", "weights:event"),
        ("wq_b(q_lora)", "q"),
        ("wait_stream", "indexer", "q"),  # the top-k (current stream) runs after the join
    ]
    single, single_log = _indexer_run(pool)
    assert single_log == [
        ("compressor", "indexer"),
        ("compute_weights(x)", "indexer"),
        ("wq_b(q_lora)", "indexer"),
    ]
    assert (selected >= 0).any()
    torch.testing.assert_close(selected, single, rtol=0, atol=0)


def test_q_lora_ready_without_multi_stream_is_refused(pool) -> None:
    with pytest.raises(ContractError, match="q_lora_ready given without enable_multi_stream"):
        _indexer_run(pool, q_lora_ready=Event("q_lora"))


def test_multi_stream_needs_two_alt_streams(pool) -> None:
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(1))
    backend = make_backend(pool)
    sim = harness.SimulatedModel(model)
    step = harness.BatchBuilder(pool).extend([0], [0], [9])
    backend.init_forward_metadata(step.batch)
    feed = sim.feed(step.rows, C4_LAYER)
    indexer = sim.indexers[C4_LAYER]
    indexer.feed = indexer.compressor.feed = feed
    with pytest.raises(ContractError, match="two alt_streams"):
        backend.forward_c4_indexer(
            x=feed.x, q_lora=feed.x, forward_batch=step.batch, c4_indexer=indexer,
            alt_streams=None, enable_multi_stream=True,
        )  # fmt: skip


# ------------------------------------------------------------------------ sglang config
def test_backend_reads_sglangs_config_object(pool) -> None:
    """YaRN values unlike the defaults, handed over as sglang's runtime config object."""

    def values() -> dict[str, Any]:  # fresh dicts: transformers edits rope_scaling in place
        yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
        return dict(HF, model_type="deepseek_v4", rope_scaling=yarn)

    backend = make_backend(pool, _CONFIG_REGISTRY["deepseek_v4"](**values()))
    assert backend.config.yarn_factor == 4.0
    assert backend.config.yarn_original_max_position == 2048
    assert backend.config == config_from_hf(values(), speculative=True, num_draft_tokens=4)


# -------------------------------------------------------------- data-parallel padding
def _run_all_layers(backend: Any, model: RandomModel, step: harness.Step) -> list[torch.Tensor]:
    sim = harness.SimulatedModel(model)
    return [sim.layer(backend, step, layer) for layer in range(len(CONFIG.compress_ratios))]


@pytest.mark.parametrize("extra_tokens", [1, 8])
def test_extend_padded_with_whole_tokens(pool, extra_tokens: int) -> None:
    """EXTEND (chunked prefill) padded by sglang's ``_pad_inputs_to_size`` to more tokens than
    its requests have: the padded rows write nothing (every cache and ring equals an unpadded
    run's) and output 0; the real rows equal the full causal pass."""
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(2))
    padded_backend, plain_backend = make_backend(pool), make_backend(pool)
    sim = harness.SimulatedModel(model)
    builder = harness.BatchBuilder(pool)
    runner = SimpleNamespace(attn_backend=padded_backend)
    for prefix, extend in (([0, 0], [100, 131]), ([100, 131], [40, 139])):
        real = sum(extend)
        plain = builder.extend([0, 1], prefix, extend)
        step = builder.pad(builder.extend([0, 1], prefix, extend), runner, 0, 0, extra_tokens)
        assert step.batch.out_cache_loc.numel() == real + extra_tokens
        assert step.batch.extend_num_tokens == real + extra_tokens
        padded_backend.init_forward_metadata(step.batch)
        plain_backend.init_forward_metadata(plain.batch)
        assert (padded_backend.forward_metadata.swa_out_loc[real:] == -1).all()
        for layer in range(len(CONFIG.compress_ratios)):
            out = sim.layer(padded_backend, step, layer)
            sim.layer(plain_backend, plain, layer)
            assert out.shape[0] == real + extra_tokens
            assert sim.max_error(step.rows, layer, out) < 1e-4
            assert (out[real:] == 0).all()
        want_state = plain_backend.state.named_tensors()
        for name, got in padded_backend.state.named_tensors().items():
            torch.testing.assert_close(got, want_state[name], rtol=0, atol=0, equal_nan=True)


def test_draft_extend_padded_with_requests_and_tokens(pool) -> None:
    """DRAFT_EXTEND_V2 as sglang runs it: planned, then padded (a whole request and two loose
    tokens), then the forward; the plan grows by sentinel rows."""
    model = RandomModel(CONFIG, pool, generator=torch.Generator().manual_seed(3))
    runner = harness.mock_runner(pool, HF, is_draft_worker=True)
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    builder = harness.BatchBuilder(pool)
    # The committed prefix first, through the draft (window-only) model's layer 0.
    draft_config = backend.config
    draft_model = RandomModel(draft_config, pool, generator=torch.Generator().manual_seed(3))
    sim = harness.SimulatedModel(draft_model)
    prefill = builder.extend([0, 1], [0, 0], [120, 250])
    backend.init_forward_metadata(prefill.batch)
    sim.layer(backend, prefill, 0)
    step = builder.draft_extend([0, 1], [120, 250], 4)
    backend.init_forward_metadata(step.batch)  # sglang plans before padding
    padded = builder.pad(step, SimpleNamespace(attn_backend=backend), 1, 4, 2)
    out = sim.layer(backend, padded, 0)
    assert out.shape[0] == 8 + 4 + 2
    assert sim.max_error(padded.rows, 0, out) < 1e-4
    assert (out[8:] == 0).all()
    del model
