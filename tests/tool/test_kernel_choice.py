"""The kernel choice a backend reads once (``compute/kernel_choice.py``) and what ``info`` and
``ab`` make of it: every op's variants with where they run, the choice here and on a CUDA host
of capability 9.0 / 10.0, and a named variant that cannot run refused in one line (exit 2)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from dsv4_backend import __main__ as cli
from dsv4_backend.compute.kernel_choice import TABLES, describe, kernel_choice
from dsv4_backend.config import DSV4AttentionConfig
from dsv4_backend.errors import ConfigError
from dsv4_backend.kernels import dispatch
from dsv4_backend.kernels.variants import resolve
from dsv4_backend.self_check.check import CHECKED

VARIANT_KEYS = {
    "name", "takes", "needs", "setting", "runs_here", "reason", "gpu_verified", "baseline",
    "self_check",
}  # fmt: skip


def test_every_table_is_chosen_once_and_the_ops_use_that_choice() -> None:
    choice = kernel_choice("cpu")
    assert [c.op for c in choice.chosen] == [t.op for t in TABLES]
    assert len({t.op for t in TABLES}) == len(TABLES) == 12
    for table in TABLES:  # the very objects the ops resolve at a forward
        assert choice[table.op] is resolve(table, "cpu")
    assert choice.lines()[0].startswith("plan: ")
    with pytest.raises(ConfigError, match="unknown op 'attn'"):
        choice["attn"]


def test_describe_lists_every_variant_and_the_cuda_choices() -> None:
    """The CUDA columns: the ops the self-check decides show the first variant in preference
    order that runs there (FlashMLA for attention on sglang's fp8 caches; DeepGEMM needs the
    fp8 selection, not the default), the others the rule without verdicts."""
    checked = {table.op for table in CHECKED}
    kernels = json.loads(json.dumps(describe("cpu", checked)))  # as info --json prints it
    assert set(kernels["ops"]) == {t.op for t in TABLES}
    for table in TABLES:
        entry = kernels["ops"][table.op]
        assert [v["name"] for v in entry["variants"]] == list(table.names)
        assert all(set(v) == VARIANT_KEYS for v in entry["variants"])
        assert all(v["runs_here"] == (v["reason"] is None) for v in entry["variants"])
        assert set(entry["chosen"]) == {"here", "cuda 9.0", "cuda 10.0"}
    attention = kernels["ops"]["attention"]
    without = describe("cpu")["ops"]
    for capability in ("cuda 9.0", "cuda 10.0"):
        picks = {op: entry["chosen"][capability]["variant"] for op, entry in kernels["ops"].items()}
        assert picks["attention"] == "flashmla" and picks["indexer"] == "bounded"
        assert picks["indexer_topk"] == "flashinfer" and picks["compressor"] == "fused"
        assert picks["low_ratio_rows"] == picks["low_ratio_scores"] == "torch"  # not checked
        assert without["attention"]["chosen"][capability]["variant"] == "triton"
    ws = next(v for v in attention["variants"] if v["name"] == "ws")
    assert not ws["runs_here"] and ws["gpu_verified"] is None and not ws["baseline"]


def test_torch_path_runs_every_torch_variant() -> None:
    with dispatch.force_path(dispatch.TORCH):
        choice = kernel_choice("cpu")
    names = {c.op: c.name for c in choice.chosen}
    assert names["attention"] == names["plan"] == names["indexer"] == "torch"
    assert names["compressor"] == names["cache_store"] == "torch"


def test_info_json_and_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kernels"]["device"] == "cpu"
    assert report["kernels"]["ops"]["attention"]["chosen"]["cuda 9.0"]["variant"] == "flashmla"
    assert report["self_check"] == "self-check: not run for cpu (DSV4_SELF_CHECK=auto)"
    assert cli.main(["info", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "Kernel variant of each op for tensors on cpu" in text and "attention/ws" in text
    if not torch.cuda.is_available():
        assert cli.main(["info", "--device", "cuda:0"]) == 2
        err = capsys.readouterr().err
        assert (
            err == "dsv4-backend info: error: --device cuda:0: no CUDA device is visible to torch\n"
        )
    assert cli.main(["info", "--device", "gpu7"]) == 2
    assert "--device 'gpu7': expected e.g. cpu or cuda:0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ws", "DSV4_ATTENTION_KERNEL=ws: the ws attention variant cannot run on cpu"),
        ("fastest", "DSV4_ATTENTION_KERNEL=fastest: unknown attention variant"),
    ],
)
def test_ab_refuses_a_named_variant_in_one_line(
    name: str, message: str, monkeypatch: pytest.MonkeyPatch, capsys, tmp_path
) -> None:
    monkeypatch.setenv("DSV4_ATTENTION_KERNEL", name)
    status = cli.main(["ab", "--out", str(tmp_path / "never"), "--quiet"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert err.startswith(f"dsv4-backend ab: error: {message}")
    assert not (tmp_path / "never").exists()


@pytest.mark.sglang
def test_the_backend_logs_its_choice_once(caplog: pytest.LogCaptureFixture) -> None:
    from dsv4_backend.sglang_adapter import backend as adapter
    from dsv4_backend.sglang_adapter.backend import DSV4AttentionBackend
    from dsv4_backend.testing import harness
    from dsv4_backend.testing.simulation import PagedRequestPool

    config = DSV4AttentionConfig.tiny()
    pool = PagedRequestPool(config, [40], generator=torch.Generator().manual_seed(0))
    runner = harness.mock_runner(pool, harness.tiny_hf_config(config))
    adapter._logged_choices.clear()
    with caplog.at_level(logging.INFO, logger=adapter.__name__):
        first = DSV4AttentionBackend(runner)  # type: ignore[arg-type]
        DSV4AttentionBackend(runner)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if "dsv4 kernels" in r.getMessage()]
    assert len(lines) == 1 and "attention: triton" in lines[0]
    assert first.kernels == kernel_choice("cpu")


def test_the_docs_table_lists_every_variant() -> None:
    """docs/kernels.md's variant table has one row per variant of every table, in the
    tables' order, each naming its file and whether it is the op's baseline."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "kernels.md").read_text()
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| ") and line.count("|") == 8 and "`" in line.split("|")[2]
    ]
    listed = [(op, name.strip("`")) for op, name, *_ in rows]
    assert listed == [(t.op, v.name) for t in TABLES for v in t.variants]
    for (_, name, *_, verified, file), (table, variant) in zip(
        rows, [(t, v) for t in TABLES for v in t.variants], strict=True
    ):
        module = getattr(variant.entry, "scores", variant.entry).__module__  # indexer: scores
        assert file.strip("`") == module.replace(".", "/").removeprefix("dsv4_backend/") + ".py"
        assert ("baseline" in verified) == variant.baseline, (table.op, name, verified)
