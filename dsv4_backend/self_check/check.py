"""The start-up self-check: every op's preferred variant runs once on a small synthetic case at
the deployment's widths and is judged against its torch twin (``judge.py``, the GPU check's
steps and bounds); the first variant in preference order that passes becomes the op's default
on this device (``kernels/variants.py`` reads the :class:`~dsv4_backend.kernels.variants.Verdict`
records). docs/self-check.md is the user's account.

The case (:class:`CheckWidths`): a model of one layer of each of the deployment's ratios among
window, c4 and c128 with its query heads a rank, head and rope dims, indexer heads, dim and
top-k, cache format and indexer selection, over two requests whose extend runs past the window,
a page and a c128 boundary, with c4 rows of more candidates than the top-k and rows of none,
-1 holes in every index list; then a chunked extend, a verify and draft steps (speculative
deployments), and a decode; and the cache stores of every cache kind.

The search: all candidates run together (:func:`run_self_check`); a failing step blames the
first op that answers for it (:data:`STEP_OWNERS`) and still runs a candidate, which gets a
failed verdict, one ERROR log line naming the op, the variant and the figure, and its next
candidate; until the run passes. A variant that raises is blamed from the traceback. A
variant named by ``DSV4_<OP>_KERNEL`` is the op's only candidate: failing, it refuses the
backend (``variants.choose``). A variant whose ``rejects`` says it cannot take the
deployment's caches is recorded as inapplicable and passed over.

:func:`self_check` adds the on-disk cache: verdicts are kept per device name, capability,
kernel path, the versions of torch, triton, flash_mla, deep_gemm, flashinfer and this package
(and a digest of its kernel sources), the widths and the named variants, so a restart reads
them in milliseconds. ``DSV4_SELF_CHECK``: unset or ``auto`` runs it when a backend is built on
a CUDA device; ``1`` on every device; ``force`` on every device, ignoring the cache; ``0``
never (the ops then follow the rule without verdicts: baselines and GPU-verified variants).

Not covered: DeepSeek-V4.1's low-ratio ops (``kernels/low_ratio/``) and the attention key
union (checked inside the ``triton`` attention variant that calls it) keep their rule without
verdicts.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import math
import os
import platform
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from dsv4_backend import _versions, envs
from dsv4_backend.cache.fp4_format import Fp4IndexKeyCache
from dsv4_backend.cache.indexer_cache import IndexerKeyCache
from dsv4_backend.compute.kernel_choice import TABLES
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.attention.flashmla import flashmla_prefill_above
from dsv4_backend.kernels.attention.table import ATTENTION
from dsv4_backend.kernels.cache_store.table import CACHE_STORE
from dsv4_backend.kernels.compressor.table import COMPRESSOR
from dsv4_backend.kernels.indexer.table import INDEXER
from dsv4_backend.kernels.indexer.topk import INDEXER_TOPK
from dsv4_backend.kernels.variants import (
    FAILED,
    INAPPLICABLE,
    LIBRARIES,
    PASSED,
    E,
    OpTable,
    Target,
    Variant,
    Verdict,
    clear_verdicts,
    explicit_choice,
    installed_libraries,
    record_verdicts,
)
from dsv4_backend.planning.kernels.table import COMPRESS_PLANS
from dsv4_backend.planning.planner import PLAN
from dsv4_backend.self_check.bounds import Finding
from dsv4_backend.self_check.judge import (
    FLASH_CONFIG,
    Schedule,
    StepwiseJudge,
    SyntheticModel,
    judge_stores,
)
from dsv4_backend.self_check.requests import PagedRequestPool

logger = logging.getLogger(__name__)

SELF_CHECK_ENV = envs.SELF_CHECK.name
#: Where the verdicts are kept (default ``$XDG_CACHE_HOME/dsv4_backend/self-check``).
CACHE_DIR_ENV = envs.SELF_CHECK_DIR.name
#: Bumped when what a cached verdict means changes.
CACHE_SCHEMA = 1
#: Extends of more rows than this take FlashMLA's prefill kernel in the check (``flashmla``
#: switches above 11673 rows when serving), so one run checks both of its kernels.
CHECK_PREFILL_ROWS = 64

#: The ops the self-check decides, in the order a forward meets them.
CHECKED: tuple[OpTable[Any], ...] = (
    PLAN,
    COMPRESS_PLANS,
    CACHE_STORE,
    COMPRESSOR,
    INDEXER,
    INDEXER_TOPK,
    ATTENTION,
)
#: The judge's steps (a finding's ``step`` starts with the name) and the ops that answer for
#: each, the first blamed first.
STEP_OWNERS: tuple[tuple[str, tuple[OpTable[Any], ...]], ...] = (
    ("plan", (PLAN, COMPRESS_PLANS)),
    ("window-store", (CACHE_STORE,)),
    ("stores", (CACHE_STORE,)),
    ("indexer-keys", (COMPRESSOR, CACHE_STORE)),
    ("compressor", (COMPRESSOR, CACHE_STORE)),
    ("indexer-scores", (INDEXER,)),
    ("indexer-selection", (INDEXER, INDEXER_TOPK)),
    ("attention", (ATTENTION,)),
)


def twin(table: OpTable[E]) -> Variant[E]:
    """The op's torch twin: its last variant, which needs nothing of the host."""
    return table.variants[-1]


