"""The package's import graph points only downward and has no cycle.

Layers, bottom to top (a module may import its own layer and the ones below):

0. ``errors``, ``_versions``, ``envs`` (and the package's ``__init__``)
1. ``config``, ``hf_config`` (its reader)
2. ``cache``, ``ops``
3. ``kernels``
4. ``planning``, ``compute``, ``self_check`` (the start-up self-check and its judge)
5. ``sglang_adapter``, ``registration``, ``info``
6. ``testing`` (the oracle: the reference, the simulation, the simulated host)
7. ``tools`` (the shipped commands: A/B, GPU check, AOT / SASS, precompile, the CPU server)
8. ``__main__`` (the command line, which runs the tools)

Every module of ``testing`` is one a tool needs (reached from ``tools`` or the command line);
a helper only tests use lives in ``tests/support/``.

Every import statement counts, including those inside functions and under ``TYPE_CHECKING``.
The reference (``testing.reference``) must stay independent of what it checks: it may import
only ``config`` and ``errors``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "dsv4_backend"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

LAYERS: dict[str, int] = {
    "": 0,
    "errors": 0,
    "_versions": 0,
    "envs": 0,
    "config": 1,
    "hf_config": 1,
    "cache": 2,
    "ops": 2,
    "kernels": 3,
    "planning": 4,
    "compute": 4,
    "self_check": 4,
    "sglang_adapter": 5,
    "registration": 5,
    "info": 5,
    "testing": 6,
    "tools": 7,
    "__main__": 8,
}
REFERENCE = f"{PACKAGE}.testing.reference"
REFERENCE_MAY_IMPORT = (f"{PACKAGE}.config", f"{PACKAGE}.errors")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> Iterator[str]:
    """Every ``dsv4_backend`` module ``path`` imports (``from a import b`` gives ``a.b`` when
    ``a/b`` is a module, else ``a``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [
                f"{module}.{alias.name}" if is_module(f"{module}.{alias.name}") else module
                for alias in node.names
            ]
        else:
            continue
        yield from (t for t in targets if t == PACKAGE or t.startswith(PACKAGE + "."))


def is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer_of(module: str) -> int:
    top = module.removeprefix(PACKAGE).lstrip(".").partition(".")[0]
    if top not in LAYERS:
        raise AssertionError(f"{module} is in no layer; add {top!r} to LAYERS")
    return LAYERS[top]


def import_graph() -> dict[str, set[str]]:
    graph = {module_name(p): set() for p in ROOT.rglob("*.py")}
    for path in ROOT.rglob("*.py"):
        graph[module_name(path)].update(imported_modules(path))
    return graph


GRAPH = import_graph()


def test_every_module_has_a_layer() -> None:
    for module in GRAPH:
        layer_of(module)


def test_no_upward_imports() -> None:
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def test_runtime_never_imports_testing_or_tools() -> None:
    offenders = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if layer_of(module) < LAYERS["testing"]
        for target in targets
        if target.startswith((f"{PACKAGE}.testing", f"{PACKAGE}.tools"))
    ]
    assert not offenders, "\n".join(offenders)


def test_reference_is_independent() -> None:
    offenders = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.startswith(REFERENCE)
        for target in targets
        if not target.startswith((REFERENCE, *REFERENCE_MAY_IMPORT))
    ]
    assert not offenders, "\n".join(offenders)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("graph", "cyclic"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"a"}}, True),
    ],
)
def test_find_cycle(graph: dict[str, set[str]], cyclic: bool) -> None:
    assert (find_cycle(graph) is not None) is cyclic


def test_the_graph_is_read() -> None:
    # The checks above would pass vacuously on an empty graph.
    assert f"{PACKAGE}.kernels.cache_store.table" in GRAPH[f"{PACKAGE}.compute.layer"]
    assert f"{PACKAGE}.tools.ab.sglang_backend" in GRAPH[f"{PACKAGE}.tools.ab.backends"]


def test_testing_holds_only_what_the_tools_need() -> None:
    """A module of ``testing`` that no tool and not the command line reaches serves tests
    only: it belongs in ``tests/support/``."""
    reached: set[str] = set()
    for module in GRAPH:
        if module.startswith((f"{PACKAGE}.tools", f"{PACKAGE}.__main__")):
            reached |= _reach(module)
    unused = sorted(
        module
        for module in GRAPH
        if module.startswith(f"{PACKAGE}.testing.")
        and not any(r == module or r.startswith(module + ".") for r in reached)
    )
    assert not unused, f"only tests import these; move them to tests/support/: {unused}"


def _reach(module: str) -> set[str]:
    """Every package module ``module`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for target in GRAPH.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _variant_module(entry: object) -> str:
    """The module that defines a variant's entry (an indexer variant's: its scores)."""
    function = getattr(entry, "scores", entry)
    return function.__module__  # type: ignore[attr-defined]


def test_variants_of_one_op_do_not_import_each_other() -> None:
    """Read from the tables themselves: retiring a variant never needs another one moved."""
    from dsv4_backend.compute.kernel_choice import TABLES

    offenders = []
    for table in TABLES:
        modules = {v.name: _variant_module(v.entry) for v in table.variants}
        for name, module in modules.items():
            reached = _reach(module)
            offenders += [
                f"{table.op}: {name} ({module}) imports {other} ({modules[other]})"
                for other in modules
                if modules[other] != module and modules[other] in reached
            ]
    assert not offenders, "\n".join(offenders)
    for op in ("attention", "indexer", "compressor", "cache_store"):  # one file per variant
        table = next(t for t in TABLES if t.op == op)
        files = {_variant_module(v.entry) for v in table.variants}
        assert len(files) == len(table.variants), (op, files)
        assert all(f.startswith(f"{PACKAGE}.kernels.{op}.") for f in files), (op, files)
