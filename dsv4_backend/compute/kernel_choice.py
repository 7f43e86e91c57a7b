"""The variant every op runs, for one device: :class:`KernelChoice`, read once per backend
from the op tables (``kernels/variants.py``) and printed by ``info`` and the backend's
start-up log; :func:`describe` is ``info --json``'s ``kernels`` section.

The ops resolve their variant through the same cached rule (``variants.resolve``), so the
object a backend logs is the one planning and the forward run with.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from dsv4_backend.cache.pools import DSV4CachePools
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels.attention.key_union import KEY_UNION
from dsv4_backend.kernels.attention.table import ATTENTION
from dsv4_backend.kernels.cache_store.table import CACHE_STORE
from dsv4_backend.kernels.compressor.table import COMPRESSOR
from dsv4_backend.kernels.indexer.table import INDEXER
from dsv4_backend.kernels.indexer.topk import INDEXER_TOPK
from dsv4_backend.kernels.low_ratio.table import (
    LOW_RATIO_PAIRS,
    LOW_RATIO_ROWS,
    LOW_RATIO_SCORES,
)
from dsv4_backend.kernels.variants import (
    Chosen,
    E,
    OpTable,
    Target,
    candidates,
    choose,
    explicit_choice,
    named_rejection,
    resolve,
    unverified_enabled,
    verdicts_for,
)
from dsv4_backend.planning.kernels.table import COMPRESS_PLANS
from dsv4_backend.planning.planner import LOW_RATIO_PLAN, PLAN

#: Every op table, in the order a forward meets them.
TABLES: tuple[OpTable[Any], ...] = (
    PLAN,
    LOW_RATIO_PLAN,
    COMPRESS_PLANS,
    CACHE_STORE,
    COMPRESSOR,
    INDEXER,
    INDEXER_TOPK,
    LOW_RATIO_PAIRS,
    LOW_RATIO_ROWS,
    LOW_RATIO_SCORES,
    ATTENTION,
    KEY_UNION,
)
#: The CUDA capabilities ``info`` shows the choice for on any host (Hopper, Blackwell).
REFERENCE_CAPABILITIES = ((9, 0), (10, 0))


@dataclass(frozen=True)
class KernelChoice:
    """The :class:`~dsv4_backend.kernels.variants.Chosen` variant of every op in
    :data:`TABLES` for one :class:`~dsv4_backend.kernels.variants.Target`."""

    target: Target
    chosen: tuple[Chosen, ...]

    def __getitem__(self, op: str) -> Chosen:
        for chosen in self.chosen:
            if chosen.op == op:
                return chosen
        raise ConfigError(f"unknown op {op!r}; expected one of {[c.op for c in self.chosen]}")

    def lines(self) -> list[str]:
        """One line an op: ``op: variant (why)``."""
        return [f"{c.op}: {c.name} ({c.reason})" for c in self.chosen]


def kernel_choice(device: torch.device | str) -> KernelChoice:
    """What every op runs for tensors on ``device`` under the current settings; a
    ``ConfigError`` naming the op, the variant and why for an explicit choice that cannot run."""
    chosen = tuple(resolve(table, device) for table in TABLES)
    return KernelChoice(Target.of(device), chosen)


def explicit_choice_refusal(
    device: torch.device, pools: DSV4CachePools, config: DSV4AttentionConfig, heads: int
) -> str | None:
    """Why a variant named for ``device`` cannot take a backend's caches (``pools``) and
    ``heads`` query heads a rank (None: every named variant can); the backend raises it when it
    is built, not at the first forward. ``ConfigError`` for a name that cannot run there."""
    extra = next(iter(pools.compressed_caches.values()), None)
    window = pools.window(pools.layers.start)
    reason = named_rejection(ATTENTION, device, window, extra, heads, config.head_dim)
    keys = next(iter(pools.indexer_caches.values()), None)
    if reason is None and keys is not None:
        reason = named_rejection(
            INDEXER,
            device,
            keys,
            config.index_n_heads,
            config.index_head_dim,
            config.indexer_selection,
        )
    return reason


def _entry(choose_it: Callable[[], Chosen]) -> dict[str, str | None]:
    try:
        chosen = choose_it()
    except ConfigError as error:
        return {"variant": None, "error": str(error)}
    return {"variant": chosen.name, "why": chosen.reason}


def preferred(table: OpTable[E], target: Target) -> Chosen[E]:
    """The first variant of ``table`` in preference order that runs on ``target`` and needs
    no setting beyond the defaults: what a backend built there runs once it passes the
    start-up self-check (``info``'s CUDA columns)."""
    for variant in table.variants:
        if variant.setting is None and variant.unmet(target) is None:
            why = "first in preference order there; the default once it passes the self-check"
            return Chosen(table.op, variant, why, explicit=False)
    raise ConfigError(f"no {table.op} variant runs on {target.describe()}")


def describe(device: torch.device | str, self_checked: Collection[str] = ()) -> dict[str, Any]:
    """Every op's variants on ``device`` in preference order (runs here or why not, what it
    takes, the setting it needs, GPU evidence, the self-check's verdict here when one ran),
    the one chosen there, and the choice on a CUDA host of each
    :data:`REFERENCE_CAPABILITIES` with the libraries sglang installs: for the ops the
    start-up self-check decides (``self_checked``, their names) the one :func:`preferred`
    there, for the others the rule without verdicts (a named variant in either case)."""
    target = Target.of(device)
    others = {f"cuda {m}.{n}": Target.cuda_host((m, n)) for m, n in REFERENCE_CAPABILITIES}
    ops = {}
    for table in TABLES:
        explicit, unverified = explicit_choice(table), unverified_enabled()
        verdicts = {v.variant: v for v in verdicts_for(table, target)}
        chosen = {"here": _entry(functools.partial(resolve, table, device))}
        for label, other in others.items():
            if explicit is None and table.op in self_checked:
                chosen[label] = _entry(functools.partial(preferred, table, other))
            else:
                chosen[label] = _entry(
                    functools.partial(choose, table, other, explicit, unverified)
                )
        ops[table.op] = {
            "summary": table.summary,
            "env": table.env,
            "chosen": chosen,
            "variants": [
                {
                    "name": variant.name,
                    "takes": variant.takes,
                    "needs": [r.text for r in variant.needs],
                    "setting": variant.setting,
                    "runs_here": reason is None,
                    "reason": reason,
                    "gpu_verified": variant.gpu_verified,
                    "baseline": variant.baseline,
                    "self_check": (
                        None
                        if variant.name not in verdicts
                        else {
                            "outcome": verdicts[variant.name].outcome,
                            "figure": verdicts[variant.name].figure,
                        }
                    ),
                }
                for variant, reason in candidates(table, target)
            ],
        }
    return {"device": str(torch.device(device)), "target": target.describe(), "ops": ops}
