"""Every configuration is served or refused when the backends are built, never accepted and
broken later: sglang's documented DeepSeek-V4 launch commands (the cookbook's cells and its
playground's options) parsed by sglang 0.5.23's own ``prepare_server_args``, then the target
backend and, with speculative decoding, the draft backends (multi-step draft decode, draft
extend) built from them. Also: the platforms the plugin leaves to sglang, the model types and
compress ratios refused, and the scheduler-facing declarations."""

from __future__ import annotations

import logging

import pytest
import torch

from dsv4_backend import registration
from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.sglang_adapter import settings
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.sglang_adapter.draft import DSV4MultiStepDraftBackend
from dsv4_backend.sglang_adapter.dspark import DSparkDraftBackend
from dsv4_backend.sglang_adapter.refusals import REFUSED
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool
from dsv4_backend.testing.simulation.v41 import tiny_v41

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
HF = harness.tiny_hf_config(CONFIG)

#: The cookbook's flags of a B200 / H200 cell, by recipe (host and port left out).
FLASH = "--trust-remote-code --model-path deepseek-ai/DeepSeek-V4-Flash"
MTP_314 = "--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 "
MTP_314 += "--speculative-num-draft-tokens 4"
MTP_112 = "--speculative-algorithm EAGLE --speculative-num-steps 1 --speculative-eagle-topk 1 "
MTP_112 += "--speculative-num-draft-tokens 2"
LOW_LATENCY = f"{FLASH} --tp 4 --moe-runner-backend flashinfer_mxfp4 {MTP_314} "
LOW_LATENCY += (
    "--chunked-prefill-size 4096 --disable-flashinfer-autotune --swa-full-tokens-ratio 0.1"
)
BALANCED = f"{FLASH} --tp 4 --dp 4 --enable-dp-attention --moe-a2a-backend deepep {MTP_112}"
HIGH_THROUGHPUT = f"{FLASH} --tp 4 --dp 4 --enable-dp-attention --moe-a2a-backend megamoe"
FP4_INDEXER = f"{FLASH} --tp 4 --moe-runner-backend flashinfer_mxfp4 "
FP4_INDEXER += "--enable-deepseek-v4-fp4-indexer"

