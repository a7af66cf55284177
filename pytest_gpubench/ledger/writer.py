"""The JSONL ledger: one record per line, appended and flushed as each call ends."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import orjson

from pytest_gpubench.core.errors import GpubenchError


class LedgerWriteError(GpubenchError):
    """The ledger could not be created or written (a read-only directory, a full disk)."""


# The keys of a call record that are its cell record's (ledger/records.py `_case_head`): the
# writer leaves them out of a call record where they equal the cell record's for its cell_id, and
# the readers (iter_records here, reports/frame.py) put them back, so a consumer sees the record
# whole (issue 24: keys repeated in every record cost ~110 B a call). Records written before
# carry them, and are read as they are.
CELL_KEYS = ("benchmark_run_id", "node", "engine", "model")
# Where they stood in a call record, to restore its order too.
_CALL_HEAD = ("type", "benchmark_run_id", "cell_id", "node", "engine", "model")


class CellKeys:
    """The cell records of a ledger so far (the first per cell_id, as the controller writes
    only the first): what a call record may leave out, and how to put it back."""

    def __init__(self) -> None:
        self.cells: dict[str, dict[str, Any]] = {}

    def note(self, record: dict[str, Any]) -> None:
        """Remember a cell record (a record of another type, or a second one, is ignored)."""
        cell_id = record.get("cell_id")
        if record.get("type") == "cell" and isinstance(cell_id, str) and cell_id not in self.cells:
            self.cells[cell_id] = {key: record[key] for key in CELL_KEYS if key in record}

    def compact(self, record: dict[str, Any]) -> dict[str, Any]:
        """A call record without the keys its cell record (already written) holds alike."""
        if record.get("type") != "call":
            return record
        cell = self.cells.get(str(record.get("cell_id")))
        if not cell:
            return record
        same = {key for key, value in cell.items() if key in record and record[key] == value}
        if not same:
            return record
        return {key: value for key, value in record.items() if key not in same}

    def restore(self, record: dict[str, Any]) -> dict[str, Any]:
        """A call record with the keys it left out taken from its cell record, in their place."""
        if record.get("type") != "call":
            return record
        cell = self.cells.get(str(record.get("cell_id")))
        if not cell or all(key in record for key in cell):
            return record  # written whole (before issue 24), or no cell record to restore from
        whole = {
            key: record[key] if key in record else cell[key]
            for key in _CALL_HEAD
            if key in record or key in cell
        }
        whole.update(record)
        return whole


def compact_records(records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Records as a ledger writes them (call records without their cell's keys)."""
    keys = CellKeys()
    for record in records:
        keys.note(record)
        yield keys.compact(record)


def record_line(record: dict[str, Any]) -> str:
    """One ledger line (without its newline): compact JSON, non-ASCII kept as is."""
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)


def read_record_line(record: dict[str, Any]) -> str:
    """record_line of a record read from a ledger (JSON's own types only), written by orjson: a
    tenth of json's time (gpubench merge writes a million); record_line where orjson would write
    it otherwise (NaN, which it writes as null; integers beyond 64 bits; keys that are not
    text). The same values; a float's exponent may be written shorter (1e-5 for 1e-05)."""
    if _has_huge_float(record):
        return record_line(record)
    try:
        return orjson.dumps(record).decode("utf-8")
    except TypeError:
        return record_line(record)


class LedgerObserver(Protocol):
    """Sees a ledger as it is written (reports/frame_cache.py keeps its columnar cache): each
    line as written to the file, then the ledger closed. It must never fail the ledger."""

    def written(self, line: bytes) -> None: ...

    def closed(self) -> None: ...


