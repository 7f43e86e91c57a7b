"""A simulated sglang host for the backend: a small model runner, ``ForwardBatch`` builders laid
out as sglang's EAGLE v2 workers lay them out, and stand-ins for the DeepSeek-V4 model modules
the backend calls (``Compressor``, ``C4Indexer``, the attention layer), fed from a
``simulation.RandomModel``.

Used by the CPU tests and the GPU check (``benchmarks/gpu_eagle_loop.py``). A ``Feed`` holds a
layer's projections for the rows of one batch (``x`` carries the rows' ``(request, position)``,
request -1 for a row that padding added); the stand-ins return the current feed, checking it
belongs to the ``x`` the backend hands them, so a CUDA graph can capture a layer and replay it
on refilled feeds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)

from dsv4_backend.config import REQUIRED_PAGE_SIZE, DSV4AttentionConfig
from dsv4_backend.planning import BatchView
from dsv4_backend.sglang_adapter.batch_read import KIND_OF_MODE
from dsv4_backend.testing.reference.rope import apply_rope, rope_cos_sin
from dsv4_backend.testing.simulation import PagedRequestPool, RandomModel

Row = tuple[int, int] | None  # (request, position); None for a padding row


def tiny_hf_config(config: DSV4AttentionConfig, **overrides: Any) -> dict[str, Any]:
    """A DeepSeek-V4 ``config.json`` mapping with ``config``'s attention values."""
    values: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_hidden_layers": len(config.compress_ratios),
        "compress_ratios": [*config.compress_ratios, 0],
        "num_attention_heads": config.num_heads,
        "head_dim": config.head_dim,
        "qk_rope_head_dim": config.rope_dim,
        "sliding_window": config.window_size,
        "index_topk": config.index_topk,
        "index_n_heads": config.index_n_heads,
        "index_head_dim": config.index_head_dim,
        "rope_theta": config.rope_theta,
        "compress_rope_theta": config.compress_rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_scaling": {
            "type": "yarn",
            "factor": config.yarn_factor,
            "original_max_position_embeddings": config.yarn_original_max_position,
            "beta_fast": config.yarn_beta_fast,
            "beta_slow": config.yarn_beta_slow,
        },
    }
    values.update(overrides)
    return values


class KVPoolStandIn:
    """What the backend reads of ``DeepSeekV4TokenToKVPool``: sizes and the full->SWA map.

    ``full_size`` / ``swa_size`` as a real pool reports them: the slots its allocators hand
    out, pages ``1 ... size / 256`` (page 0 is padding), so slots reach ``size + 255``.
    """

    def __init__(self, full_size: int, swa_size: int, full_to_swa: torch.Tensor | None) -> None:
        self.size = self.full_size = full_size
        self.swa_size = swa_size
        self.full_to_swa_index_mapping = full_to_swa


def mock_runner(
    pool: PagedRequestPool,
    hf_config: dict[str, Any],
    *,
    page_size: int = REQUIRED_PAGE_SIZE,
    topk: int = 1,
    num_steps: int = 3,
    num_draft_tokens: int = 4,
    attn_cp_size: int = 1,
    disable_radix_cache: bool = False,
    is_draft_worker: bool = False,
    tp_size: int = 1,
    speculative_algorithm: str | None = None,
    **cache_flags: Any,
) -> SimpleNamespace:
    """A model runner with a real ``ReqToTokenPool`` holding ``pool``'s page table
    (``tp_size``: attention TP ranks, no attention DP).

    ``server_args`` has sglang's defaults (radix cache on) unless overridden; ``cache_flags``
    sets further ``server_args`` options (e.g. ``enable_hierarchical_cache=True``);
    ``speculative_algorithm`` defaults to ``"EAGLE"`` with a ``topk``, else None."""
    device = str(pool.device)
    req_to_token_pool = ReqToTokenPool(
        size=pool.num_requests,
        max_context_len=pool.max_context,
        device=device,
        enable_memory_saver=False,
    )
    req_to_token_pool.req_to_token.copy_(pool.req_to_token)
    server_args = SimpleNamespace(
        speculative_algorithm=speculative_algorithm or ("EAGLE" if topk else None),
        speculative_eagle_topk=topk,
        speculative_num_steps=num_steps,
        speculative_num_draft_tokens=num_draft_tokens,
        attn_cp_size=attn_cp_size,
        dcp_size=1,
        tp_size=tp_size,
        attn_dp_size=1,
        page_size=page_size,
        disable_radix_cache=disable_radix_cache,
        **cache_flags,
    )
    return SimpleNamespace(
        device=device,
        page_size=page_size,
        model_config=SimpleNamespace(hf_config=hf_config, context_len=pool.max_context),
        server_args=server_args,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=KVPoolStandIn(pool.full_size, pool.swa_size, pool.full_to_swa),
        is_draft_worker=is_draft_worker,
        attn_backend=None,
    )


