"""The GPU check's verdict: the kernels of one path judged step by step against the torch path
on the same inputs, so that a near tie in the indexer's ranking is not read as a kernel error.

docs/gpu-check.md derives the bounds. A batch is planned on the path under test and on the
torch path (the plans must be equal), then each layer runs as the backend runs it
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
indexer-scores     every candidate's score vs fp32 scores       :func:`score_bound`
indexer-selection  the selected set                             tie-aware (below)
attention          the output; the twin attends to the          ``attention_tolerance`` plus the
                   selection under test                         bf16 output's rounding
reference          window-only and c128 layers of dense caches  ``attention_tolerance``
                   against the full causal pass
stores             ``store_rows`` of random rows, every cache   equal bytes
                   kind and format
=================  ===========================================  ===============================

Tie-aware selection: with fp32 scores ``s`` and a bound ``b`` on each score's error, a set ``K``
is the top-k of some scores within ``b`` of ``s`` exactly when it holds ``min(topk, candidates)``
distinct candidates and ``min_{a in K} (s_a + b_a) >= max_{c not in K} (s_c - b_c)``: an entry
may give way only to one whose fp32 score is within the bounds of its own.

``python -m dsv4_backend.testing.gpu_verdict --device cuda --fmt fp8`` runs every serving mode
(:func:`judge_serving_modes`) and the stores, prints one line a finding and writes them as JSON
(``--json``); exit status 0 when every finding passed, 1 otherwise, 3 without the device.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dsv4_backend import ops
from dsv4_backend.cache.indexer_cache import IndexerKeyCache
from dsv4_backend.cache.token_cache import SlotCache, TokenCache
from dsv4_backend.compute.layer import (
    attend,
    compress_and_store,
    select_c4_entries,
    store_window_keys,
)
from dsv4_backend.config import INDEXER_SELECTIONS, WINDOW_PAGE_TOKENS, DSV4AttentionConfig
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention.common import attention_tolerance, dot_operand_dtype
from dsv4_backend.kernels.cache_store.table import store_rows
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.kernels.indexer.common import C4_ENTRIES_PER_PAGE, entry_slots
from dsv4_backend.kernels.indexer.fp8 import quantised_view
from dsv4_backend.kernels.indexer.table import index_scores
from dsv4_backend.planning import AttentionMetadata, BatchView, plan
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel

#: Entries of the compressors on two paths: the same fp32 arithmetic in another order (a few
#: ulp of values of order 1, summed over at most 2 * 128 pooled rows); a wrong entry errs O(1).
COMPRESSOR_ATOL = 1e-4
#: One e4m3 step relative to the largest value of a row (3 mantissa bits): where two paths'
#: entries straddle a rounding boundary, their fp8 bytes differ by one step.
FP8_STEP = 2.0**-3
#: Rounding of a bf16 output (8 significant bits).
BF16_OUTPUT_RTOL = 2.0**-8


@dataclass(frozen=True)
class Finding:
    """One comparison. ``excess``: the worst error as a fraction of its bound (passes at
    ``<= 1``; 0 for equal, ``inf`` for an exact comparison that differs)."""

    mode: str
    layer: int
    step: str
    excess: float
    passed: bool
    detail: str = ""

    def as_json(self) -> dict[str, object]:
        out = asdict(self)
        out["excess"] = self.excess if math.isfinite(self.excess) else None
        return out


def score_bound(
    q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, operand_dtype: torch.dtype
) -> torch.Tensor:
    """Bound on the error of ``sum_h w_h relu(q_h . k)`` computed with operands rounded to
    ``operand_dtype`` and fp32 accumulation, against the fp32 score.

    ``q_idx`` ``[T, HI, DI]``, ``weights`` ``[T, HI]``, ``keys`` ``[T, N, DI]`` (each row's
    candidates), all float. Rounding q, k and w once each to a roundoff ``u`` moves a product by
    at most ``(3u + 3u^2) |w| |q| |k|``; relu is 1-Lipschitz; both paths' fp32 sums over
    ``DI`` and ``HI`` add at most ``(DI + HI) * 2^-24`` each of the same magnitude. Returns
    ``[T, N]`` float32 (plus a floor of ``2^-40`` so that an exact 0 is never out of bounds).
    """
    u = torch.finfo(operand_dtype).eps / 2 if operand_dtype != torch.float32 else 0.0
    accumulation = 2 * (q_idx.shape[-1] + q_idx.shape[1]) * torch.finfo(torch.float32).eps / 2
    magnitude = torch.einsum(
        "th,thn->tn",
        weights.float().abs(),
        torch.einsum("thd,tnd->thn", q_idx.float().abs(), keys.float().abs()),
    )
    return (3 * u + 3 * u * u + accumulation) * magnitude + 2.0**-40


def check_selection(
    selected: torch.Tensor,
    candidates: torch.Tensor,
    scores: torch.Tensor,
    bound: torch.Tensor,
    topk: int,
) -> tuple[float, str]:
    """The tie-aware check of a top-k selection (module docstring).

    Parameters
    ----------
    selected : ``[T, K]`` int slots the path under test selected, ``-1`` padded.
    candidates : ``[T, N]`` int slot of each row's candidate entry, ``-1`` past its count.
    scores : ``[T, N]`` fp32 scores of the candidates (ignored where ``candidates`` is -1).
    bound : ``[T, N]`` bound on each score's error (:func:`score_bound`).
    topk : ``K``.

    Returns ``(excess, detail)``: 0 and ``""`` for a valid selection; else ``inf`` when a row
    holds the wrong number of entries, a duplicate or a non-candidate, or the largest
    ``(s_c - b_c) - (s_a + b_a)`` over the batch (a kept entry ``a`` beaten by a dropped
    ``c``) as a fraction of the bounds, and the first offending row.
    """
    valid = candidates >= 0
    chosen = selected >= 0
    expected = valid.sum(1).clamp(max=topk)
    count = chosen.sum(1)
    unused = torch.iinfo(selected.dtype).max
    ordered = torch.where(chosen, selected, unused).sort(1).values
    duplicate = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != unused)).any(1)
    member = (candidates[:, :, None] == selected[:, None, :]).any(-1) & valid
    found = member.sum(1)
    for name, bad in (
        ("holds the wrong number of entries", count != expected),
        ("selects an entry twice", duplicate),
        ("selects a slot that is not a candidate", found != count),
    ):
        if bad.any():
            row = int(bad.nonzero()[0])
            return math.inf, (
                f"row {row} {name}: {int(count[row])} selected, {int(found[row])} of them "
                f"candidates, {int(expected[row])} expected"
            )
    kept = torch.where(member, scores + bound, math.inf).amin(1)
    dropped = torch.where(valid & ~member, scores - bound, -math.inf).amax(1)
    slack = torch.where(member, bound, 0).amax(1) + torch.where(valid & ~member, bound, 0).amax(1)
    overlap = (dropped - kept) / slack.clamp(min=2.0**-40)
    has_both = torch.isfinite(kept) & torch.isfinite(dropped)
    overlap = torch.where(has_both, overlap, -math.inf)
    worst = float(overlap.max()) if overlap.numel() else -math.inf
    if worst <= 0:
        return 0.0, ""
    row = int(overlap.argmax())
    return 1.0 + worst, (
        f"row {row}: a dropped entry scores {float(dropped[row]):.6g} (minus its bound), a kept "
        f"one {float(kept[row]):.6g} (plus its bound)"
    )


def differing_bytes(got: torch.Tensor, want: torch.Tensor) -> int:
    """Bytes at which two tensors of one shape and dtype differ."""
    return int((_as_bytes(got) != _as_bytes(want)).sum())


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


def _excess(error: torch.Tensor, bound: torch.Tensor | float) -> float:
    if error.numel() == 0:
        return 0.0
    return float((error / bound).max())


class StepwiseJudge:
    """Runs a :class:`RandomModel`'s batches on ``path`` and judges every step (module
    docstring) into :attr:`findings`.

    ``query_dtype`` casts the attention queries (bf16, as a deployment runs them); ``None``
    keeps the model's fp32 queries. ``operand_dtype``: the indexer dots' operand dtype the
    score bound assumes (default ``dot_operand_dtype`` of the model's device).
    """

    def __init__(
        self,
        model: RandomModel,
        path: str,
        *,
        query_dtype: torch.dtype | None = None,
        operand_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.path = path
        self.query_dtype = query_dtype
        self.operand_dtype = operand_dtype or dot_operand_dtype(model.device)
        self.twin = copy.deepcopy(model.state)
        self.findings: list[Finding] = []

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.findings)

    def _add(self, mode: str, layer: int, step: str, excess: float, detail: str = "") -> None:
        self.findings.append(Finding(mode, layer, step, excess, excess <= 1.0, detail))

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
        with force_path(self.path):
            got = step(self.model.state, *mine, **kwargs)
        with force_path(dispatch.TORCH):
            want = step(self.twin, *theirs, **kwargs)
        return got, want

    def forward(
        self, batch: BatchView, mode: str, *, rejected: Mapping[int, int] | None = None
    ) -> None:
        """Plan and run every layer the plan serves; ``rejected`` as in ``RandomModel``."""
        model = self.model
        with force_path(self.path):
            metadata = plan(model.config, batch)
        with force_path(dispatch.TORCH):
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
            dense = model.state.pools.window(0).fmt == "dense"
            if model.config.compress_ratios[layer] != 4 and dense:
                self._reference(mode, layer, rows, rejected or {}, out)

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
        self._add(mode, layer, "attention", _excess(error, bound), f"max |diff| {_max(error):.3g}")
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
            compress_and_store, layer, meta, req_pool_indices, *projections, *weights,
            indexer=indexer,
        )  # fmt: skip
        error = (got - want).abs()
        self._add(mode, layer, f"{step} entries", _excess(error, COMPRESSOR_ATOL))
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
            bound = bound + FP8_STEP * theirs.abs().amax(1, keepdim=True)
        error = (mine - theirs).abs()
        self._add(mode, layer, f"{step} cache", _excess(error, bound))

    def _indexer(self, mode: str, layer: int, meta: _Pair, inputs: ops.LayerInputs) -> None:
        state = self.model.state
        assert inputs.index_q is not None and inputs.index_weights is not None
        self._both(select_c4_entries, layer, meta, inputs.index_q, inputs.index_weights)
        comp = meta.mine.compressed(4)
        assert comp is not None
        q_idx = inputs.index_q
        if state.config.indexer_selection == "fp8":
            q_idx = quantised_view(q_idx)
        keys = state.pools.indexer(layer)
        page_table = meta.mine.page_table
        width = page_table.shape[1] * C4_ENTRIES_PER_PAGE
        args = (q_idx, inputs.index_weights, keys, page_table, comp.topk_lengths_raw, width)
        with force_path(dispatch.TORCH):
            exact = index_scores(*args)
        with force_path(self.path):
            scored = index_scores(*args)
        valid = torch.isfinite(exact)
        columns = torch.arange(width, device=exact.device).expand_as(exact)
        candidates = entry_slots(page_table, torch.where(valid, columns, -1))
        bound = score_bound(
            q_idx, inputs.index_weights, keys.gather(candidates), self.operand_dtype
        )
        error = torch.where(valid, (scored - exact).abs(), 0)
        padding = int((~valid & (scored != -math.inf)).sum())
        excess = math.inf if padding else _excess(error, bound)
        self._add(mode, layer, "indexer-scores", excess, f"{padding} padding columns not -inf")
        excess, detail = check_selection(
            comp.page_indices, candidates, exact, bound, state.config.index_topk
        )
        self._add(mode, layer, "indexer-selection", excess, detail)
        # The twin attends to the selection under test: a tie swap is not an attention error.
        twin_comp = meta.theirs.compressed(4)
        assert twin_comp is not None
        twin_comp.page_indices.copy_(comp.page_indices)

    def _reference(
        self,
        mode: str,
        layer: int,
        rows: list[tuple[int, int]],
        rejected: Mapping[int, int],
        out: torch.Tensor,
    ) -> None:
        """The output under test ``out`` against the full causal pass (layers without a
        selection, dense caches: the reference knows no fp8 rounding)."""
        keep = [i for i, (r, p) in enumerate(rows) if p < rejected.get(r, p + 1)]
        if not keep:
            return
        expected = self.model.expected(layer, [rows[i] for i in keep])
        bound: torch.Tensor | float = attention_tolerance(out.device)
        if out.dtype == torch.bfloat16:
            bound = bound + BF16_OUTPUT_RTOL * expected.abs()
        error = (out[keep].float().cpu() - expected).abs()
        self._add(mode, layer, "reference", _excess(error, bound), f"max |diff| {_max(error):.3g}")


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
    extend of ``chunk`` more, a verify of ``drafts`` draft tokens, ``steps`` draft steps, the
    draft model's extend over them and a decode."""

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
        yield "verify", pool.verify(requests, lens, self.drafts)
        lens = [n + self.drafts for n in lens]
        for step in range(self.steps):
            yield f"draft-step-{step}", pool.draft_step(requests, lens, self.steps, step)
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
    compress_ratios=(0, 4, 128, 4), num_heads=64, head_dim=512, rope_dim=64, index_topk=512,
    index_n_heads=64, index_head_dim=128, speculative=True,
)  # fmt: skip
#: A request whose c4 rows see up to 530 candidates of which 512 are kept, and a short one.
FLASH_SCHEDULE = Schedule((2200, 300), (2100, 250), (20, 5), drafts=4, steps=3)
#: ``--config`` of the command line.
CONFIGS = {
    "tiny": (DSV4AttentionConfig.tiny(speculative=True), FULL_SCHEDULE),
    "flash": (FLASH_CONFIG, FLASH_SCHEDULE),
}


