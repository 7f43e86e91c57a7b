"""A kernel path judged step by step against the torch path on the same inputs, so that a near
tie in the indexer's ranking is not read as a kernel error; the start-up self-check
(``check.py``) and the GPU check's verdict (``tools/gpu_verdict.py``) run it.

docs/gpu-check.md derives the bounds (``bounds.py``). A batch is planned on the path under test
and on the torch path (the plans must be equal), then each layer runs as the backend runs it
(``compute/layer.py``): window store, indexer compressor, indexer, compressor, attention.
Before each step a twin of the state is loaded with the state under test; the step runs on
both, the path under test on the state and the torch path on the twin, and the results are
compared (every later step starts from what the path under test wrote):

=================  ===========================================  ===============================
step               compared                                     bound
=================  ===========================================  ===============================
plan               every metadata tensor                        equal
window-store       the layer's window cache bytes               equal
indexer-keys,      the entries each row completed (fp32)        ``COMPRESSOR_ATOL``
compressor         the rings                                    equal
                   the cache at the written slots (read back)   one fp8 step (fp8 caches)
indexer-scores     every candidate's score vs fp32 scores       ``bounds.score_bound``
indexer-selection  the selected set                             tie-aware (``bounds.py``)
attention          the output; the twin attends to the          ``attention_tolerance`` plus the
                   selection under test                         bf16 output's rounding
stores             ``store_rows`` of random rows, every cache   equal bytes
                   kind and format
=================  ===========================================  ===============================

The model is any :class:`JudgedModel`: :class:`SyntheticModel` (random inputs, what the
self-check runs) or the simulation's ``RandomModel`` (inputs of a reference model, which the
GPU verdict also compares with the full causal pass).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dsv4_backend import ops
from dsv4_backend.cache.fp4_format import C4_ROUNDING, Fp4IndexKeyCache
from dsv4_backend.cache.indexer_cache import IndexerKeyCache
from dsv4_backend.cache.state import AttentionState
from dsv4_backend.cache.token_cache import SlotCache, TokenCache
from dsv4_backend.compute.layer import (
    attend,
    compress_and_store,
    select_c4_entries,
    store_window_keys,
)
from dsv4_backend.config import WINDOW_PAGE_TOKENS, DSV4AttentionConfig, compress_overlap
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention.common import attention_tolerance, dot_operand_dtype
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.kernels.indexer.common import C4_ENTRIES_PER_PAGE, entry_slots
from dsv4_backend.kernels.indexer.table import index_scores, selection_queries
from dsv4_backend.kernels.variants import OpTable, force_variant
from dsv4_backend.planning import AttentionMetadata, BatchView, plan
from dsv4_backend.self_check.bounds import (
    BF16_OUTPUT_RTOL,
    COMPRESSOR_ATOL,
    FP4_STEP,
    FP8_STEP,
    Finding,
    check_selection,
    differing_bytes,
    excess,
    score_bound,
)
from dsv4_backend.self_check.requests import PagedRequestPool


class JudgedModel(Protocol):
    """What :class:`StepwiseJudge` runs: layers of ``config`` over the requests of ``pool``."""

    config: DSV4AttentionConfig
    pool: PagedRequestPool
    device: torch.device
    state: AttentionState
    runtime_params: list[ops.LayerParams]

    def rows(self, metadata: AttentionMetadata, batch: BatchView) -> list[tuple[int, int]]:
        """``(request, position)`` of every row of ``metadata``, a plan of ``batch``."""
        ...

    def layers_served(self, metadata: AttentionMetadata) -> list[int]:
        """The layers a plan serves (all, or the window-only ones)."""
        ...

    def layer_inputs(
        self, layer: int, rows: Sequence[tuple[int, int]], rejected: Mapping[int, int] | None
    ) -> ops.LayerInputs | None:
        """``layer``'s inputs of ``rows`` (None for no row)."""
        ...


