"""The package's structure counters (issue 45's table), for a closing note's before and after:

    python benchmarks_dev/structure_counters.py              # the working tree's pytest_gpubench/
    python benchmarks_dev/structure_counters.py --rev ce3d441  # a commit's (git archive)
    python benchmarks_dev/structure_counters.py --list       # and where each one is, file:line

What each counts, over pytest_gpubench/**/*.py:

    lines                   every line (wc -l)
    dict[str, Any]          the text's occurrences (comments and strings too)
    imports in functions    Import and ImportFrom nodes inside a function (a def or lambda at any
                            depth), leaving out those under `if TYPE_CHECKING:` (they never run);
                            a module-level `try: import x` is at module level
    over 600 / 591-600      modules of more than 600 lines; modules of 591 to 600 lines
    kind switches           outside engines/ and targets/: isinstance (or issubclass) of a concrete
                            engine or target class (a class of engines/ or targets/ that is not a
                            Protocol nor an exception) or of a node model (config/nodes.py's
                            *Node); a kind string ("llamacpp", "ollama", "openai", "local",
                            "ssh", "slurm", "provider") compared with ==, !=, in, not in, or
                            matched in a case; and, told apart, a dict display keyed by one
    circles                 in the graph of module imports, every import counted (at module level,
                            in functions, under TYPE_CHECKING): the strongly connected groups of
                            more than one module, and the elementary circles; once with every
                            edge, once leaving out a folder's factory (its __init__) importing its
                            own submodules inside a function (tests/test_architecture.py's rule
                            until 2026-11-29; it counts every edge now)
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# The detection tests/test_architecture.py refuses kind switches by (one copy of it).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.kind_switches import KIND_ROOMS, kind_classes, kind_switches

# The kind names of a week ago (issue 45's table), not today's config: an older commit is counted
# by the same names.
KIND_STRINGS = frozenset({"llamacpp", "ollama", "openai", "local", "ssh", "slurm", "provider"})
LIMIT = 600
NEAR = 10


@dataclass
class Counters:
    lines: int = 0
    modules: int = 0
    dict_str_any: int = 0
    imports_in_functions: list[str] = field(default_factory=list)
    over_limit: list[str] = field(default_factory=list)
    near_limit: list[str] = field(default_factory=list)
    kind_switches: list[str] = field(default_factory=list)
    circle_groups: list[list[str]] = field(default_factory=list)
    circles: int = 0
    circle_groups_factory_excepted: list[list[str]] = field(default_factory=list)
    circles_factory_excepted: int = 0


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_name(package: Path, path: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports_in_functions(tree: ast.AST) -> list[int]:
    """The line of each import that runs inside a function."""
    found: list[int] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for statement in node.orelse:
                visit(statement, in_function)
            return
        if in_function and isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node.lineno)
        inside = in_function or isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


def _package_imports(package: Path, tree: ast.AST) -> tuple[set[str], set[str]]:
    """(every package module this file imports, those imported inside a function only)."""
    top = package.name
    eager: set[str] = set()
    lazy: set[str] = set()

    def names(node: ast.Import | ast.ImportFrom) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names if a.name.split(".")[0] == top}
        if not node.module or node.level != 0 or node.module.split(".")[0] != top:
            return set()
        found = {node.module}
        base = package.parent / node.module.replace(".", "/")
        for alias in node.names:
            if (base / f"{alias.name}.py").exists() or (base / alias.name / "__init__.py").exists():
                found.add(f"{node.module}.{alias.name}")
        return found

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            (lazy if in_function else eager).update(names(node))
        inside = in_function or isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return eager | lazy, lazy - eager


def _circles(graph: dict[str, set[str]]) -> tuple[list[list[str]], int]:
    """The strongly connected groups of more than one module, and the elementary circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    # Elementary circles in each group: each one counted once, from its smallest module.
    count = 0
    for group in groups:
        for start in group:
            count += _circles_from(graph, start, {m for m in group if m >= start})
    return sorted(groups), count