@dataclass(frozen=True)
class CheckWidths:
    """What the self-check's synthetic model takes of a deployment (the module docstring)."""

    num_heads: int
    head_dim: int
    rope_dim: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    #: The ratios checked: window (0) and those of 4 and 128 the model has.
    ratios: tuple[int, ...]
    fmt: str
    indexer_selection: str
    speculative: bool

    @classmethod
    def of_model(cls, config: DSV4AttentionConfig, fmt: str, heads: int) -> CheckWidths:
        """The widths of a model of ``config`` with ``heads`` query heads a rank and caches of
        format ``fmt`` (``"fp8"`` or ``"dense"``)."""
        ratios = tuple(sorted({0} | ({4, 128} & set(config.compress_ratios))))
        return cls(
            num_heads=heads,
            head_dim=config.head_dim,
            rope_dim=config.rope_dim,
            index_topk=config.index_topk,
            index_n_heads=config.index_n_heads,
            index_head_dim=config.index_head_dim,
            ratios=ratios,
            fmt=fmt,
            indexer_selection=config.indexer_selection,
            speculative=config.speculative,
        )

    def config(self) -> DSV4AttentionConfig:
        return DSV4AttentionConfig(
            compress_ratios=self.ratios,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            rope_dim=self.rope_dim,
            index_topk=self.index_topk,
            index_n_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim,
            indexer_selection=self.indexer_selection,
            speculative=self.speculative,
        )

    def schedule(self) -> Schedule:
        """Two requests: one whose c4 rows see more candidates than the top-k and whose extend
        crosses the window and a c128 boundary (and pages, at wide top-ks), and a short one;
        speculative deployments add a verify of 4 drafts and 3 draft steps."""
        prompt = max(4 * self.index_topk + 52, 150)
        drafts, steps = (4, 3) if self.speculative else (0, 0)
        return Schedule((prompt + 40, 64), (prompt, 40), (20, 5), drafts=drafts, steps=steps)

    @property
    def ops(self) -> tuple[OpTable, ...]:
        """The checked ops these widths exercise (no c4 layer: no indexer; no compressed
        layer: no compressor)."""
        skip: set[OpTable] = set()
        if 4 not in self.ratios:
            skip |= {INDEXER, INDEXER_TOPK}
        if self.ratios == (0,):
            skip.add(COMPRESSOR)
        return tuple(t for t in CHECKED if t not in skip)


