"""Reading the YAML files a user writes (cells.yaml, prompts.yaml): a safe loader that rejects a
key written twice in one mapping, and every parse or validation problem as one line naming the
file, and the line or the key."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from yaml.events import (
    AliasEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
)
from yaml.nodes import MappingNode

from pytest_gpubench.core.errors import GpubenchError, key_path

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


# libyaml's parser where PyYAML was built with it (the wheels are): about ten times faster
# than the pure-Python one, which the same rules below fall back to.
_BASE: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_NODE_EVENTS = (ScalarEvent, AliasEvent, SequenceStartEvent, MappingStartEvent)


class _NoDuplicateKeys:
    """Refuses a key written twice in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[attr-defined]
            line = key_node.start_mark.line + 1
            try:
                if key in first_lines:
                    raise DuplicateKeyError(key, line, first_lines[key])
            except TypeError:
                continue  # an unhashable key: PyYAML's own error says so below
            first_lines[key] = line
        result: dict[Any, Any] = super().construct_mapping(node, deep=deep)  # type: ignore[misc]
        return result


class StrictSafeLoader(_NoDuplicateKeys, _BASE):  # type: ignore[misc]
    """The safe loader that refuses duplicate keys; check_nesting runs before it."""


class _PythonStrictLoader(_NoDuplicateKeys, yaml.SafeLoader):
    """The pure-Python loader, for the wording of a parse error (it names the character that
    libyaml only points at), with the nesting counted while composing."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        depth = getattr(self, "_gpubench_depth", 0) + 1
        if depth > MAX_NESTING:
            raise TooDeepError(self.peek_event().start_mark.line + 1)  # type: ignore[no-untyped-call]
        self._gpubench_depth = depth
        try:
            return super().compose_node(parent, index)
        finally:
            self._gpubench_depth = depth - 1


def check_nesting(text: str) -> None:
    """TooDeepError at the first node nested deeper than MAX_NESTING (the document's root is
    level 1), from the parser's events, before anything recurses through the document."""
    depth = 0
    for event in yaml.parse(text, Loader=_BASE):
        if isinstance(event, _NODE_EVENTS) and depth + 1 > MAX_NESTING:
            mark = event.start_mark
            raise TooDeepError(mark.line + 1 if mark is not None else 1)
        if isinstance(event, (SequenceStartEvent, MappingStartEvent)):
            depth += 1
        elif isinstance(event, (SequenceEndEvent, MappingEndEvent)):
            depth -= 1


def parse_yaml(text: str, path: Path) -> Any:
    """The document in `text`, read from `path`; a GpubenchError of one line on any problem."""
    try:
        try:
            check_nesting(text)
            return yaml.load(text, Loader=StrictSafeLoader)
        except (DuplicateKeyError, TooDeepError):
            raise
        except yaml.YAMLError:
            yaml.load(text, Loader=_PythonStrictLoader)  # its error where it finds one
            raise
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


def read_yaml_mapping(path: Path, expected: str) -> Any:
    """The parsed document; `expected` says what the file holds, for an empty file's error."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise GpubenchError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise GpubenchError(f"{path}: is a directory, not a file") from None
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise GpubenchError(
            f"{path}: line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}); save the file as UTF-8"
        ) from None
    loaded = parse_yaml(text, path)
    if loaded is None:
        raise GpubenchError(f"{path}: the file is empty (expected {expected})")
    if not isinstance(loaded, dict):
        raise GpubenchError(f"{path}: expected {expected}, got {type(loaded).__name__}")
    return loaded


def key_path_of(loc: tuple[int | str, ...], raw: Any) -> str:
    """A location as the file's reader writes it: `prompts.P-EASY.max_tokens`."""
    return key_path(loc)


def one_line_errors(
    path: Path,
    exc: ValidationError,
    raw: Any,
    describe: Callable[[tuple[int | str, ...], Any], str] = key_path_of,
) -> GpubenchError:
    """pydantic's findings in a file a user wrote, each on a line naming the file and the key
    (`describe`: how a location reads in this file; cells.yaml's names its cells)."""
    lines = []
    for error in exc.errors():
        where = describe(tuple(error["loc"]), raw)
        if error["type"] == "extra_forbidden":
            lines.append(f"{path}: {where}: unknown key (remove it or check its spelling)")
        elif error["type"] == "missing":
            lines.append(f"{path}: {where}: required key is missing")
        else:
            value = error.get("input")
            plain = not isinstance(value, dict | list) and error["type"] != "unknown_kind"
            shown = f" (got {value!r})" if plain else ""
            lines.append(f"{path}: {where}: {error['msg']}{shown}")
    return GpubenchError("\n".join(lines))
