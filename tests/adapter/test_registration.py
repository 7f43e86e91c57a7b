"""Registration with the real sglang 0.5.23: entry point, registry, CLI choices, opt-out, spawned
processes, draft factory, model override, idempotence, version range, and the ``info`` command.

The checks that need a fresh interpreter run ``sglang_probe.py`` in subprocesses (each also
runs ``info``), both started at once by one fixture; each test reads its facts.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from dsv4_backend import __main__ as cli
from dsv4_backend._versions import SUPPORTED_SGLANG, check_sglang_version
from dsv4_backend.errors import ConfigError, MissingBackendError
from dsv4_backend.registration import register
from dsv4_backend.sglang_adapter.factory import BACKEND_MODULE, DRAFT_MODULE, adapter_class

PROBE = Path(__file__).parents[1] / "support" / "sglang_probe.py"
OUR_FACTORY = "dsv4_backend.sglang_adapter.factory.create_dsv4_backend"
SGLANG_FACTORY = "sglang.srt.layers.attention.attention_registry.create_dsv4_backend"
SGLANG_DRAFT = "sglang.srt.speculative.draft_utils.DraftBackendFactory"


@dataclass(frozen=True)
class Run:
    """A finished subprocess of :func:`runs`; ``facts`` is where a probe wrote its JSON."""

    returncode: int
    stdout: str
    stderr: str
    facts: Path

    def succeeded(self) -> Run:
        """Return ``self`` after checking the exit status, showing stderr when it failed."""
        assert self.returncode == 0, f"exit {self.returncode}:\n{self.stderr[-4000:]}"
        return self


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Run both probes concurrently, each in a fresh interpreter.

    ``loaded``: plugins loaded as by default; ``opted_out``: ``SGLANG_PLUGINS`` names only
    another plugin.
    """
    out = tmp_path_factory.mktemp("probes")
    env = {key: value for key, value in os.environ.items() if key != "SGLANG_PLUGINS"}
    commands = {
        "loaded": ([str(PROBE), str(out / "loaded.json"), "--full"], env),
        "opted_out": (
            [str(PROBE), str(out / "opted_out.json")],
            {**env, "SGLANG_PLUGINS": "some_other_plugin"},
        ),
    }
    processes = {
        name: subprocess.Popen(
            [sys.executable, *args],
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (args, child_env) in commands.items()
    }
    results = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=300)
        results[name] = Run(process.returncode, stdout, stderr, out / f"{name}.json")
    return results


@pytest.fixture(scope="module")
def loaded(runs: dict[str, Run]) -> dict[str, Any]:
    """The probe's facts with this package's plugin loaded."""
    return json.loads(runs["loaded"].succeeded().facts.read_text())


@pytest.fixture(scope="module")
def opted_out(runs: dict[str, Run]) -> dict[str, Any]:
    """The probe's facts with ``SGLANG_PLUGINS`` naming only another plugin."""
    return json.loads(runs["opted_out"].succeeded().facts.read_text())


def test_entry_point_names_a_zero_argument_register() -> None:
    (entry,) = [
        ep for ep in metadata.entry_points(group="sglang.srt.plugins") if ep.name == "dsv4_backend"
    ]
    assert entry.value == "dsv4_backend.registration:register"
    assert entry.load() is register
    assert not inspect.signature(register).parameters


def test_sglang_requirement_is_the_supported_range() -> None:
    requirements = [Requirement(text) for text in metadata.requires("dsv4-backend") or []]
    (sglang,) = [req for req in requirements if req.name == "sglang" and not req.marker]
    assert sglang.specifier == SpecifierSet(SUPPORTED_SGLANG)


@pytest.mark.sglang
def test_dependency_ranges_admit_sglangs_pins() -> None:
    """``pip install dsv4-backend[flashinfer]`` beside sglang 0.5.23 keeps sglang's pins."""
    ours = {
        canonicalize_name(req.name): req.specifier
        for req in map(Requirement, metadata.requires("dsv4-backend") or [])
    }
    pinned = [
        req
        for req in map(Requirement, metadata.requires("sglang") or [])
        if not req.marker and canonicalize_name(req.name) in ours
    ]
    assert {canonicalize_name(req.name) for req in pinned} >= {"torch", "flashinfer-python"}
    for req in pinned:
        for version in (spec.version for spec in req.specifier if spec.operator == "=="):
            assert version in ours[canonicalize_name(req.name)], f"{req} vs ours"


@pytest.mark.sglang
def test_dsv4_resolves_to_this_package_and_builtin_to_sglangs(loaded: dict[str, Any]) -> None:
    assert loaded["registry"] == {"dsv4": OUR_FACTORY, "dsv4_builtin": SGLANG_FACTORY}


