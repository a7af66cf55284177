"""The package's shape: imports flow one way (no cycle, no upward import), and a session that
runs no benchmark pays nothing for the heavy libraries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from support.kind_switches import KIND_ROOMS, kind_classes, kind_switches

import pytest_gpubench
from pytest_gpubench.config.cell import ENGINE_KINDS
from pytest_gpubench.config.nodes import NODE_KINDS

PACKAGE = Path(pytest_gpubench.__file__).parent
# Bottom first: a module may import only from the folders (and public modules) listed before it.
# A folder is one entry: its modules import each other freely, and where a folder's __init__
# holds a factory (engines/, targets/, telemetry/, run/load/) it imports its submodules lazily,
# inside the function, and the submodules import the protocol from a module of its own
# (engines/protocol.py, targets/protocol.py, telemetry/samplers.py), never from the __init__.
LAYERS = (
    "pytest_gpubench",
    "core",
    "config",
    "measure",
    "targets",
    "telemetry",
    "engines",
    "ledger",
    "results",
    "reports",
    "run",
    "cli",
    "benchmark",
    "xdist",
    "hookspecs",
    "plugin",
)
# What a user's code and other plugins import: everything else lives in a folder by layer.
PUBLIC_FACE = {"__init__", "plugin", "xdist", "hookspecs", "benchmark"}


def _unit(module: str) -> str:
    """The LAYERS entry of a dotted module name: its folder, or the public module itself."""
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


def _imports(
    tree: ast.AST, *, in_functions: bool = True, for_type_checking: bool = False
) -> set[str]:
    """The package's modules a file imports at run time, at module level and, unless told not
    to, inside functions; imports for type checking only (they never run) when asked for."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:  # node: any syntax node, a statement or not
        if not in_functions and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return
        if isinstance(node, ast.If) and _is_type_checking(node) and not for_type_checking:
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


def import_graph(*, for_type_checking: bool = False) -> dict[str, set[str]]:
    """{layer unit: the other units it imports} (with the imports for type checking only, when
    asked for: a type named from a layer above is an arrow back up all the same)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(_module_name(path))
        tree = ast.parse(path.read_text())
        imported = {_unit(m) for m in _imports(tree, for_type_checking=for_type_checking)}
        graph.setdefault(unit, set()).update(imported - {unit})
    return graph


def module_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, every edge: two modules that import each
    other, lazily, for type checking only or not, a folder's factory (its __init__) and its own
    submodules among them, are a circle."""
    return {
        _module_name(path): module_imports(_module_name(path), ast.parse(path.read_text()))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def module_imports(module: str, tree: ast.AST) -> set[str]:
    """The modules one module imports, as module_graph counts them: a type named for an
    annotation only is an edge too (the two modules cannot be read, nor moved, one without the
    other), and so is an import inside a function."""
    return _imports(tree, for_type_checking=True) - {module}


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
    cycle = find_cycle(import_graph(for_type_checking=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_imports_another_in_a_cycle() -> None:
    """Inside a folder too, over every edge: a factory's lazy import of its own submodules closes
    a loop as any other import does (issue 45: 3 groups, 48 circles, before the protocols moved
    out of engines/, targets/ and telemetry/'s __init__)."""
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_only_the_public_face_sits_at_the_top() -> None:
    top = {path.stem for path in PACKAGE.glob("*.py")}
    folders = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert top == PUBLIC_FACE
    assert folders | PUBLIC_FACE - {"__init__"} == set(LAYERS) - {"pytest_gpubench"}


def test_every_module_is_placed_in_a_layer() -> None:
    assert set(import_graph()) <= set(LAYERS), "add new modules to LAYERS in this test"


def test_no_module_imports_from_a_layer_above_it() -> None:
    """Not even a type for its annotations: reports/ once took the run controller (run/) to
    read its judgement, an arrow back up that only type checking saw."""
    rank = {unit: index for index, unit in enumerate(LAYERS)}
    upward = sorted(
        f"{unit} imports {target}"
        for unit, targets in import_graph(for_type_checking=True).items()
        for target in targets
        if target in rank and rank[target] > rank[unit]
    )
    assert upward == []


def test_the_checks_see_a_circle_in_a_folder_and_a_typed_arrow_back_up() -> None:
    """The two holes the checks had: a module's lazy import of a sibling that imports it back
    (engines/managed.py and its builders), and an upward import for type checking only."""
    lazy = ast.parse("def build():\n    from pytest_gpubench.engines.managed_x import plan\n")
    sibling = "pytest_gpubench.engines.managed_x"
    assert module_imports("pytest_gpubench.engines.managed", lazy) == {sibling}
    # A folder's factory's lazy import of its own submodule is an edge as well.
    assert module_imports("pytest_gpubench.engines", lazy) == {sibling}
    typed = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from pytest_gpubench.run.controller import RunController\n"
    )
    assert _imports(typed) == set()
    assert _imports(typed, for_type_checking=True) == {"pytest_gpubench.run.controller"}


def test_the_circle_checks_see_imports_for_type_checking_and_inside_functions() -> None:
    """The hole three circles hid in (config/cell_rules and config/matrix, ledger/outcomes and
    ledger/schema, results/engine_checks and results/judging): one side's import was for type
    checking only."""
    typed = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from pytest_gpubench.config.matrix import Cell\n"
    )
    lazy = ast.parse("def read():\n    from pytest_gpubench.config.matrix import Cell\n")
    matrix = "pytest_gpubench.config.matrix"
    for tree in (typed, lazy):
        assert module_imports("pytest_gpubench.config.cell_rules", tree) == {matrix}
    # And a folder's factory's own submodule named for type checking.
    assert module_imports("pytest_gpubench.config", typed) == {matrix}


# A kind stays in its room (issue 45): outside engines/ and targets/, code asks a kind's facts
# (config/engine_kinds.py, the node models of config/nodes.py) or its protocol, never its name
# nor its class (tests/support/kind_switches.py, by which benchmarks_dev/structure_counters.py
# counts them too).
KIND_NAMES = frozenset(ENGINE_KINDS) | frozenset(NODE_KINDS)


def test_the_kind_switch_check_sees_every_form() -> None:
    code = (
        "if engine == 'ollama': pass\n"
        "if kind not in ('slurm', 'ssh'): pass\n"
        "NAMES = {'llamacpp': 'llama-server'}\n"
        "match node:\n    case 'local': pass\n"
        "if isinstance(target, SlurmTarget): pass\n"
        "if kind.drives_load and name == 'tiny': pass\n"
    )
    found = kind_switches(ast.parse(code), {"SlurmTarget"}, KIND_NAMES)
    assert [line for line, _ in found] == [1, 2, 3, 5, 6]


def test_no_kind_is_switched_on_outside_its_room() -> None:
    """Not a kind's name compared nor a table keyed by kinds (a cell's rule, a verdict's words,
    a rental's line), not an isinstance of a concrete engine, target or node model: a new kind
    then touches its room and its facts, and nothing else."""
    classes = kind_classes(PACKAGE)
    switches = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {code}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in KIND_ROOMS
        for line, code in kind_switches(ast.parse(path.read_text()), classes, KIND_NAMES)
    ]
    assert switches == []


