"""Reads a ledger in one streaming pass into columns: the call records as a frame, the few
other records (meta, cell, skipped, sample, end) as they are.

A dict per call record costs about 9 KB in memory and most of the time of a report on a large
ledger; here each line is parsed (orjson) and only the fields a report needs are kept, a chunk of
rows at a time as numpy columns, text as categorical codes. The ledger itself is not changed.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import multiprocessing
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast, overload

import numpy as np
import orjson
import pandas as pd

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.files import atomic_file
from pytest_gpubench.ledger.schema import (
    CellRecord,
    EndRecord,
    LoadRecord,
    MetaRecord,
    SampleRecord,
    SkippedRecord,
    end_of,
    meta_of,
    records_of,
)
from pytest_gpubench.ledger.writer import CELL_KEYS, NotFinite, parse_line
from pytest_gpubench.results.stats import PromptSummary, summarize_frame, text_column
from pytest_gpubench.telemetry.aggregate import TelemetrySummary, telemetry_summaries

# The columns stats.summarize needs (stats.call_frame builds the same frame from dicts).
SUMMARY_TEXT = ("cell_id", "prompt_id", "prompt_sha256", "phase", "cold_kind", "finish_reason")
SUMMARY_NUMBERS = (
    "run_idx",
    "first_delta_ms",
    "total_duration_ms",
    "tokens_per_sec",
    "tpot_ms",
    "e2e_tokens_per_sec",
    "engine_tokens_per_sec",
    "engine_prompt_ms",
    "engine_total_ms",
    "control_ms",
    "first_answer_ms",
    "reasoning_tokens",
    "cpu_pressure",
)
# The per-case resource figures (telemetry/aggregate.py) the report's telemetry table needs.
TELEMETRY_TEXT = ("gpu_energy_source",)
TELEMETRY_NUMBERS = (
    "gpu_peak_memory_used_mib",
    "gpu_utilization_mean_pct",
    "gpu_power_mean_w",
    "gpu_energy_j_per_token",
    "gpu_tokens_per_j",
    "engine_cpu_s",
    "engine_cpu_s_per_token",
    "engine_peak_rss_mib",
    "engine_gpu_memory_peak_mib",
)
# The further columns of a CSV export: one row per call record.
EXPORT_TEXT = (
    "benchmark_run_id",
    "node",
    "engine",
    "model",
    "case_id",
    "started_at_utc",
    "backend",
    "error",
    "worker",
)
EXPORT_NUMBERS = ("prompt_tokens", "completion_tokens", "client_chunks", "content_reads")
# The call record's field that stats names decode_tokens_per_sec.
_RENAMED = {"tokens_per_sec": "decode_tokens_per_sec"}
_DECODE_METRICS = ("decode_tokens_per_sec", "tpot_ms")
CHUNK_ROWS = 65_536
_ABSENT = object()


@dataclass
class LedgerData:
    """A ledger read for reporting: one row per call record, and every other record."""

    path: Path | None
    calls: pd.DataFrame
    others: list[dict[str, Any]] = field(default_factory=list)

    @overload
    def of_type(self, kind: Literal["cell"]) -> list[CellRecord]: ...
    @overload
    def of_type(self, kind: Literal["load"]) -> list[LoadRecord]: ...
    @overload
    def of_type(self, kind: Literal["sample"]) -> list[SampleRecord]: ...
    @overload
    def of_type(self, kind: Literal["skipped"]) -> list[SkippedRecord]: ...
    def of_type(self, kind: str) -> Sequence[Mapping[str, Any]]:
        """The records of one type, typed (ledger/schema.py)."""
        return records_of(self.others, kind)

    @property
    def meta(self) -> MetaRecord:
        """The meta record; an empty one (every fact unknown) where the ledger has none."""
        return meta_of(self.others) or cast(MetaRecord, {})

    @property
    def end(self) -> EndRecord:
        """The end record; an empty one where the run did not end (it was killed)."""
        return end_of(self.others) or cast(EndRecord, {})

    def summaries(self, *, with_samples: bool = True) -> list[PromptSummary]:
        return summarize_frame(self.calls, with_samples=with_samples)

    def telemetry(self) -> list[TelemetrySummary]:
        """Per (cell, prompt) resource figures of the successful warm calls (none for a ledger
        without telemetry, or columns cached before it was read)."""
        needed = ("cell_id", "prompt_id", "phase", "ok", *TELEMETRY_TEXT, *TELEMETRY_NUMBERS)
        if any(name not in self.calls.columns for name in needed):
            return []
        warm = self.calls[(self.calls["phase"] == "warm") & self.calls["ok"]]
        rows = warm[[name for name in needed if name != "ok"]]
        records = [
            {"type": "call", "error": None, **{str(k): _plain(v) for k, v in row.items()}}
            for row in rows.to_dict("records")
        ]
        return telemetry_summaries(records)


def _plain(value: Any) -> Any:
    """A NaN or missing cell as None, as in the call record."""
    return None if value is None or (isinstance(value, float) and value != value) else value


def read_ledger_frame(path: str | os.PathLike[str], *, export: bool = False) -> LedgerData:
    """Stream a ledger into columns; a truncated last line (a killed run) is left out, a bad
    line elsewhere is an error naming the file and line. `export`: keep the CSV columns too."""
    path = Path(path)
    # Millions of short-lived dicts would set off the cyclic collector thousands of times, each
    # pass walking every row kept so far: off while reading (records hold no cycles).
    collecting = gc.isenabled()
    gc.disable()
    try:
        stamp = _stamp(path)
        if not export:
            cached = _read_cache(path, stamp)
            if cached is not None:
                return cached
        data, complete = _read(path, export=export)
        if complete and not export:
            _save_cache(path, stamp, data)
        return data
    finally:
        if collecting:
            gc.enable()


def _read(path: Path, *, export: bool) -> tuple[LedgerData, bool]:
    """The data, and whether the ledger ended with a whole line (nothing truncated or still
    being written: the columns may then be cached). A large ledger is read in byte ranges, one
    per core, each in a forked process: parsing JSON is most of the time and holds one core."""
    try:
        size = path.stat().st_size
        workers = min(os.cpu_count() or 1, MAX_WORKERS)
        if size < PARALLEL_MIN_BYTES or workers < 2 or not _can_fork():
            parts = [_read_range(path, 0, size, export)]
        else:
            bounds = _line_bounds(path, size, workers)
            ranges = [(path, a, b, export) for a, b in itertools.pairwise(bounds)]
            with multiprocessing.get_context("fork").Pool(len(ranges)) as pool:
                parts = pool.starmap(_read_range, ranges)
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot read ledger: {exc.strerror}") from None
    builder = _FrameBuilder(export=export)
    others: list[dict[str, Any]] = []
    lines_before = 0
    truncated = False
    for index, part in enumerate(parts):
        if part.not_finite is not None:
            line, problem = part.not_finite
            raise GpubenchError(f"{path}: line {lines_before + line}: {problem}")
        if part.bad_line is not None:
            later = any(p.records for p in parts[index + 1 :])
            if part.content_after_bad or later:
                raise GpubenchError(
                    f"{path}: line {lines_before + part.bad_line} is not valid JSON"
                )
            truncated = True  # the tail of a run that died while writing
        builder.chunks.extend(part.chunks)
        others.extend(part.others)
        lines_before += part.lines
    whole = parts[-1].whole if parts else True
    frame = _restore_cell_keys(builder.frame(), others)
    return LedgerData(path, frame, others), whole and not truncated


PARALLEL_MIN_BYTES = 64 << 20
MAX_WORKERS = 4


def _can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def _line_bounds(path: Path, size: int, parts: int) -> list[int]:
    """Byte offsets that split the file into about equal ranges, each at a line's start."""
    bounds = [0]
    with path.open("rb") as ledger:
        for number in range(1, parts):
            ledger.seek(size * number // parts)
            ledger.readline()  # to the start of the next whole line
            bounds.append(ledger.tell())
    bounds.append(size)
    return sorted(set(bounds))


@dataclass
class _Part:
    """What one byte range of a ledger held."""

    chunks: list[dict[str, Any]]
    others: list[dict[str, Any]]
    lines: int
    records: int
    bad_line: int | None
    content_after_bad: bool
    whole: bool
    # A whole line with NaN or an infinity in a record's field: (its line, what and where).
    not_finite: tuple[int, str] | None = None


def _read_range(path: Path, start: int, end: int, export: bool) -> _Part:
    builder = _FrameBuilder(export=export)
    others: list[dict[str, Any]] = []
    bad_line: int | None = None
    after_bad = False
    whole = True
    lines = records = 0
    position = start
    with path.open("rb") as ledger:
        ledger.seek(start)
        for line in ledger:
            if position >= end:
                break
            position += len(line)
            lines += 1
            whole = line.endswith(b"\n")
            if not line.strip():
                continue
            records += 1
            if bad_line is not None:
                after_bad = True
                break
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                # orjson refuses NaN and infinities, which Python's json writes: one in a
                # record's field is named as gpubench gate names it, not taken for a cut tail.
                problem = _not_finite(line)
                if problem is not None:
                    builder.flush()
                    return _Part(
                        builder.chunks, others, lines, records, None, False, whole,
                        not_finite=(lines, problem),
                    )  # fmt: skip
                bad_line = lines
                continue
            if not isinstance(record, dict):
                continue
            if record.get("type") == "call":
                builder.add(record)
            else:
                others.append(record)
    builder.flush()
    return _Part(builder.chunks, others, lines, records, bad_line, after_bad, whole)


def _not_finite(line: bytes) -> str | None:
    """Where a line orjson could not read holds NaN or an infinity in a record's field
    (ledger.writer.parse_line), or None: the line is not JSON for another reason."""
    try:
        parse_line(line)
    except NotFinite as exc:
        return str(exc)
    except (ValueError, RecursionError):
        return None
    return None


# -- the columnar cache beside the ledger -------------------------------------------------------
# <ledger>.columns.npz holds the summary columns and the other records of a ledger that ended
# with a whole line, stamped with the ledger's size and modification time: the ledger stays the
# truth, the cache is used only while both match, and is rewritten otherwise.
CACHE_SUFFIX = ".columns.npz"
# 2: the engine's own VRAM column. 3: a reasoning model's first answer and reasoning tokens.
CACHE_VERSION = 3


def cache_path(path: Path) -> Path:
    return path.with_name(path.name + CACHE_SUFFIX)


def _stamp(path: Path) -> str:
    try:
        status = path.stat()
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot read ledger: {exc.strerror}") from None
    return f"{CACHE_VERSION}:{status.st_size}:{status.st_mtime_ns}"


def _save_cache(path: Path, stamp: str, data: LedgerData) -> None:
    frame = data.calls
    arrays: dict[str, Any] = {
        "stamp": np.array(stamp),
        "others": np.frombuffer(orjson.dumps(data.others), dtype=np.uint8),
    }
    for name in frame.columns:
        column = frame[name]
        if isinstance(column.dtype, pd.CategoricalDtype):
            arrays[f"codes:{name}"] = column.cat.codes.to_numpy(dtype="int32")
            categories = [str(value) for value in column.cat.categories]
            arrays[f"categories:{name}"] = np.frombuffer(orjson.dumps(categories), dtype=np.uint8)
        else:
            arrays[f"values:{name}"] = column.to_numpy()
    target = cache_path(path)
    # A read-only directory or a full disk: the report is still right, only slower next time.
    with (
        contextlib.suppress(OSError),
        atomic_file(target, durable=False) as temporary,
        temporary.open("wb") as file,
    ):
        np.savez(file, allow_pickle=False, **arrays)


def _read_cache(path: Path, stamp: str) -> LedgerData | None:
    target = cache_path(path)
    try:
        with np.load(target, allow_pickle=False) as archive:
            if str(archive["stamp"]) != stamp:
                return None
            columns: dict[str, Any] = {}
            for key in archive.files:
                kind, _, name = key.partition(":")
                if kind == "values":
                    columns[name] = archive[key]
                elif kind == "codes":
                    categories = orjson.loads(archive[f"categories:{name}"].tobytes())
                    columns[name] = pd.Categorical.from_codes(archive[key], categories=categories)
            others = orjson.loads(archive["others"].tobytes())
    except (OSError, ValueError, KeyError, orjson.JSONDecodeError):
        return None  # none yet, or unreadable: read the ledger
    return LedgerData(path, pd.DataFrame(columns), others)


def frame_of_records(records: Iterable[Mapping[str, Any]], *, export: bool = False) -> LedgerData:
    """The same, from records already in memory (a run that just ended, a test)."""
    builder = _FrameBuilder(export=export)
    others: list[dict[str, Any]] = []
    for record in records:
        if record.get("type") == "call":
            builder.add(record)
        else:
            others.append(dict(record))
    return LedgerData(None, _restore_cell_keys(builder.frame(), others), others)


def _restore_cell_keys(frame: pd.DataFrame, others: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The columns of the keys a call record leaves to its cell record (ledger.writer.CELL_KEYS),
    filled from the first cell record of each cell_id where the call record left them out;
    a call record written whole (before issue 24) keeps its own."""
    names = [name for name in CELL_KEYS if name in frame.columns]
    if not names or frame.empty:
        return frame
    cells: dict[str, Mapping[str, Any]] = {}
    for record in others:
        if record.get("type") == "cell":
            cells.setdefault(str(record.get("cell_id")), record)
    for name in names:
        column = frame[name]
        missing = column.isna().to_numpy()
        if not missing.any():
            continue
        by_cell = {
            cell_id: _as_text(cell[name])
            for cell_id, cell in cells.items()
            if cell.get(name) is not None
        }
        restored = frame["cell_id"].astype(object).map(by_cell)
        filled = column.astype(object).where(~missing, restored)
        frame[name] = pd.Categorical(filled)
    return frame


class _FrameBuilder:
    """Rows are gathered as tuples, and every CHUNK_ROWS turned into numpy columns."""

    def __init__(self, *, export: bool) -> None:
        self.text = SUMMARY_TEXT + TELEMETRY_TEXT + (EXPORT_TEXT if export else ())
        self.numbers = SUMMARY_NUMBERS + TELEMETRY_NUMBERS + (EXPORT_NUMBERS if export else ())
        # "error" is always read (it decides `ok`); kept as a column only for an export.
        self.fields = (*self.text, *self.numbers, *(() if export else ("error",)))
        self.export = export
        self.rows: list[tuple[Any, ...]] = []
        self.chunks: list[dict[str, Any]] = []

    def add(self, record: Mapping[str, Any]) -> None:
        self.rows.append((*map(record.get, self.fields), record.get("coalesced", _ABSENT)))
        if len(self.rows) >= CHUNK_ROWS:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        columns = list(zip(*self.rows, strict=True))
        self.rows = []
        chunk: dict[str, Any] = {}
        width = len(self.text)
        for index, name in enumerate(self.text):
            chunk[name] = pd.factorize(text_column(columns[index]), use_na_sentinel=True)
        for index, name in enumerate(self.numbers, start=width):
            chunk[name] = _floats(columns[index])
        errors = columns[self.fields.index("error")]
        finish = columns[self.fields.index("finish_reason")]
        # Element-wise comparisons of object arrays run in C: None == None, "x" != "error".
        none = np.array(None, dtype=object)
        chunk["ok"] = np.equal(_objects(errors), none) & np.not_equal(_objects(finish), "error")
        # Only records that carry `coalesced` have today's decode rate (stats.call_frame); the
        # sentinel compares equal to itself only.
        chunk["_current"] = np.not_equal(_objects(columns[-1]), np.array(_ABSENT, dtype=object))
        chunk["coalesced"] = np.fromiter(
            (value is True for value in columns[-1]), dtype=bool, count=len(errors)
        )
        self.chunks.append(chunk)

    def frame(self) -> pd.DataFrame:
        self.flush()
        data: dict[str, Any] = {}
        for name in self.text:
            data[name] = _categorical([chunk[name] for chunk in self.chunks])
        for name in self.numbers:
            data[_RENAMED.get(name, name)] = _concat([chunk[name] for chunk in self.chunks])
        current = _concat([chunk["_current"] for chunk in self.chunks], dtype=bool)
        for metric in _DECODE_METRICS:
            data[metric][~current] = np.nan
        data["ok"] = _concat([chunk["ok"] for chunk in self.chunks], dtype=bool)
        data["coalesced"] = _concat([chunk["coalesced"] for chunk in self.chunks], dtype=bool)
        return pd.DataFrame(data)


def _objects(values: Sequence[Any]) -> np.ndarray[Any, np.dtype[np.object_]]:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def _floats(values: Sequence[Any]) -> np.ndarray[Any, np.dtype[np.float64]]:
    # Through an object array: None becomes NaN two to three times faster than np.array(values).
    try:
        return _objects(values).astype("float64")
    except (TypeError, ValueError):
        coerced = pd.to_numeric(pd.Series(_objects(values)), errors="coerce")
        return coerced.to_numpy(dtype="float64", na_value=np.nan)


def _concat(parts: list[Any], dtype: str | type = "float64") -> Any:
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


def _categorical(parts: list[tuple[Any, Any]]) -> pd.Categorical:
    """Chunks of (codes, uniques) as one categorical; values that are not text become text."""
    categories: dict[str, int] = {}
    codes = []
    for chunk_codes, uniques in parts:
        mapping = np.array(
            [categories.setdefault(_as_text(value), len(categories)) for value in uniques] + [-1],
            dtype="int64",
        )
        codes.append(mapping[chunk_codes])  # the -1 of a missing value picks the last: -1
    joined = np.concatenate(codes) if codes else np.empty(0, dtype="int64")
    result: pd.Categorical = pd.Categorical.from_codes(  # type: ignore[call-overload]
        joined, categories=list(categories)
    )
    return result


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else str(value)