# ----------------------------------------------------------------------------- batches
@dataclass
class Step:
    """A ``ForwardBatch`` and the ``(request, position)`` of each of its query rows."""

    batch: ForwardBatch
    rows: list[Row]


#: The sglang forward mode of each planner kind (the inverse of ``batch_read``'s mapping).
#: The sglang mode each kind is built as (MIXED is an EXTEND kind too: ``BatchBuilder.mixed``).
FORWARD_MODES = {kind: mode for mode, kind in KIND_OF_MODE.items() if mode is not ForwardMode.MIXED}


def forward_batch(view: BatchView, rows: Sequence[Row]) -> Step:
    """The sglang ``ForwardBatch`` of a simulation ``view`` whose query rows are ``rows``.

    Laid out as sglang's EAGLE v2 workers hand it over (``batch_read``'s table): a draft step's
    ``out_cache_loc`` is the whole ``[bs, 1, num_steps]`` buffer and its ``positions`` are the
    step's; extend kinds carry host and device extend lengths.
    """
    device = view.seq_lens.device
    positions = torch.tensor([row[1] for row in rows], dtype=torch.int64, device=device)
    extra: dict[str, Any] = {}
    if view.extend_seq_lens is not None:
        extra = dict(
            extend_seq_lens=torch.tensor(view.extend_seq_lens, device=device),
            extend_prefix_lens=torch.tensor(view.extend_prefix_lens, device=device),
            extend_seq_lens_cpu=list(view.extend_seq_lens),
            extend_prefix_lens_cpu=list(view.extend_prefix_lens),
            extend_num_tokens=len(rows),
        )
    batch = ForwardBatch(
        forward_mode=FORWARD_MODES[view.kind],
        batch_size=view.batch_size,
        input_ids=torch.zeros(len(rows), dtype=torch.int64, device=device),
        req_pool_indices=view.req_pool_indices,
        seq_lens=view.seq_lens,
        seq_lens_cpu=torch.tensor(view.seq_lens_cpu, dtype=torch.int64),
        seq_lens_sum=sum(view.seq_lens_cpu),
        out_cache_loc=view.out_cache_loc,
        positions=positions,
        **extra,
    )
    return Step(batch, list(rows))


