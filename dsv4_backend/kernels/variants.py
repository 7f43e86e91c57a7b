"""Every op's implementations declared once, as an :class:`OpTable` of :class:`Variant` records,
and the one rule that picks a variant for the tensors of a device (docs/kernels.md).

A variant records its entry point, what it needs of the host (:class:`Requirement`: dispatch
paths, a CUDA capability, an installed library), what inputs it takes, and the evidence that
lets it be a CUDA default: ``gpu_verified`` (the ``scripts/gpu_check.sh`` run it passed) or
``baseline`` (the CUDA default since before the GPU check existed; it stays one until a
verified variant replaces it). A table lists its variants in order of preference.

:func:`choose` picks, for a :class:`Target` (the dispatch path, device, capability and
libraries of the tensors' host):

1. the variant pinned by :func:`force_variant`, else the one named by the op's environment
   variable (``DSV4_<OP>_KERNEL``); it must run on the target, or the choice is a
   ``ConfigError`` naming the variant and why (never a silent fallback);
2. else the first variant that runs on the target and may be its default: one that passed
   the start-up self-check on the target (``self_check/check.py`` records a :class:`Verdict`
   per variant it ran, :func:`record_verdicts`; a variant that failed it, or cannot take the
   model's inputs, is passed over); else off CUDA any that runs (the interpreter therefore
   runs the newest kernels the tests cover); on CUDA one that is ``gpu_verified`` or
   ``baseline``, or any with ``DSV4_UNVERIFIED_KERNELS=1`` (:func:`force_unverified` pins
   either rule on every device, for tests).

An explicit choice that failed the self-check is a ``ConfigError`` naming its figure.

:func:`resolve` is :func:`choose` for a device, read once per (table, target, settings): every
call of an op with the same settings gets the same frozen :class:`Chosen`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from dsv4_backend import envs
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels import dispatch

#: Libraries a variant may need (module names); an sglang GPU host installs all of them.
LIBRARIES = ("flashinfer", "flash_mla", "deep_gemm", "tvm", "tvm_ffi")

#: A table's entry type: what its op calls, e.g. ``Callable[[AttentionCall], torch.Tensor]``
#: or a record of entry points (``IndexerKernels``); mypy checks each variant's against it.
E = TypeVar("E")


@dataclass(frozen=True)
class Target:
    """Where an op's tensors are: the dispatch ``path`` (``dispatch.PATHS``), the device type,
    the CUDA ``capability`` (``None`` off CUDA) and the installed :data:`LIBRARIES`.
    ``hypothetical``: a host described, not this one (:meth:`cuda_host`); a requirement that
    probes this machine (a toolchain, a device) answers from the description instead."""

    path: str
    device_type: str
    capability: tuple[int, int] | None
    libraries: frozenset[str]
    hypothetical: bool = False

    @classmethod
    def of(cls, device: torch.device | str) -> Target:
        """The target of tensors on ``device`` under the current ``dispatch.force_path``."""
        device = torch.device(device)
        return _target(dispatch.select_path(device), device.type, device.index)

    @classmethod
    def cuda_host(cls, capability: tuple[int, int]) -> Target:
        """A CUDA host of ``capability`` with every library sglang installs, and the ``nvcc``
        its JIT kernels build with (what ``info`` shows a CPU host would run on such a GPU)."""
        path = dispatch.TRITON if dispatch.triton_installed() else dispatch.TORCH
        return cls(path, "cuda", capability, frozenset(LIBRARIES), hypothetical=True)

    def describe(self) -> str:
        where = self.device_type
        if self.capability is not None:
            where += f" (compute capability {self.capability[0]}.{self.capability[1]})"
        return f"{where}, {self.path} path"


@functools.cache
def _target(path: str, device_type: str, index: int | None) -> Target:
    """One ``Target`` object per (path, device): what an op resolves on every call."""
    capability = None
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability(index or 0)
        capability = (major, minor)
    return Target(path, device_type, capability, installed_libraries())


def _importable(name: str) -> bool:
    """Whether module ``name`` imports, by its spec (nothing is imported). One already in
    ``sys.modules`` counts as it stands there: ``find_spec`` raises for a module without a spec
    (a stand-in) and for a ``None`` entry (an import that is made to fail)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


@functools.cache
def installed_libraries() -> frozenset[str]:
    """The :data:`LIBRARIES` this process can import (:func:`_importable`)."""
    return frozenset(name for name in LIBRARIES if _importable(name))


