"""The A/B tool (``python -m dsv4_backend ab``): traces, backends, verdicts, reports, refusals.

Runs use the torch kernel path, so the file stays fast in the interpreter session the suite runs
in: comparisons with the reference a small trace (2 requests crossing the 128-token window /
c128 block, 2 speculative rounds, 2 decodes), checks of the tool's mechanics (warm-up, verdicts,
report) a tiny one (1 request of 40 tokens, every mode on both paths).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stress import sized

from dsv4_backend.cache import fp8_format
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import BatchError, ConfigError
from dsv4_backend.kernels.dispatch import force_path
from dsv4_backend.planning import ForwardKind, per_step_draft_out_cache_loc, plan
from dsv4_backend.testing.simulation.v41 import tiny_v41
from dsv4_backend.tools.ab.backends import DSV4Backend, ReferenceBackend
from dsv4_backend.tools.ab.cli import add_ab_parser, main, run_ab
from dsv4_backend.tools.ab.report import (
    ERROR_RATIO_LIMITS,
    FAIL_COLOUR,
    TIME_MS_LIMITS,
    build_report,
    plot_errors,
    plot_step_times,
    plot_times,
    render_markdown,
)
from dsv4_backend.tools.ab.runner import run_trace
from dsv4_backend.tools.ab.tolerance import (
    CPU_ATOL,
    E4M3_RMS_ROUNDOFF,
    default_tolerance,
    same_format_atol,
)
from dsv4_backend.tools.ab.trace import (
    BOUNDARY,
    MODES,
    NUM_DRAFT_STEPS,
    NUM_DRAFT_TOKENS,
    PATHS,
    SHARE_TAIL,
    build_trace,
)

CONFIG = DSV4AttentionConfig.tiny(speculative=True)
SMALL = dict(num_requests=2, max_len=150, cycles=2, decode_steps=2)
SMALL_ARGS = ["--requests", "2", "--max-len", "150", "--cycles", "2", "--decode-steps", "2"]
TINY = dict(num_requests=1, max_len=40, cycles=2, decode_steps=2)
TINY_ARGS = ["--requests", "1", "--max-len", "40", "--cycles", "2", "--decode-steps", "2"]
#: Every mode of an EAGLE trace (the default; ``dspark`` steps belong to ``--spec dspark``).
ALL_LABELS = [f"{m}/{p}" for m in MODES if m != "dspark" for p in PATHS]


@pytest.fixture(scope="module")
def trace():
    return build_trace(CONFIG, **SMALL, seed=0)


@pytest.fixture(scope="module")
def tiny_trace():
    return build_trace(CONFIG, **TINY, seed=0)


def torch_dsv4(**kwargs) -> DSV4Backend:
    return DSV4Backend("dsv4-torch", path="torch", **kwargs)


# --------------------------------------------------------------------------------- the trace
@settings(max_examples=sized(10, 100), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    requests=st.integers(1, 4),
    max_len=st.integers(30, 700),
    cycles=st.integers(0, 4),
    decode_steps=st.integers(0, 4),
    prefix_share=st.booleans(),
)
def test_trace_fits_its_pool_and_covers_every_mode(
    seed: int, requests: int, max_len: int, cycles: int, decode_steps: int, prefix_share: bool
) -> None:
    build = lambda: build_trace(  # noqa: E731
        CONFIG, num_requests=requests, max_len=max_len, cycles=cycles,
        decode_steps=decode_steps, seed=seed, prefix_share=prefix_share,
    )  # fmt: skip
    headroom = NUM_DRAFT_TOKENS * cycles + decode_steps
    if prefix_share and max_len - headroom < CONFIG.page_size + 2 * SHARE_TAIL:
        with pytest.raises(ConfigError, match="--prefix-share needs"):
            build()
        return
    trace = build()
    assert max(trace.max_lens) <= max_len
    assert len(trace.max_lens) == requests + prefix_share
    pool = trace.build_model().pool
    for step in trace.steps:
        batch = step.batch(pool)  # the pool's builders accept every step
        assert batch.num_rows == len(step.rows())
        assert all(p < trace.max_lens[r] for r, p in step.rows())
    expected = {"prefill/eager", "prefill/graph"}
    expected |= {f"{m}/{p}" for m in MODES[1:4] for p in PATHS[: min(cycles, 2)]}
    expected |= {f"decode/{p}" for p in PATHS[: min(decode_steps, 2)]}
    assert set(trace.labels) == expected
    if cycles:
        assert any(step.rejected for step in trace.steps), "no verify rejects a draft"
        drafts = {s.step_id for s in trace.steps if s.mode == "draft"}
        assert drafts == set(range(NUM_DRAFT_STEPS - 1))  # the last step only samples
    if max_len - headroom >= BOUNDARY and cycles + decode_steps and not prefix_share:
        # Every request crosses a multiple of 128 after its prompt.
        for r in range(requests):
            prompt = next(s for s in trace.steps if s.mode == "prefill" and s.path == "graph")
            start = prompt.lens[r] + prompt.extend_lens[r]
            assert trace.max_lens[r] // BOUNDARY > (start - 1) // BOUNDARY


def test_given_prompt_lengths_make_one_request_each() -> None:
    """``--prompt-lens``: the GPU check's prompts of 3 (mod 4) past c128 boundaries; a length
    without room for the rounds and decodes is refused, naming the range."""
    trace = build_trace(CONFIG, max_len=300, cycles=2, decode_steps=2, prompt_lens=(131, 259))
    first, rest = (s.extend_lens for s in trace.steps if s.mode == "prefill")
    assert [a + b for a, b in zip(first, rest, strict=True)] == [131, 259]
    assert len(trace.max_lens) == 2
    pool = trace.build_model().pool
    assert all(step.batch(pool).num_rows == len(step.rows()) for step in trace.steps)
    with pytest.raises(
        ConfigError,
        match=r"prompt lengths \[131, 299\]; expected one or more "
        r"in \[2, 290\]",
    ):
        build_trace(CONFIG, max_len=300, cycles=2, decode_steps=2, prompt_lens=(131, 299))


# ------------------------------------------------------------------------------ the verdict
def test_reference_against_itself_is_exact(tiny_trace) -> None:
    result = run_trace(tiny_trace, ReferenceBackend(), ReferenceBackend())
    assert result.passed and list(result.modes) == ALL_LABELS
    for stats in result.modes.values():
        assert stats.steps > 0 and stats.rows > 0
        assert stats.max_abs_error == 0.0 and stats.min_cosine == pytest.approx(1.0)


class _CountingReference(ReferenceBackend):
    """The reference backend, counting its prepares and steps."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared = self.ran = 0

    def prepare(self, trace, device) -> None:
        self.prepared += 1
        super().prepare(trace, device)

    def run(self, step):
        self.ran += 1
        return super().run(step)


