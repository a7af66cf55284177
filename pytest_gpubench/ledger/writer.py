"""The JSONL ledger: one record per line, appended and flushed as each call ends."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pytest_gpubench.core.errors import GpubenchError


class LedgerWriteError(GpubenchError):
    """The ledger could not be created or written (a read-only directory, a full disk)."""


def record_line(record: dict[str, Any]) -> str:
    """One ledger line (without its newline): compact JSON, non-ASCII kept as is."""
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)


class Ledger:
    """Appends records to runs/<benchmark_run_id>.jsonl; only the controller process writes.

    Each record is one write of a whole line, flushed to the OS at once, so a crash (even kill -9)
    loses only what had not ended. A write that fails (a full disk) is cut back off the file, so
    the ledger never holds half a line; the last record is fsync'd on close.
    """

    def __init__(self, path: Path, scrub: Callable[[str], str] | None = None) -> None:
        self.path = path
        self._scrub = scrub
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise LedgerWriteError(f"{path}: cannot create the ledger: {_reason(exc)}") from None

    def append(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise LedgerWriteError(f"{self.path}: the ledger is closed")
        line = record_line(record)
        if self._scrub is not None:
            line = self._scrub(line)
        data = (line + "\n").encode("utf-8")
        size = os.fstat(self._fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            raise LedgerWriteError(
                f"{self.path}: cannot write the ledger: {_reason(exc)}"
            ) from None

    def close(self) -> None:
        """fsync and close; a failure to sync is reported (the records may not be on disk)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        except OSError as exc:
            raise LedgerWriteError(f"{self.path}: cannot sync the ledger: {_reason(exc)}") from None
        finally:
            os.close(fd)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def iter_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Read a ledger, tolerating a truncated last line (a run that was killed mid-write)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot read ledger: {exc.strerror}") from None
    last = len(lines) - 1
    while last >= 0 and not lines[last].strip():
        last -= 1
    for number, line in enumerate(lines[: last + 1], start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == last + 1:
                return  # the truncated tail of a run that died while writing
            raise GpubenchError(f"{path}: line {number} is not valid JSON") from None
        except (ValueError, RecursionError):
            # A number longer than Python reads (4,300 digits), or nesting deeper than it recurses:
            # no record the plugin writes.
            raise GpubenchError(
                f"{path}: line {number} is not a ledger record (too deeply nested or a number "
                "too long to read)"
            ) from None
        if isinstance(record, dict):
            yield record


def read_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return list(iter_records(path))
