"""The variant rule (``kernels/variants.py``): an explicit choice runs or is refused with its
name and why; otherwise the first variant that runs and may be a default there (on CUDA:
GPU-verified or the baseline, or any with ``DSV4_UNVERIFIED_KERNELS=1``)."""

from __future__ import annotations

import sys
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_backend.envs import UNVERIFIED_KERNELS
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.variants import (
    OpTable,
    Target,
    Variant,
    choose,
    custom,
    force_unverified,
    force_variant,
    on_cuda,
    on_paths,
    resolve,
    unverified_enabled,
    with_library,
)

CPU = Target(dispatch.TORCH, "cpu", None, frozenset())
HOPPER = Target.cuda_host((9, 0))
AMPERE = Target.cuda_host((8, 0))


def _entry() -> None:
    """Stands in for an op's function."""


def _variant(name: str, runs: bool, verified: bool = False, baseline: bool = False) -> Variant:
    needs = () if runs else (custom("never", lambda target: f"{name} never runs"),)
    return Variant(name, _entry, needs, "anything", "gpu_check 2026-12-02" if verified else None,
                   baseline)  # fmt: skip


@given(
    st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=6),
    st.sampled_from([CPU, HOPPER]),
    st.sampled_from([None, True, False]),
)
def test_the_default_is_the_first_variant_allowed_there(
    flags: list[tuple[bool, bool, bool]], target: Target, unverified: bool | None
) -> None:
    table = OpTable("op", "a test op", tuple(_variant(f"v{i}", *f) for i, f in enumerate(flags)))
    anything = target.device_type != "cuda" if unverified is None else unverified
    allowed = [
        i
        for i, (runs, verified, baseline) in enumerate(flags)
        if runs and (anything or verified or baseline)
    ]
    if not allowed:
        with pytest.raises(ConfigError, match="no op variant runs on") as error:
            choose(table, target, None, unverified)
        assert all(f"v{i}" in str(error.value) for i in range(len(flags)))
        return
    chosen = choose(table, target, None, unverified)
    assert chosen.name == f"v{allowed[0]}" and not chosen.explicit


@given(st.lists(st.booleans(), min_size=1, max_size=5), st.data())
def test_an_explicit_choice_runs_or_is_refused_by_name(
    runs: list[bool], data: st.DataObject
) -> None:
    table = OpTable("op", "a test op", tuple(_variant(f"v{i}", r) for i, r in enumerate(runs)))
    pick = data.draw(st.integers(0, len(runs) - 1))
    why = f"DSV4_OP_KERNEL=v{pick}"
    if runs[pick]:
        chosen = choose(table, HOPPER, (f"v{pick}", why))  # explicit: verification not needed
        assert chosen.name == f"v{pick}" and chosen.explicit and chosen.reason == why
        return
    with pytest.raises(ConfigError) as error:
        choose(table, HOPPER, (f"v{pick}", why))
    message = str(error.value)
    assert message.startswith(f"{why}: the v{pick} op variant cannot run")
    assert f"v{pick} never runs" in message and "\n" not in message


def test_an_unknown_name_lists_the_variants() -> None:
    table = OpTable("op", "a test op", (_variant("a", True), _variant("b", True)))
    with pytest.raises(ConfigError, match=r"DSV4_OP_KERNEL=c: unknown op variant; .*\('a', 'b'\)"):
        choose(table, CPU, ("c", "DSV4_OP_KERNEL=c"))
    with pytest.raises(ConfigError, match="unknown op variant 'c'"), force_variant(table, "c"):
        pass


def test_requirements_say_what_is_missing() -> None:
    gpu = on_cuda(9, 10)
    assert gpu.unmet(HOPPER) is None and gpu.unmet(Target.cuda_host((10, 0))) is None
    assert gpu.unmet(AMPERE) == "needs compute capability 9.x / 10.x, not 8.0"
    assert gpu.unmet(CPU) == "needs a CUDA device (tensors are on cpu)"
    triton = on_paths(dispatch.TRITON)
    assert triton.unmet(HOPPER) is None  # a CUDA host with triton installed
    assert triton.unmet(CPU) == "runs on the triton path, not torch"
    assert with_library("flash_mla").unmet(CPU) == "flash_mla is not installed"
    assert with_library("flash_mla").unmet(HOPPER) is None  # sglang's GPU hosts install it
    with pytest.raises(ConfigError, match="unknown library 'cutlass'"):
        with_library("cutlass")


def test_names_are_unique() -> None:
    with pytest.raises(ConfigError, match="must be unique"):
        OpTable("op", "a test op", (_variant("a", True), _variant("a", True)))


def test_resolve_follows_pins_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    table = OpTable("resolve_test", "a test op", (_variant("a", True), _variant("b", True)))
    first = resolve(table, "cpu")
    assert first.name == "a" and resolve(table, "cpu") is first  # read once, the same object
    with force_variant(table, "b"):
        assert resolve(table, "cpu").name == "b"
    monkeypatch.setenv("DSV4_RESOLVE_TEST_KERNEL", "b")
    assert resolve(table, "cpu").reason == "DSV4_RESOLVE_TEST_KERNEL=b"
    monkeypatch.setenv("DSV4_RESOLVE_TEST_KERNEL", "nope")
    with pytest.raises(ConfigError, match="DSV4_RESOLVE_TEST_KERNEL=nope: unknown"):
        resolve(table, "cpu")


def test_unverified_variants_need_the_opt_in_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    table = OpTable(
        "op", "a test op", (_variant("new", True), _variant("old", True, baseline=True))
    )
    assert choose(table, HOPPER, None).name == "old"
    assert choose(table, HOPPER, None).reason == "the baseline"
    assert UNVERIFIED_KERNELS.name in choose(table, HOPPER, None, unverified=True).reason
    assert choose(table, CPU, None).name == "new"  # the interpreter runs what the tests cover
    assert choose(table, CPU, None, unverified=False).name == "old"
    assert unverified_enabled() is None
    monkeypatch.setenv(UNVERIFIED_KERNELS.name, "1")
    assert unverified_enabled() is True
    with force_unverified(False):
        assert unverified_enabled() is False


def test_a_stand_in_module_counts_as_installed(monkeypatch):
    """A library is read from ``sys.modules`` where it stands there: a stand-in without a
    module spec is importable, a ``None`` entry is not (``find_spec`` raises for both), and
    elsewhere its spec decides."""
    from dsv4_backend.kernels import variants

    monkeypatch.setitem(sys.modules, "flash_mla", types.ModuleType("flash_mla"))
    assert variants._importable("flash_mla")
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    assert not variants._importable("flash_mla")
    assert variants._importable("torch")
    assert not variants._importable("no_such_dsv4_library")