def test_warm_up_runs_every_step_untimed_then_starts_afresh(tiny_trace) -> None:
    """With warm-up (the default on CUDA) each backend runs the whole trace once untimed, is
    prepared again, and the timed run compares as without it; its seconds are reported apart."""
    a, b = _CountingReference(), _CountingReference()
    result = run_trace(tiny_trace, a, b, warmup=True)
    assert result.passed
    assert all(stats.max_abs_error == 0.0 for stats in result.modes.values())
    for side in (a, b):
        assert side.prepared == 2 and side.ran == 2 * len(tiny_trace.steps)
    assert set(result.warmup_s) == {"a", "b"} and min(result.warmup_s.values()) > 0
    report = build_report(result)
    assert report["warmup_s"] == result.warmup_s
    assert "warm-up pass before timing" in render_markdown(report)
    cold = run_trace(tiny_trace, ReferenceBackend(), ReferenceBackend())  # cpu: no warm-up
    assert cold.warmup_s == {} and "no warm-up pass" in render_markdown(build_report(cold))


def test_package_matches_reference_on_every_mode(trace) -> None:
    result = run_trace(trace, torch_dsv4(), ReferenceBackend())
    assert result.passed, result.failed
    assert list(result.modes) == ALL_LABELS
    for stats in result.modes.values():
        assert 0 < stats.max_abs_error < 1e-4
        assert stats.min_cosine > 0.99999
        assert all(len(t) == stats.steps for side in stats.times.values() for t in side.values())
    # Rows after a rejected draft are not compared.
    verify_rows = sum(len(s.rows()) for s in trace.steps if s.mode == "verify")
    compared = result.modes["verify/eager"].rows + result.modes["verify/graph"].rows
    assert compared < verify_rows