@dataclass(frozen=True)
class Requirement:
    """One thing a variant needs of its :class:`Target`: ``unmet`` says why a target lacks it
    (``None``: it has it); ``text`` is how ``info`` lists it."""

    text: str
    unmet: Callable[[Target], str | None]


def on_paths(*paths: str) -> Requirement:
    """Runs on the dispatch ``paths`` only."""

    def unmet(target: Target) -> str | None:
        if target.path in paths:
            return None
        return f"runs on the {' / '.join(paths)} path, not {target.path}"

    return Requirement(" / ".join(paths), unmet)


#: Runs on compiled Triton and in the interpreter (the Triton kernels' requirement).
TRITON_PATHS = on_paths(dispatch.TRITON, dispatch.TRITON_INTERPRETER)


def on_cuda(*majors: int) -> Requirement:
    """Needs a CUDA device (of one of the compute capability ``majors``, when given)."""

    def unmet(target: Target) -> str | None:
        if target.device_type != "cuda" or target.capability is None:
            return f"needs a CUDA device (tensors are on {target.device_type})"
        if majors and target.capability[0] not in majors:
            have = f"{target.capability[0]}.{target.capability[1]}"
            return f"needs compute capability {' / '.join(f'{m}.x' for m in majors)}, not {have}"
        return None

    arch = f" {' / '.join(f'{m}.x' for m in majors)}" if majors else ""
    return Requirement(f"CUDA{arch}", unmet)


def with_library(module: str, *functions: str) -> Requirement:
    """Needs the library ``module`` installed (one of :data:`LIBRARIES`) and, on this host (not
    a described one), with the ``functions`` the variant calls: a release without one is
    refused here, not failed at the first call."""
    if module not in LIBRARIES:
        raise ConfigError(f"unknown library {module!r}; expected one of {LIBRARIES}")

    def unmet(target: Target) -> str | None:
        if module not in target.libraries:
            return f"{module} is not installed"
        if functions and not target.hypothetical:
            return missing_functions(module, functions)
        return None

    return Requirement(f"{module} ({', '.join(functions)})" if functions else module, unmet)


def missing_functions(module: str, functions: tuple[str, ...]) -> str | None:
    """Which of ``functions`` the importable ``module`` lacks, as a reason (None: it has all)."""
    loaded = importlib.import_module(module)
    missing = [name for name in functions if not hasattr(loaded, name)]
    if not missing:
        return None
    version = getattr(loaded, "__version__", "of unknown version")
    return f"{module} {version} has no {', '.join(missing)}"


def custom(text: str, unmet: Callable[[Target], str | None]) -> Requirement:
    """A requirement a variant states itself (a toolchain, a runtime probe)."""
    return Requirement(text, unmet)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one record a variant
class Variant(Generic[E]):
    """One implementation of an op.

    ``entry``: what the op calls, of the table's entry type ``E`` (its op's call, see the
    op's ``table.py``); ``needs``: what it needs of the host; ``takes``: which inputs it serves,
    as ``info`` prints it; ``rejects``: for a variant whose inputs are limited, why it cannot
    take given ones (its arguments are the op's, see its ``table.py``); ``gpu_verified``: the
    ``scripts/gpu_check.sh`` run it passed (date and figure), ``None`` if it never has;
    ``baseline``: the CUDA default from before the GPU check, kept until a verified variant
    replaces it; ``setting``: a setting the variant needs beyond the defaults (which its
    ``rejects`` checks; ``info``'s CUDA columns, which assume the defaults, pass it over).
    """

    name: str
    entry: E
    needs: tuple[Requirement, ...]
    takes: str
    gpu_verified: str | None = None
    baseline: bool = False
    rejects: Callable[..., str | None] | None = None
    setting: str | None = None

    def unmet(self, target: Target) -> str | None:
        """Why this variant cannot run on ``target`` (``None``: it can)."""
        for requirement in self.needs:
            reason = requirement.unmet(target)
            if reason is not None:
                return reason
        return None

    def may_default(self, target: Target, unverified: bool | None) -> bool:
        """Whether the variant may be chosen on ``target`` without being named: ``unverified``
        True / False lets variants that have not passed the GPU check be defaults or not on
        every device; ``None`` off CUDA only."""
        if unverified is None:
            unverified = target.device_type != "cuda"
        return unverified or self.gpu_verified is not None or self.baseline


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one table an op
class OpTable(Generic[E]):
    """The variants of one op in order of preference, each entry an ``E``; ``env`` names one
    explicitly."""

    op: str
    summary: str
    variants: tuple[Variant[E], ...]
    env: str = field(default="")

    def __post_init__(self) -> None:
        if not self.env:
            object.__setattr__(self, "env", envs.kernel_variable(self.op))
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names) or not names:
            raise ConfigError(f"op {self.op!r}: variant names {names} must be unique, non-empty")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variants)

    def __getitem__(self, name: str) -> Variant[E]:
        for variant in self.variants:
            if variant.name == name:
                return variant
        raise ConfigError(f"unknown {self.op} variant {name!r}; expected one of {self.names}")