def _circles_from(graph: dict[str, set[str]], start: str, allowed: set[str]) -> int:
    """The elementary circles through start among the allowed modules."""

    def walk(node: str, seen: frozenset[str]) -> int:
        total = 0
        for target in graph.get(node, ()):
            if target == start:
                total += 1
            elif target in allowed and target not in seen:
                total += walk(target, seen | {target})
        return total

    return walk(start, frozenset({start}))


def count(package: Path) -> Counters:
    counters = Counters()
    paths = sorted(package.rglob("*.py"))
    trees = {path: ast.parse(path.read_text(), str(path)) for path in paths}
    classes = kind_classes(package, trees.items())
    full: dict[str, set[str]] = {}
    factory_excepted: dict[str, set[str]] = {}
    for path, tree in trees.items():
        text = path.read_text()
        where = str(path.relative_to(package.parent))
        lines = text.count("\n")
        counters.lines += lines
        counters.modules += 1
        counters.dict_str_any += text.count("dict[str, Any]")
        counters.imports_in_functions += [f"{where}:{n}" for n in _imports_in_functions(tree)]
        if lines > LIMIT:
            counters.over_limit.append(f"{where} ({lines})")
        elif lines > LIMIT - NEAR:
            counters.near_limit.append(f"{where} ({lines})")
        if path.relative_to(package).parts[0] not in KIND_ROOMS:
            counters.kind_switches += [
                f"{where}:{line}: {code}"
                for line, code in kind_switches(tree, classes, KIND_STRINGS)
            ]
        module = _module_name(package, path)
        imported, lazy = _package_imports(package, tree)
        full[module] = imported - {module}
        own = {m for m in lazy if path.name == "__init__.py" and m.startswith(module + ".")}
        factory_excepted[module] = imported - own - {module}
    counters.circle_groups, counters.circles = _circles(full)
    counters.circle_groups_factory_excepted, counters.circles_factory_excepted = _circles(
        factory_excepted
    )
    return counters


def report(counters: Counters, *, listing: bool) -> str:
    tables = sum("keyed by" in line for line in counters.kind_switches)
    rows = [
        ("modules", str(counters.modules)),
        ("lines", str(counters.lines)),
        ("dict[str, Any]", str(counters.dict_str_any)),
        ("imports in functions", str(len(counters.imports_in_functions))),
        (f"modules over {LIMIT} lines", str(len(counters.over_limit))),
        (f"modules of {LIMIT - NEAR + 1}-{LIMIT} lines", str(len(counters.near_limit))),
        (
            "kind switches outside engines/, targets/ (of them tables keyed by kind)",
            f"{len(counters.kind_switches)} ({tables})",
        ),
        (
            "import circles (groups / elementary), every edge",
            f"{len(counters.circle_groups)} / {counters.circles}",
        ),
        (
            "import circles (groups / elementary), a factory's own lazy imports left out",
            f"{len(counters.circle_groups_factory_excepted)} / {counters.circles_factory_excepted}",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    out = [f"{name:<{width}}  {value}" for name, value in rows]
    out.append("over the limit: " + ", ".join(counters.over_limit))
    out.append("near the limit: " + ", ".join(counters.near_limit))
    out.append("circle groups, every edge:")
    out += ["  " + " ".join(group) for group in counters.circle_groups]
    out.append("circle groups, a factory's own lazy imports left out:")
    out += ["  " + " ".join(group) for group in counters.circle_groups_factory_excepted]
    out.append("kind switches:")
    out += ["  " + line for line in counters.kind_switches]
    if listing:
        out.append("imports in functions:")
        out += ["  " + line for line in counters.imports_in_functions]
    return "\n".join(out)


def _checkout(rev: str, directory: Path) -> Path:
    root = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", root, "archive", rev, "pytest_gpubench"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    return directory / "pytest_gpubench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a commit to count instead of the working tree")
    parser.add_argument("--list", action="store_true", help="list each import in a function")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        if args.rev:
            package = _checkout(args.rev, Path(scratch))
        else:
            package = Path(__file__).resolve().parent.parent / "pytest_gpubench"
        print(report(count(package), listing=args.list))


if __name__ == "__main__":
    main()
