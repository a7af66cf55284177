"""Naming, fingerprinting and replacing files: a safe file name for any text, the sha256 of a
file, and the one way a file is replaced (atomic_file / atomic_write)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
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


@contextlib.contextmanager
def atomic_file(path: Path, *, mode: int | None = 0o644, durable: bool = True) -> Iterator[Path]:
    """Replace `path` atomically: the block writes the temporary file it is given (in the same
    folder, so the rename never crosses a file system), which then takes `path`'s place with
    `mode` (None: as the block left it). A reader sees the old file or the new one, never half
    of one; when the block or the rename fails, the temporary file is removed and the error
    raised. `durable` syncs the file to disk before the rename and the folder after it: a crash
    then keeps the new file too (baselines, journals); caches that can be rebuilt skip it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(descriptor)
    temporary = Path(name)
    try:
        yield temporary
        if mode is not None:
            os.chmod(temporary, mode)
        if durable:
            _sync(temporary, os.O_RDONLY)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    if durable:
        with contextlib.suppress(OSError):  # a folder that cannot be opened (some file systems)
            _sync(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def atomic_write(
    path: Path, content: str | bytes, *, mode: int = 0o644, durable: bool = True
) -> None:
    """Replace `path` with `content` (text as UTF-8) atomically: see atomic_file."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    with atomic_file(path, mode=mode, durable=durable) as temporary:
        temporary.write_bytes(data)


def _sync(path: Path, flags: int) -> None:
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
