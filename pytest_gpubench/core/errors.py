"""The one exception type for errors a user can cause (bad files, options, unreachable cells)."""

from __future__ import annotations

import math
from typing import Any


class GpubenchError(Exception):
    """A user-facing error: the message names the file, key or cell and what to do."""


def shown_key(key: str) -> str:
    """A key as written, or quoted where it is empty, holds a dot or a character that would
    break the line (a carriage return would hide the file's name)."""
    plain = key and key.isprintable() and "." not in key and key.strip() == key
    return key if plain else repr(key)


def key_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error's location as the user reads a file: `prompts.P-EASY.history[0].n`."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int) and parts:
            parts[-1] = f"{parts[-1]}[{item}]"
        else:
            parts.append(f"[{item}]" if isinstance(item, int) else shown_key(item))
    return ".".join(parts)


Location = tuple[int | str, ...]


def non_finite_at(value: Any, loc: Location = ()) -> tuple[Location, float] | None:
    """Where in parsed JSON the first number that is not finite sits, and that number: Python's
    json reads NaN, Infinity and -Infinity (and 1e999 as an infinity), which JSON itself has
    not, and a figure that is one would reach a computation as a number. None when there is
    none. Walked without recursion: a document may nest as deep as its parser allowed."""
    pending: list[tuple[Location, Any]] = [(loc, value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return where, item
        elif isinstance(item, dict):
            pending.extend(reversed([((*where, key), inner) for key, inner in item.items()]))
        elif isinstance(item, list):
            pending.extend(reversed([((*where, index), inner) for index, inner in enumerate(item)]))
    return None