#: A :class:`Verdict`'s outcomes: it passed, it failed, or it cannot take the model's inputs
#: (its ``rejects`` said why; not an error).
PASSED, FAILED, INAPPLICABLE = "pass", "fail", "inapplicable"


@dataclass(frozen=True)
class Verdict:
    """What the start-up self-check found of one variant of ``op`` on a target: ``outcome``
    (:data:`PASSED`, :data:`FAILED` or :data:`INAPPLICABLE`) and ``figure``, the worst finding
    against its bound (or why the variant cannot take the inputs)."""

    op: str
    variant: str
    outcome: str
    figure: str

    def __post_init__(self) -> None:
        if self.outcome not in (PASSED, FAILED, INAPPLICABLE):
            raise ConfigError(
                f"verdict outcome {self.outcome!r}; expected {PASSED}, {FAILED} or {INAPPLICABLE}"
            )


_verdicts: dict[Target, dict[str, tuple[Verdict, ...]]] = {}


def record_verdicts(target: Target, verdicts: Iterable[Verdict]) -> None:
    """Make ``verdicts`` the self-check's findings on ``target``, replacing those of the ops
    they name (every later :func:`resolve` there follows them)."""
    by_op: dict[str, list[Verdict]] = {}
    for verdict in verdicts:
        by_op.setdefault(verdict.op, []).append(verdict)
    recorded = _verdicts.setdefault(target, {})
    recorded.update({op: tuple(found) for op, found in by_op.items()})


def clear_verdicts(target: Target | None = None) -> None:
    """Forget the verdicts recorded on ``target`` (every target: None)."""
    if target is None:
        _verdicts.clear()
    else:
        _verdicts.pop(target, None)


def verdicts_for(table: OpTable[Any], target: Target) -> tuple[Verdict, ...]:
    """The self-check's verdicts on ``table``'s variants on ``target`` (empty: none ran)."""
    return _verdicts.get(target, {}).get(table.op, ())


@dataclass(frozen=True)
class Chosen(Generic[E]):
    """The variant an op runs on a target, and why (``explicit``: named, not defaulted)."""

    op: str
    variant: Variant[E]
    reason: str
    explicit: bool

    @property
    def name(self) -> str:
        return self.variant.name


_forced: dict[str, list[str]] = {}
_forced_unverified: list[bool] = []


@contextlib.contextmanager
def force_variant(table: OpTable[Any], name: str) -> Iterator[None]:
    """Run ``table``'s op with variant ``name`` inside the block (tests, A/B)."""
    table[name]  # ConfigError for an unknown name
    pins = _forced.setdefault(table.op, [])
    pins.append(name)
    try:
        yield
    finally:
        pins.pop()


def explicit_choice(table: OpTable[Any]) -> tuple[str, str] | None:
    """``(name, why)`` of the variant pinned or named by the environment, or ``None``."""
    pins = _forced.get(table.op)
    if pins:
        return pins[-1], "pinned by force_variant"
    name = os.environ.get(table.env, "")
    return (name, f"{table.env}={name}") if name else None