def test_dspark_trace_matches_reference() -> None:
    """``--spec dspark``: draft blocks through the draft head's stages (eager, graph, DP
    padding) and the target's verify of each block, every row within tolerance; a perturbed
    draft plan (causal rows, as a verify plans them) fails the dspark modes only."""
    trace = build_trace(CONFIG, **{**SMALL, "decode_steps": 0}, seed=1, spec="dspark", dp_pad=1)
    assert {s.mode for s in trace.steps} == {"prefill", "dspark", "verify"}
    result = run_trace(trace, torch_dsv4(), ReferenceBackend())
    assert result.passed, result.failed
    assert {"dspark/eager", "dspark/graph"} <= set(result.modes)
    assert result.modes["dspark/eager"].rows == 2 * 3  # one block of 3 rows per request

    class CausalDraft(DSV4Backend):
        """Plans every draft block as a causal verify of the draft's layers."""

        def prepare(self, trace, device) -> None:
            super().prepare(trace, device)
            draft = self.draft
            verify = ForwardKind.TARGET_VERIFY
            draft.plan = lambda view, graph=False: plan(  # type: ignore[method-assign]
                draft.config, dataclasses.replace(view, kind=verify)
            )

    perturbed = run_trace(trace, CausalDraft("causal", path="torch"), ReferenceBackend())
    assert not perturbed.passed
    assert {label.split("/")[0] for label in perturbed.failed} == {"dspark"}


def test_v41_trace_runs_the_late_layer_tail_on_both_sides() -> None:
    """``--v41 --bounded-replay``: prefills (eager, graph) whose late layers run over their
    late-layer tail on both sides (the package plans the tail, the reference gives its rows of
    the pass with the tail's window floors), then decodes: every row of every layer within
    tolerance. The package without the tail's window floors fails the prefills only; without
    the bounded replay on one side the rows of the late layers differ, and the step fails."""
    trace = build_trace(
        tiny_v41(), num_requests=2, max_len=300, cycles=0, decode_steps=2, bounded_replay=True
    )
    assert [s.label for s in trace.steps] == [
        "prefill/eager", "prefill/graph", "decode/eager", "decode/graph",
    ]  # fmt: skip
    result = run_trace(trace, torch_dsv4(), ReferenceBackend())
    assert result.passed, result.failed
    assert all(0 < stats.max_abs_error < 1e-4 for stats in result.modes.values())

    def no_floors(config, batch, **kwargs):
        return plan(config, dataclasses.replace(batch, window_floors=None), **kwargs)

    perturbed = run_trace(trace, DSV4Backend("no-floors", path="torch", planner=no_floors),
                          ReferenceBackend())  # fmt: skip
    assert {label.split("/")[0] for label in perturbed.failed} == {"prefill"}
    plain = run_trace(dataclasses.replace(trace, bounded_replay=False), torch_dsv4(),
                      ReferenceBackend())  # fmt: skip
    assert plain.passed, plain.failed  # the full prefill on both sides

    class TailOnOneSide(DSV4Backend):
        def prepare(self, trace, device) -> None:
            super().prepare(dataclasses.replace(trace, bounded_replay=True), device)

    one_sided = run_trace(dataclasses.replace(trace, bounded_replay=False),
                          TailOnOneSide("tail", path="torch"), ReferenceBackend())  # fmt: skip
    assert "returned rows" in str(one_sided.modes["prefill/eager"].error)


