"""The one exception type for errors a user can cause (bad files, options, unreachable cells)."""

from __future__ import annotations


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
