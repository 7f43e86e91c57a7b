"""The start-up self-check (``self_check/check.py``): a variant that gives wrong results or
raises fails with one ERROR line and the next in preference order becomes the default; a
named one that fails refuses the backend; one that cannot take the caches is passed over; the
verdicts are cached on disk under the key the docstring states; ``DSV4_SELF_CHECK`` selects
where it runs; ``scripts/dsv4 self-check`` runs it by hand.

The machinery tests run on the torch path with test variants in the attention table (the
torch kernel, perturbed or not: fast, and every step of the search is the one a GPU takes);
the command runs the interpreter's real attention kernels.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dsv4_backend import __main__ as cli
from dsv4_backend.compute.kernel_choice import TABLES, kernel_choice
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels import dispatch, variants
from dsv4_backend.kernels.attention.table import ATTENTION
from dsv4_backend.kernels.attention.torch import sparse_attention_torch
from dsv4_backend.kernels.variants import (
    FAILED,
    INAPPLICABLE,
    PASSED,
    Variant,
    resolve,
)
from dsv4_backend.self_check import check

#: Small widths: window and c4 layers, no drafts (three forwards).
WIDTHS = dataclasses.replace(check.PRESETS["tiny"], ratios=(0, 4), speculative=False)


def exact(*args: Any, **kwargs: Any) -> torch.Tensor:
    return sparse_attention_torch(*args, **kwargs)


def perturbed(*args: Any, **kwargs: Any) -> torch.Tensor:
    return sparse_attention_torch(*args, **kwargs) * 1.01  # a wrong kernel


def raising(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise RuntimeError("illegal instruction (a stand-in)")


def _variant(name: str, entry: Callable[..., torch.Tensor], **fields: Any) -> Variant:
    return Variant(name, entry, (), f"test variant {name}", **fields)


@pytest.fixture
def attention_variants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable]:
    """Replace the attention table's variants before its torch twin (on the torch path only
    these run), the verdict cache in ``tmp_path``; everything restored after."""
    original = ATTENTION.variants
    monkeypatch.setenv(check.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(ATTENTION.env, raising=False)

    def install(*candidates: Variant) -> None:
        object.__setattr__(ATTENTION, "variants", (*candidates, original[-1]))
        variants._choose_cached.cache_clear()

    with dispatch.force_path(dispatch.TORCH):
        yield install
    object.__setattr__(ATTENTION, "variants", original)
    variants._choose_cached.cache_clear()
    variants.clear_verdicts()
    check._checked.clear()


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


def test_a_wrong_variant_fails_and_the_next_is_the_default(attention_variants, caplog) -> None:
    attention_variants(_variant("wrong", perturbed), _variant("right", exact))
    with caplog.at_level(logging.ERROR):
        report = check.self_check(WIDTHS, "cpu", ops=[ATTENTION])
    wrong, right = report.verdicts
    assert (wrong.variant, wrong.outcome, right.variant, right.outcome) == (
        "wrong", FAILED, "right", PASSED,
    )  # fmt: skip
    assert wrong.figure.startswith("attention worst ") and "max |diff|" in wrong.figure
    assert float(wrong.figure.split()[2]) > 1 >= float(right.figure.split()[2])
    [line] = _errors(caplog)  # one line: the op, the variant, the figure, what comes next
    assert "the attention variant 'wrong' failed: attention worst" in line
    assert line.endswith("checking 'right' next")
    assert report.runs == 2 and report.chosen == {"attention": "right"}
    chosen = resolve(ATTENTION, "cpu")
    assert chosen.name == "right" and chosen.reason.startswith("passed the start-up self-check")


def test_a_raising_variant_fails_and_the_twin_is_left(attention_variants, caplog) -> None:
    attention_variants(_variant("raises", raising))
    with caplog.at_level(logging.ERROR):
        report = check.self_check(WIDTHS, "cpu", ops=[ATTENTION])
    [verdict] = report.verdicts
    assert verdict.outcome == FAILED
    assert verdict.figure == "raised RuntimeError: illegal instruction (a stand-in)"
    assert _errors(caplog)[0].endswith("torch (the twin) next")
    assert resolve(ATTENTION, "cpu").name == "torch"


def test_a_named_variant_that_fails_refuses_the_backend(
    attention_variants, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Named, it is the op's only candidate: the check fails it, the choice is refused with
    its figure, and a backend built with the self-check on is refused when built."""
    attention_variants(_variant("wrong", perturbed), _variant("right", exact))
    monkeypatch.setenv(ATTENTION.env, "wrong")
    report = check.self_check(WIDTHS, "cpu", ops=[ATTENTION])
    assert [(v.variant, v.outcome) for v in report.verdicts] == [("wrong", FAILED)]
    with pytest.raises(
        ConfigError,
        match="DSV4_ATTENTION_KERNEL=wrong: the wrong attention "
        "variant failed the start-up self-check on cpu, torch path: attention",
    ):
        kernel_choice("cpu")
    pytest.importorskip("sglang")
    from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
    from dsv4_backend.testing import harness
    from dsv4_backend.testing.simulation import PagedRequestPool

    variants.clear_verdicts()
    monkeypatch.setenv(check.SELF_CHECK_ENV, "1")
    monkeypatch.setattr(check, "CHECKED", (ATTENTION,))  # the other ops have only twins here
    config = DSV4AttentionConfig.tiny()
    pool = PagedRequestPool(config, [40], generator=torch.Generator().manual_seed(0))
    runner = harness.mock_runner(pool, harness.tiny_hf_config(config))
    with pytest.raises(ConfigError, match="failed the start-up self-check"):
        DSV4AttentionBackend(runner)  # type: ignore[arg-type]
    monkeypatch.setenv(ATTENTION.env, "right")
    backend = DSV4AttentionBackend(runner)  # type: ignore[arg-type]
    assert backend.self_check is not None and backend.kernels["attention"].name == "right"