class BatchBuilder:
    """``ForwardBatch``es of every EAGLE v2 mode over the requests of ``pool`` (its views)."""

    def __init__(self, pool: PagedRequestPool) -> None:
        self.pool = pool

    def extend(self, requests: Sequence[int], prefix: Sequence[int], extend: Sequence[int]) -> Step:
        """EXTEND (prefill, chunked when ``prefix > 0``)."""
        rows = _extend_rows(requests, prefix, extend)
        return forward_batch(self.pool.extend(requests, prefix, extend), rows)

    def mixed(
        self,
        requests: Sequence[int],
        prefix: Sequence[int],
        extend: Sequence[int],
        running: Sequence[int],
        running_seq_lens: Sequence[int],
    ) -> Step:
        """MIXED (``--enable-mixed-chunk``): the chunks of ``requests`` (as :meth:`extend`),
        then the ``running`` decode requests as 1-token extends after a prefix of
        ``seq_len - 1`` (``running_seq_lens`` include the decoded token), their write slots
        after the chunks' -- the layout ``ScheduleBatch.mix_with_running``
        (sglang/srt/managers/schedule_batch.py) gives the batch."""
        step = self.extend(
            [*requests, *running],
            [*prefix, *(s - 1 for s in running_seq_lens)],
            [*extend, *(1 for _ in running)],
        )
        step.batch.forward_mode = ForwardMode.MIXED
        return step

    def draft_extend(self, requests: Sequence[int], seq_lens: Sequence[int], n: int) -> Step:
        """DRAFT_EXTEND_V2 after verify: ``n`` tokens each from committed ``seq_lens`` ``L``;
        sglang passes ``seq_lens = L + n``."""
        extend = [n] * len(requests)
        view = self.pool.extend(requests, seq_lens, extend, draft_model=True)
        return forward_batch(view, _extend_rows(requests, seq_lens, extend))

    def decode(self, requests: Sequence[int], seq_lens: Sequence[int]) -> Step:
        """DECODE: ``seq_lens`` include the decoded token."""
        rows = [(r, s - 1) for r, s in zip(requests, seq_lens, strict=True)]
        return forward_batch(self.pool.decode(requests, seq_lens), rows)

    def draft(self, requests: Sequence[int], seq_lens: Sequence[int], num_steps: int) -> Step:
        """The multi-step draft batch (topk 1) at step 0: ``seq_lens = L``, ``positions = L``,
        ``out_cache_loc`` the whole ``[bs, 1, num_steps]`` buffer. ``advance`` moves a step."""
        rows = [(r, s) for r, s in zip(requests, seq_lens, strict=True)]
        return forward_batch(self.pool.draft_step(requests, seq_lens, num_steps, 0), rows)

    @staticmethod
    def advance(step: Step) -> Step:
        """The next draft step of the same batch: positions + 1 (as ``draft_forward`` does)."""
        step.batch.positions = step.batch.positions + 1
        return Step(step.batch, [(r, p + 1) for r, p in step.rows])

    def verify(self, requests: Sequence[int], seq_lens: Sequence[int], n: int) -> Step:
        """TARGET_VERIFY: ``seq_lens = L``; rows ``L ... L + n - 1`` per request."""
        rows = [(r, s + i) for r, s in zip(requests, seq_lens, strict=True) for i in range(n)]
        return forward_batch(self.pool.verify(requests, seq_lens, n), rows)

    @staticmethod
    def idle() -> Step:
        """An idle DP rank's IDLE batch (no requests, no rows), laid out as
        ``ScheduleBatch.prepare_for_idle`` leaves it."""
        empty = torch.zeros(0, dtype=torch.int64)
        batch = ForwardBatch(
            forward_mode=ForwardMode.IDLE,
            batch_size=0,
            input_ids=empty.clone(),
            req_pool_indices=empty.clone(),
            seq_lens=empty.clone(),
            seq_lens_cpu=empty.clone(),
            seq_lens_sum=0,
            out_cache_loc=empty.clone(),
            positions=empty.clone(),
        )
        batch.capture_hidden_mode = CaptureHiddenMode.NULL
        return Step(batch, [])

    @staticmethod
    def dp_dummy_extend(num_tokens: int) -> Step:
        """The EXTEND request sglang fabricates for an idle rank under MAX_LEN DP padding
        (``prepare_mlp_sync_batch``): all ``num_tokens`` padded tokens at pool row 0, slot 0."""
        zeros = torch.zeros(num_tokens, dtype=torch.int64)
        one = torch.tensor([num_tokens])
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            input_ids=zeros,
            req_pool_indices=torch.zeros(1, dtype=torch.int64),
            seq_lens=one,
            seq_lens_cpu=one,
            out_cache_loc=zeros,
            positions=zeros,
            seq_lens_sum=num_tokens,
            extend_seq_lens=one,
            extend_prefix_lens=torch.zeros(1, dtype=torch.int64),
            extend_seq_lens_cpu=[num_tokens],
            extend_prefix_lens_cpu=[0],
            extend_num_tokens=num_tokens,
        )
        return Step(batch, [None] * num_tokens)

    @staticmethod
    def pad(
        step: Step, runner: Any, extra_requests: int, rows_per_request: int, extra_tokens: int = 0
    ) -> Step:
        """Data-parallel padding by sglang's own ``ForwardBatch._pad_inputs_to_size``:
        ``extra_requests`` whole requests of ``rows_per_request`` rows, then ``extra_tokens``
        tokens of no request (``prepare_mlp_sync_batch`` pads an EXTEND batch to the
        data-parallel token count this way, setting ``extend_num_tokens`` to it)."""
        batch = step.batch
        bs = batch.batch_size + extra_requests
        num_tokens = batch.out_cache_loc.numel() + extra_requests * rows_per_request + extra_tokens
        if batch.forward_mode == ForwardMode.EXTEND:
            batch.extend_num_tokens = num_tokens
        batch._pad_inputs_to_size(runner, num_tokens, bs)
        batch.batch_size = bs
        padding: list[Row] = [None] * (extra_requests * rows_per_request + extra_tokens)
        return Step(batch, step.rows + padding)


