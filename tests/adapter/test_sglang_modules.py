"""The adapter driven by sglang 0.5.23's own DeepSeek-V4 modules, built on the CPU.

sglang's ``Compressor`` (ratio 4 and 128) and ``C4Indexer`` get random weights through their
own weight loaders (the ratio-4 ``ape`` loader applies sglang's "ape hotfix" layout) and are
fed to ``DSV4AttentionBackend`` over a chunked prefill and decodes. Every compressed entry,
indexer key and top-k selection is compared with an independent computation written here from
sglang's conventions: ``wkv_gate`` gives ``[kv | score]``; a ratio-4 entry pools the previous
block's first halves and the current block's second halves; RMSNorm with the module's
``variance_epsilon``; RoPE as interleaved pairs of the trailing dims from the module's
``freqs_cis`` table; indexer weights ``weights_proj(x) * weight_scale``. Negative controls
(kv/score swapped, overlap halves swapped, neox-style RoPE) must fail the same comparison.

sglang's ``MQALayer`` itself cannot be built on the CPU (its rotary embedding imports vllm's
CPU kernel), so the attention layer stays covered by the simulated host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY, get_rope_config

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
from dsv4_backend.testing import harness
from dsv4_backend.testing.simulation import PagedRequestPool

pytestmark = pytest.mark.sglang

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
HIDDEN, Q_LORA = 64, 32
C4_LAYER, C128_LAYER = 1, 2
#: Non-default values: a reader falling back to its defaults cannot pass.
EPS = 1e-3
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
MAX_LENS = [140, 270]
#: (prefix, extend) chunks per request, then decodes: crosses c4 / c128 boundaries.
CHUNKS = [([0, 0], [61, 131]), ([61, 131], [69, 123])]
DECODES = 4


@contextlib.contextmanager
def sglang_process_config() -> Iterator[None]:
    """sglang's process-wide runtime context (what a server publishes before building)."""
    reset_context()
    publish(
        ServerArgs(model_path="dummy", device="cpu"),
        role="test",
        ranks=SpawnRanks(world_rank=0, dp_rank=None),
    )
    try:
        yield
    finally:
        reset_context()


def sglang_config() -> Any:
    values = dict(
        harness.tiny_hf_config(CONFIG),
        model_type="deepseek_v4",
        hidden_size=HIDDEN,
        q_lora_rank=Q_LORA,
        rms_norm_eps=EPS,
        max_position_embeddings=4096,
        rope_scaling=dict(YARN),
    )
    return _CONFIG_REGISTRY["deepseek_v4"](**values)


def compressed_freqs_cis(hf: Any) -> torch.Tensor:
    """The compressed layers' ``freqs_cis``, built as sglang's ``MqaAttentionBase`` does."""
    _, scaling = get_rope_config(hf)
    return precompute_freqs_cis(
        dim=hf.qk_rope_head_dim,
        seqlen=hf.max_position_embeddings,
        original_seq_len=scaling["original_max_position_embeddings"],
        base=hf.compress_rope_theta,
        factor=scaling.get("factor", 1.0),
        beta_fast=scaling.get("beta_fast", 32),
        beta_slow=scaling.get("beta_slow", 1),
    )