def choose(
    table: OpTable[E],
    target: Target,
    override: tuple[str, str] | None,
    unverified: bool | None = None,
    verdicts: tuple[Verdict, ...] = (),
) -> Chosen[E]:
    """The variant of ``table`` for ``target`` (the module docstring's rule); ``override`` is
    ``(name, why)`` of an explicit choice; ``unverified`` as in ``Variant.may_default``;
    ``verdicts`` the self-check's on ``target`` (:func:`verdicts_for`). ``ConfigError`` for an
    explicit choice that is unknown, cannot run on ``target`` or failed the self-check there,
    or a target no variant runs on."""
    found = {v.variant: v for v in verdicts}
    if override is not None:
        name, why = override
        if name not in table.names:
            raise ConfigError(f"{why}: unknown {table.op} variant; expected one of {table.names}")
        variant = table[name]
        reason = variant.unmet(target)
        if reason is not None:
            raise ConfigError(
                f"{why}: the {name} {table.op} variant cannot run on {target.describe()}: {reason}"
            )
        verdict = found.get(name)
        if verdict is not None and verdict.outcome == FAILED:
            raise ConfigError(
                f"{why}: the {name} {table.op} variant failed the start-up self-check on "
                f"{target.describe()}: {verdict.figure}"
            )
        return Chosen(table.op, variant, why, explicit=True)
    skipped = []
    for variant in table.variants:
        reason = variant.unmet(target)
        verdict = found.get(variant.name)
        if reason is None and verdict is not None:
            if verdict.outcome == PASSED:
                why = f"passed the start-up self-check here ({verdict.figure})"
                return Chosen(table.op, variant, why, False)
            skipped.append(f"{variant.name}: self-check {verdict.outcome}: {verdict.figure}")
            continue
        if reason is None and variant.may_default(target, unverified):
            return Chosen(table.op, variant, _why_default(variant, target, unverified), False)
        skipped.append(f"{variant.name}: {reason or 'has not passed scripts/gpu_check.sh'}")
    raise ConfigError(f"no {table.op} variant runs on {target.describe()} ({'; '.join(skipped)})")


def _why_default(variant: Variant[Any], target: Target, unverified: bool | None) -> str:
    if variant.gpu_verified is not None:
        return f"GPU-verified ({variant.gpu_verified})"
    if not variant.baseline and unverified is None:
        return "the first variant that runs here (off CUDA)"
    if not variant.baseline:
        return f"unverified variants allowed ({envs.UNVERIFIED_KERNELS.name}=1 or force_unverified)"
    if target.device_type == "cuda" or unverified is False:
        return "the baseline"
    return "the first variant that runs here"


@functools.cache
def _choose_cached(
    table: OpTable[Any],
    target: Target,
    override: tuple[str, str] | None,
    unverified: bool | None,
    verdicts: tuple[Verdict, ...],
) -> Chosen[Any]:
    return choose(table, target, override, unverified, verdicts)


def resolve(table: OpTable[E], device: torch.device | str) -> Chosen[E]:
    """The variant ``table``'s op runs for tensors on ``device`` under the current settings
    (``force_path``, ``force_variant``, the environment, the self-check's verdicts); the same
    object for the same ones."""
    target = Target.of(device)
    return _choose_cached(
        table, target, explicit_choice(table), unverified_enabled(), verdicts_for(table, target)
    )


def unverified_enabled() -> bool | None:
    """Whether variants that have not passed the GPU check may be defaults: as pinned by
    :func:`force_unverified`, else True with ``DSV4_UNVERIFIED_KERNELS=1``, else ``None`` (off
    CUDA only)."""
    if _forced_unverified:
        return _forced_unverified[-1]
    return True if envs.UNVERIFIED_KERNELS.get() == "1" else None


@contextlib.contextmanager
def force_unverified(enabled: bool) -> Iterator[None]:
    """Inside the block, let variants that have not passed the GPU check be defaults on every
    device (``True``: the interpreter's choice on CUDA too) or on none (``False``: the
    baselines they would replace, in the interpreter too). Tests and the GPU check use it."""
    _forced_unverified.append(enabled)
    try:
        yield
    finally:
        _forced_unverified.pop()


def candidates(table: OpTable[E], target: Target) -> list[tuple[Variant[E], str | None]]:
    """Every variant of ``table`` with why it cannot run on ``target`` (``None``: it can)."""
    return [(v, v.unmet(target)) for v in table.variants]


def named_rejection(table: OpTable[Any], device: torch.device, *inputs: object) -> str | None:
    """Why the variant named for ``device`` (``table.env`` or ``force_variant``) cannot take
    these inputs (its ``rejects(device, *inputs)``); None for a default or a named variant that
    takes them. ``ConfigError`` for a name that is unknown or cannot run there."""
    chosen = resolve(table, device)
    rejects = chosen.variant.rejects
    reason = None if rejects is None else rejects(device, *inputs)
    if not chosen.explicit or reason is None:
        return None
    return f"{chosen.reason}: the {chosen.name} {table.op} variant cannot run here: {reason}"
