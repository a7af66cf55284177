"""Reads a ledger in one streaming pass into columns: the call records as a frame, the few
other records (meta, cell, skipped, sample, end) as they are.

A dict per call record costs about 9 KB in memory and most of the time of a report on a large
ledger; here each line is parsed (orjson) and only the fields a report needs are kept, a chunk of
rows at a time as numpy columns, text as categorical codes. The ledger itself is not changed.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import io
import itertools
import multiprocessing
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast, overload

import numpy as np
import orjson
import pandas as pd

from pytest_gpubench.config.metrics import RESOURCES, VALIDITY
from pytest_gpubench.core.errors import GpubenchError
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
from pytest_gpubench.ledger.writer import NotFinite, parse_line
from pytest_gpubench.reports.frame_columns import (
    ABSENT,
    CACHED_NUMBERS,
    CACHED_TEXT,
    CHECK_NUMBERS,
    CHUNK_ROWS,
    TELEMETRY_NUMBERS,
    TELEMETRY_TEXT,
    FrameBuilder,
    as_text,
    restore_cell_keys,
)
from pytest_gpubench.results.engine_checks import (
    COUNTER_COLUMNS,
    EngineChecks,
    engine_checks_frame,
)
from pytest_gpubench.results.stats import (
    PromptSummary,
    summarize_frame,
)
from pytest_gpubench.telemetry.aggregate import TelemetrySummary


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
        without telemetry, or columns cached before it was read): what
        telemetry.aggregate.telemetry_summaries gives for their records, computed on the
        columns (a dict per call took 10 s and more of a million-call report)."""
        needed = ("cell_id", "prompt_id", "phase", "ok", *TELEMETRY_TEXT, *TELEMETRY_NUMBERS)
        if any(name not in self.calls.columns for name in needed):
            return []
        calls = self.calls
        keep = (
            (calls["phase"] == "warm").to_numpy(dtype=bool)
            & calls["ok"].to_numpy(dtype=bool)
            & calls["cell_id"].notna().to_numpy()
            & calls["prompt_id"].notna().to_numpy()
        )
        warm = calls.loc[keep, [name for name in needed if name not in ("phase", "ok")]]
        if warm.empty:
            return []
        keys = [warm["cell_id"].astype(str), warm["prompt_id"].astype(str)]
        grouped = warm.groupby(keys, sort=False)
        sizes = grouped.size()
        peaks = grouped[list(_TELEMETRY_PEAKS)].max()
        medians = grouped[list(_TELEMETRY_MEDIANS)].median()
        sources = grouped["gpu_energy_source"].agg(_energy_sources)
        return [
            TelemetrySummary(
                cell_id=cell_id,
                prompt_id=prompt_id,
                calls=int(sizes[(cell_id, prompt_id)]),
                gpu_energy_source=sources[(cell_id, prompt_id)] or None,
                **{
                    name: _plain_float(table.at[(cell_id, prompt_id), name])
                    for table, names in ((peaks, _TELEMETRY_PEAKS), (medians, _TELEMETRY_MEDIANS))
                    for name in names
                },
            )
            for cell_id, prompt_id in sorted(sizes.index)
        ]

    def has_validity(self) -> bool:
        """Whether some call has a validity measure (config/metrics.VALIDITY: a tools or
        json_schema prompt's): a report then needs the summaries' samples to count the valid
        answers."""
        columns = self.calls.columns
        return any(
            bool(self.calls[rate.measure].notna().any())
            for rate in VALIDITY
            if rate.measure in columns
        )

    def engine_checks(self, unchecked: Iterable[str] = ()) -> list[EngineChecks]:
        """Per (cell, prompt) the warm calls' checks against the engine, counted on the columns
        by results.engine_checks (as the session's judgement counts them); none for columns
        cached before they were read."""
        needed = ("cell_id", "prompt_id", "phase", "ok", *CHECK_NUMBERS, *COUNTER_COLUMNS)
        if any(name not in self.calls.columns for name in needed):
            return []
        return engine_checks_frame(self.calls, unchecked)


# TelemetrySummary's figures (config/metrics.RESOURCES): the peak of the per-call peaks, the
# median of the rest.
_TELEMETRY_PEAKS = tuple(figure.name for figure in RESOURCES if figure.peak)
_TELEMETRY_MEDIANS = tuple(figure.name for figure in RESOURCES if not figure.peak)


def _energy_sources(column: pd.Series[Any]) -> str:
    """The energy sources a group's calls named, sorted, joined by `+` ("" for none)."""
    return "+".join(sorted({str(value) for value in column.dropna().unique() if value}))


