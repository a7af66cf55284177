"""Where the package tells engine or node kinds apart outside their rooms (issue 45): the one
detection that tests/test_architecture.py refuses by and benchmarks_dev/structure_counters.py
counts by (over this checkout's package, or an older commit's)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

# The folders a kind may be told apart in: its engine's and its target's.
KIND_ROOMS = ("engines", "targets")


def kind_classes(package: Path, trees: Iterable[tuple[Path, ast.AST]] | None = None) -> set[str]:
    """The classes of a kind: those of engines/ and targets/ (but a protocol or an error) and
    config/nodes.py's node models. `trees`: (path, parsed module) pairs already read, else each
    module of `package` is parsed here."""
    if trees is None:
        trees = ((path, ast.parse(path.read_text())) for path in sorted(package.rglob("*.py")))
    classes: set[str] = set()
    for path, tree in trees:
        parts = path.relative_to(package).parts
        in_room, node_models = parts[0] in KIND_ROOMS, parts == ("config", "nodes.py")
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(base) for base in node.bases]
            error = any(name.endswith(("Error", "Exception")) for name in [node.name, *bases])
            if in_room and not error and not any("Protocol" in base for base in bases):
                classes.add(node.name)
            if node_models and node.name.endswith("Node"):
                classes.add(node.name)
    return classes


def _kind_names(node: ast.AST, names: frozenset[str]) -> set[str]:
    """The kind names a constant, or a tuple, list or set of constants, spells."""
    elements = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {e.value for e in elements if isinstance(e, ast.Constant) and e.value in names}


def kind_switches(tree: ast.AST, classes: set[str], names: frozenset[str]) -> list[tuple[int, str]]:
    """Each place a module tells kinds apart itself, by line: isinstance (or issubclass) of a
    kind's class, a kind's name (one of `names`) compared (==, !=, in, not in) or matched in a
    case, a table keyed by kinds."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            named = {
                n.id if isinstance(n, ast.Name) else n.attr
                for n in ast.walk(node.args[1])
                if isinstance(n, ast.Name | ast.Attribute)
            }
            if named & classes:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops
        ):
            if any(_kind_names(side, names) for side in [node.left, *node.comparators]):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.match_case) and any(
            isinstance(n, ast.MatchValue) and _kind_names(n.value, names)
            for n in ast.walk(node.pattern)
        ):
            found.append((node.pattern.lineno, f"case {ast.unparse(node.pattern)}"))
        elif isinstance(node, ast.Dict) and any(
            key is not None and _kind_names(key, names) for key in node.keys
        ):
            found.append((node.lineno, f"a table keyed by kind: {ast.unparse(node)[:60]}"))
    return sorted(found)
