"""``scripts/dsv4 ab --server``: two sglang servers (Engines) on the same prompts.

The comparison rule and the report are checked on made-up runs (a token that differs before
the first narrow step fails; one after it does not); the backends' names map to server
configurations, and sglang's own backends are refused on the CPU; one real run compares this
backend's Triton kernels (interpreter) with its torch kernels through sglang's Engine.
"""

from __future__ import annotations

import json

import pytest

from dsv4_backend.errors import ConfigError
from dsv4_backend.tools.ab.cli import main
from dsv4_backend.tools.cpu_server import ab_server, runs


def result(ids: tuple[int, ...], margins: tuple[float, ...]) -> runs.RequestResult:
    return runs.RequestResult(ids, tuple(-0.1 for _ in ids), margins, 0.5, 0)


def test_tokens_are_compared_before_the_first_narrow_step() -> None:
    a = result((1, 2, 3, 4), (2.0, 2.0, 0.2, 2.0))
    same_then_apart = result((1, 2, 9, 9), (2.0, 2.0, 2.0, 2.0))
    assert runs.agreement(a, same_then_apart).equal
    assert runs.agreement(a, same_then_apart).compared == 2
    apart_early = result((1, 7, 3, 4), (2.0, 2.0, 2.0, 2.0))
    found = runs.agreement(a, apart_early)
    assert not found.equal and found.first_difference == 1


def test_the_report_fails_a_request_whose_tokens_differ(tmp_path) -> None:
    config = runs.ServerConfig("dsv4")
    a = runs.Run(config, (result((1, 2), (3.0, 3.0)), result((5, 6), (3.0, 3.0))), 1.0)
    b = runs.Run(config, (result((1, 2), (3.0, 3.0)), result((5, 8), (3.0, 3.0))), 2.0)
    setup = dict(model="m", device="cpu", eagle=False, prompt_lengths=[3, 4], new_tokens=2, seed=0)
    report = ab_server.build_report(a, b, 0.5, setup)
    assert not report["passed"] and [r["ok"] for r in report["requests"]] == [True, False]
    assert report["a"]["output_tokens_per_s"] == 4.0 and report["b"]["output_tokens_per_s"] == 2.0
    text = ab_server.render_markdown(report)
    assert "**FAILED**: requests 1" in text and "| 1 | **FAIL** | 2 | 2 | 1 |" in text


@pytest.mark.parametrize(
    ("name", "device", "message"),
    [
        ("sglang:dsv4_builtin", "cpu", "run CUDA kernels"),
        ("reference", "cpu", "expected one of"),
        ("dsv4-torch", "cuda", "on a GPU the server runs the kernels it chooses"),
    ],
)
def test_backends_a_server_cannot_be_are_refused(name: str, device: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ab_server.server_config(name, device, eagle=False)


def test_server_configurations_of_the_backends() -> None:
    torch_side = ab_server.server_config("dsv4-torch", "cpu", eagle=True)
    assert torch_side.env["TRITON_INTERPRET"] == "0"
    assert torch_side.engine_args["speculative_algorithm"] == "EAGLE"
    builtin = ab_server.server_config("sglang:dsv4_builtin", "cuda", eagle=False)
    assert builtin.engine_args["attention_backend"] == "dsv4_builtin" and not builtin.env


@pytest.mark.server
def test_a_server_ab_of_triton_and_torch_kernels(tiny_checkpoint, tmp_path, capsys) -> None:
    out = tmp_path / "report"
    status = main(
        [
            "--server", "--model-path", str(tiny_checkpoint), "--a", "dsv4", "--b", "dsv4-torch",
            "--requests", "2", "--max-len", "40", "--new-tokens", "6", "--out", str(out),
        ]
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert status == 0 and report["passed"], (out / "report.md").read_text()
    assert [r["steps"] for r in report["requests"]] == [6, 6]
    assert "Server A/B: dsv4 (A) vs dsv4-torch (B)" in capsys.readouterr().out