#: ``--widths`` presets: the tiny configuration (the CPU's default, docs/design.md §6) and
#: DeepSeek-V4-Flash's (a GPU's default), both with fp8 caches.
PRESETS = {
    "tiny": CheckWidths.of_model(DSV4AttentionConfig.tiny(speculative=True), "fp8", 8),
    "flash": CheckWidths.of_model(FLASH_CONFIG, "fp8", FLASH_CONFIG.num_heads),
}


@dataclass(frozen=True)
class SelfCheckReport:
    """One self-check's outcome on ``device``: a verdict per variant it judged, the judge
    runs it took and its time (``cached``: read from disk, no run)."""

    device: str
    path: str
    widths: CheckWidths
    #: The ops it decided.
    ops: tuple[str, ...]
    verdicts: tuple[Verdict, ...]
    runs: int
    seconds: float
    cached: bool

    @property
    def chosen(self) -> dict[str, str]:
        """The variant each decided op defaults to: its passing one, else its twin."""
        chosen = {table.op: twin(table).name for table in CHECKED if table.op in self.ops}
        chosen.update({v.op: v.variant for v in self.verdicts if v.outcome == PASSED})
        return chosen

    @property
    def failed(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if v.outcome == FAILED)

    def as_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "path": self.path,
            "widths": asdict(self.widths),
            "ops": list(self.ops),
            "verdicts": [asdict(v) for v in self.verdicts],
            "chosen": self.chosen,
            "runs": self.runs,
            "seconds": round(self.seconds, 3),
            "cached": self.cached,
        }

    def lines(self) -> list[str]:
        how = "read from the cache" if self.cached else f"{self.runs} run(s)"
        head = f"self-check on {self.device} ({self.path} path): {how}, {self.seconds:.2f} s"
        return [head] + [f"  {v.op}: {v.variant} {v.outcome} ({v.figure})" for v in self.verdicts]


# ------------------------------------------------------------------------------ the search
def _rejection(table: OpTable, variant: Variant, model: SyntheticModel) -> str | None:
    """Why ``variant`` cannot take the model's caches (its ``rejects``; None: it can)."""
    if variant.rejects is None:
        return None
    pools, config = model.state.pools, model.config
    device = model.device
    if table is ATTENTION:
        window = pools.window(0)
        for extra in (None, *pools.compressed_caches.values()):
            reason = variant.rejects(device, window, extra, config.num_heads, config.head_dim)
            if reason is not None:
                return reason
        return None
    if table is INDEXER:
        keys: IndexerKeyCache | Fp4IndexKeyCache | None = next(
            iter(pools.indexer_caches.values()), None
        )
        if keys is None:
            return None
        heads, dim = config.index_n_heads, config.index_head_dim
        return variant.rejects(device, keys, heads, dim, config.indexer_selection)
    raise ConfigError(f"the self-check cannot ask the {table.op} variant {variant.name} why")


def _candidates(
    table: OpTable, target: Target, model: SyntheticModel
) -> tuple[list[Variant], list[Verdict]]:
    """``table``'s variants to judge on ``target`` in preference order (the named one alone,
    or every one that runs there but the twin), and the inapplicable verdicts of those that
    cannot take the model's caches."""
    named = explicit_choice(table)
    pool = [table[named[0]]] if named else list(table.variants[:-1])
    ready, inapplicable = [], []
    for variant in pool:
        if variant is twin(table) or variant.unmet(target) is not None:
            continue
        reason = _rejection(table, variant, model)
        if reason is None:
            ready.append(variant)
        else:
            inapplicable.append(Verdict(table.op, variant.name, INAPPLICABLE, reason))
    return ready, inapplicable


def _owners(step: str) -> tuple[OpTable, ...]:
    for prefix, owners in STEP_OWNERS:
        if step.startswith(prefix):
            return owners
    raise ConfigError(f"the self-check's judge reported an unknown step {step!r}")