#: ``(name, command, environment, None when served else the flag the refusal names)``.
COMMANDS = [
    ("low-latency", LOW_LATENCY, {}, None),
    ("balanced", BALANCED, {}, None),
    ("high-throughput", HIGH_THROUGHPUT, {}, None),
    ("pro-low-latency", LOW_LATENCY.replace("--tp 4", "--tp 8"), {}, None),
    ("nextn", LOW_LATENCY.replace("EAGLE", "NEXTN"), {}, None),
    ("reasoning-and-tool-parsers",
     f"{LOW_LATENCY} --reasoning-parser deepseek-v4 --tool-call-parser deepseekv4", {}, None),
    # Served on SM100 / SM120 only, as sglang serves it (this CPU host: refused; the cell
    # on those GPUs: test_fp4_indexer_cell_is_served_on_sm100_and_sm120).
    ("fp4-indexer", FP4_INDEXER, {}, "--enable-deepseek-v4-fp4-indexer needs SM100 or SM120"),
    ("dspark", LOW_LATENCY.replace("EAGLE", "DSPARK"), {}, None),
    ("ngram", f"{FLASH} --tp 4 --speculative-algorithm NGRAM --speculative-num-draft-tokens 16 "
     "--speculative-ngram-max-bfs-breadth 10", {}, "--speculative-algorithm (only EAGLE"),
    ("mixed-chunk", f"{FLASH} --tp 4 --enable-mixed-chunk", {}, None),
    ("mixed-chunk-eagle", f"{LOW_LATENCY} --enable-mixed-chunk", {}, None),  # sglang drops it
    ("trtllm", f"{LOW_LATENCY} --dsv4-attn-backend trtllm", {}, "--dsv4-attn-backend trtllm"),
    ("flashmla-mega", f"{LOW_LATENCY} --dsv4-attn-backend flashmla_mega", {},
     "--dsv4-attn-backend flashmla_mega"),
    ("pd-prefill", f"{HIGH_THROUGHPUT} --disaggregation-mode prefill", {},
     "--disaggregation-mode"),
    ("pd-decode-hisparse", f"{HIGH_THROUGHPUT} --disaggregation-mode decode --enable-hisparse "
     "--disable-radix-cache", {}, "--enable-hisparse"),
    ("hisparse", f"{HIGH_THROUGHPUT} --enable-hisparse --disable-radix-cache", {},
     "--enable-hisparse"),
    ("hicache", f"{LOW_LATENCY} --enable-hierarchical-cache", {}, "--enable-hierarchical-cache"),
    ("prefill-cp", f"{FLASH} --tp 8 --enable-prefill-cp --cp-strategy interleave", {}, None),
    ("prefill-cp-mtp", f"{LOW_LATENCY} --enable-prefill-cp --cp-strategy interleave", {}, None),
    ("prefill-cp-zigzag", f"{FLASH} --tp 4 --enable-prefill-cp --cp-strategy zigzag", {},
     "zigzag"),
    ("cp-decode-attn-tp", f"{FLASH} --tp 4 --enable-prefill-cp --cp-strategy interleave "
     "--enable-cp-decode-attn-tp", {}, None),
    ("attention-cp", f"{FLASH} --tp 4 --attn-cp-size 2", {}, "--attention-context-parallel"),
    ("two-batch-overlap", f"{BALANCED} --enable-two-batch-overlap", {}, None),
    ("two-batch-overlap-megamoe", f"{HIGH_THROUGHPUT} --enable-two-batch-overlap", {}, None),
    ("pipeline", f"{FLASH} --tp 4 --pp-size 2", {}, None),
    ("pipeline-h20", f"{FLASH} --tp 1 --pp-size 8", {}, None),
    ("prefill-graph", f"{LOW_LATENCY} --cuda-graph-backend-prefill breakable", {},
     "--cuda-graph-backend-prefill"),
    ("prefill-graph-json", f'{LOW_LATENCY} --cuda-graph-config {{"prefill":{{"backend":"full"}}}}',
     {}, "--cuda-graph-config with a prefill backend"),
    ("decode-graph-json", f'{LOW_LATENCY} --cuda-graph-config {{"decode":{{"max_bs":64}}}}', {},
     None),
    ("v41-layout", LOW_LATENCY, {"SGLANG_DSV4_KV_LAYOUT": "v41"}, "SGLANG_DSV4_KV_LAYOUT"),
]  # fmt: skip


@pytest.fixture(scope="module")
def pool() -> PagedRequestPool:
    return PagedRequestPool(CONFIG, [40], generator=torch.Generator().manual_seed(0))