def make_judge(
    device: torch.device | str,
    path: str,
    *,
    schedule: Schedule = FULL_SCHEDULE,
    fmt: str = "dense",
    query_dtype: torch.dtype | None = None,
    operand_dtype: torch.dtype | None = None,
    seed: int = 0,
    config: DSV4AttentionConfig | None = None,
) -> StepwiseJudge:
    """A judge of ``path`` over a fresh random model whose requests fit ``schedule`` (the tiny
    configuration by default; ``fmt`` its caches' format)."""
    config = config or DSV4AttentionConfig.tiny(speculative=True)
    generator = torch.Generator().manual_seed(seed)
    pool = PagedRequestPool(config, list(schedule.max_lens), generator=generator, device=device)
    model = RandomModel(config, pool, generator=generator, fmt=fmt, device=device)
    return StepwiseJudge(model, path, query_dtype=query_dtype, operand_dtype=operand_dtype)


def judge_serving_modes(
    device: torch.device | str,
    path: str,
    *,
    schedule: Schedule = FULL_SCHEDULE,
    **options: Any,
) -> StepwiseJudge:
    """Every serving mode of ``schedule`` on ``path``; ``options`` as in :func:`make_judge`."""
    judge = make_judge(device, path, schedule=schedule, **options)
    for mode, batch in schedule.batches(judge.model.pool):
        judge.forward(batch, mode)
    return judge


