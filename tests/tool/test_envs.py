"""Every environment variable the package reads is in one table (``dsv4_backend/envs.py``):
no other ``DSV4_*`` name appears in the package's strings, no module but ``envs.py`` reads a
``DSV4_*`` variable itself, a value outside a variable's choices is refused naming it, and
``info`` prints the table."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from dsv4_backend import __main__ as cli
from dsv4_backend import envs
from dsv4_backend.compute.kernel_choice import TABLES
from dsv4_backend.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2] / "dsv4_backend"
#: ``DSV4_`` words that are not sglang's (``SGLANG_DSV4_...``).
NAME = re.compile(r"(?<![A-Z_])DSV4_[A-Z0-9_]+")


def _strings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def test_every_variable_named_in_the_package_is_in_the_table() -> None:
    known = set(envs.VARIABLES) | {envs.kernel_variable(t.op) for t in TABLES}
    known |= {"DSV4_<OP>_KERNEL"}  # the pattern, as the docs spell it
    unknown = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in ROOT.rglob("*.py")
        for text in _strings(path)
        for name in NAME.findall(text.replace("DSV4_<OP>_KERNEL", ""))
        if name not in known
    )
    assert not unknown, "\n".join(unknown)
    assert envs.SELF_CHECK.name in known and len(envs.VARIABLES) >= 8


def test_only_the_table_reads_them() -> None:
    readers = []
    for path in ROOT.rglob("*.py"):
        if path.name == "envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "os.environ.get", "os.getenv",
            ):  # fmt: skip
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and str(first.value).startswith("DSV4_"):
                    readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not readers, readers


def test_a_value_outside_the_choices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envs.SELF_CHECK.name, "sometimes")
    with pytest.raises(ConfigError, match=r"DSV4_SELF_CHECK='sometimes'; expected one of"):
        envs.SELF_CHECK.get()
    monkeypatch.setenv(envs.SELF_CHECK.name, "")
    assert envs.SELF_CHECK.get() == "auto" and not envs.SELF_CHECK.is_set()


def test_info_prints_the_table(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setenv(envs.STRICT_CHECKS.name, "1")
    assert cli.main(["info", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["environment"]) == set(envs.VARIABLES)
    assert report["environment"]["DSV4_STRICT_CHECKS"] == "1"
