"""The JSONL ledger: one record per line, appended and flushed as each call ends."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from pytest_gpubench.errors import GpubenchError


class Ledger:
    """Appends records to runs/<benchmark_run_id>.jsonl; only the controller process writes."""

    def __init__(self, path: Path, scrub: Callable[[str], str] | None = None) -> None:
        self.path = path
        self._scrub = scrub
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = path.open("a", encoding="utf-8")

    def append(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError(f"ledger {self.path} is closed")
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)
        if self._scrub is not None:
            line = self._scrub(line)
        # One write and a flush per record: a crash (even kill -9) loses only what had not ended.
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
        if isinstance(record, dict):
            yield record


def read_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return list(iter_records(path))