def _plain_float(value: Any) -> float | None:
    """A figure as the call records' reader gives it: a float, None for NaN."""
    number = float(value)
    return None if number != number else number


def read_ledger_frame(path: str | os.PathLike[str], *, export: bool = False) -> LedgerData:
    """Stream a ledger into columns; a truncated last line (a killed run) is left out, a bad
    line elsewhere is an error naming the file and line. `export`: keep the CSV columns too.

    The columns of the ledger's lines that its cache (<ledger>.columns) holds are read from
    there, only the lines after them are parsed; the cache is then extended with those, where
    the ledger is finished (its last record is the end record)."""
    path = Path(path)
    # Millions of short-lived dicts would set off the cyclic collector thousands of times, each
    # pass walking every row kept so far: off while reading (records hold no cycles).
    collecting = gc.isenabled()
    gc.disable()
    try:
        size = _size(path)
        cached = _CachedFrames() if export else load_cache(path, size)
        parts = _read_parts(path, cached.covered, size, export=export)
        data, complete = _assemble(path, cached, parts, export=export)
        if complete and not export and parts and parts[-1].last_type == "end":
            _extend_cache(path, cached, parts)
        return data
    finally:
        if collecting:
            gc.enable()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot read ledger: {exc.strerror}") from None


def _read_parts(path: Path, start: int, size: int, *, export: bool) -> list[_Part]:
    """The lines from byte `start` to the end, parsed. A large range is read in byte ranges,
    one per core, each in a forked process: parsing JSON is most of the time and holds one
    core."""
    if start >= size:
        return []
    try:
        workers = min(os.cpu_count() or 1, MAX_WORKERS)
        if size - start < PARALLEL_MIN_BYTES or workers < 2 or not _can_fork():
            return [_read_range(path, start, size, export)]
        bounds = _line_bounds(path, start, size, workers)
        ranges = [(path, a, b, export) for a, b in itertools.pairwise(bounds)]
        with multiprocessing.get_context("fork").Pool(len(ranges)) as pool:
            return pool.starmap(_read_range, ranges)
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot read ledger: {exc.strerror}") from None


def _assemble(
    path: Path, cached: _CachedFrames, parts: list[_Part], *, export: bool
) -> tuple[LedgerData, bool]:
    """The data of the cached frames and the parsed parts, and whether the ledger ended with a
    whole line (nothing truncated or still being written: the parts may then be cached)."""
    builder = FrameBuilder(export=export)
    others: list[dict[str, Any]] = []
    for cached_frame in cached.frames:
        builder.chunks.extend(cached_frame.chunks)
        others.extend(cached_frame.others)
    lines_before = cached.lines
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
    frame = restore_cell_keys(builder.frame(), others)
    return LedgerData(path, frame, others), whole and not truncated


PARALLEL_MIN_BYTES = 64 << 20
MAX_WORKERS = 4