def test_a_variant_that_cannot_take_the_caches_is_passed_over(attention_variants, caplog):
    def dense_only(device, window, extra, heads, dim) -> str | None:
        return None if window.fmt == "dense" else f"takes dense caches, not {window.fmt}"

    attention_variants(_variant("dense", perturbed, rejects=dense_only), _variant("right", exact))
    with caplog.at_level(logging.ERROR):
        report = check.self_check(WIDTHS, "cpu", ops=[ATTENTION])
    assert [(v.variant, v.outcome) for v in report.verdicts] == [
        ("dense", INAPPLICABLE), ("right", PASSED),
    ]  # fmt: skip
    assert report.verdicts[0].figure == "takes dense caches, not fp8"
    assert report.runs == 1 and not _errors(caplog)
    assert resolve(ATTENTION, "cpu").name == "right"


def test_verdicts_are_cached_under_the_stated_key(
    attention_variants, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    attention_variants(_variant("wrong", perturbed), _variant("right", exact))
    first = check.self_check(WIDTHS, "cpu", ops=[ATTENTION])
    again = check.self_check(WIDTHS, "cpu", ops=[ATTENTION])
    assert not first.cached and again.cached and again.runs == 0
    assert again.verdicts == first.verdicts and again.seconds < 0.5
    [stored] = (tmp_path / "cache").glob("*.json")
    key = json.loads(stored.read_text())["key"]
    assert set(key) == {"schema", "device", "capability", "path", "versions", "sources",
                        "widths", "named", "ops"}  # fmt: skip
    assert set(key["versions"]) >= {"torch", "triton", "flash_mla", "deep_gemm", "flashinfer",
                                    "dsv4_backend"}  # fmt: skip
    assert not check.self_check(WIDTHS, "cpu", ops=[ATTENTION], use_cache=False).cached
    wider = dataclasses.replace(WIDTHS, num_heads=16)
    assert not check.self_check(wider, "cpu", ops=[ATTENTION]).cached
    versions = check._library_versions()
    monkeypatch.setattr(check, "_library_versions", lambda: {**versions, "flash_mla": "9.9"})
    assert not check.self_check(WIDTHS, "cpu", ops=[ATTENTION]).cached
    monkeypatch.setenv(ATTENTION.env, "right")  # a named variant is its own key
    assert not check.self_check(WIDTHS, "cpu", ops=[ATTENTION]).cached
    assert len(list((tmp_path / "cache").glob("*.json"))) == 4
    stored.write_text("{not json")  # unreadable: run again
    monkeypatch.delenv(ATTENTION.env)
    monkeypatch.setattr(check, "_library_versions", lambda: versions)
    assert not check.self_check(WIDTHS, "cpu", ops=[ATTENTION]).cached


@pytest.mark.parametrize(("setting", "runs"), [("", False), ("0", False), ("1", True)])
def test_the_setting_selects_where_it_runs(
    setting: str, runs: bool, attention_variants, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset (auto): only on CUDA, so not on this CPU; 0: never; 1: here too, and the
    verdicts steer the choice; a second backend of the process reuses the first's."""
    attention_variants(_variant("wrong", perturbed), _variant("right", exact))
    monkeypatch.setattr(check, "CHECKED", (ATTENTION,))
    monkeypatch.setenv(check.SELF_CHECK_ENV, setting)
    config = DSV4AttentionConfig.tiny()
    report = check.at_startup(config, "fp8", 8, torch.device("cpu"))
    assert (report is not None) == runs
    assert resolve(ATTENTION, "cpu").name == ("right" if runs else "wrong")
    if runs:
        assert check.at_startup(config, "fp8", 8, torch.device("cpu")) is report
    monkeypatch.setenv(check.SELF_CHECK_ENV, "sometimes")
    with pytest.raises(ConfigError, match="DSV4_SELF_CHECK='sometimes'; expected one of"):
        check.at_startup(config, "fp8", 8, torch.device("cpu"))


def test_a_check_that_cannot_run_refuses_the_backend_naming_the_way_out(
    attention_variants, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise ValueError("out of memory (a stand-in)")

    attention_variants(_variant("right", exact))
    monkeypatch.setattr(check, "run_self_check", broken)
    monkeypatch.setenv(check.SELF_CHECK_ENV, "1")
    with pytest.raises(
        ConfigError,
        match=r"the start-up self-check could not run on cpu: "
        r"ValueError: out of memory \(a stand-in\); DSV4_SELF_CHECK=0 starts",
    ):
        check.at_startup(DSV4AttentionConfig.tiny(), "fp8", 8, torch.device("cpu"))


def test_every_op_ends_with_a_twin_that_needs_nothing() -> None:
    """The twin the self-check judges against runs anywhere; every checked op is in the
    kernel choice and every judged step has owners among them."""
    for table in TABLES:
        assert check.twin(table).needs == () and check.twin(table).rejects is None, table.op
    assert set(check.CHECKED) <= set(TABLES)
    for _, owners in check.STEP_OWNERS:
        assert set(owners) <= set(check.CHECKED)


def test_the_command_checks_the_interpreters_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``self-check --op attention --json`` runs the interpreter's attention kernel against
    the torch twin at the tiny widths and exits 0; a second run reads the cache."""
    monkeypatch.setenv(check.CACHE_DIR_ENV, str(tmp_path))
    try:
        assert cli.main(["self-check", "--op", "attention", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["path"] == "triton-interpreter" and report["ops"] == ["attention"]
        assert report["chosen"] == {"attention": "triton"} and not report["cached"]
        [verdict] = report["verdicts"]
        assert verdict["variant"] == "triton" and verdict["outcome"] == PASSED
        assert cli.main(["self-check", "--op", "attention"]) == 0
        assert "read from the cache" in capsys.readouterr().out
    finally:
        variants.clear_verdicts()
        variants._choose_cached.cache_clear()
    assert cli.main(["self-check", "--op", "attn"]) == 2
    assert "--op attn: expected one of ('plan'," in capsys.readouterr().err


def test_the_fp4_indexer_selection_is_checked(tmp_path: Path, monkeypatch) -> None:
    """Widths of a deployment with sglang's fp4 indexer (``indexer_selection="fp4"``): its
    model's c4 keys are fp4 pages, on which the interpreter's indexer (its first variant
    here) passes against the torch twin (the cache store's judge writes fp4 keys too:
    ``judge.judge_stores``)."""
    from dsv4_backend.kernels.indexer.table import INDEXER

    monkeypatch.setenv(check.CACHE_DIR_ENV, str(tmp_path))
    widths = dataclasses.replace(WIDTHS, indexer_selection="fp4")
    assert widths.config().indexer_selection == "fp4"
    try:
        report = check.self_check(widths, "cpu", ops=[INDEXER])
    finally:
        variants.clear_verdicts()
        variants._choose_cached.cache_clear()
        check._checked.clear()
    outcomes = {(v.op, v.variant): v.outcome for v in report.verdicts}
    assert outcomes[("indexer", "bounded")] == PASSED, report.verdicts
