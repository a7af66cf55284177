"""The package's shape: imports flow one way (no cycle, no upward import), and a session that
runs no benchmark pays nothing for the heavy libraries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_gpubench

PACKAGE = Path(pytest_gpubench.__file__).parent
# Bottom first: a module may import only from modules listed before it. A subpackage (engines/,
# targets/) is one entry: its __init__ holds the protocol and the factory that imports its
# submodules, and its submodules import the protocol.
LAYERS = (
    "pytest_gpubench",
    "errors",
    "cache",
    "files",
    "secrets",
    "signals",
    "provenance",
    "load_profile",
    "matrix",
    "shards",
    "options",
    "status",
    "measure",
    "ledger",
    "tinymodel",
    "cases",
    "stats",
    "outcomes",
    "targets",
    "slurm_array",
    "telemetry",
    "ledger_frame",
    "engines",
    "baseline",
    "gate",
    "records",
    "merge",
    "load",
    "ledger_gate",
    "report",
    "html_report",
    "history",
    "exports",
    "progress",
    "guards",
    "nodes",
    "live_cell",
    "harness",
    "controller",
    "junit",
    "benchmark",
    "xdist",
    "hookspecs",
    "init",
    "cli",
    "plugin",
)


def _unit(module: str) -> str:
    """The LAYERS entry of a dotted module name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> set[str]:
    """The package's modules a file imports at run time, at module level or inside functions
    (imports for type checking only are left out: they never run)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:  # node: any syntax node, a statement or not
        if isinstance(node, ast.If) and _is_type_checking(node):
            for statement in node.orelse:
                visit(statement)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "pytest_gpubench":
                found.add(node.module)
                found.update(
                    f"{node.module}.{alias.name}"
                    for alias in node.names
                    if (
                        PACKAGE.parent / node.module.replace(".", "/") / f"{alias.name}.py"
                    ).exists()
                )
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "pytest_gpubench")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """{layer unit: the other units it imports}."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(_module_name(path))
        imported = {_unit(module) for module in _imports(ast.parse(path.read_text()))}
        graph.setdefault(unit, set()).update(imported - {unit})
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that ends where it starts, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def walk(unit: str) -> list[str] | None:
        state[unit] = "open"
        path.append(unit)
        for target in sorted(graph.get(unit, ())):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state:
                cycle = walk(target)
                if cycle:
                    return cycle
        path.pop()
        state[unit] = "done"
        return None

    for unit in sorted(graph):
        if unit not in state:
            cycle = walk(unit)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one_and_only_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_module_is_placed_in_a_layer() -> None:
    assert set(import_graph()) <= set(LAYERS), "add new modules to LAYERS in this test"


def test_no_module_imports_from_a_layer_above_it() -> None:
    rank = {unit: index for index, unit in enumerate(LAYERS)}
    upward = sorted(
        f"{unit} imports {target}"
        for unit, targets in import_graph().items()
        for target in targets
        if target in rank and rank[target] > rank[unit]
    )
    assert upward == []


@pytest.mark.parametrize("module", ["pytest_gpubench.plugin", "pytest_gpubench.xdist"])
def test_importing_the_plugin_loads_neither_pandas_nor_scipy(module: str) -> None:
    """Installing the plugin costs nothing to a session that runs no benchmark."""
    code = (
        f"import sys, {module}\n"
        "print(sorted(m for m in ('pandas', 'scipy', 'numpy', 'paramiko') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_a_session_without_benchmarks_loads_neither_pandas_nor_scipy(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_heavy_libraries_absent():
            assert "pandas" not in sys.modules
            assert "scipy" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