class Ledger:
    """Appends records to runs/<benchmark_run_id>.jsonl; only the controller process writes.

    A call record is written without the keys its cell record holds alike (CELL_KEYS); the
    readers restore them. Each record is one write of a whole line, flushed to the OS at once,
    so a crash (even kill -9) loses only what had not ended. A write that fails (a full disk) is
    cut back off the file, so the ledger never holds half a line; the last record is fsync'd on
    close.
    """

    def __init__(
        self,
        path: Path,
        scrub: Callable[[str], str] | None = None,
        *,
        observer: LedgerObserver | None = None,
        dumps: Callable[[dict[str, Any]], str] = record_line,
    ) -> None:
        self.path = path
        self._scrub = scrub
        self._observer = observer
        self._dumps = dumps
        self._cell_keys = CellKeys()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise LedgerWriteError(f"{path}: cannot create the ledger: {_reason(exc)}") from None

    def append(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise LedgerWriteError(f"{self.path}: the ledger is closed")
        compact = self._cell_keys.compact(record)
        line = self._dumps(compact)
        if "NaN" in line or "Infinity" in line:
            # Rare (a text may hold the words): only then the record types (h11, pydantic).
            from pytest_gpubench.ledger.schema import finite_fields

            line = self._dumps(finite_fields(compact))
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
        # Only a cell record on disk may stand for its calls' keys.
        self._cell_keys.note(record)
        if self._observer is not None:
            self._observer.written(data)

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
        if self._observer is not None:
            self._observer.closed()


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def iter_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Read a ledger line by line, tolerating a truncated last line (a run that was killed
    mid-write); call records come back whole (their cell's keys restored), as they were before
    issue 24. A ledger of gigabytes is never held whole. NaN or an infinity in a record's field
    is one error naming the line and the field."""
    path = Path(path)
    cell_keys = CellKeys()
    # A line that does not parse is an error only once another record follows it.
    unparsed: tuple[int, str] | None = None
    try:
        # A 1 MiB buffer: reading a large ledger line by line through the default 8 KiB one
        # took five times the CPU.
        with path.open("rb", buffering=1 << 20) as ledger:
            for number, line in enumerate(ledger, start=1):
                if not line.strip():
                    continue
                if unparsed is not None:
                    raise GpubenchError(f"{path}: line {unparsed[0]} {unparsed[1]}") from None
                try:
                    record, problem = parse_line(line)
                except NotFinite as exc:
                    raise GpubenchError(f"{path}: line {number}: {exc}") from None
                if problem == _TOO_DEEP:
                    raise GpubenchError(f"{path}: line {number} {problem}") from None
                if problem is not None:
                    unparsed = (number, problem)
                    continue
                if isinstance(record, dict):
                    cell_keys.note(record)
                    yield cell_keys.restore(record)
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot read ledger: {exc.strerror}") from None


_NOT_JSON = "is not valid JSON"
_TOO_DEEP = "is not a ledger record (too deeply nested or a number too long to read)"


# orjson reads an integer beyond 64 bits as a float, where json reads the integer it is: a line
# whose value holds a float that large (or NaN, which orjson refuses anyway) is read by json, as
# before. Checked on the parsed value (6 µs a record): a regular expression over the line for
# nineteen digits took 40 µs, and matched a small float's fraction too.
_HUGE = 2.0**63


def _has_huge_float(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is float:
            if not -_HUGE < item < _HUGE:
                return True
        elif kind is dict:
            stack.extend(item.values())
        elif kind is list:
            stack.extend(item)
    return False


class NotFinite(Exception):
    """A record holds NaN or an infinity in a field its type declares (the message says which
    field and which number)."""


def parse_line(line: bytes) -> tuple[Any, str | None]:
    """A line's JSON value, and None; or None and what is wrong with the line. orjson reads it
    (ten times faster than json), json where orjson reads it otherwise or not at all (NaN,
    Infinity, lone surrogates, integers beyond 64 bits). Python's json reads NaN and infinities,
    which JSON has not: in a field a record's type declares (ledger/schema.py) one is
    NotFinite, naming the field; a key no type declares keeps it as written."""
    try:
        value = orjson.loads(line)
        if not _has_huge_float(value):
            return value, None
    except orjson.JSONDecodeError:
        pass
    try:
        record = json.loads(line.decode("utf-8", errors="replace"))
    except json.JSONDecodeError:
        return None, _NOT_JSON
    except (ValueError, RecursionError):
        # A number longer than Python reads (4,300 digits), or nesting deeper than it recurses:
        # no record the plugin writes.
        return None, _TOO_DEEP
    if isinstance(record, dict):
        # The record types import the measurement's (h11, pydantic): only a reader of a file
        # that orjson could not read pays for them.
        from pytest_gpubench.ledger.schema import non_finite_field

        found = non_finite_field(record)
        if found is not None:
            where, value = found
            raise NotFinite(f"{where}: expected a finite number, got {json.dumps(value)}")
    return record, None


def read_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return list(iter_records(path))