def build_all(pool: PagedRequestPool, server_args, hf=HF) -> list[object]:
    """The target backend and, with speculative decoding, the draft runner's backends, as
    sglang builds them from ``server_args``."""
    target = harness.mock_runner(pool, hf)
    target.server_args = server_args
    built: list[object] = [DSV4AttentionBackend(target, cache_format="dense")]
    if server_args.speculative_algorithm == "DSPARK":  # the draft runner's one backend
        draft = harness.mock_runner(
            pool, hf, topk=0, num_draft_tokens=server_args.speculative_num_draft_tokens,
            is_draft_worker=True, speculative_algorithm="DSPARK",
        )  # fmt: skip
        draft.server_args = server_args
        built.append(DSparkDraftBackend(draft, cache_format="dense"))
    elif server_args.speculative_algorithm is not None:
        draft = harness.mock_runner(pool, hf, is_draft_worker=True)
        draft.server_args = server_args
        topk, steps = server_args.speculative_eagle_topk, server_args.speculative_num_steps
        built.append(DSV4MultiStepDraftBackend(draft, topk, steps, cache_format="dense"))
        built.append(DSV4AttentionBackend(draft, cache_format="dense"))  # draft extend
    return built


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("name", "command", "env", "refused"), COMMANDS, ids=[c[0] for c in COMMANDS]
)
def test_documented_launch_commands_are_served_or_refused_at_build_time(
    pool: PagedRequestPool, monkeypatch: pytest.MonkeyPatch, name, command, env, refused
) -> None:
    from sglang.srt.server_args import prepare_server_args

    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    server_args = prepare_server_args(command.split())
    if refused is None:
        assert build_all(pool, server_args)
    else:
        with pytest.raises(ConfigError) as error:
            build_all(pool, server_args)
        assert refused in str(error.value), str(error.value)


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("capability", "served"), [((10, 0), True), ((12, 0), True), ((9, 0), False), ((8, 9), False)]
)
def test_fp4_indexer_cell_is_served_on_sm100_and_sm120(
    pool: PagedRequestPool, monkeypatch: pytest.MonkeyPatch, capability, served: bool
) -> None:
    """The cookbook's fp4-indexer cell (with and without MTP) on a device of ``capability``
    (the settings' platform probe replaced): built with the fp4 indexer selection on SM100 /
    SM120, refused naming the capability elsewhere, as sglang refuses the flag."""
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setattr(settings, "device_capability", lambda device: capability)
    for command in (FP4_INDEXER, f"{FP4_INDEXER} {MTP_314}"):
        server_args = prepare_server_args(command.split())
        if served:
            built = build_all(pool, server_args)
            assert built[0].config.indexer_selection == "fp4"
            assert isinstance(built[0].state.pools.indexer(1), Fp4IndexKeyCache)
        else:
            want = f"compute capability {capability[0]}.{capability[1]}"
            with pytest.raises(ConfigError, match=want):
                build_all(pool, server_args)


@pytest.mark.sglang
def test_every_refusal_row_is_sglang_s_option_and_off_by_default() -> None:
    """A row names a real ``ServerArgs`` field, whose default is served."""
    from sglang.srt.server_args import ServerArgs

    defaults = ServerArgs(model_path="unused")
    rows = [row for row in REFUSED if row.source == "server_args"]
    assert rows
    for row in rows:
        assert hasattr(defaults, row.option), row.option
        assert not row.matches(getattr(defaults, row.option)), row.option


