"""Reading the YAML files a user writes (cells.yaml, prompts.yaml): a safe loader that rejects a
key written twice in one mapping, and every parse problem as one line naming file and line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode

from pytest_gpubench.core.errors import GpubenchError

# Deeper than any file a person writes; PyYAML composes recursively, and pydantic and json after
# it recurse too, so a deeper document would end in a RecursionError instead of a clear line.
MAX_NESTING = 100


class DuplicateKeyError(yaml.YAMLError):
    """A mapping holds the same key twice: PyYAML would keep the last silently."""

    def __init__(self, key: object, line: int, first_line: int) -> None:
        super().__init__(f"duplicate key {key!r} (first written on line {first_line})")
        self.key = key
        self.line = line
        self.first_line = first_line


class TooDeepError(yaml.YAMLError):
    """The document nests deeper than MAX_NESTING."""

    def __init__(self, line: int) -> None:
        super().__init__(f"nested deeper than {MAX_NESTING} levels")
        self.line = line


class StrictSafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses duplicate mapping keys and runaway nesting."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        # Counted while composing, before PyYAML's own recursion reaches Python's limit.
        depth = getattr(self, "_gpubench_depth", 0) + 1
        if depth > MAX_NESTING:
            raise TooDeepError(self.peek_event().start_mark.line + 1)  # type: ignore[no-untyped-call]
        self._gpubench_depth = depth
        try:
            return super().compose_node(parent, index)
        finally:
            self._gpubench_depth = depth - 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in first_lines:
                    raise DuplicateKeyError(key, line, first_lines[key])
            except TypeError:
                continue  # an unhashable key: PyYAML's own error says so below
            first_lines[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, path: Path) -> Any:
    """The document in `text`, read from `path`; a GpubenchError of one line on any problem."""
    try:
        return yaml.load(text, Loader=StrictSafeLoader)
    except DuplicateKeyError as exc:
        raise GpubenchError(
            f"{path}: line {exc.line}: duplicate key {exc.key!r} (first written on line "
            f"{exc.first_line}); YAML would keep only the last, so remove or rename one"
        ) from None
    except TooDeepError as exc:
        raise GpubenchError(
            f"{path}: line {exc.line}: nested deeper than {MAX_NESTING} levels"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise GpubenchError(f"{path}:{where}: malformed YAML: {problem}") from None
    except RecursionError:
        raise GpubenchError(f"{path}: nested too deeply to read") from None