def _figure(findings: Sequence[Finding]) -> str:
    if not findings:
        return "no finding"
    worst = max(findings, key=lambda f: f.excess)
    value = "inf" if not math.isfinite(worst.excess) else f"{worst.excess:.3g}"
    where = f"{worst.mode}" + (f", layer {worst.layer}" if worst.layer >= 0 else "")
    detail = f": {worst.detail}" if worst.detail and not worst.passed else ""
    return f"{worst.step} worst {value} of its bound ({where}{detail}; {len(findings)} findings)"


def _judge_once(
    widths: CheckWidths,
    device: torch.device,
    path: str,
    pins: Mapping[OpTable, str],
    seed: int,
) -> list[Finding]:
    """One run of the judge over the widths' schedule and the stores, ``pins`` on the path
    under test, every op's twin on the other side."""
    schedule = widths.schedule()
    model = _synthetic_model(widths, device, schedule.max_lens, seed)
    pool = model.pool
    twins = {table: twin(table).name for table in TABLES}
    judge = StepwiseJudge(
        model,
        path,
        query_dtype=torch.bfloat16 if device.type == "cuda" else None,
        pins=pins,
        twin_pins=twins,
    )
    with flashmla_prefill_above(CHECK_PREFILL_ROWS):
        for mode, batch in schedule.batches(pool):
            judge.forward(batch, mode)
    stores = judge_stores(device, path, seed=seed, pins=pins, twin_pins=twins)
    return judge.findings + stores


def _blame_raise(tb: TracebackType | None, current: Mapping[OpTable, Variant]) -> OpTable | None:
    """The op whose pinned variant's module raised (innermost frame first), or None."""
    modules = [frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(tb)]
    for module in reversed(modules):
        for table, variant in current.items():
            entry = getattr(variant.entry, "scores", variant.entry)  # indexer: its kernels
            if module == getattr(entry, "__module__", None):
                return table
    return None


def run_self_check(
    widths: CheckWidths,
    device: torch.device | str,
    *,
    ops: Sequence[OpTable] | None = None,
    seed: int = 0,
) -> tuple[tuple[Verdict, ...], int]:
    """The search of the module docstring on ``device``: ``(verdicts, runs)``. ``ops``: the
    ops to decide (default every one the widths exercise); the other checked ops run their
    twin on both sides."""
    device = torch.device(device)
    target = Target.of(device)
    path = dispatch.select_path(device)
    probe = _synthetic_model(widths, device, [16], 0)  # the caches ``rejects`` is asked of
    queues: dict[OpTable, list[Variant]] = {}
    verdicts: list[Verdict] = []
    deciding = widths.ops if ops is None else tuple(t for t in widths.ops if t in ops)
    resting = {table: twin(table).name for table in CHECKED if table not in deciding}
    for table in deciding:
        ready, inapplicable = _candidates(table, target, probe)
        verdicts += inapplicable
        if ready:
            queues[table] = ready
    runs = 0
    while queues:
        current = {table: queue[0] for table, queue in queues.items()}
        runs += 1
        try:
            pins = resting | {t: v.name for t, v in current.items()}
            findings = _judge_once(widths, device, path, pins, seed)
        except Exception as error:  # a variant that raises fails; the message is its figure
            raiser = _blame_raise(error.__traceback__, current)
            if raiser is None:
                raise
            figure = f"raised {type(error).__name__}: {str(error)[:300]}"
            _fail(raiser, queues, verdicts, figure)
            continue
        failing = [f for f in findings if not f.passed]
        if not failing:
            for table, variant in current.items():
                owned = [f for f in findings if table in _owners(f.step)]
                verdicts.append(Verdict(table.op, variant.name, PASSED, _figure(owned)))
            break
        blamed: dict[OpTable, list[Finding]] = {}
        for finding in failing:
            owner = next((t for t in _owners(finding.step) if t in current), None)
            if owner is None:  # no candidate left to blame: the twins disagree with themselves
                raise ConfigError(
                    f"the self-check's twins disagree on {finding.step} ({finding.mode}): "
                    f"{finding.detail}"
                )
            blamed.setdefault(owner, []).append(finding)
        for table, found in blamed.items():
            _fail(table, queues, verdicts, _figure(found))
    return tuple(verdicts), runs


