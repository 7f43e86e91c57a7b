"""The serving trace an A/B run replays: steps of every mode, on the eager and the graph path.

A trace is a list of :class:`Step`\\ s over a fixed set of requests. Applied in order to a
fresh :class:`~dsv4_backend.testing.simulation.RandomModel` built from the trace's seed, each
step is one forward batch; both backends of a run replay the same steps on models built from
the same seed, so their inputs, page layouts and caches stay identical.

The built-in trace (:func:`build_trace`) serves each request like an EAGLE v2 worker with
topk 1 and 3 draft steps (4 draft tokens):

1. ``prefill``: the prompt in two chunks (eager, then graph);
2. ``cycles`` speculative rounds from the committed length ``L``, alternating eager / graph:
   ``draft`` steps 0 and 1 (rows ``L``, ``L + 1``; the last step only samples), ``verify``
   (rows ``L ... L + 3``), ``draft_extend`` (the window-only MTP layer, the same 4 rows). A
   random number of drafts is accepted; rows fed a rejected draft see wrong inputs (and are
   left out of the comparison) and the next round starts from the accepted length;
3. ``decode`` steps, alternating eager / graph.

With ``spec="dspark"`` (``--spec dspark``) the rounds are DSpark's instead: a ``dspark`` draft
block of ``DSPARK_BLOCK_SIZE`` rows per request at ``L ... L + g - 1`` through the draft head's
three window-only stages (``simulation.DSparkDraft``: the committed tokens' keys are injected
first, every row sees the last 128 committed keys and the whole block; the reference is
``reference_dspark_block``), then the target's ``verify`` of the anchor and the ``g`` drafts
(``NUM_DRAFT_TOKENS`` rows), a random number of them accepted.

With ``dp_pad = N`` (the ``--dp-pad`` scenario) every ``draft``, ``verify`` and ``decode`` batch
gains ``N`` requests as DP attention pads them for a rank with fewer requests than its peers
(pool row 0, ``seq_lens`` 1, write slot 0: :meth:`PagedRequestPool.pad_requests`), before it is
planned; only the real rows are compared. ``prefill`` (padded in tokens, not requests) and
``draft_extend`` (padded after planning, in the sglang adapter) are left as they are.

With ``prefix_share`` one more request shares request 0's prompt (its ``req_to_token`` row
points at request 0's pages, as sglang's radix cache hands a hit over): after request 0's
prefill it extends from the cached prefix, whole 256-token pages, in a ``prefill`` step of its
own, then takes part in the rounds and decodes.

Prompts end a few tokens before a multiple of 128 (window, c128 block and, at 256, page
boundaries), so the rounds and decodes that follow cross it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.planning import BatchView, ForwardKind
from dsv4_backend.testing.simulation import DSparkDraft, PagedRequestPool, RandomModel
from dsv4_backend.testing.simulation.dspark import NUM_STAGES as DSPARK_STAGES
from dsv4_backend.testing.simulation.v41 import V41Served

MODES = ("prefill", "draft", "verify", "draft_extend", "decode", "dspark")
#: Modes whose batches DP attention pads with requests before planning (``--dp-pad``).
DP_PADDED_MODES = ("draft", "dspark", "verify", "decode")
#: Speculative algorithms of the rounds (``--spec``).
SPECS = ("eagle", "dspark")
PATHS = ("eager", "graph")
#: EAGLE draft steps per round (topk 1); every step but the last runs attention.
NUM_DRAFT_STEPS = 3
#: Tokens a verify checks per request: the bonus token and one draft per step.
NUM_DRAFT_TOKENS = NUM_DRAFT_STEPS + 1
#: Rows per request of a DSpark draft block (its verify checks the anchor and these drafts).
DSPARK_BLOCK_SIZE = NUM_DRAFT_TOKENS - 1
#: Prompts end just before a multiple of this (window = c128 block = half a page).
BOUNDARY = 128
#: With ``prefix_share``: the shared prompt's tokens past its last whole page, and the sharing
#: request's own prompt tokens after it, each at most this many.
SHARE_TAIL = 8

Row = tuple[int, int]  # (request, position)


@dataclass(frozen=True)
class Step:
    """One forward batch of a trace.

    Attributes
    ----------
    mode : one of ``MODES``.
    path : ``"eager"`` or ``"graph"``.
    requests : request ids in batch order.
    lens : per request, ``prefix`` (prefill, draft_extend), ``seq_lens`` including the decoded
        token (decode), or the committed length ``L`` (draft, verify) — what the pool's batch
        builder of the mode takes.
    extend_lens : tokens per request of an extend mode; empty otherwise.
    step_id : the draft step; None for the other modes.
    rejected : ``(request, first position fed a wrong draft)`` pairs.
    """

    mode: str
    path: str
    requests: tuple[int, ...]
    lens: tuple[int, ...]
    extend_lens: tuple[int, ...] = ()
    step_id: int | None = None
    rejected: tuple[tuple[int, int], ...] = ()

    @property
    def label(self) -> str:
        """``"mode/path"``, e.g. ``"verify/graph"``: the unit the report aggregates over."""
        return f"{self.mode}/{self.path}"

    @property
    def rejected_map(self) -> dict[int, int]:
        return dict(self.rejected)

    def positions(self, index: int) -> range:
        """Positions of the rows of ``requests[index]``, in row order."""
        start = self.lens[index]
        if self.mode in ("prefill", "draft_extend"):
            return range(start, start + self.extend_lens[index])
        if self.mode == "decode":
            return range(start - 1, start)
        if self.mode == "verify":
            return range(start, start + NUM_DRAFT_TOKENS)
        if self.mode == "dspark":
            return range(start, start + DSPARK_BLOCK_SIZE)
        return range(start + self.step_id, start + self.step_id + 1)  # draft

    def rows(self) -> list[Row]:
        """``(request, position)`` of every query row, in the planner's row order."""
        return [(r, p) for i, r in enumerate(self.requests) for p in self.positions(i)]

    def accepted(self, row: Row) -> bool:
        """False for a row fed a rejected draft (its output matches nothing)."""
        request, position = row
        return position < self.rejected_map.get(request, position + 1)

    def layers(self, config: DSV4AttentionConfig) -> list[int]:
        """Layers the step runs: all, the window-only ones for the MTP draft extend, or the
        DSpark draft head's stages."""
        if self.mode == "dspark":
            return list(range(DSPARK_STAGES))
        ratios = config.compress_ratios
        return [i for i, r in enumerate(ratios) if r == 0 or self.mode != "draft_extend"]

    def batch(self, pool: PagedRequestPool, dp_pad: int = 0) -> BatchView:
        """The batch view of this step over ``pool``; ``dp_pad`` padding requests appended
        (after the real rows) for the ``DP_PADDED_MODES``."""
        requests, lens = list(self.requests), list(self.lens)
        if self.mode in ("prefill", "draft_extend"):
            return pool.extend(
                requests, lens, list(self.extend_lens), draft_model=self.mode == "draft_extend"
            )
        if self.mode == "decode":
            view = pool.decode(requests, lens)
        elif self.mode == "verify":
            view = pool.verify(requests, lens, NUM_DRAFT_TOKENS)
        elif self.mode == "dspark":
            view = pool.verify(requests, lens, DSPARK_BLOCK_SIZE, kind=ForwardKind.DSPARK_BLOCK)
        else:
            view = pool.draft_step(requests, lens, NUM_DRAFT_STEPS, self.step_id)
        return pool.pad_requests(view, dp_pad) if dp_pad else view


