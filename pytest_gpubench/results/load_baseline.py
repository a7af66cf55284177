"""Load baselines: `baselines/load/<cell>.json`, one entry per load point (`<prompt>@load-<point>`)
with its figures and per-request samples; read for the gate, merged by --baseline-update."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Strict, ValidationError

from pytest_gpubench.core.errors import GpubenchError, key_path, non_finite_at
from pytest_gpubench.core.files import atomic_write
from pytest_gpubench.results.baseline import baseline_exists, baseline_file_name
from pytest_gpubench.results.load_gate import (
    baseline_point,
    gated,
    is_result,
    point_key,
    skipped_step_keys,
    skipped_why,
)

FORMAT = 1
LOAD_DIR = "load"
_REPAIR = "restore it from git or rewrite it with --baseline-update"


class LoadBaselineFile(BaseModel):
    """A load baseline file: the cell it belongs to and its points by key. A point holds a valid
    load record's figures and samples and its history (load_gate.baseline_point); the load gate
    reads them as it reads records, a figure of the wrong type being unknown."""

    model_config = ConfigDict(extra="ignore")

    # Never checked: format 1 is the only one (a later format is read as far as it agrees).
    format: Any = FORMAT
    cell_id: Annotated[str, Strict()]
    points: Annotated[dict[str, Any], Strict()]


def load_baseline_path(baselines_dir: Path, cell_id: str) -> Path:
    return baselines_dir / LOAD_DIR / baseline_file_name(cell_id)


def read_load_baseline(baselines_dir: Path, cell_id: str) -> dict[str, dict[str, Any]]:
    """{point key: baseline point} of a cell; empty when it has no load baseline yet."""
    path = load_baseline_path(baselines_dir, cell_id)
    if not baseline_exists(path):
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        # ValueError: not UTF-8, not JSON, or a number too long to read.
        raise GpubenchError(f"{path}: corrupt load baseline ({exc}); {_REPAIR}") from None
    try:
        parsed = LoadBaselineFile.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = key_path(tuple(error["loc"])) or "top level"
        raise GpubenchError(
            f"{path}: not the load baseline of {cell_id} ({where}: {str(error['msg']).lower()}); "
            + _REPAIR
        ) from None
    if parsed.cell_id != cell_id:
        raise GpubenchError(
            f"{path}: not the load baseline of {cell_id} (cell_id: it holds "
            f"{parsed.cell_id[:60]!r}'s points); {_REPAIR}"
        )
    # The points are read as loosely as records (a figure of the wrong type is unknown), but NaN
    # or an infinity (Python's json reads them; JSON has none) would be compared as a number.
    found = non_finite_at(data)
    if found is not None:
        at, value = found
        raise GpubenchError(
            f"{path}: corrupt load baseline ({key_path(at)}: expected a finite number, got "
            f"{json.dumps(value)}); {_REPAIR}"
        )
    return {key: value for key, value in parsed.points.items() if isinstance(value, dict)}


def read_load_baselines(
    baselines_dir: Path, cell_ids: Iterable[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    return {
        cell_id: read_load_baseline(baselines_dir, cell_id) for cell_id in sorted(set(cell_ids))
    }


def write_load_baselines(
    baselines_dir: Path, loads: Sequence[Mapping[str, Any]], *, replacing: bool = True
) -> list[str]:
    """--baseline-update: each cell's valid load points of this run over its file's (a point
    not measured now keeps its old entry); the notes say what was written and what not."""
    notes: list[str] = []
    by_cell: dict[str, list[Mapping[str, Any]]] = {}
    for record in loads:
        if gated(record):
            by_cell.setdefault(str(record.get("cell_id")), []).append(record)
    for cell_id, records in sorted(by_cell.items()):
        valid = [record for record in records if is_result(record)]
        for record in records:
            if not is_result(record):
                reason = record.get("invalid_reason") or record.get("error") or "no result"
                notes.append(
                    f"load baseline NOT written for {cell_id} {point_key(record)}: {reason}"
                )
        if not valid:
            continue
        try:
            points = read_load_baseline(baselines_dir, cell_id)
        except GpubenchError:
            if not replacing:
                raise
            points = {}
        points.update(
            {
                point_key(record): baseline_point(record, points.get(point_key(record)))
                for record in valid
            }
        )
        # A sweep that stopped at saturation ratifies its lower capacity: the steps it did not
        # run leave the baseline (else they would hold every later run back as unmeasured).
        for record in records:
            for key in skipped_step_keys(record).values():
                if points.pop(key, None) is not None:
                    notes.append(f"load baseline: {cell_id} {key} removed: {skipped_why(record)}")
        path = load_baseline_path(baselines_dir, cell_id)
        written = LoadBaselineFile(cell_id=cell_id, points=dict(sorted(points.items())))
        _write(path, written.model_dump())
        notes.append(f"load baseline written: {cell_id} -> {path}")
    return notes


def _write(path: Path, data: Mapping[str, Any]) -> None:
    """Atomically: a crash leaves the old file or the new one."""
    try:
        atomic_write(path, json.dumps(data, indent=1, sort_keys=False) + "\n")
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot write load baseline: {exc.strerror}") from None
