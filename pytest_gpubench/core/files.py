"""Naming and fingerprinting files: a safe file name for any text, the sha256 of a file."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

UNSAFE_IN_FILE_NAME = re.compile(r"[^A-Za-z0-9._-]")
HASH_CHARS = 12


def safe_file_name(text: str) -> str:
    """`text` with every character that is unsafe in a file name replaced by `_`."""
    return UNSAFE_IN_FILE_NAME.sub("_", text)


def distinct_file_name(text: str, limit: int = 80) -> str:
    """A short, safe file name for any text; distinct texts keep distinct names (a hash is added
    whenever the safe name had to change the text or cut it short)."""
    plain = safe_file_name(text)
    if plain == text and len(plain) <= limit:
        return plain
    digest = hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]
    return f"{plain[: limit - HASH_CHARS - 1]}-{digest}"


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file, read in blocks (models are gigabytes)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