@dataclass(frozen=True)
class Trace:
    """Steps over requests of lengths ``max_lens``; ``seed`` builds the models' data."""

    config: DSV4AttentionConfig
    max_lens: tuple[int, ...]
    steps: tuple[Step, ...]
    seed: int
    #: Padding requests added to the batches of the ``DP_PADDED_MODES`` (module docstring).
    dp_pad: int = 0
    #: Prefix hits: ``(request, (owner, pages))`` — the request's first pages are the owner's.
    shared_pages: tuple[tuple[int, tuple[int, int]], ...] = ()
    #: Shared prompts: ``(request, (owner, tokens))`` — the owner's first tokens' data.
    same_tokens: tuple[tuple[int, tuple[int, int]], ...] = ()
    #: The speculative algorithm of the rounds (``SPECS``).
    spec: str = "eagle"
    #: DeepSeek-V4.1's decoder SWA bounded replay: a prefill's late layers run over its
    #: late-layer tail, on both sides of a run (``build_trace``).
    bounded_replay: bool = False

    @property
    def labels(self) -> list[str]:
        """Every ``mode/path`` of the trace, in ``MODES`` then ``PATHS`` order."""
        present = {s.label for s in self.steps}
        return [f"{m}/{p}" for m in MODES for p in PATHS if f"{m}/{p}" in present]

    @property
    def max_rows(self) -> int:
        """Most query rows of one step, DP padding included."""
        return max(len(s.rows()) for s in self.steps) + self.dp_pad * NUM_DRAFT_TOKENS

    def batch(self, step: Step, pool: PagedRequestPool) -> BatchView:
        """``step``'s batch over ``pool`` as this trace serves it (with its DP padding)."""
        return step.batch(pool, self.dp_pad if step.mode in DP_PADDED_MODES else 0)

    def build_model(self, device: torch.device | str = "cpu", fmt: str = "dense") -> RandomModel:
        """A fresh model over a fresh pool with ``fmt`` caches; equal data and page layout
        for equal seeds."""
        generator = torch.Generator().manual_seed(self.seed)
        pool = PagedRequestPool(
            self.config,
            self.max_lens,
            generator=generator,
            device=device,
            shared_pages=dict(self.shared_pages),
            same_tokens=dict(self.same_tokens),
        )
        return RandomModel(self.config, pool, generator=generator, fmt=fmt, device=device)

    def build_draft(
        self, pool: PagedRequestPool, device: torch.device | str = "cpu", fmt: str = "dense"
    ) -> DSparkDraft:
        """The DSpark draft head over ``pool`` (a model's from ``build_model``); equal data
        for equal seeds."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        return DSparkDraft(
            self.config,
            pool,
            block_size=DSPARK_BLOCK_SIZE,
            generator=generator,
            fmt=fmt,
            device=device,
        )

    def build_v41(self, device: torch.device | str = "cpu", fmt: str = "dense") -> V41Served:
        """A DeepSeek-V4.1 trace's model served over a fresh pool with ``fmt`` caches; equal
        data and page layout for equal seeds."""
        return V41Served.build(self.config, self.max_lens, self.seed, fmt=fmt, device=device)  # type: ignore[arg-type]

    def tail_rows(self, step: Step) -> list[Row]:
        """The rows a ``prefill`` step's late layers run over under the bounded replay: each
        request's last ``min(window, extend)`` rows (``planning.late_layer_tail``'s)."""
        window = self.config.window_size
        return [
            (r, p)
            for i, r in enumerate(step.requests)
            for p in step.positions(i)[-min(window, step.extend_lens[i]) :]
        ]

    def late_window_floors(self) -> list[torch.Tensor]:
        """Per request ``[max_len]`` int64: under the bounded replay the window floor of each
        position its late layers ran at in a prefill's tail (``seq_len - window``), else 0."""
        window = self.config.window_size
        floors = [torch.zeros(n, dtype=torch.int64) for n in self.max_lens]
        for step in self.steps if self.bounded_replay else ():
            if step.mode == "prefill":
                for i, r in enumerate(step.requests):
                    end = step.lens[i] + step.extend_lens[i]
                    floors[r][end - min(window, step.extend_lens[i]) : end] = max(0, end - window)
        return floors

    def block_seed(self, step: Step) -> int:
        """The seed of a ``dspark`` step's block data (the same for both backends)."""
        return self.seed * 1_000_003 + sum((i + 1) * n for i, n in enumerate(step.lens))