def load_random(module: torch.nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors loaded through each parameter's sglang weight loader."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    loaded = {}
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        else:
            value = torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5
        value = value.to(param.dtype)
        getattr(param, "weight_loader", default_weight_loader)(param, value)
        loaded[name] = value.clone()
    return loaded


@dataclass
class Modules:
    hf: Any
    freqs_cis: torch.Tensor
    core: dict[int, Any]  # layer -> sglang Compressor
    indexer: Any  # sglang C4Indexer of C4_LAYER
    checkpoint: dict[str, dict[str, torch.Tensor]]  # what was loaded, per module


@pytest.fixture(scope="module")
def modules() -> Iterator[Modules]:
    from sglang.srt.layers.attention.dsv4.compressor import Compressor
    from sglang.srt.layers.attention.dsv4.indexer import C4Indexer

    gen = torch.Generator().manual_seed(0)
    with sglang_process_config():
        hf = sglang_config()
        freqs = compressed_freqs_cis(hf)
        core = {
            layer: Compressor(
                hf, layer_id=layer, is_in_indexer=False, freqs_cis=freqs,
                compress_ratio=CONFIG.compress_ratios[layer], head_dim=CONFIG.head_dim,
            )
            for layer in (C4_LAYER, C128_LAYER)
        }  # fmt: skip
        indexer = C4Indexer(hf, layer_id=C4_LAYER, freqs_cis=freqs)
        checkpoint = {f"core{k}": load_random(m, gen) for k, m in core.items()}
        checkpoint["indexer"] = load_random(indexer, gen)
        yield Modules(hf, freqs, core, indexer, checkpoint)


# --------------------------------------------------------------- independent computation
@dataclass(frozen=True)
class Conventions:
    """sglang's conventions; each negative control flips one."""

    swap_kv_score: bool = False
    swap_overlap: bool = False
    neox: bool = False


def rope(x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor, neox: bool):
    """RoPE of the trailing ``2 * freqs_cis.shape[-1]`` dims of ``x`` ``[n, ..., D]``."""
    table = freqs_cis[positions]  # [n, R/2] complex64
    table = table.reshape(table.shape[0], *([1] * (x.dim() - 2)), table.shape[-1])
    r = 2 * freqs_cis.shape[-1]
    head, tail = x[..., :-r], x[..., -r:].float()
    if neox:
        first, second = tail[..., : r // 2], tail[..., r // 2 :]
        rotated = torch.view_as_real(torch.complex(first, second) * table)
        tail = torch.cat([rotated[..., 0], rotated[..., 1]], dim=-1)
    else:
        pairs = torch.view_as_complex(tail.reshape(*tail.shape[:-1], r // 2, 2).contiguous())
        tail = torch.view_as_real(pairs * table).flatten(-2)
    return torch.cat([head.float(), tail], dim=-1)


def entries(
    compressor: Any, ape: torch.Tensor, norm: torch.Tensor, freqs: torch.Tensor,
    x: torch.Tensor, fb: Any, conv: Conventions,
) -> torch.Tensor:  # fmt: skip
    """Every complete entry of one request whose tokens 0 ... S-1 have hidden states ``x``."""
    ratio, d = compressor.ratio, compressor.head_dim
    c = 2 if ratio == 4 else 1
    kv_score = compressor.compute_kv_score(x, fb).float()
    kv, score = kv_score[:, : c * d], kv_score[:, c * d :]
    if conv.swap_kv_score:
        kv, score = score, kv
    score = score + ape.float()[torch.arange(x.shape[0]) % ratio]
    first, second = (slice(d, 2 * d), slice(0, d)) if conv.swap_overlap else (
        slice(0, d), slice(d, 2 * d)
    )  # fmt: skip
    out = []
    for w in range(x.shape[0] // ratio):
        cur = slice(ratio * w, ratio * w + ratio)
        if ratio == 128:
            slot_kv, slot_score = kv[cur], score[cur]
        else:
            prev = slice(ratio * (w - 1), ratio * w)
            prev_kv = kv[prev, first] if w else kv.new_zeros(ratio, d)
            prev_score = score[prev, first] if w else score.new_full((ratio, d), -torch.inf)
            slot_kv = torch.cat([prev_kv, kv[cur, second]])
            slot_score = torch.cat([prev_score, score[cur, second]])
        pooled = (torch.softmax(slot_score, dim=0) * slot_kv).sum(0)
        normed = pooled * torch.rsqrt(pooled.pow(2).mean() + EPS) * norm.float()
        out.append(normed)
    stacked = torch.stack(out)
    return rope(stacked, freqs, torch.arange(len(out)) * ratio, conv.neox)


def index_scores(
    indexer: Any, keys: torch.Tensor, x: torch.Tensor, q_lora: torch.Tensor,
    positions: torch.Tensor, freqs: torch.Tensor, conv: Conventions,
) -> torch.Tensor:  # fmt: skip
    """``[T, n]`` ``sum_h w[t, h] * relu(q[t, h] . k[s])`` (visibility not applied)."""
    q = indexer.wq_b(q_lora)[0].view(-1, indexer.n_heads, indexer.head_dim)
    q = rope(q, freqs, positions, conv.neox)
    weights = indexer.weights_proj(x)[0].float() * indexer.weight_scale
    return torch.einsum("th,ths->ts", weights, torch.einsum("thd,sd->ths", q, keys).relu())


# ----------------------------------------------------------------------------- the run
@dataclass
class Run:
    pool: PagedRequestPool
    backend: DSV4AttentionBackend
    x: list[torch.Tensor]  # per request [max_len, HIDDEN] bf16
    q_lora: list[torch.Tensor]
    selections: list[tuple[list[tuple[int, int]], torch.Tensor]]  # (rows, c4 slots)
    fb: Any


@pytest.fixture(scope="module")
def run(modules: Modules) -> Run:
    gen = torch.Generator().manual_seed(1)
    pool = PagedRequestPool(CONFIG, MAX_LENS, generator=gen)
    runner = harness.mock_runner(pool, modules.hf)
    x = [torch.randn(n, HIDDEN, generator=gen).bfloat16() for n in MAX_LENS]
    q_lora = [torch.randn(n, Q_LORA, generator=gen).bfloat16() for n in MAX_LENS]
    builder = harness.BatchBuilder(pool)
    steps = [builder.extend([0, 1], prefix, extend) for prefix, extend in CHUNKS]
    seq = [p + e for p, e in zip(*CHUNKS[-1], strict=True)]
    for i in range(DECODES):
        steps.append(builder.decode([0, 1], [s + i + 1 for s in seq]))
    with force_path("torch"), sglang_process_config():
        backend = DSV4AttentionBackend(runner, cache_format="dense")
        selections = []
        for step in steps:
            fb = step.batch
            rows_x = torch.stack([x[r][p] for r, p in step.rows])
            rows_q = torch.stack([q_lora[r][p] for r, p in step.rows])
            backend.init_forward_metadata(fb)
            backend.forward_c4_indexer(
                x=rows_x, q_lora=rows_q, forward_batch=fb, c4_indexer=modules.indexer
            )
            selections.append((step.rows, backend.forward_metadata.c4.page_indices.clone()))
            for layer, compressor in modules.core.items():
                backend.forward_core_compressor(rows_x, fb, layer, compressor)
    return Run(pool, backend, x, q_lora, selections, fb)


def slots(pool: PagedRequestPool, request: int, ratio: int, n: int) -> torch.Tensor:
    """Compressed-cache slots of entries ``0 ... n-1`` of ``request``."""
    per_page = CONFIG.page_size // ratio
    full = pool.req_to_token[pool.pool_index(request), torch.arange(n) * ratio].long()
    return full // CONFIG.page_size * per_page + torch.arange(n) % per_page


def final_len(request: int) -> int:
    return CHUNKS[-1][0][request] + CHUNKS[-1][1][request] + DECODES


def expected_entries(modules: Modules, run: Run, which: str, request: int, conv: Conventions):
    n = final_len(request)
    compressor = modules.indexer.compressor if which == "indexer" else modules.core[int(which)]
    ckpt = modules.checkpoint["indexer" if which == "indexer" else f"core{which}"]
    prefix = "compressor." if which == "indexer" else ""
    with sglang_process_config():
        return entries(
            compressor, ckpt[prefix + "ape"], ckpt[prefix + "norm.weight"], modules.freqs_cis,
            run.x[request][:n], run.fb, conv,
        )  # fmt: skip


def stored_entries(run: Run, which: str, request: int) -> torch.Tensor:
    pools = run.backend.state.pools
    ratio = 4 if which == "indexer" else CONFIG.compress_ratios[int(which)]
    cache = pools.indexer(C4_LAYER) if which == "indexer" else pools.compressed(int(which))
    return cache.gather(slots(run.pool, request, ratio, final_len(request) // ratio))


CACHES = ["indexer", str(C4_LAYER), str(C128_LAYER)]
CONTROLS = {
    "kv/score swapped": Conventions(swap_kv_score=True),
    "overlap halves swapped": Conventions(swap_overlap=True),
    "neox rope": Conventions(neox=True),
}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("which", CACHES)
@pytest.mark.parametrize("request_id", [0, 1])
def test_entries_equal_sglangs_conventions(modules, run, which: str, request_id: int) -> None:
    want = expected_entries(modules, run, which, request_id, Conventions())
    assert want.shape[0] >= 1
    assert relative_error(stored_entries(run, which, request_id), want) < 1e-5


@pytest.mark.parametrize(
    ("which", "control"),
    [
        (w, c)
        for w in CACHES
        for c in CONTROLS
        if (w, c) != (str(C128_LAYER), "overlap halves swapped")
    ],
)
def test_negative_controls_fail_the_entry_comparison(modules, run, which: str, control: str):
    want = expected_entries(modules, run, which, 1, CONTROLS[control])
    assert relative_error(stored_entries(run, which, 1), want) > 1e-2


@dataclass
class Selection:
    """A query row's expected top-k (c4 slots) and the score of every visible slot."""

    slots: set[int]
    scores: dict[int, float]
    kth: float  # the smallest selected score


def _expected_selection(modules: Modules, run: Run, conv: Conventions) -> list[Selection]:
    keys = {r: expected_entries(modules, run, "indexer", r, conv) for r in (0, 1)}
    expected = []
    for rows, _ in run.selections:
        for r, p in rows:
            with sglang_process_config():
                scores = index_scores(
                    modules.indexer, keys[r], run.x[r][p : p + 1], run.q_lora[r][p : p + 1],
                    torch.tensor([p]), modules.freqs_cis, conv,
                )[0, : (p + 1) // 4]  # fmt: skip
            ids = scores.topk(min(scores.numel(), CONFIG.index_topk)).indices
            visible = slots(run.pool, r, 4, scores.numel()).tolist()
            expected.append(Selection(
                slots={visible[i] for i in ids.tolist()},
                scores={s: float(v) for s, v in zip(visible, scores.tolist(), strict=True)},
                kth=float(scores[ids].min()) if ids.numel() else 0.0,
            ))  # fmt: skip
    return expected


def _got_selection(run: Run) -> list[set[int]]:
    return [{int(s) for s in row if s >= 0} for _, sel in run.selections for row in sel]


def _disagreements(got: list[set[int]], want: list[Selection], tie: float) -> list[int]:
    """Rows whose selections differ by more than near-ties at the k-th score (relative
    ``tie``: summation order alone can swap entries whose scores agree to rounding)."""
    bad = []
    for row, (g, w) in enumerate(zip(got, want, strict=True)):
        scale = max((abs(v) for v in w.scores.values()), default=1.0)
        if any(abs(w.scores.get(s, float("inf")) - w.kth) > tie * scale for s in g ^ w.slots):
            bad.append(row)
    return bad


def test_top_k_equals_sglangs_conventions(modules, run) -> None:
    got, want = _got_selection(run), _expected_selection(modules, run, Conventions())
    assert len(got) == len(want) and any(len(w.slots) == CONFIG.index_topk for w in want)
    assert _disagreements(got, want, tie=1e-5) == []
    # Rows with fewer visible entries than index_topk keep them all.
    assert all(g == w.slots for g, w in zip(got, want, strict=True) if len(w.slots) < 16)


def test_neox_rope_changes_the_top_k(modules, run) -> None:
    want = _expected_selection(modules, run, Conventions(neox=True))
    assert len(_disagreements(_got_selection(run), want, tie=1e-5)) > 10