# What a benchmark needs and a session without one must not pay for: the statistics, SSH, the
# matrix's validation (pydantic) and the HTTP clients (httpx, h11): together 0.2-0.3 s.
HEAVY = ("pandas", "scipy", "numpy", "paramiko", "pydantic", "httpx", "h11", "yaml")


# The modules every session imports: the pytest11 entry point, the xdist hooks it registers and
# the hook specifications it adds (pytest_addhooks).
@pytest.mark.parametrize(
    "module", ["pytest_gpubench.plugin", "pytest_gpubench.xdist", "pytest_gpubench.hookspecs"]
)
def test_importing_the_plugin_loads_neither_pandas_nor_scipy(module: str) -> None:
    """Installing the plugin costs nothing to a session that runs no benchmark."""
    code = f"import sys, {module}\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


# The package's modules every session imports (the plugin, its option table and its hooks): what
# a session without benchmarks does not use (the matrix, the shards, the harness) is not here.
EVERY_SESSION = {
    "pytest_gpubench",
    "pytest_gpubench.plugin",
    "pytest_gpubench.xdist",
    "pytest_gpubench.hookspecs",
    "pytest_gpubench.config",
    "pytest_gpubench.config.options",
    "pytest_gpubench.core",
    "pytest_gpubench.core.errors",
}


def test_importing_the_plugin_loads_only_what_every_session_uses() -> None:
    code = (
        "import sys, pytest_gpubench.plugin, pytest_gpubench.xdist, pytest_gpubench.hookspecs\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pytest_gpubench'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == repr(sorted(EVERY_SESSION))


def test_a_session_without_benchmarks_loads_neither_pandas_nor_scipy(
    pytester: pytest.Pytester,
) -> None:
    """Nor pydantic, httpx, h11 or paramiko: not during the test, nor by the end of the session
    (the plugin's sessionfinish and terminal summary run after it; the conftest looks last)."""
    pytester.makeconftest(
        f"""
        import sys

        def pytest_unconfigure(config):
            loaded = sorted(name for name in {HEAVY!r} if name in sys.modules)
            print("loaded by the end:", loaded)
        """
    )
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_heavy_libraries_absent():
            assert "pandas" not in sys.modules
            assert "scipy" not in sys.modules
            for name in ("pydantic", "httpx", "h11", "paramiko"):
                assert name not in sys.modules, name
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["loaded by the end: []"])