def judge_stores(device: torch.device | str, path: str, *, seed: int = 0) -> list[Finding]:
    """``store_rows`` on ``path`` against the torch path: random fp32 and bf16 rows at random
    slots (some -1) of every cache kind at DeepSeek-V4-Flash widths (window, c4, c128 token
    caches, dense and fp8; the indexer key cache, dense and fp8); every byte equal."""
    generator = torch.Generator().manual_seed(seed)
    dim, rope, index_dim = 512, 64, 128
    caches: list[tuple[str, SlotCache]] = []
    for fmt in ("dense", "fp8"):
        for name, page in (("window", WINDOW_PAGE_TOKENS), ("c4", 64), ("c128", 2)):
            caches.append((f"{name}-{fmt}", TokenCache(512, dim, rope, page, fmt, device=device)))
        caches.append((f"indexer-{fmt}", IndexerKeyCache(512, index_dim, fmt, device=device)))
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
            with force_path(path):
                store_rows(cache, rows, slots)
            with force_path(dispatch.TORCH):
                store_rows(twin, rows, slots)
            wrong = differing_bytes(cache.storage, twin.storage)
            excess = math.inf if wrong else 0.0
            mode = f"{name} {str(dtype).removeprefix('torch.')} rows"
            findings.append(Finding(mode, -1, "stores", excess, not wrong, f"{wrong} bytes differ"))
    return findings


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--fmt", choices=("dense", "fp8"), default="fp8")
    parser.add_argument(
        "--query-dtype", choices=("float32", "bfloat16"), default="bfloat16",
        help="the attention queries' dtype (a deployment's: bfloat16)",
    )  # fmt: skip
    parser.add_argument("--config", choices=tuple(CONFIGS), default="tiny")
    parser.add_argument(
        "--indexer-selection", choices=INDEXER_SELECTIONS, default="exact",
        help="exact scores, or sglang's fp8 ones (DSV4_INDEXER_SELECTION)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the findings to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_verdict: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 3
    path = dispatch.select_path(device)
    config, schedule = CONFIGS[args.config]
    config = dataclasses.replace(config, indexer_selection=args.indexer_selection)
    judge = judge_serving_modes(
        device, path, schedule=schedule, config=config, fmt=args.fmt,
        query_dtype=getattr(torch, args.query_dtype), seed=args.seed,
    )  # fmt: skip
    findings = judge.findings + judge_stores(device, path, seed=args.seed)
    for f in findings:
        if not f.passed:
            print(f"FAIL {f.mode} layer {f.layer} {f.step}: excess {f.excess:.3g} {f.detail}")
    worst: dict[str, float] = {}
    for f in findings:
        worst[f.step] = max(worst.get(f.step, 0.0), f.excess)
    for step, excess in worst.items():
        print(f"{step}: worst excess {excess:.3g} of its bound")
    failed = sum(not f.passed for f in findings)
    print(f"gpu_verdict ({path}, {args.config}, {args.fmt} caches, {args.query_dtype} queries): "
          f"{len(findings) - failed} of {len(findings)} findings pass")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            summary = {"path": path, "config": args.config, "fmt": args.fmt,
                       "query_dtype": args.query_dtype,
                       "worst_excess": {k: v if math.isfinite(v) else None
                                        for k, v in worst.items()},
                       "findings": [f.as_json() for f in findings]}  # fmt: skip
            json.dump(summary, out, indent=1)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