def _fail(
    table: OpTable, queues: dict[OpTable, list[Variant]], verdicts: list[Verdict], figure: str
) -> None:
    """Record ``table``'s current candidate as failed with one ERROR line; move to its next."""
    failed = queues[table].pop(0)
    verdicts.append(Verdict(table.op, failed.name, FAILED, figure))
    following = queues[table][0].name if queues[table] else f"{twin(table).name} (the twin)"
    logger.error(
        "dsv4 self-check: the %s variant %r failed: %s; %s next",
        table.op,
        failed.name,
        figure,
        f"checking {following!r}" if queues[table] else following,
    )
    if not queues[table]:
        del queues[table]


def _synthetic_model(
    widths: CheckWidths, device: torch.device, max_lens: Sequence[int], seed: int
) -> SyntheticModel:
    """A synthetic model of the widths over requests of up to ``max_lens`` tokens."""
    config = widths.config()
    generator = torch.Generator().manual_seed(seed)
    pool = PagedRequestPool(config, list(max_lens), generator=generator, device=device)
    return SyntheticModel(config, pool, generator=generator, fmt=widths.fmt, device=device)


# ---------------------------------------------------------------------------- the cache
def setting() -> str:
    """``DSV4_SELF_CHECK`` (``auto`` when unset); ``ConfigError`` for another value."""
    return envs.SELF_CHECK.get()


def runs_on(device: torch.device) -> bool:
    """Whether the self-check runs for a backend (or ``info``) on ``device``: with
    ``DSV4_SELF_CHECK`` ``auto`` on CUDA devices, ``1`` / ``force`` on every device, ``0``
    never."""
    chosen = setting()
    return chosen in ("1", "force") or (chosen == "auto" and device.type == "cuda")


def cache_dir() -> Path:
    configured = envs.SELF_CHECK_DIR.get()
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dsv4_backend" / "self-check"


@functools.cache
def _source_digest() -> str:
    """A digest of the sources whose change can change a verdict."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for folder in ("cache", "compute", "kernels", "ops", "planning", "self_check"):
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


#: The distributions a library module may come from (the first installed one is read).
_DISTRIBUTIONS = {
    "triton": ("triton",),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "flash_mla": ("sgl-flash-mla", "flash-mla", "flash_mla"),
    "deep_gemm": ("sgl-deep-gemm", "deep-gemm", "deep_gemm"),
    "tvm": ("apache-tvm", "tvm"),
    "tvm_ffi": ("apache-tvm-ffi", "tvm-ffi"),
}


def _library_versions() -> dict[str, str | None]:
    """torch's, each library's (from its distribution's metadata: nothing is imported, but a
    module without one, which is imported for its ``__version__``) and this package's."""
    versions: dict[str, str | None] = {"torch": torch.__version__}
    for name in ("triton", *LIBRARIES):
        present = dispatch.triton_installed() if name == "triton" else name in installed_libraries()
        found = [_versions.installed_version(d) for d in _DISTRIBUTIONS[name]] if present else []
        version = next((v for v in found if v is not None), None)
        if present and version is None:
            version = str(getattr(importlib.import_module(name), "__version__", "unknown"))
        versions[name] = version
    versions["dsv4_backend"] = _versions.installed_version("dsv4-backend")
    return versions