def _can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def _line_bounds(path: Path, start: int, size: int, parts: int) -> list[int]:
    """Byte offsets that split [start, size) into about equal ranges, each at a line's start."""
    bounds = [start]
    with path.open("rb") as ledger:
        for number in range(1, parts):
            ledger.seek(start + (size - start) * number // parts)
            ledger.readline()  # to the start of the next whole line
            bounds.append(min(ledger.tell(), size))
    bounds.append(size)
    return sorted(set(bounds))


@dataclass
class _Part:
    """What one byte range [start, end) of a ledger held."""

    chunks: list[dict[str, Any]]
    others: list[dict[str, Any]]
    lines: int
    records: int
    bad_line: int | None
    content_after_bad: bool
    whole: bool
    start: int = 0
    end: int = 0
    # The type of its last record ("end" where the ledger's run ended there).
    last_type: str | None = None
    # A whole line with NaN or an infinity in a record's field: (its line, what and where).
    not_finite: tuple[int, str] | None = None


# Lines read through a 1 MiB buffer: a fifth of the CPU time of the default 8 KiB one.
READ_BUFFER = 1 << 20


def _read_range(path: Path, start: int, end: int, export: bool) -> _Part:
    with path.open("rb", buffering=READ_BUFFER) as ledger:
        ledger.seek(start)
        return parse_lines(ledger, start, end, export=export)


def parse_lines(lines: Iterable[bytes], start: int, end: int, *, export: bool = False) -> _Part:
    """The records of a ledger's lines from byte `start` (call records into columns, the others
    as they are), up to byte `end`."""
    builder = FrameBuilder(export=export)
    others: list[dict[str, Any]] = []
    bad_line: int | None = None
    after_bad = False
    whole = True
    count = records = 0
    position = start
    last_type: str | None = None
    # The loop runs once a line (a million times for a large ledger): builder.add inlined, the
    # names it calls bound once.
    loads = orjson.loads
    rows = builder.rows
    fields = builder.fields
    for line in lines:
        if position >= end:
            break
        size = len(line)
        position += size
        count += 1
        whole = line.endswith(b"\n")
        # strip() copies the line: only one that does not open a record can be blank.
        if line[:1] != b"{" and not line.strip():
            continue
        records += 1
        if bad_line is not None:
            after_bad = True
            break
        try:
            record = loads(line)
        except orjson.JSONDecodeError:
            # orjson refuses NaN and infinities, which Python's json writes: one in a record's
            # field is named as gpubench gate names it, not taken for a cut tail.
            problem = _not_finite(line)
            if problem is not None:
                builder.flush()
                return _Part(
                    builder.chunks, others, count, records, None, False, whole, start, position,
                    not_finite=(count, problem),
                )  # fmt: skip
            bad_line = count
            continue
        if not isinstance(record, dict):
            continue
        get = record.get
        last_type = get("type")
        if last_type == "call":
            rows.append((*map(get, fields), get("coalesced", ABSENT)))
            if len(rows) >= CHUNK_ROWS:
                builder.flush()
                rows = builder.rows
        else:
            others.append(record)
    builder.flush()
    return _Part(
        builder.chunks, others, count, records, bad_line, after_bad, whole, start, position,
        last_type if isinstance(last_type, str) else None,
    )  # fmt: skip


def _not_finite(line: bytes) -> str | None:
    """Where a line orjson could not read holds NaN or an infinity in a record's field
    (ledger.writer.parse_line), or None: the line is not JSON for another reason."""
    try:
        parse_line(line)
    except NotFinite as exc:
        return str(exc)
    return None


# -- the columnar cache beside the ledger -------------------------------------------------------
# <ledger>.columns holds the columns of the ledger's lines as frames appended one after another,
# each for a byte range of the ledger: the first from byte 0, each next where the last ended.
# A frame is used only while the ledger still holds, at the end of its range, the bytes the
# frame saw there: the ledger stays the truth, and a frame that no longer matches ends the
# cache (what follows is parsed). A session appends a frame every few thousand lines as it
# writes its ledger (reports/frame_cache.py), `gpubench merge` as it writes the merged one, and a
# report the lines it had to parse, once the ledger is finished.
CACHE_SUFFIX = ".columns"
# 6: how busy the engine kept its CPUs (5: the engine checks' columns; 4: frames appended as the
# ledger grows; 3: one file rewritten whole, <ledger>.columns.npz).
CACHE_VERSION = 6
_MAGIC = b"GBCOLS04"
_HEAD = struct.Struct("<8sIQ")
# The bytes of the ledger a frame keeps from the end of its range, to check it still holds them.
_TAIL_BYTES = 64


def cache_path(path: Path) -> Path:
    return path.with_name(path.name + CACHE_SUFFIX)


@dataclass
class _Frame:
    chunks: list[dict[str, Any]]
    others: list[dict[str, Any]]


@dataclass
class _CachedFrames:
    """The cache's frames that still match the ledger: they hold its bytes [0, covered), its
    first `lines` lines; the cache file's first `valid_bytes` bytes are theirs."""

    frames: list[_Frame] = field(default_factory=list)
    covered: int = 0
    lines: int = 0
    valid_bytes: int = 0


def load_cache(path: Path, size: int) -> _CachedFrames:
    """The frames of the ledger's cache that match it, in order (none: no cache, or none that
    can be read)."""
    cached = _CachedFrames()
    try:
        blob = memoryview(cache_path(path).read_bytes())
    except OSError:
        return cached
    try:
        with path.open("rb") as ledger:
            while cached.valid_bytes + _HEAD.size <= len(blob):
                frame = _next_frame(blob, cached, ledger, size)
                if frame is None:
                    break
                cached.frames.append(frame)
    except OSError:
        pass
    return cached


def _next_frame(blob: memoryview, cached: _CachedFrames, ledger: Any, size: int) -> _Frame | None:
    """The frame at cached.valid_bytes when it is whole and continues the ledger's bytes where
    the last ended (cached is moved past it); else None."""
    offset = cached.valid_bytes
    magic, header_size, payload_size = _HEAD.unpack_from(blob, offset)
    body = offset + _HEAD.size
    if magic != _MAGIC or body + header_size + payload_size > len(blob):
        return None
    try:
        header = orjson.loads(blob[body : body + header_size])
        start, end, tail = int(header["start"]), int(header["end"]), bytes.fromhex(header["tail"])
        if (
            header.get("version") != CACHE_VERSION
            or header.get("columns") != [*CACHED_TEXT, *CACHED_NUMBERS, *COUNTER_COLUMNS]
            or start != cached.covered
            or not start < end <= size
        ):
            return None
        ledger.seek(end - len(tail))
        if ledger.read(len(tail)) != tail:
            return None
        payload = blob[body + header_size : body + header_size + payload_size]
        frame = _decode_frame(bytes(payload), int(header["chunks"]))
    except (KeyError, TypeError, ValueError, orjson.JSONDecodeError):
        return None
    cached.covered = end
    cached.lines += int(header["lines"])
    cached.valid_bytes = body + header_size + payload_size
    return frame


def read_cached(path: Path) -> LedgerData | None:
    """The ledger's data from its cache alone, where the cache holds every byte of it (the
    first report on a session's ledger); None where some of it would have to be parsed."""
    size = _size(path)
    cached = load_cache(path, size)
    if cached.covered != size:
        return None
    data, _ = _assemble(path, cached, [], export=False)
    return data


def frame_bytes(part: _Part, tail: bytes) -> bytes:
    """One frame of the cache: the part's byte range, the ledger's bytes at its end (`tail`),
    its line count, and its chunks of columns and other records (an npz)."""
    arrays: dict[str, Any] = {
        "others": np.frombuffer(orjson.dumps(part.others), dtype=np.uint8),
    }
    for index, chunk in enumerate(part.chunks):
        for name, value in chunk.items():
            if isinstance(value, tuple):
                codes, uniques = value
                arrays[f"{index}:codes:{name}"] = np.asarray(codes, dtype=np.int32)
                texts = [as_text(unique) for unique in uniques]
                arrays[f"{index}:uniques:{name}"] = np.frombuffer(
                    orjson.dumps(texts), dtype=np.uint8
                )
            else:
                arrays[f"{index}:values:{name}"] = value
    payload = io.BytesIO()
    np.savez(payload, allow_pickle=False, **arrays)
    header = orjson.dumps(
        {
            "version": CACHE_VERSION,
            "start": part.start,
            "end": part.end,
            "tail": tail.hex(),
            "lines": part.lines,
            "chunks": len(part.chunks),
            "columns": [*CACHED_TEXT, *CACHED_NUMBERS, *COUNTER_COLUMNS],
        }
    )
    data = payload.getvalue()
    return _HEAD.pack(_MAGIC, len(header), len(data)) + header + data


def _decode_frame(payload: bytes, chunk_count: int) -> _Frame:
    chunks: list[dict[str, Any]] = [{} for _ in range(chunk_count)]
    with np.load(io.BytesIO(payload), allow_pickle=False) as archive:
        others = orjson.loads(archive["others"].tobytes())
        for key in archive.files:
            index, _, rest = key.partition(":")
            kind, _, name = rest.partition(":")
            if kind == "codes":
                uniques = orjson.loads(archive[f"{index}:uniques:{name}"].tobytes())
                chunks[int(index)][name] = (archive[key], np.array(uniques, dtype=object))
            elif kind == "values":
                chunks[int(index)][name] = archive[key]
    return _Frame(chunks, others)


def _extend_cache(path: Path, cached: _CachedFrames, parts: list[_Part]) -> None:
    """Append the parsed parts to the cache as frames after the ones that matched (what
    followed them is cut off). A read-only directory or a full disk: the report is still
    right, only slower next time."""
    with contextlib.suppress(OSError), path.open("rb") as ledger:
        frames = []
        for part in parts:
            ledger.seek(max(part.start, part.end - _TAIL_BYTES))
            frames.append(frame_bytes(part, ledger.read(part.end - ledger.tell())))
        append_frames(cache_path(path), frames, at=cached.valid_bytes)


def append_frames(target: Path, frames: Sequence[bytes], *, at: int) -> int:
    """Write frames into the cache file from byte `at` (the file cut there first), under an
    exclusive lock; returns the byte after them."""
    descriptor = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        os.ftruncate(descriptor, at)
        os.lseek(descriptor, at, os.SEEK_SET)
        for data in frames:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
        return os.lseek(descriptor, 0, os.SEEK_CUR)
    finally:
        os.close(descriptor)


def frame_of_records(records: Iterable[Mapping[str, Any]], *, export: bool = False) -> LedgerData:
    """The same, from records already in memory (a run that just ended, a test)."""
    builder = FrameBuilder(export=export)
    others: list[dict[str, Any]] = []
    for record in records:
        if record.get("type") == "call":
            builder.add(record)
        else:
            others.append(dict(record))
    return LedgerData(None, restore_cell_keys(builder.frame(), others), others)