#: DeepSeek-V4.1-Flash (sglang's ``DeepseekV41Config`` fields, tiny widths) and its launches.
V41_HF = harness.tiny_hf_config(
    tiny_v41(), model_type="deepseek_v41", kv_source_layer_ids=[1, 3],
    index_source_layer_ids=[1, 3, 5], candidate_source_layer_id=3, candidate_topk_blocks=2,
    candidate_block_size=8,
)  # fmt: skip
V41_FLASH = "--trust-remote-code --model-path deepseek-ai/DeepSeek-V4.1-Flash --tp 4"
FULL_PREFILL = "--no-enable-decoder-swa-bounded-replay"
V41_COMMANDS = [
    ("v41-flash-tp4", f"{V41_FLASH} {FULL_PREFILL}", None),
    ("v41-flash-tp4-eager", f"{V41_FLASH} {FULL_PREFILL} --cuda-graph-backend-decode disabled",
     None),
    # The late-layer tail from sglang's decoder tail graphs (its default) or eagerly.
    ("v41-bounded-replay", f"{V41_FLASH} --enable-decoder-swa-bounded-replay", None),
    ("v41-bounded-replay-eager-tail", f"SGLANG_DSV4_DECODER_TAIL_GRAPH_MAX_ROWS=0 {V41_FLASH} "
     "--enable-decoder-swa-bounded-replay --speculative-algorithm DSPARK "
     "--speculative-num-steps 1 --speculative-num-draft-tokens 5", None),
    ("v41-dspark", f"{V41_FLASH} {FULL_PREFILL} --speculative-algorithm DSPARK "
     "--speculative-num-steps 1 --speculative-num-draft-tokens 5", None),
    ("v41-eagle", f"{V41_FLASH} {FULL_PREFILL} {MTP_314}", "--speculative-algorithm (only DSPARK"),
    ("v41-pipeline", f"{V41_FLASH} {FULL_PREFILL} --pp-size 2", "--pipeline-parallel-size"),
    ("v41-dp-attention", f"{V41_FLASH} {FULL_PREFILL} --dp 4 --enable-dp-attention", None),
    ("v41-dp-attention-dspark", f"{V41_FLASH} {FULL_PREFILL} --dp 4 --enable-dp-attention "
     "--speculative-algorithm DSPARK --speculative-num-steps 1 --speculative-num-draft-tokens 5",
     None),
    ("v41-two-batch-overlap", f"{V41_FLASH} {FULL_PREFILL} --enable-two-batch-overlap",
     "--enable-two-batch-overlap"),
    # Prefill CP is served with fp8 caches over sglang's pool (tests/serving/
    # test_v41_context_parallel.py); these builds' dense caches are not its views.
    ("v41-prefill-cp", f"{V41_FLASH} {FULL_PREFILL} --enable-prefill-cp --cp-strategy interleave",
     "--attention-context-parallel-size with DeepSeek-V4.1"),
]  # fmt: skip


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("name", "command", "refused"), V41_COMMANDS, ids=[c[0] for c in V41_COMMANDS]
)
def test_deepseek_v41_launches_are_served_or_refused_at_build_time(
    name: str, command: str, refused: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DeepSeek-V4.1 model is served (decode graphs, DSpark, DP attention; the decoder SWA
    bounded replay with its tail run eagerly); its launches with what is not served are
    refused, naming the flag. ``NAME=value`` words before the command are its environment."""
    from sglang.srt.server_args import prepare_server_args

    words = command.split()
    monkeypatch.delenv("SGLANG_DSV4_DECODER_TAIL_GRAPH_MAX_ROWS", raising=False)
    while "=" in words[0]:
        variable, value = words.pop(0).split("=", 1)
        monkeypatch.setenv(variable, value)
    pool = PagedRequestPool(tiny_v41(), [40], generator=torch.Generator().manual_seed(0))
    server_args = prepare_server_args(words)
    if refused is None:
        assert build_all(pool, server_args, V41_HF)
    else:
        with pytest.raises(ConfigError) as error:
            build_all(pool, server_args, V41_HF)
        assert refused in str(error.value), str(error.value)


#: DeepSeek-V4.1 launches with no bounded-replay flag: sglang's own V4.1 hook resolves it.
V41_DEFAULT_COMMANDS = [
    ("v41-flash-tp4-default", V41_FLASH),
    ("v41-default-dspark", f"{V41_FLASH} --speculative-algorithm DSPARK --speculative-num-steps 1 "
     "--speculative-num-draft-tokens 5"),
    ("v41-default-dp-attention", f"{V41_FLASH} --dp 4 --enable-dp-attention"),
]  # fmt: skip


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("name", "command"), V41_DEFAULT_COMMANDS, ids=[c[0] for c in V41_DEFAULT_COMMANDS]
)
def test_default_deepseek_v41_launches_are_served_with_the_bounded_replay(
    name: str, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sglang's ``validate_deepseek_v41_features`` (``arg_groups/deepseek_v4_hook.py``), run as
    on a CUDA host (its platform check and the model type it reads from the checkpoint given),
    resolves ``--enable-decoder-swa-bounded-replay`` on for these launches; the backends built
    from the resolved arguments serve the late-layer tail, with sglang's default tail graphs
    (``SGLANG_DSV4_DECODER_TAIL_GRAPH_MAX_ROWS`` unset)."""
    from types import SimpleNamespace

    from sglang.srt.arg_groups import deepseek_v4_hook
    from sglang.srt.arg_groups.cuda_graph_hook import parse_cuda_graph_config
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.delenv("SGLANG_DSV4_DECODER_TAIL_GRAPH_MAX_ROWS", raising=False)
    platform = deepseek_v4_hook.get_platform()
    cuda = SimpleNamespace(
        **{name: getattr(platform, name) for name in dir(platform) if name.startswith("is_")}
    )
    cuda.is_cuda, cuda.is_hip = True, False
    monkeypatch.setattr(deepseek_v4_hook, "get_platform", lambda: cuda)
    checkpoint = SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v41"))
    monkeypatch.setattr(deepseek_v4_hook, "model_config_of", lambda _: checkpoint)
    server_args = prepare_server_args(command.split())
    parse_cuda_graph_config(server_args)  # the prefill graph's default backend, which it reads
    deepseek_v4_hook.validate_deepseek_v41_features(server_args)
    resolved = resolving_view(server_args)
    assert resolved.enable_decoder_swa_bounded_replay is True
    pool = PagedRequestPool(tiny_v41(), [40], generator=torch.Generator().manual_seed(0))
    backends = build_all(pool, resolved, V41_HF)
    assert backends[0].bounded_replay


@pytest.mark.parametrize("ratio", [1, 2])
def test_low_compress_ratios_are_refused(ratio: int) -> None:
    """1 and 2 are DeepSeek-V4.1's low ratios (with their own compressors), never window-only
    layers."""
    with pytest.raises(ConfigError, match=rf"compress_ratios contains \[{ratio}\]"):
        DSV4AttentionConfig(compress_ratios=(0, ratio, 4, 128))


@pytest.mark.sglang
def test_platforms_other_than_cuda_leave_dsv4_to_sglang(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On HIP (and NPU, XPU, ...) sglang's own registry picks a per-platform backend: the
    plugin changes nothing and says so in one INFO line."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    assert registration.unserved_platform() is None  # the CPU: served (tests, torch path)
    before = dict(ATTENTION_BACKENDS)
    monkeypatch.setattr(registration, "unserved_platform", lambda: "HIP (ROCm)")
    with caplog.at_level(logging.INFO, logger=registration.logger.name):
        registration.register()
    assert dict(ATTENTION_BACKENDS) == before
    lines = [r.getMessage() for r in caplog.records if r.name == registration.logger.name]
    assert lines == [
        "dsv4 attention backend: left to sglang on HIP (ROCm) (dsv4_backend serves CUDA; "
        "sglang's registry picks its own backend for this platform)."
    ]


@pytest.mark.sglang
def test_backends_declare_what_sglang_s_scheduler_reads(pool: PagedRequestPool) -> None:
    """The overlap scheduler publishes host sequence lengths only to backends that ask
    (``decide_needs_cpu_seq_lens``: ``getattr(backend, "needs_cpu_seq_lens", True)``); the
    eager planner sizes its plans from them, so every backend says so itself."""
    backends = build_all(pool, harness.mock_runner(pool, HF).server_args)
    assert len(backends) == 3
    assert all("needs_cpu_seq_lens" in vars(type(b)) and b.needs_cpu_seq_lens for b in backends)


@pytest.mark.sglang
def test_get_swa_out_cache_loc_follows_sglang_s_contract(pool: PagedRequestPool) -> None:
    """int32 window slots; IDLE translates its padding ``out_cache_loc`` (slot 0) through
    ``full_to_swa`` and never reads the plan (stale there)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    runner = harness.mock_runner(pool, HF)
    backend = DSV4AttentionBackend(runner, cache_format="dense")
    step = harness.BatchBuilder(pool).decode([0], [30])
    backend.init_forward_metadata(step.batch)
    loc = backend.get_swa_out_cache_loc(step.batch)
    assert loc.dtype == torch.int32
    assert loc.tolist() == pool.full_to_swa[step.batch.out_cache_loc].tolist()
    empty = torch.zeros(0, dtype=torch.int64)
    idle = ForwardBatch(
        forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=empty, req_pool_indices=empty,
        seq_lens=empty, out_cache_loc=torch.zeros(3, dtype=torch.int64), seq_lens_sum=0,
    )  # fmt: skip
    idle_loc = backend.get_swa_out_cache_loc(idle)  # the decode's plan is still current
    assert idle_loc.dtype == torch.int32
    assert idle_loc.tolist() == [int(pool.full_to_swa[0])] * 3