def cache_key(
    widths: CheckWidths, device: torch.device, ops: Sequence[OpTable] | None = None
) -> dict[str, Any]:
    """What a cached verdict is valid for (the module docstring; ``ops`` as in
    :func:`run_self_check`)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name, capability = (
            torch.cuda.get_device_name(index),
            torch.cuda.get_device_capability(index),
        )
    else:
        name, capability = platform.processor() or platform.machine(), None
    named = {table.op: choice[0] for table in CHECKED if (choice := explicit_choice(table))}
    return {
        "schema": CACHE_SCHEMA,
        "device": name,
        "capability": capability,
        "path": dispatch.select_path(device),
        "versions": _library_versions(),
        "sources": _source_digest(),
        "widths": asdict(widths),
        "named": named,
        "ops": [t.op for t in widths.ops if ops is None or t in ops],
    }


def _cache_file(key: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / f"{digest}.json"


def _read_cache(key: Mapping[str, Any]) -> tuple[Verdict, ...] | None:
    path = _cache_file(key)
    try:
        body = json.loads(path.read_text())
        if body["key"] != json.loads(json.dumps(key)):
            return None
        return tuple(Verdict(**v) for v in body["verdicts"])
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None  # absent or unreadable: run the check


def _write_cache(key: Mapping[str, Any], verdicts: Iterable[Verdict], seconds: float) -> None:
    path = _cache_file(key)
    body = {"key": key, "verdicts": [asdict(v) for v in verdicts], "seconds": seconds}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(body, indent=1) + "\n")
        partial.replace(path)
    except OSError as error:  # a read-only home: the check still holds for this process
        logger.warning("dsv4 self-check: cannot keep its verdicts in %s: %s", path, error)


# ------------------------------------------------------------------------------ the entry
def self_check(
    widths: CheckWidths,
    device: torch.device | str,
    *,
    use_cache: bool = True,
    ops: Sequence[OpTable] | None = None,
) -> SelfCheckReport:
    """Run (or read from the cache) the self-check of ``widths`` on ``device`` and record its
    verdicts for the ops there (``variants.record_verdicts``); ``ops`` as in
    :func:`run_self_check`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    key = cache_key(widths, device, ops)
    found = _read_cache(key) if use_cache else None
    if found is None:
        clear_verdicts(Target.of(device))  # the judge pins variants a verdict may refuse
        verdicts, runs = run_self_check(widths, device, ops=ops)
    else:
        verdicts, runs = found, 0
    seconds = time.perf_counter() - start
    if found is None:
        _write_cache(key, verdicts, seconds)
    record_verdicts(Target.of(device), verdicts)
    report = SelfCheckReport(
        str(device),
        key["path"],
        widths,
        tuple(key["ops"]),
        verdicts,
        runs,
        seconds,
        cached=found is not None,
    )
    logger.info("dsv4 %s", "\n".join(report.lines()))
    return report


def at_startup(
    config: DSV4AttentionConfig, fmt: str, heads: int, device: torch.device
) -> SelfCheckReport | None:
    """The self-check a backend runs when it is built (``DSV4_SELF_CHECK``), at the model's
    widths with ``heads`` query heads a rank; None where it does not run. A process checks
    each set of widths once (the draft worker's backend reuses the target's verdicts)."""
    if not runs_on(device):
        return None
    chosen = setting()
    widths = CheckWidths.of_model(config, fmt, heads)
    done = _checked.get((widths, str(device)))
    if done is not None and chosen != "force":
        record_verdicts(Target.of(device), done.verdicts)
        return done
    try:
        report = self_check(widths, device, use_cache=chosen != "force")
    except ConfigError:
        raise
    except Exception as error:  # the check itself broke: say so, and the way around it
        raise ConfigError(
            f"the start-up self-check could not run on {device}: {type(error).__name__}: "
            f"{error}; {SELF_CHECK_ENV}=0 starts without it (the ops then run their baselines)"
        ) from error
    _checked[(widths, str(device))] = report
    return report


_checked: dict[tuple[CheckWidths, str], SelfCheckReport] = {}