def _extend_rows(
    requests: Sequence[int], prefix: Sequence[int], extend: Sequence[int]
) -> list[Row]:
    return [(r, p + i) for r, p, e in zip(requests, prefix, extend, strict=True) for i in range(e)]


# ---------------------------------------------------------------------- model stand-ins
def _gather(values: list[torch.Tensor], rows: Sequence[Row]) -> torch.Tensor:
    """Stack ``values[request][position]`` per row; zeros for padding rows."""
    template = values[0][0]
    return torch.stack(
        [
            template.new_zeros(template.shape) if row is None else values[row[0]][row[1]]
            for row in rows
        ]
    )


def row_ids(rows: Sequence[Row], device: torch.device) -> torch.Tensor:
    """``[T, 2]`` float32 ``(request, position)``; ``(-1, 0)`` for padding rows."""
    ids = [(-1, 0) if row is None else row for row in rows]
    return torch.tensor(ids, dtype=torch.float32, device=device).reshape(-1, 2)


@dataclass
class Feed:
    """What the model's projections produce for one layer's rows (``T`` rows).

    ``x`` ``[T, 2]`` row ids; ``q`` ``[T, H, D]``; ``kv`` ``[T, D]``; ``kv_score`` ``[T, 2cD]``
    (kv then score); the indexer's ``index_kv_score`` ``[T, 4*DI]``, ``index_q`` ``[T, HI*DI]``
    (before RoPE: the backend ropes it) and ``index_weights`` ``[T, HI]``; None where the
    layer's ratio has none. Fixed storage, so a CUDA graph can read refilled feeds.
    """

    x: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor
    kv_score: torch.Tensor | None = None
    index_kv_score: torch.Tensor | None = None
    index_q: torch.Tensor | None = None
    index_weights: torch.Tensor | None = None

    def copy_(self, other: Feed) -> None:
        for name, value in vars(self).items():
            if value is not None:
                value.copy_(getattr(other, name))