@contextlib.contextmanager
def _pinned(path: str, pins: Mapping[OpTable, str]) -> Iterator[None]:
    """``path`` forced and every ``{table: variant}`` of ``pins`` pinned inside the block."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(force_path(path))
        for table, name in pins.items():
            stack.enter_context(force_variant(table, name))
        yield


def served_layers(config: DSV4AttentionConfig, metadata: AttentionMetadata) -> list[int]:
    """Layers a plan can serve: all, or the window-only ones for a window-only plan."""
    ratios = config.compress_ratios
    return [i for i, r in enumerate(ratios) if r == 0 or metadata.compressed(r) is not None]


def plan_rows(metadata: AttentionMetadata, batch: BatchView) -> list[tuple[int, int]]:
    """``(request, position)`` of every row of ``metadata``, a plan of ``batch`` over a
    :class:`PagedRequestPool` (request ``i`` in pool row ``i + 1``)."""
    requests = [int(i) - 1 for i in batch.req_pool_indices.tolist()]
    return [
        (requests[b], p)
        for b, p in zip(
            metadata.row_batch_ids.tolist(), metadata.positions_causal.tolist(), strict=True
        )
    ]


def pool_state(
    config: DSV4AttentionConfig, pool: PagedRequestPool, fmt: str, device: torch.device
) -> AttentionState:
    """An ``AttentionState`` of ``fmt`` caches for every slot and request row of ``pool``."""
    return AttentionState.allocate(
        config,
        num_full_slots=pool.num_full_slots,
        num_swa_slots=pool.num_full_slots,
        num_request_slots=pool.num_requests + 1,
        fmt=fmt,  # type: ignore[arg-type]
        device=device,
    )


class SyntheticModel:
    """Random inputs and parameters of ``config``'s layers, drawn anew for every call at the
    scales of a real layer (unit-RMS queries and keys, sinks near 2, indexer queries and keys
    sharing a direction so that most scores are positive and the top-k boundary has no exact
    tie); nothing is compared with a reference, only a path with its twin."""

    def __init__(
        self,
        config: DSV4AttentionConfig,
        pool: PagedRequestPool,
        *,
        generator: torch.Generator,
        fmt: str,
        device: torch.device | str,
    ) -> None:
        self.config, self.pool, self.generator = config, pool, generator
        self.device = torch.device(device)
        self.state = pool_state(config, pool, fmt, self.device)
        di = config.index_head_dim
        self.shared = torch.zeros(di)
        self.shared[-min(16, di) :] = self._randn(min(16, di)).sign()
        self.runtime_params = [self._params(ratio) for ratio in config.compress_ratios]

    def _randn(self, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator) * std + mean

    def _params(self, ratio: int) -> ops.LayerParams:
        d, di = self.config.head_dim, self.config.index_head_dim
        c = compress_overlap(ratio) if ratio else 0
        values: dict[str, torch.Tensor] = {"sink": self._randn(self.config.num_heads, mean=2.0)}
        if ratio:
            values.update(
                ape=self._randn(ratio, c * d, std=0.5),
                norm_weight=self._randn(d, std=0.1, mean=1.0),
            )
        if ratio == 4:
            values.update(
                index_ape=self._randn(4, 2 * di, std=0.5),
                index_norm_weight=self._randn(di, std=0.1, mean=1.0),
            )
        return ops.LayerParams(**{k: v.to(self.device) for k, v in values.items()})

    rows = staticmethod(plan_rows)

    def layers_served(self, metadata: AttentionMetadata) -> list[int]:
        return served_layers(self.config, metadata)

    def layer_inputs(
        self, layer: int, rows: Sequence[tuple[int, int]], rejected: Mapping[int, int] | None
    ) -> ops.LayerInputs | None:
        if not rows:
            return None
        t, config = len(rows), self.config
        ratio, d = config.compress_ratios[layer], config.head_dim
        hi, di = config.index_n_heads, config.index_head_dim
        values = {"q": self._randn(t, config.num_heads, d), "kv": self._randn(t, d)}
        if ratio:
            c = compress_overlap(ratio)
            values.update(kv_proj=self._randn(t, c * d), score_proj=self._randn(t, c * d))
        if ratio == 4:
            values.update(
                index_kv_proj=self._randn(t, 2 * di) + self.shared.repeat(2),
                index_score_proj=self._randn(t, 2 * di),
                index_q=(self._randn(t, hi, di) + 0.5 * self.shared) * di**-0.5,
                index_weights=(0.1 + torch.rand(t, hi, generator=self.generator)) * hi**-0.5,
            )
        return ops.LayerInputs(**{k: v.to(self.device) for k, v in values.items()})


class StepwiseJudge:
    """Runs a :class:`JudgedModel`'s batches on ``path`` and judges every step (module
    docstring) into :attr:`findings`.

    ``pins``: variants the path under test runs (``{table: name}``, ``variants.force_variant``);
    ``twin_pins``: the twin's (default: none, the torch path's choice). A variant named in the
    environment applies to both sides unless pinned (the self-check pins every op).

    ``query_dtype`` casts the attention queries (bf16, as a deployment runs them); ``None``
    keeps the model's fp32 queries. ``operand_dtype``: the indexer dots' operand dtype the
    score bound assumes (default ``dot_operand_dtype`` of the model's device).
    """

    def __init__(
        self,
        model: JudgedModel,
        path: str,
        *,
        query_dtype: torch.dtype | None = None,
        operand_dtype: torch.dtype | None = None,
        pins: Mapping[OpTable, str] | None = None,
        twin_pins: Mapping[OpTable, str] | None = None,
    ) -> None:
        self.model = model
        self.path = path
        self.pins = dict(pins or {})
        self.twin_pins = dict(twin_pins or {})
        self.query_dtype = query_dtype
        self.operand_dtype = operand_dtype or dot_operand_dtype(model.device)
        self.twin = copy.deepcopy(model.state)
        self.findings: list[Finding] = []

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.findings)

    def _add(self, mode: str, layer: int, step: str, worst: float, detail: str = "") -> None:
        self.findings.append(Finding(mode, layer, step, worst, worst <= 1.0, detail))

    def _load_twin(self) -> None:
        twin = self.twin.named_tensors()
        for name, tensor in self.model.state.named_tensors().items():
            twin[name].copy_(tensor)

    def _both(self, step: Callable[..., Any], *args: object, **kwargs: object) -> tuple[Any, Any]:
        """Load the twin, then ``step(state, *args)`` on the path under test and ``step(twin,
        *args)`` on the torch path, a :class:`_Pair` in ``args`` giving each its own value."""
        self._load_twin()
        mine = [a.mine if isinstance(a, _Pair) else a for a in args]
        theirs = [a.theirs if isinstance(a, _Pair) else a for a in args]
        with self.under_test():
            got = step(self.model.state, *mine, **kwargs)
        with self.as_twin():
            want = step(self.twin, *theirs, **kwargs)
        return got, want

    @contextlib.contextmanager
    def under_test(self) -> Iterator[None]:
        """The path under test with its pinned variants."""
        with _pinned(self.path, self.pins):
            yield

    @contextlib.contextmanager
    def as_twin(self) -> Iterator[None]:
        """The torch path with the twin's pinned variants."""
        with _pinned(dispatch.TORCH, self.twin_pins):
            yield

    def forward(
        self, batch: BatchView, mode: str, *, rejected: Mapping[int, int] | None = None
    ) -> None:
        """Plan and run every layer the plan serves; ``rejected`` as in ``RandomModel``."""
        model = self.model
        with self.under_test():
            metadata = plan(model.config, batch)
        with self.as_twin():
            twin_metadata = plan(model.config, batch)
        theirs = twin_metadata.named_tensors()
        unequal = [n for n, t in metadata.named_tensors().items() if not torch.equal(t, theirs[n])]
        self._add(mode, -1, "plan", math.inf if unequal else 0.0, ", ".join(unequal))
        rows = model.rows(metadata, batch)
        meta = _Pair(metadata, twin_metadata)
        for layer in model.layers_served(metadata):
            inputs = model.layer_inputs(layer, rows, rejected)
            if inputs is None:
                continue
            out = self._layer(
                mode, layer, meta, batch.req_pool_indices, inputs, model.runtime_params[layer]
            )
            self.after_layer(mode, layer, rows, rejected or {}, out)

    def _layer(
        self,
        mode: str,
        layer: int,
        meta: _Pair,
        req_pool_indices: torch.Tensor,
        inputs: ops.LayerInputs,
        params: ops.LayerParams,
    ) -> torch.Tensor:
        """Judge every step of one layer; returns the attention output under test."""
        state, twin = self.model.state, self.twin
        ratio = state.config.compress_ratios[layer]
        self._both(store_window_keys, layer, meta, inputs.kv)
        got = state.pools.window(layer).storage
        wrong = differing_bytes(got, twin.pools.window(layer).storage)
        self._add(mode, layer, "window-store", math.inf if wrong else 0.0, f"{wrong} bytes differ")
        if ratio == 4:
            assert inputs.index_kv_proj is not None and inputs.index_score_proj is not None
            assert params.index_ape is not None and params.index_norm_weight is not None
            projections = (inputs.index_kv_proj, inputs.index_score_proj)
            weights = (params.index_ape, params.index_norm_weight)
            self._compressor(mode, layer, meta, req_pool_indices, projections, weights, True)
            self._indexer(mode, layer, meta, inputs)
        if ratio:
            assert inputs.kv_proj is not None and inputs.score_proj is not None
            assert params.ape is not None and params.norm_weight is not None
            projections = (inputs.kv_proj, inputs.score_proj)
            weights = (params.ape, params.norm_weight)
            self._compressor(mode, layer, meta, req_pool_indices, projections, weights, False)
        q = inputs.q if self.query_dtype is None else inputs.q.to(self.query_dtype)
        got, want = self._both(attend, layer, meta, q, params.sink)
        bound = attention_tolerance(q.device)
        if got.dtype == torch.bfloat16:
            bound = bound + BF16_OUTPUT_RTOL * want.float().abs()
        error = (got.float() - want.float()).abs()
        self._add(mode, layer, "attention", excess(error, bound), f"max |diff| {_max(error):.3g}")
        return got

    def _compressor(
        self,
        mode: str,
        layer: int,
        meta: _Pair,
        req_pool_indices: torch.Tensor,
        projections: tuple[torch.Tensor, torch.Tensor],
        weights: tuple[torch.Tensor, torch.Tensor],
        indexer: bool,
    ) -> None:
        state, twin = self.model.state, self.twin
        step = "indexer-keys" if indexer else "compressor"
        got, want = self._both(
            compress_and_store,
            layer,
            meta,
            req_pool_indices,
            *projections,
            *weights,
            indexer=indexer,
        )
        error = (got - want).abs()
        self._add(mode, layer, f"{step} entries", excess(error, COMPRESSOR_ATOL))
        rings = state.indexer_states if indexer else state.compressor_states
        twin_rings = twin.indexer_states if indexer else twin.compressor_states
        same = torch.equal(rings[layer].ring, twin_rings[layer].ring)
        self._add(mode, layer, f"{step} rings", 0.0 if same else math.inf)
        cache: SlotCache = state.pools.indexer(layer) if indexer else state.pools.compressed(layer)
        twin_cache = twin.pools.indexer(layer) if indexer else twin.pools.compressed(layer)
        comp = meta.mine.compressed(4 if indexer else state.config.compress_ratios[layer])
        assert comp is not None
        mine, theirs = cache.gather(comp.out_loc), twin_cache.gather(comp.out_loc)
        bound = torch.full_like(theirs, COMPRESSOR_ATOL)
        if cache.fmt == "fp8":
            rounding = FP4_STEP if isinstance(cache, Fp4IndexKeyCache) else FP8_STEP
            bound = bound + rounding * theirs.abs().amax(1, keepdim=True)
        error = (mine - theirs).abs()
        self._add(mode, layer, f"{step} cache", excess(error, bound))

    def _indexer(self, mode: str, layer: int, meta: _Pair, inputs: ops.LayerInputs) -> None:
        state = self.model.state
        assert inputs.index_q is not None and inputs.index_weights is not None
        self._both(select_c4_entries, layer, meta, inputs.index_q, inputs.index_weights)
        comp = meta.mine.compressed(4)
        assert comp is not None
        q_idx = selection_queries(state.config.indexer_selection, inputs.index_q)
        keys = state.pools.indexer(layer)
        page_table = meta.mine.page_table
        width = page_table.shape[1] * C4_ENTRIES_PER_PAGE
        args = (q_idx, inputs.index_weights, keys, page_table, comp.topk_lengths_raw, width)
        with self.as_twin():
            exact = index_scores(*args)
        with self.under_test():
            scored = index_scores(*args)
        valid = torch.isfinite(exact)
        columns = torch.arange(width, device=exact.device).expand_as(exact)
        candidates = entry_slots(page_table, torch.where(valid, columns, -1))
        bound = score_bound(
            q_idx, inputs.index_weights, keys.gather(candidates), self.operand_dtype
        )
        error = torch.where(valid, (scored - exact).abs(), 0)
        padding = int((~valid & (scored != -math.inf)).sum())
        worst = math.inf if padding else excess(error, bound)
        self._add(mode, layer, "indexer-scores", worst, f"{padding} padding columns not -inf")
        worst, detail = check_selection(
            comp.page_indices, candidates, exact, bound, state.config.index_topk
        )
        self._add(mode, layer, "indexer-selection", worst, detail)
        # The twin attends to the selection under test: a tie swap is not an attention error.
        twin_comp = meta.theirs.compressed(4)
        assert twin_comp is not None
        twin_comp.page_indices.copy_(comp.page_indices)

    def after_layer(
        self,
        mode: str,
        layer: int,
        rows: list[tuple[int, int]],
        rejected: Mapping[int, int],
        out: torch.Tensor,
    ) -> None:
        """Called with each layer's output under test ``out`` (``tools/gpu_verdict.py`` judges
        it against the full causal pass); nothing here."""


@dataclass(frozen=True)
class _Pair:
    """A value for the path under test and its twin (``StepwiseJudge._both``)."""

    mine: AttentionMetadata
    theirs: AttentionMetadata


def _max(x: torch.Tensor) -> float:
    return float(x.max()) if x.numel() else 0.0


@dataclass(frozen=True)
class Schedule:
    """Requests of up to ``max_lens`` tokens: an extend of ``prompt`` tokens each, a chunked
    extend of ``chunk`` more, a verify of ``drafts`` draft tokens (none for 0), ``steps``
    draft steps and the draft model's extend over them (none for 0), and a decode."""

    max_lens: tuple[int, ...]
    prompt: tuple[int, ...]
    chunk: tuple[int, ...]
    drafts: int
    steps: int

    def batches(self, pool: PagedRequestPool) -> Iterator[tuple[str, BatchView]]:
        requests = list(range(len(self.max_lens)))
        zeros = [0] * len(requests)
        lens = list(self.prompt)
        yield "extend", pool.extend(requests, zeros, lens)
        yield "chunked-extend", pool.extend(requests, lens, list(self.chunk))
        lens = [n + c for n, c in zip(lens, self.chunk, strict=True)]
        if self.drafts:
            yield "verify", pool.verify(requests, lens, self.drafts)
            lens = [n + self.drafts for n in lens]
        for step in range(self.steps):
            yield f"draft-step-{step}", pool.draft_step(requests, lens, self.steps, step)
        if self.steps:
            steps = [self.steps] * len(requests)
            yield "draft-extend", pool.extend(requests, lens, steps, draft_model=True)
        yield "decode", pool.decode(requests, [n + self.steps + 1 for n in lens])


#: Three requests over page, window-block and c4 / c128 boundaries (the GPU check's).
FULL_SCHEDULE = Schedule((140, 270, 40), (126, 253, 5), (1, 4, 20), drafts=4, steps=3)
#: Two requests, every mode, c4 rows with more candidates than the tiny top-k (the CPU tests').
SHORT_SCHEDULE = Schedule((76, 16), (60, 5), (6, 2), drafts=2, steps=2)
#: DeepSeek-V4-Flash's attention widths (64 heads of 512, indexer 64 x 128, top-512), one
#: layer of each ratio and a second c4 layer.
FLASH_CONFIG = DSV4AttentionConfig(
    compress_ratios=(0, 4, 128, 4),
    num_heads=64,
    head_dim=512,
    rope_dim=64,
    index_topk=512,
    index_n_heads=64,
    index_head_dim=128,
    speculative=True,
)
#: A request whose c4 rows see up to 530 candidates of which 512 are kept, and a short one.
FLASH_SCHEDULE = Schedule((2200, 300), (2100, 250), (20, 5), drafts=4, steps=3)


def judge_stores(
    device: torch.device | str,
    path: str,
    *,
    seed: int = 0,
    pins: Mapping[OpTable, str] | None = None,
    twin_pins: Mapping[OpTable, str] | None = None,
) -> list[Finding]:
    """``store_rows`` on ``path`` against the torch path: random fp32 and bf16 rows at random
    slots (some -1) of every cache kind at DeepSeek-V4-Flash widths (window, c4, c128 token
    caches, dense and fp8; the indexer key cache, dense and fp8, and its fp4 keys of
    ``indexer_selection="fp4"``); every byte equal."""
    generator = torch.Generator().manual_seed(seed)
    dim, rope, index_dim = 512, 64, 128
    caches: list[tuple[str, SlotCache]] = []
    for fmt in ("dense", "fp8"):
        for name, page in (("window", WINDOW_PAGE_TOKENS), ("c4", 64), ("c128", 2)):
            caches.append((f"{name}-{fmt}", TokenCache(512, dim, rope, page, fmt, device=device)))
        caches.append((f"indexer-{fmt}", IndexerKeyCache(512, index_dim, fmt, device=device)))
        fp4_keys = Fp4IndexKeyCache(512, index_dim, fmt, device, rounding=C4_ROUNDING)
        caches.append((f"indexer-fp4-{fmt}", fp4_keys))
    findings = []
    for name, cache in caches:
        for dtype in (torch.float32, torch.bfloat16):
            slots = torch.randperm(cache.num_slots, generator=generator)[:40]
            slots[::7] = -1
            rows = torch.randn(40, cache.dim, generator=generator) * 3
            rows, slots = rows.to(device=device, dtype=dtype), slots.to(device)
            storage = cache.storage.view(torch.uint8).reshape(-1)  # random bytes left intact
            storage.copy_(torch.randint(0, 256, storage.shape, generator=generator))
            twin = copy.deepcopy(cache)
            with _pinned(path, pins or {}):
                store_rows(cache, rows, slots)
            with _pinned(dispatch.TORCH, twin_pins or {}):
                store_rows(twin, rows, slots)
            wrong = differing_bytes(cache.storage, twin.storage)
            mode = f"{name} {str(dtype).removeprefix('torch.')} rows"
            findings.append(
                Finding(
                    mode,
                    -1,
                    "stores",
                    math.inf if wrong else 0.0,
                    not wrong,
                    f"{wrong} bytes differ",
                )
            )
    return findings