@pytest.mark.sglang
def test_sglang_parser_accepts_both_names(loaded: dict[str, Any]) -> None:
    assert loaded["parsed"] == {"dsv4": "dsv4", "dsv4_builtin": "dsv4_builtin"}


@pytest.mark.sglang
def test_other_plugins_only_leave_sglang_untouched(opted_out: dict[str, Any]) -> None:
    assert opted_out["registry"] == {"dsv4": SGLANG_FACTORY, "dsv4_builtin": None}
    assert opted_out["parsed"] == {"dsv4": "dsv4", "dsv4_builtin": None}
    assert opted_out["draft_functions"] == {
        "decode": f"{SGLANG_DRAFT}._create_dsv4_decode_backend",
        "extend": f"{SGLANG_DRAFT}._create_dsv4_prefill_backend",
    }
    # info says whose backend serves and why
    assert f"{SGLANG_FACTORY}   (sglang's own)" in opted_out["info"]
    assert "SGLANG_PLUGINS=some_other_plugin does not name" in opted_out["info"]


@pytest.mark.sglang
def test_spawned_process_sees_the_same_registration(loaded: dict[str, Any]) -> None:
    assert loaded["spawned_registry"] == loaded["registry"]


@pytest.mark.sglang
@pytest.mark.parametrize(("kind", "module"), [("decode", DRAFT_MODULE), ("extend", BACKEND_MODULE)])
def test_draft_factory_entries_build_this_packages_backends(
    loaded: dict[str, Any], kind: str, module: str
) -> None:
    """The entry is ours, and calling it reaches ``module``'s class: with the probe's stand-in
    runner that class either builds, or raises from inside ``module`` (a missing module's
    MissingBackendError is tested with ``adapter_class`` below)."""
    assert loaded["draft_functions"][kind].startswith("dsv4_backend.")
    call = loaded["draft_calls"][kind]
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{module} is not installed"
    if "error" in call:
        assert spec.origin in call["files"], call
    else:
        assert call["stamp"] == "dsv4"
        assert call["backend_module"] == module


@pytest.mark.sglang
def test_builtin_draft_factories_stay_reachable(loaded: dict[str, Any]) -> None:
    assert loaded["draft_builtin"] == {
        "decode": f"{SGLANG_DRAFT}._create_dsv4_decode_backend",
        "extend": f"{SGLANG_DRAFT}._create_dsv4_prefill_backend",
    }
    assert loaded["draft_create_backend"].startswith("dsv4_backend.registration.")


@pytest.mark.sglang
def test_explicit_builtin_request_survives_the_model_override(loaded: dict[str, Any]) -> None:
    assert loaded["declared"] == {"dsv4_builtin": "dsv4_builtin", "unset": "dsv4"}


@pytest.mark.sglang
def test_register_again_changes_nothing_and_one_line_is_logged(loaded: dict[str, Any]) -> None:
    assert loaded["register_again_same_objects"]
    (line,) = loaded["log"]
    assert "dsv4" in line
    assert "dsv4_backend" in line


@pytest.mark.sglang
def test_info_reports_versions_paths_and_registry(loaded: dict[str, Any]) -> None:
    text = loaded["info"]
    for label in ("torch", "triton", "tvm", "flashinfer", "sglang"):
        assert f"\n  {label} " in text
    assert f"(supported: {SUPPORTED_SGLANG})" in text
    assert re.search(r"triton interpreter +yes", text)  # conftest sets TRITON_INTERPRET=1
    assert f"{OUR_FACTORY}   (this package)" in text


def test_cli_requires_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "info" in capsys.readouterr().err


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1"])
def test_supported_sglang_is_accepted(version: str) -> None:
    check_sglang_version(version)


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.5.24.dev0", "0.6.0", "unknown"])
def test_unsupported_sglang_is_refused_naming_version_and_range(version: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_sglang_version(version)
    assert f"found sglang {version}" in str(refused.value)
    assert SUPPORTED_SGLANG in str(refused.value)


def test_missing_backend_module_raises_missing_backend_error() -> None:
    module = "dsv4_backend.sglang_adapter.no_such_module"
    with pytest.raises(MissingBackendError, match=f"{module}.SomeBackend is missing"):
        adapter_class(module, "SomeBackend")


def test_import_error_inside_the_backend_propagates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "dsv4_broken_backend.py").write_text("import dsv4_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as raised:
        adapter_class("dsv4_broken_backend", "Backend")
    assert raised.value.name == "dsv4_no_such_dependency"