@pytest.mark.sglang
def test_a_v41_trace_is_refused_by_the_sglang_backends() -> None:
    from dsv4_backend.tools.ab.sglang_backend import SglangBackend

    trace = build_trace(tiny_v41(), num_requests=1, max_len=40, cycles=0, decode_steps=1)
    with pytest.raises(ConfigError, match=r"DeepSeek-V4\.1 traces run the dsv4 backends"):
        SglangBackend("dsv4").prepare(trace, torch.device("cpu"))


def test_prefix_share_trace_serves_a_cache_hit(tmp_path: Path, capsys) -> None:
    """``--prefix-share``: request 2 shares request 0's prompt and its first page, and starts at
    256 in a prefill step of its own; every mode still matches the reference."""
    trace = build_trace(CONFIG, num_requests=2, max_len=290, cycles=1, decode_steps=1,
                        prefix_share=True)  # fmt: skip
    assert trace.shared_pages == ((2, (0, 1)),)
    ((owner, prompt),) = (spec for r, spec in trace.same_tokens if r == 2)
    assert owner == 0 and prompt > 256
    join = [s for s in trace.steps if s.requests == (2,)]
    assert [(s.mode, s.lens) for s in join] == [("prefill", (256,))]
    assert all(2 in s.requests for s in trace.steps if s.mode != "prefill")
    pool = trace.build_model().pool
    assert torch.equal(pool.req_to_token[3, :256], pool.req_to_token[1, :256])
    assert not torch.equal(pool.req_to_token[3, 256:512], pool.req_to_token[1, 256:512])
    args = ["--requests", "2", "--max-len", "290", "--cycles", "1", "--decode-steps", "1"]
    status = main(["--a", "dsv4-torch", *args, "--prefix-share", "--out", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0, report["failed"]  # every mode matches the reference
    assert report["trace"]["prefix_hits"] == [{"request": 2, "owner": 0, "tokens": 256}]
    assert (
        "request 2 starts from request 0's cached 256 tokens"
        in (tmp_path / "report.md").read_text()
    )


def stale_draft_slice_plan(config, batch, *, widths=None):
    """Section 5, bug 1: every draft step planned with step 0's write slots."""
    if batch.draft is not None:
        d = batch.draft
        per_step = per_step_draft_out_cache_loc(
            batch.out_cache_loc, batch.batch_size, 1, d.num_steps
        )
        batch = dataclasses.replace(batch, out_cache_loc=per_step[0].repeat_interleave(d.num_steps))
    return plan(config, batch, widths=widths)


def test_wrong_draft_slice_is_refused_and_names_the_draft_mode(trace) -> None:
    """Once served silently (error ~0.1): now the write-slot check refuses the plan."""
    result = run_trace(trace, torch_dsv4(planner=stale_draft_slice_plan), ReferenceBackend())
    assert not result.passed
    assert result.failed == ["draft/eager"]  # the run stops at the first refusal
    error = result.modes["draft/eager"].error
    assert "BatchError" in error and "out_cache_loc (draft step 1's slots" in error
    report = build_report(result)
    assert report["failed"] == ["draft/eager"]
    assert "**FAILED**: draft/eager" in render_markdown(report)


def test_a_backend_that_raises_fails_its_mode_and_stops(trace) -> None:
    def no_verify(config, batch, *, widths=None):
        if batch.kind is ForwardKind.TARGET_VERIFY:
            raise BatchError("verify refused")
        return plan(config, batch, widths=widths)

    result = run_trace(trace, torch_dsv4(planner=no_verify), ReferenceBackend())
    assert result.failed == ["verify/eager"]
    assert "BatchError: verify refused" in result.modes["verify/eager"].error
    assert result.modes["decode/graph"].steps == 0  # nothing ran after the failure


def test_tolerance_is_per_mode_and_overridable(tiny_trace) -> None:
    result = run_trace(
        tiny_trace, torch_dsv4(), ReferenceBackend(), atol={"*": 1e-3, "verify": 1e-12}
    )
    assert result.failed == ["verify/eager", "verify/graph"]
    assert result.modes["decode/eager"].atol == 1e-3


def test_tolerance_follows_both_sides_cache_formats() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_tolerance(cpu, "dense", "dense").atol == CPU_ATOL == same_format_atol(cpu)
    assert default_tolerance(cuda, "fp8", "fp8").atol == pytest.approx(12 * 2**-8)
    for device in (cpu, cuda):
        assert default_tolerance(device, "fp8", "fp8").median_row_rtol is None
        mixed = default_tolerance(device, "fp8", "dense")
        assert mixed == default_tolerance(device, "dense", "fp8")
        assert mixed.median_row_rtol == pytest.approx(2**-4 / 3**0.5)
        assert mixed.atol == pytest.approx(16 * 2**-4)
        assert "e4m3" in mixed.derivation and "ue8m0" in mixed.derivation


def test_fp8_against_dense_passes_within_e4m3_rounding(trace) -> None:
    """``--a dsv4-fp8 --b dsv4``: every mode far over the dense bound (1e-4), within FP8's."""
    result = run_trace(trace, torch_dsv4(fmt="fp8"), torch_dsv4())
    assert result.passed, result.failed
    assert result.tolerance.median_row_rtol == E4M3_RMS_ROUNDOFF
    for stats in result.modes.values():
        assert stats.max_abs_error > 100 * CPU_ATOL  # the rounding is there ...
        assert 0.3 * E4M3_RMS_ROUNDOFF < stats.median_row_error < 0.8 * E4M3_RMS_ROUNDOFF
    report = build_report(result)
    assert report["cache_formats"] == {"a": "fp8", "b": "dense"}
    assert "u/sqrt(3)" in render_markdown(report)


def test_fp8_quantisation_bug_fails_the_fp8_tolerance(trace, monkeypatch) -> None:
    """An encoder whose ue8m0 scale is one exponent too small saturates the largest values of
    every 64-channel group: the median row error goes to ~4x its bound and every mode fails."""
    exponent = fp8_format.ue8m0_exponent
    monkeypatch.setattr(fp8_format, "ue8m0_exponent", lambda amax: (exponent(amax) - 1).clamp(0))
    result = run_trace(trace, torch_dsv4(fmt="fp8"), torch_dsv4())
    assert result.failed == ALL_LABELS
    for stats in result.modes.values():
        assert stats.error is None and stats.max_abs_error <= stats.atol  # not a gross error
        assert stats.median_row_error > 2 * E4M3_RMS_ROUNDOFF
    assert "| decode/graph | **FAIL** |" in render_markdown(build_report(result))


@pytest.mark.sglang
def test_sglang_registry_backend_runs_the_trace(tiny_trace) -> None:
    """``sglang:dsv4`` (this package's adapter, FP8 caches, built through sglang's registry and
    draft factory) equals ``dsv4-fp8``. The CLI allows it on CUDA only; the driver itself is
    host-agnostic, so it is exercised here through the Python API."""
    from dsv4_backend.tools.ab.sglang_backend import SglangBackend

    with force_path("torch"):
        result = run_trace(tiny_trace, SglangBackend("dsv4"), torch_dsv4(fmt="fp8"))
    assert result.passed and list(result.modes) == ALL_LABELS
    assert all(s.max_abs_error < 1e-5 for s in result.modes.values())


def test_plot_shows_the_verdict_zero_bars_and_fixed_scales(tiny_trace, tmp_path: Path) -> None:
    """A failed run is framed in red, a passed one is not; zero errors and the reference's zero
    planning time are labelled; every axis has the same limits whatever the figures."""
    import matplotlib.image
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    passed = build_report(run_trace(tiny_trace, torch_dsv4(), torch_dsv4()))  # identical: 0
    failed = run_trace(tiny_trace, torch_dsv4(), ReferenceBackend(), atol={"decode": 0})
    failed = build_report(failed)
    assert passed["passed"] and failed["failed"] == ["decode/eager", "decode/graph"]
    assert "| decode/eager | **FAIL** |" in render_markdown(failed)
    corners = {}
    for name, report in (("passed", passed), ("failed", failed)):
        plot_times(report, tmp_path / f"{name}.png")
        corners[name] = tuple(matplotlib.image.imread(tmp_path / f"{name}.png")[1, 1, :3])
    assert corners["failed"] == pytest.approx(to_rgb(FAIL_COLOUR), abs=0.02)
    assert corners["passed"] == pytest.approx((1.0, 1.0, 1.0))
    fig, axes = plt.subplots(2, 2)
    for column, report in enumerate((passed, failed)):
        plot_errors(axes[0, column], report["modes"])
        plot_step_times(axes[1, column], report, "plan")
        assert axes[0, column].get_ylim() == pytest.approx(ERROR_RATIO_LIMITS)
        assert axes[1, column].get_ylim() == pytest.approx(TIME_MS_LIMITS)
    labels = [[t.get_text() for t in ax.texts] for ax in axes.flat]
    assert labels[0].count("0") == len(passed["modes"])  # every error is exactly 0
    assert labels[3].count("0") == len(failed["modes"])  # the reference's planning bars
    plt.close(fig)


# ----------------------------------------------------------------------------------- the CLI
def test_cli_writes_markdown_png_and_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "report"
    status = main(["--a", "dsv4-torch", *TINY_ARGS, "--out", str(out), "--json"])
    captured = capsys.readouterr()
    assert status == 0
    assert captured.err == ""  # no progress bar when stderr is not a terminal
    report = json.loads(captured.out)
    assert report == json.loads((out / "report.json").read_text())
    assert report["passed"] and report["failed"] == []
    assert report["a"] == {"name": "dsv4-torch", "kernels": "torch"}
    assert report["b"]["name"] == "reference" and report["device"] == "cpu"
    assert report["trace"]["requests"] == 1 and report["trace"]["seed"] == 0
    assert [m["label"] for m in report["modes"]] == ALL_LABELS
    for mode in report["modes"]:
        assert mode["max_abs_error"] < mode["atol"] == 1e-4 and mode["passed"]
        timing = mode["timing"]
        for side in ("a", "b"):
            for kind in ("plan_ms", "kernel_ms"):
                assert timing[side][kind]["median"] <= timing[side][kind]["p90"]
        assert timing["ratio_a_over_b"]["plan"] is None  # the reference does not plan
        assert timing["ratio_a_over_b"]["kernel"] > 0
    markdown = (out / "report.md").read_text()
    assert "**PASSED**" in markdown and "![time per mode](times.png)" in markdown
    assert all(f"| {label} |" in markdown for label in ALL_LABELS)
    assert (out / "times.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_exits_1_naming_the_modes_over_tolerance(tmp_path: Path, capsys) -> None:
    args = ["--a", "dsv4-torch", "--requests", "1", "--max-len", "40", "--cycles", "1"]
    status = main([*args, "--decode-steps", "1", "--atol", "decode=1e-12", "--out", str(tmp_path)])
    assert status == 1
    assert "**FAILED**: decode/eager" in capsys.readouterr().out


def test_config_file_gives_the_dimensions(tmp_path: Path, capsys) -> None:
    hf = {
        "num_hidden_layers": 5,
        "compress_ratios": [0, 0, 4, 128, 4, 0],  # the last is the MTP slot
        "num_attention_heads": 4,
        "head_dim": 192,
        "qk_rope_head_dim": 64,
        "index_topk": 8,
        "index_n_heads": 2,
        "index_head_dim": 64,
        "sliding_window": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    args = ["--a", "dsv4-torch", "--config", str(path), "--requests", "1", "--max-len", "40"]
    status = main([*args, "--cycles", "2", "--decode-steps", "2", "--out", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0, report["failed"]
    # One layer per compress ratio by default.
    assert report["config"]["compress_ratios"] == [0, 4, 128]
    assert (report["config"]["num_heads"], report["config"]["head_dim"]) == (4, 192)


def test_add_ab_parser_wires_the_command() -> None:
    parser = argparse.ArgumentParser(prog="dsv4-backend")
    add_ab_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["ab", "--requests", "2", "--atol", "verify=2e-4", "--quiet"])
    assert args.run is run_ab and args.requests == 2 and args.atol == ["verify=2e-4"]
    # B is resolved by the mode: the reference for a trace, dsv4-torch for --server.
    assert (args.a, args.b, args.max_len, args.out) == ("dsv4", None, 300, Path("ab-report"))
    assert not args.server


def _bad_config(tmp_path: Path) -> list[str]:
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"num_attention_heads": 32, "head_dim": 128}))
    return ["--config", str(path)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--a", "flashattn"], "unknown backend 'flashattn'"),
        (["--b", "sglang:dsv4_builtin", "--device", "cpu"], "needs a CUDA device"),
        (["--device", "tpu"], "--device 'tpu'"),
        ("bad-config", "neither compress_ratios nor layer_types + compress_rates"),
        (["--config", "/nonexistent/config.json"], "cannot read it"),
        (["--layers", "0,9"], "layer ids must be in 0 ... 3"),
        (["--atol", "prefil=1e-3"], "--atol names ['prefil']"),
        (["--max-len", "12"], "max_len=12 leaves no room for a prompt"),
        (["--prefix-share", "--max-len", "150"], "--prefix-share needs a prompt longer than"),
        (["--max-len", str(10**9)], "--max-len 1000000000: expected at most 65536"),
        (["--atol", "-1"], "--atol '-1': the tolerance must be a finite number >= 0"),
        (["--atol", "verify=nan"], "--atol 'verify=nan': the tolerance must be a finite number"),
        ("out-under-a-file", "is a file, not a folder"),
        (["--bounded-replay"], "--bounded-replay is DeepSeek-V4.1's (--v41)"),
        (["--v41", "--layers", "0"], "--v41 is the tiny DeepSeek-V4.1 configuration"),
        (["--v41", "--cycles", "1"], "a DeepSeek-V4.1 trace has prefills and decodes only"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    args: list[str] | str, message: str, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "never"
    if args == "bad-config":
        args = _bad_config(tmp_path)
    elif args == "out-under-a-file":  # refused before the run, not after it
        (tmp_path / "file").write_text("")
        args, out = [], tmp_path / "file" / "report"
    status = main([*args, "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("dsv4-backend ab: error: ")
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("out", ["/proc/forbidden", "/sys/forbidden"])
def test_unwritable_out_is_refused_before_the_trace_runs(out: str, capsys, monkeypatch) -> None:
    """Root passes ``os.access`` there; the probe file is what fails, before any step runs."""
    if not Path(out).parent.is_dir():
        pytest.skip(f"{Path(out).parent} does not exist here")

    def no_run(*args, **kwargs):
        raise AssertionError("the trace ran")

    monkeypatch.setattr("dsv4_backend.tools.ab.runner.run_trace", no_run)
    status = main(["--a", "dsv4-torch", *SMALL_ARGS, "--out", out, "--quiet"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert err.startswith(f"dsv4-backend ab: error: --out {out}: cannot write a report there (")


def test_out_is_made_before_the_run_and_keeps_no_probe(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "new" / "report"
    seen = []

    def run_trace_seeing_out(*args, **kwargs):
        seen.append(out.is_dir())
        raise ConfigError("stop here")

    monkeypatch.setattr("dsv4_backend.tools.ab.runner.run_trace", run_trace_seeing_out)
    assert main(["--a", "dsv4-torch", *SMALL_ARGS, "--out", str(out), "--quiet"]) == 2
    assert seen == [True] and list(out.iterdir()) == []


@pytest.mark.parametrize("args", [["--requests", "x"], ["--max-len"], ["--bogus"]])
def test_argument_errors_are_one_line_and_status_2(args: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.count("\n") == 1 and err.startswith("dsv4-backend ab: error: ")
    assert args[0] in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_refused(capsys) -> None:
    assert main(["--device", "cuda", "--quiet"]) == 2
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err