class CompressorStandIn:
    """sglang ``Compressor`` surface: ``compute_kv_score``, ``ape`` (hotfixed layout),
    ``norm.weight``, ``ratio``, ``head_dim``, ``is_in_indexer``, ``layer_id``, ``rotate``.
    ``compute_kv_score`` returns the current feed's projections."""

    def __init__(self, model: RandomModel, layer: int, *, indexer: bool) -> None:
        params = model.params[layer]
        self.layer_id = layer
        self.is_in_indexer = self.rotate = indexer
        self.ratio = 4 if indexer else model.config.compress_ratios[layer]
        ape = params.index_ape if indexer else params.ape
        norm = params.index_norm_weight if indexer else params.norm_weight
        self.head_dim = norm.shape[0]
        # sglang stores a ratio-4 ape as its two halves stacked (Compressor._apply_ape_hotfix).
        self.ape_converted = self.ratio == 4
        if self.ape_converted:
            ape = torch.cat(torch.chunk(ape, 2, dim=-1), dim=0).reshape(self.ratio, -1)
        self.ape = ape
        self.norm = SimpleNamespace(weight=norm, variance_epsilon=model.config.rms_norm_eps)
        self.feed: Feed | None = None

    def compute_kv_score(self, x: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        assert self.feed is not None and self.feed.x is x, "stand-in fed another batch's rows"
        return self.feed.index_kv_score if self.is_in_indexer else self.feed.kv_score


class IndexerStandIn:
    """sglang ``C4Indexer`` surface: ``wq_b`` (un-roped queries), ``compute_weights`` (the
    feed's weights, already scaled: ``weight_scale`` is 1), ``n_heads``, ``head_dim``,
    ``layer_id``, ``compressor``."""

    def __init__(self, model: RandomModel, layer: int) -> None:
        self.layer_id = layer
        self.n_heads = model.config.index_n_heads
        self.head_dim = model.config.index_head_dim
        self.compressor = CompressorStandIn(model, layer, indexer=True)
        self.weight_scale = 1.0
        self.feed: Feed | None = None

    def wq_b(self, q_lora: torch.Tensor) -> tuple[torch.Tensor, None]:
        assert self.feed is not None and self.feed.x is q_lora, "stand-in fed another batch"
        return self.feed.index_q, None

    def compute_weights(self, x: torch.Tensor, skip_scale: bool = False) -> torch.Tensor:
        assert self.feed is not None and self.feed.x is x, "stand-in fed another batch's rows"
        return self.feed.index_weights


@dataclass(frozen=True)
class AttentionTPRank:
    """Rank ``rank`` of an attention TP group of ``size``: it holds heads ``[rank * Hl, (rank
    + 1) * Hl)``, ``Hl = H / size``. ``pad_to``: the width sglang's DeepSeek-V4 layer pads a
    rank's query and sink to (64 on FlashMLA GPUs); padded query heads hold NaN here (sglang
    leaves them uninitialised), padded sink entries 0 (as sglang's)."""

    rank: int
    size: int
    pad_to: int | None = None

    def local(self, q: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``q`` ``[T, Hl or pad_to, D]`` and ``sink`` of the full ``q`` / ``sink``."""
        heads = q.shape[1] // self.size
        own = slice(self.rank * heads, (self.rank + 1) * heads)
        q, sink = q[:, own], sink[own]
        if self.pad_to is None or self.pad_to == heads:
            return q, sink
        padded_q = q.new_full((q.shape[0], self.pad_to, q.shape[2]), float("nan"))
        padded_q[:, :heads] = q
        padded_sink = sink.new_zeros(self.pad_to)
        padded_sink[:heads] = sink
        return padded_q, padded_sink


class SimulatedModel:
    """Drives a backend's sglang-facing methods per layer, as ``MQALayer.forward`` does."""

    def __init__(self, model: RandomModel) -> None:
        self.model = model
        config = model.config
        self.indexers = {
            i: IndexerStandIn(model, i) for i, r in enumerate(config.compress_ratios) if r == 4
        }
        self.compressors = {
            i: CompressorStandIn(model, i, indexer=False)
            for i, r in enumerate(config.compress_ratios)
            if r
        }

    def feed(self, rows: Sequence[Row], layer: int) -> Feed:
        """The ``RandomModel`` inputs of ``rows`` (zeros for padding rows)."""
        model = self.model
        config = model.config
        inputs = model.inputs[layer]
        x = row_ids(rows, model.device)
        if not rows:
            q = torch.zeros(0, config.num_heads, config.head_dim, device=model.device)
            return Feed(x=x, q=q, kv=q[:, 0])

        def take(name: str) -> torch.Tensor:
            return _gather([getattr(i, name) for i in inputs], rows)

        feed = Feed(x=x, q=take("q"), kv=take("kv"))
        if inputs[0].kv_proj is not None:
            feed.kv_score = torch.cat([take("kv_proj"), take("score_proj")], dim=-1)
        if inputs[0].index_q is not None:
            feed.index_kv_score = torch.cat(
                [take("index_kv_proj"), take("index_score_proj")], dim=-1
            )
            positions = torch.tensor([0 if r is None else r[1] for r in rows], device=model.device)
            cos, sin = rope_cos_sin(config, 4, positions)
            index_q = apply_rope(take("index_q"), cos, sin, inverse=True)
            feed.index_q = index_q.reshape(len(rows), -1)
            feed.index_weights = take("index_weights")
        return feed

    def layer(
        self, backend: Any, step: Step, layer: int, tp: AttentionTPRank | None = None
    ) -> torch.Tensor:
        """Window-key store, indexer, compressor, attention of ``layer``: ``[T, H, D]``
        (``tp``: as that attention TP rank, ``run_feed``)."""
        return self.run_feed(backend, step.batch, layer, self.feed(step.rows, layer), tp)

    def run_feed(
        self,
        backend: Any,
        fb: Any,
        layer: int,
        feed: Feed,
        tp: AttentionTPRank | None = None,
        local: Feed | None = None,
    ) -> torch.Tensor:
        """The backend calls of one layer on ``feed`` (graph-capturable: tensor work only);
        with ``tp``, as that attention TP rank (its heads of ``q`` and the sink; the indexer
        and the compressors are replicated, as in sglang).

        ``local``: as a prefill context-parallel rank whose own rows (``x``, queries, indexer
        queries and weights) are ``local``'s, while ``feed`` holds the whole batch's: sglang's
        model all-gathers the window keys and the compressors' projections (``compute_kv_score``)
        of every rank's rows, so those come from ``feed``."""
        ratio = self.model.config.compress_ratios[layer]
        backend.store_cache(layer_id=layer, swa_k=feed.kv, forward_batch=fb)
        # What the rank's modules see: its own x, queries and weights; every row's projections.
        rank = feed
        if local is not None:
            rank = dataclasses.replace(
                local, kv_score=feed.kv_score, index_kv_score=feed.index_kv_score
            )
        if ratio == 4:
            indexer = self.indexers[layer]
            indexer.feed = indexer.compressor.feed = rank
            backend.forward_c4_indexer(
                x=rank.x, q_lora=rank.x, forward_batch=fb, c4_indexer=indexer
            )
        if ratio:
            compressor = self.compressors[layer]
            compressor.feed = rank
            backend.forward_core_compressor(rank.x, fb, layer, compressor)
        q, sink = rank.q, self.model.params[layer].sink
        local_heads = q.shape[1]
        if tp is not None:
            local_heads //= tp.size
            q, sink = tp.local(q, sink)
        attn_layer = SimpleNamespace(
            layer_id=layer, tp_q_head_num=local_heads, v_head_dim=q.shape[2]
        )
        return backend.forward(
            q=q,
            k=q,
            v=q,
            layer=attn_layer,
            forward_batch=fb,
            compress_ratio=ratio,
            attn_sink=sink,
            save_kv_cache=False,
        )

    def max_error(self, rows: Sequence[Row], layer: int, out: torch.Tensor) -> float:
        """Largest difference to the full causal pass over the real rows."""
        keep = [i for i, row in enumerate(rows) if row is not None]
        if not keep:
            return 0.0
        expected = self.model.expected(layer, [rows[i] for i in keep])
        return (out[keep].float().cpu() - expected).abs().max().item()