def build_trace(
    config: DSV4AttentionConfig,
    *,
    num_requests: int = 3,
    max_len: int = 300,
    cycles: int = 4,
    decode_steps: int = 4,
    seed: int = 0,
    dp_pad: int = 0,
    prefix_share: bool = False,
    spec: str = "eagle",
    bounded_replay: bool = False,
    prompt_lens: Sequence[int] | None = None,
) -> Trace:
    """The built-in trace (module docstring) over ``num_requests`` requests of at most
    ``max_len`` tokens; ``seed`` draws the lengths, the accepted drafts and the data;
    ``dp_pad`` padding requests join every batch of the ``DP_PADDED_MODES``;
    ``prefix_share`` adds request ``num_requests``, a prefix hit on request 0's prompt;
    ``spec`` picks EAGLE or DSpark rounds (module docstring). A DeepSeek-V4.1 ``config``
    (``config.v41``) makes a trace of prefills and decodes (no rounds, DP padding or prefix
    hit yet); ``bounded_replay`` runs its prefills' late layers over their late-layer tail.
    ``prompt_lens``: the requests' prompt lengths (one request each) instead of drawn ones,
    e.g. lengths of 3 (mod 4) just past a c128 boundary (``scripts/gpu_check.sh``'s A/B).

    Raises ``ConfigError`` when the sizes cannot make a trace (``max_len`` must leave room for
    a 2-token prompt, the rounds and the decodes; with ``prefix_share``, for a prompt longer
    than a page), or for what a DeepSeek-V4.1 trace does not have.
    """
    if spec not in SPECS:
        raise ConfigError(f"spec={spec!r}; expected one of {SPECS}")
    if config.v41 is None and bounded_replay:
        raise ConfigError("--bounded-replay is DeepSeek-V4.1's (--v41); this is a V4 config")
    if config.v41 is not None and (cycles or dp_pad or prefix_share):
        raise ConfigError(
            f"a DeepSeek-V4.1 trace has prefills and decodes only: cycles={cycles}, "
            f"dp_pad={dp_pad}, prefix_share={prefix_share}; use --cycles 0 and neither "
            "--dp-pad nor --prefix-share"
        )
    if num_requests < 1 or cycles < 0 or decode_steps < 0 or dp_pad < 0:
        raise ConfigError(
            f"requests={num_requests}, cycles={cycles}, decode_steps={decode_steps}, "
            f"dp_pad={dp_pad}; expected requests >= 1 and cycles, decode steps, dp_pad >= 0"
        )
    # Positions past the prompt: each round reaches NUM_DRAFT_TOKENS past its committed length
    # and commits at most as many; each decode commits one.
    headroom = NUM_DRAFT_TOKENS * cycles + decode_steps
    if max_len - headroom < 2:
        raise ConfigError(
            f"max_len={max_len} leaves no room for a prompt: {cycles} rounds and "
            f"{decode_steps} decodes need {headroom} positions past it; use a max_len of at "
            f"least {headroom + 2}"
        )
    rng = random.Random(seed)
    longest = max_len - headroom
    if prompt_lens is not None:
        prompts = [int(n) for n in prompt_lens]
        if not prompts or not all(2 <= n <= longest for n in prompts):
            raise ConfigError(
                f"prompt lengths {prompts}; expected one or more in [2, {longest}] (max_len "
                f"{max_len} less {headroom} positions for the rounds and decodes)"
            )
        num_requests = len(prompts)
    else:
        prompts = _prompt_lengths(rng, num_requests, longest, cycles + decode_steps)
    page = config.page_size
    share: tuple[int, int] | None = None  # (hit, the sharing request's prompt)
    if prefix_share:
        if longest < page + 2 * SHARE_TAIL:
            raise ConfigError(
                f"--prefix-share needs a prompt longer than a page ({page} tokens): use a "
                f"max_len of at least {page + 2 * SHARE_TAIL + headroom}"
            )
        if prompts[0] <= page:
            prompts[0] = rng.randint(page + 1, page + SHARE_TAIL)
        prompts[0] = min(prompts[0], longest - 1)  # room for the sharing request's own tokens
        hit = prompts[0] // page * page
        share = (hit, rng.randint(prompts[0] + 1, min(longest, prompts[0] + SHARE_TAIL)))
    accepted = [[rng.randint(0, NUM_DRAFT_TOKENS - 1) for _ in prompts] for _ in range(cycles)]
    if cycles and all(a == NUM_DRAFT_TOKENS - 1 for row in accepted for a in row):
        accepted[0][0] = 0  # keep at least one rejection in every trace
    first = tuple(rng.randint(1, p - 1) for p in prompts)
    rest = tuple(p - f for p, f in zip(prompts, first, strict=True))
    steps = [
        Step("prefill", "eager", tuple(range(num_requests)), (0,) * num_requests, first),
        Step("prefill", "graph", tuple(range(num_requests)), first, rest),
    ]
    lens = list(prompts)
    shared: dict[str, tuple[tuple[int, tuple[int, int]], ...]] = {}
    if share is not None:
        hit, prompt = share
        steps.append(Step("prefill", "eager", (num_requests,), (hit,), (prompt - hit,)))
        shared = dict(
            shared_pages=((num_requests, (0, hit // page)),),
            same_tokens=((num_requests, (0, prompts[0])),),
        )
        lens.append(prompt)
        accepted = [[*taken, rng.randint(0, NUM_DRAFT_TOKENS - 1)] for taken in accepted]
    num_requests = len(lens)
    requests = tuple(range(num_requests))
    for cycle, taken in enumerate(accepted):
        path = PATHS[cycle % 2]
        committed = tuple(lens)
        rejected = tuple(
            (r, committed[r] + 1 + a) for r, a in enumerate(taken) if a < NUM_DRAFT_TOKENS - 1
        )
        if spec == "dspark":
            steps.append(Step("dspark", path, requests, committed))
            steps.append(Step("verify", path, requests, committed, rejected=rejected))
        else:
            steps += [
                Step("draft", path, requests, committed, step_id=i, rejected=rejected)
                for i in range(NUM_DRAFT_STEPS - 1)
            ]
            steps.append(Step("verify", path, requests, committed, rejected=rejected))
            steps.append(
                Step(
                    "draft_extend",
                    path,
                    requests,
                    committed,
                    (NUM_DRAFT_TOKENS,) * num_requests,
                    rejected=rejected,
                )
            )
        lens = [n + 1 + a for n, a in zip(lens, taken, strict=True)]
    for i in range(decode_steps):
        lens = [n + 1 for n in lens]
        steps.append(Step("decode", PATHS[i % 2], requests, tuple(lens)))
    reach = [0] * num_requests
    for step in steps:
        for r, p in step.rows():
            reach[r] = max(reach[r], p + 1)
    return Trace(
        config=config,
        max_lens=tuple(reach),
        steps=tuple(steps),
        seed=seed,
        dp_pad=dp_pad,
        spec=spec,
        bounded_replay=bounded_replay,
        **shared,
    )


def _prompt_lengths(rng: random.Random, count: int, longest: int, advance: int) -> list[int]:
    """Prompt lengths ``<= longest`` that end at most ``advance - 1`` tokens before a multiple
    ``b`` of ``BOUNDARY`` (different ones per request while there are enough), so that the
    ``advance`` (or more) tokens committed after the prompt reach position ``b``; random
    lengths when no boundary fits."""
    gap = max(1, advance - 1)
    boundaries = [b for b in range(BOUNDARY, longest + 1, BOUNDARY) if b - gap >= 2]
    if not boundaries:
        return [rng.randint(2, longest) for _ in range(count)]
    rng.shuffle(boundaries)
    return [boundaries[i % len(boundaries)] - rng.randint(1, gap) for i in range(count)]
