"""Trace replay (`trace:` in a `load:` profile): a file of request arrivals replayed on its own
schedule: Mooncake's JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of
shared prompt blocks) or BurstGPT's CSV (`Timestamp` s, `Request tokens`, `Response tokens`),
sped up and cut to a time window."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator

from pytest_gpubench.core.errors import GpubenchError

TRACE_FORMATS = ("mooncake", "burstgpt")
# BurstGPT's columns (its README): seconds from the trace's start, and the token counts.
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


class Trace(BaseModel):
    """A trace file and how it is replayed (aiperf's fixed-schedule replay, SGLang's mooncake
    replay): one load point per `speedup` (2: twice as fast), the arrivals in `window` (seconds
    of the trace: [start, end]) only."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Annotated[str, Field(min_length=1)]
    format: Literal["mooncake", "burstgpt"]
    speedup: list[PositiveFloat] = [1.0]
    window: tuple[Annotated[float, Field(ge=0.0)], PositiveFloat] | None = None
    # Tokens per hash_id block (Mooncake's traces use 512): requests sharing a hash_id share
    # that block of their prompt, as its users' requests shared a prefix.
    block_tokens: PositiveInt = 512
    # A request's output length cap (a long trace answer on a small test model).
    max_output_tokens: PositiveInt | None = None

    @field_validator("speedup", mode="before")
    @classmethod
    def _one_or_more(cls, value: object) -> object:
        return [value] if isinstance(value, int | float) and not isinstance(value, bool) else value

    def resolved(self, base: Path) -> Trace:
        path = Path(self.path).expanduser()
        return self.model_copy(update={"path": str(path if path.is_absolute() else base / path)})


@dataclass(frozen=True)
class TraceEntry:
    """One request of the trace: when it arrives (seconds after the window's start, at 1x),
    its prompt and output lengths, and its shared blocks."""

    at_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


def read_trace(trace: Trace, where: str) -> list[TraceEntry]:
    """The trace's requests in the window, in arrival order, times from the window's start."""
    path = Path(trace.path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        reason = "file not found" if isinstance(exc, FileNotFoundError) else exc.strerror
        raise GpubenchError(f"{where}.path: {path}: {reason}") from None
    except UnicodeDecodeError:
        raise GpubenchError(f"{where}.path: {path}: not UTF-8 text") from None
    source = f"{where}.path: {path}"
    rows = _mooncake(text, source) if trace.format == "mooncake" else _burstgpt(text, source)
    rows.sort(key=lambda row: row.at_s)
    start, end = trace.window if trace.window is not None else (0.0, float("inf"))
    if rows and trace.window is None:
        start = rows[0].at_s
    kept = [
        TraceEntry(
            row.at_s - start,
            row.input_tokens,
            min(row.output_tokens, trace.max_output_tokens or row.output_tokens),
            row.hash_ids,
        )
        for row in rows
        if start <= row.at_s < end
    ]
    if not kept:
        raise GpubenchError(f"{where}.window: no request of {path} arrives in {trace.window}")
    return kept


def _positive(value: object, what: str, source: str, line: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 1:
        raise GpubenchError(
            f"{source}: line {line}: {what} must be a positive count (got {value!r})"
        )
    return int(value)


def _mooncake(text: str, source: str) -> list[TraceEntry]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise GpubenchError(f"{source}: line {number}: malformed JSON: {exc.msg}") from None
        if not isinstance(item, dict) or "timestamp" not in item:
            raise GpubenchError(
                f"{source}: line {number}: expected an object with timestamp (ms), "
                "input_length, output_length, hash_ids (Mooncake)"
            )
        stamp = item["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, int | float) or stamp < 0:
            raise GpubenchError(
                f"{source}: line {number}: timestamp must be ms >= 0 (got {stamp!r})"
            )
        hashes = item.get("hash_ids") or []
        if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
            raise GpubenchError(f"{source}: line {number}: hash_ids must be a list of integers")
        rows.append(
            TraceEntry(
                stamp / 1000.0,
                _positive(item.get("input_length"), "input_length", source, number),
                _positive(item.get("output_length"), "output_length", source, number),
                tuple(hashes),
            )
        )
    return rows


def _burstgpt(text: str, source: str) -> list[TraceEntry]:
    reader = csv.DictReader(io.StringIO(text))
    missing = [name for name in BURSTGPT_COLUMNS if name not in (reader.fieldnames or [])]
    if missing:
        raise GpubenchError(f"{source}: missing column(s) {', '.join(missing)} (BurstGPT CSV)")
    rows = []
    for number, row in enumerate(reader, 2):
        try:
            values = [float(row[name]) for name in BURSTGPT_COLUMNS]
        except (TypeError, ValueError):
            raise GpubenchError(f"{source}: line {number}: not a number in {dict(row)}") from None
        if values[1] < 1 or values[2] < 1:
            continue  # BurstGPT logs failed requests with 0 response tokens: nothing to replay
        rows.append(TraceEntry(values[0], int(values[1]), int(values[2])))
    return rows
