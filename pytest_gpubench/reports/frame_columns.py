"""The columns a ledger's call records are read into for reports: which fields (a report's, the
telemetry's, the engine checks' and an export's), built a chunk of rows at a time into numpy
columns with text as categorical codes (`FrameBuilder`), and the keys a call record leaves to its
cell record filled back in. reports/frame.py reads a ledger into them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from pytest_gpubench.config.metrics import MEASURES, RESOURCES
from pytest_gpubench.ledger.writer import CELL_KEYS
from pytest_gpubench.results.engine_checks import CHECK_FIELDS, COUNTER_COLUMNS, COUNTER_PREFIX
from pytest_gpubench.results.stats import DECODE_METRICS, text_column

# The columns stats.summarize needs (stats.call_frame builds the same frame from dicts).
SUMMARY_TEXT = (
    "cell_id", "prompt_id", "prompt_sha256", "phase", "cold_kind", "finish_reason", "kind",
)  # fmt: skip
SUMMARY_NUMBERS = ("run_idx", *(measure.field for measure in MEASURES))
# The per-case resource figures (telemetry/aggregate.py) the report's telemetry table needs.
TELEMETRY_TEXT = ("gpu_energy_source",)
TELEMETRY_NUMBERS = tuple(figure.name for figure in RESOURCES)
# The warm calls' checks against the engine: results/engine_checks.CHECK_FIELDS (those not read
# already), and each of the call's engine_counters as a column of its own (COUNTER_COLUMNS).
CHECK_NUMBERS = tuple(
    name for name in CHECK_FIELDS if name not in (*SUMMARY_NUMBERS, *TELEMETRY_NUMBERS)
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
EXPORT_NUMBERS = ("prompt_tokens", "content_reads")
# The call record's fields that stats names otherwise (tokens_per_sec: decode_tokens_per_sec).
_RENAMED = {measure.field: measure.name for measure in MEASURES if measure.field != measure.name}
CHUNK_ROWS = 65_536
ABSENT = object()


# The columns a frame holds (a report's, not an export's): a frame of other columns (written
# before a measure was added to config/metrics.py) is not used, and its lines are parsed again.
CACHED_TEXT = SUMMARY_TEXT + TELEMETRY_TEXT
CACHED_NUMBERS = SUMMARY_NUMBERS + TELEMETRY_NUMBERS + CHECK_NUMBERS


def restore_cell_keys(frame: pd.DataFrame, others: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
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
            cell_id: as_text(cell[name])
            for cell_id, cell in cells.items()
            if cell.get(name) is not None
        }
        restored = frame["cell_id"].astype(object).map(by_cell)
        filled = column.astype(object).where(~missing, restored)
        frame[name] = pd.Categorical(filled)
    return frame


class FrameBuilder:
    """Rows are gathered as tuples, and every CHUNK_ROWS turned into numpy columns."""

    def __init__(self, *, export: bool) -> None:
        self.text = CACHED_TEXT + (EXPORT_TEXT if export else ())
        self.numbers = CACHED_NUMBERS + (EXPORT_NUMBERS if export else ())
        # "error" is always read (it decides `ok`); kept as a column only for an export. The
        # engine's counters (a dict) are split into COUNTER_COLUMNS.
        self.fields = (
            *self.text,
            *self.numbers,
            *(() if export else ("error",)),
            "engine_counters",
        )
        self.export = export
        self.rows: list[tuple[Any, ...]] = []
        self.chunks: list[dict[str, Any]] = []

    def add(self, record: Mapping[str, Any]) -> None:
        self.rows.append((*map(record.get, self.fields), record.get("coalesced", ABSENT)))
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
        chunk.update(_counter_columns(columns[self.fields.index("engine_counters")]))
        errors = columns[self.fields.index("error")]
        finish = columns[self.fields.index("finish_reason")]
        # Element-wise comparisons of object arrays run in C: None == None, "x" != "error".
        none = np.array(None, dtype=object)
        chunk["ok"] = np.equal(_objects(errors), none) & np.not_equal(_objects(finish), "error")
        # Only records that carry `coalesced` have today's decode rate (stats.call_frame); the
        # sentinel compares equal to itself only.
        chunk["_current"] = np.not_equal(_objects(columns[-1]), np.array(ABSENT, dtype=object))
        chunk["coalesced"] = np.fromiter(
            (value is True for value in columns[-1]), dtype=bool, count=len(errors)
        )
        self.chunks.append(chunk)

    def frame(self) -> pd.DataFrame:
        self.flush()
        data: dict[str, Any] = {}
        for name in self.text:
            data[name] = _categorical([chunk[name] for chunk in self.chunks])
        for name in (*self.numbers, *COUNTER_COLUMNS):
            data[_RENAMED.get(name, name)] = _concat([chunk[name] for chunk in self.chunks])
        current = _concat([chunk["_current"] for chunk in self.chunks], dtype=bool)
        for metric in DECODE_METRICS:
            data[metric][~current] = np.nan
        data["ok"] = _concat([chunk["ok"] for chunk in self.chunks], dtype=bool)
        data["coalesced"] = _concat([chunk["coalesced"] for chunk in self.chunks], dtype=bool)
        return pd.DataFrame(data)


def _counter_columns(counters: Sequence[Any]) -> dict[str, Any]:
    """COUNTER_COLUMNS from the calls' engine_counters (a dict, or None): one pass over the
    calls that have one (a ledger without them costs one `any`)."""
    count = len(counters)
    columns = {name: np.full(count, np.nan) for name in COUNTER_COLUMNS}
    if not any(counters):
        return columns
    by_name = {name.removeprefix(COUNTER_PREFIX): column for name, column in columns.items()}
    for index, found in enumerate(counters):
        if found and isinstance(found, dict):
            for name, value in found.items():
                column = by_name.get(name)
                if column is not None and isinstance(value, int | float):
                    column[index] = value
    return columns


def _objects(values: Sequence[Any]) -> np.ndarray[Any, np.dtype[np.object_]]:
    # fromiter: a third of the time of filling an empty object array from a tuple (numpy 1.23+).
    return np.fromiter(values, dtype=object, count=len(values))


def _floats(values: Sequence[Any]) -> np.ndarray[Any, np.dtype[np.float64]]:
    # Through an object array: None becomes NaN two to three times faster than np.array(values).
    try:
        return _objects(values).astype("float64")
    except (TypeError, ValueError, OverflowError):
        kept = [None if _too_large(value) else value for value in values]
        coerced = pd.to_numeric(pd.Series(_objects(kept)), errors="coerce")
        return coerced.to_numpy(dtype="float64", na_value=np.nan)


def _too_large(value: Any) -> bool:
    """An integer past a float's range (an edited ledger's): read as unknown."""
    if not isinstance(value, int):
        return False
    try:
        float(value)
    except OverflowError:
        return True
    return False


def _concat(parts: list[Any], dtype: str | type = "float64") -> Any:
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


def _categorical(parts: list[tuple[Any, Any]]) -> pd.Categorical:
    """Chunks of (codes, uniques) as one categorical; values that are not text become text."""
    categories: dict[str, int] = {}
    codes = []
    for chunk_codes, uniques in parts:
        mapping = np.array(
            [categories.setdefault(as_text(value), len(categories)) for value in uniques] + [-1],
            dtype="int64",
        )
        codes.append(mapping[chunk_codes])  # the -1 of a missing value picks the last: -1
    joined = np.concatenate(codes) if codes else np.empty(0, dtype="int64")
    result: pd.Categorical = pd.Categorical.from_codes(  # type: ignore[call-overload]
        joined, categories=list(categories)
    )
    return result


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else str(value)
