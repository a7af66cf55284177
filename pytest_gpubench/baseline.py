"""Baselines on disk: one stable, sorted JSON file per cell under baselines/, read and written."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpubench.errors import GpubenchError
from pytest_gpubench.ledger import read_ledger
from pytest_gpubench.stats import (
    PERCENTILE_NAMES,
    SAMPLE_FIELDS,
    WARM_METRICS,
    PromptSummary,
    WarmSamples,
    summarize,
)

# 2: p90s, the decode, TPOT, end-to-end and engine-side metrics and samples, the coalesced count;
# the mean of per-call tokens/s of format 1 is no longer written (and ignored when read).
FORMAT_VERSION = 2
DEFAULT_MIN_SUCCESS_RATE = 0.95
# Anything but these becomes "_" in a file name; the exact cell id is kept inside the file.
_UNSAFE_IN_FILE_NAME = re.compile(r"[^A-Za-z0-9._-]")
_REPAIR = "restore it with `git checkout -- <file>` or write it again with --baseline-update"


@dataclass(frozen=True)
class Provenance:
    """Where a baseline's numbers came from."""

    benchmark_run_id: str | None = None
    git_sha: str | None = None
    engine_version: str | None = None
    model_digest: str | None = None
    gpus: tuple[Any, ...] = ()
    # When the run that measured them started (the ledger's meta record), not when written.
    date: str | None = None


@dataclass(frozen=True)
class CellBaseline:
    """The committed numbers of one cell: a summary per prompt and their provenance."""

    cell_id: str
    provenance: Provenance
    prompts: tuple[PromptSummary, ...]

    def prompt(self, prompt_id: str) -> PromptSummary | None:
        return next((p for p in self.prompts if p.prompt_id == prompt_id), None)


@dataclass(frozen=True)
class BaselineUpdate:
    """What --baseline-update did: files written per cell, and why the other cells were not."""

    written: dict[str, Path] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


# -- names ------------------------------------------------------------------------------------


def baseline_file_name(cell_id: str) -> str:
    """`local:llamacpp:qwen3.5:0.8b` -> `local_llamacpp_qwen3.5_0.8b.json`."""
    return _UNSAFE_IN_FILE_NAME.sub("_", cell_id) + ".json"


def baseline_path(baselines_dir: Path, cell_id: str) -> Path:
    return baselines_dir / baseline_file_name(cell_id)


# -- to and from JSON (pure) ------------------------------------------------------------------


def summary_to_dict(summary: PromptSummary) -> dict[str, Any]:
    warm: dict[str, Any] = {
        "n": summary.n_warm,
        "n_ok": summary.n_warm_ok,
        "success_rate": summary.warm_success_rate,
        "coalesced": summary.warm_coalesced,
    }
    for metric in WARM_METRICS:
        warm[metric] = {name: summary.warm_percentile(metric, name) for name in PERCENTILE_NAMES}
    return {
        "prompt_sha256": summary.prompt_sha256,
        "cold": {
            "n": summary.n_cold,
            "n_ok": summary.n_cold_ok,
            "kind": summary.cold_kind,
            "first_delta_ms": summary.cold_first_delta_ms,
            "total_duration_ms": summary.cold_total_duration_ms,
        },
        "warm": warm,
        "samples": {field: list(getattr(summary.samples, field)) for field in SAMPLE_FIELDS},
    }


def baseline_to_dict(baseline: CellBaseline) -> dict[str, Any]:
    provenance = baseline.provenance
    return {
        "format": FORMAT_VERSION,
        "cell_id": baseline.cell_id,
        "provenance": {
            "benchmark_run_id": provenance.benchmark_run_id,
            "git_sha": provenance.git_sha,
            "engine_version": provenance.engine_version,
            "model_digest": provenance.model_digest,
            "gpus": list(provenance.gpus),
            "date": provenance.date,
        },
        "prompts": {summary.prompt_id: summary_to_dict(summary) for summary in baseline.prompts},
    }


def dumps_baseline(baseline: CellBaseline) -> str:
    """Sorted keys, two-space indent, a final newline: the same numbers give the same bytes."""
    return (
        json.dumps(
            baseline_to_dict(baseline),
            sort_keys=True,
            indent=2,
            ensure_ascii=False,
            allow_nan=False,
        )
        + "\n"
    )


class _Fields:
    """Typed access to a parsed baseline; every problem names the file and the key path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> GpubenchError:
        return GpubenchError(f"{self.source}: corrupt baseline: {where}: {problem}; {_REPAIR}")

    def get(self, data: Mapping[str, Any], key: str, where: str) -> Any:
        if key not in data:
            raise self.fail(_join(where, key), "required key is missing")
        return data[key]

    def mapping(self, data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
        value = self.get(data, key, where)
        if not isinstance(value, dict):
            raise self.fail(_join(where, key), f"expected an object, got {_kind(value)}")
        return value

    def number(self, data: Mapping[str, Any], key: str, where: str) -> float | None:
        value = self.get(data, key, where)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise self.fail(_join(where, key), f"expected a number, got {_kind(value)}")
        return float(value)

    def count(self, data: Mapping[str, Any], key: str, where: str) -> int:
        value = self.get(data, key, where)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(_join(where, key), f"expected a count, got {_kind(value)}")
        return value

    def text(self, data: Mapping[str, Any], key: str, where: str) -> str | None:
        value = self.get(data, key, where)
        if value is not None and not isinstance(value, str):
            raise self.fail(_join(where, key), f"expected a string, got {_kind(value)}")
        return value

    def optional_number(self, data: Mapping[str, Any], key: str, where: str) -> float | None:
        """A number added after format 1: None where an older file lacks it."""
        return self.number(data, key, where) if key in data else None

    def optional_mapping(self, data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
        return self.mapping(data, key, where) if key in data else {}

    def numbers(self, data: Mapping[str, Any], key: str, where: str) -> tuple[float, ...]:
        value = self.get(data, key, where)
        valid = isinstance(value, list) and all(
            isinstance(item, int | float) and not isinstance(item, bool) for item in value
        )
        if not valid:
            raise self.fail(_join(where, key), "expected a list of numbers")
        return tuple(float(item) for item in value)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {json.dumps(value)[:40]}"


# What a format 1 file must have; format 2 must have every figure. A format 1 file's
# `tokens_per_sec_mean` and `tokens_per_sec` samples (another definition of tokens/s) are ignored:
# its decode rate and the figures it predates are None, and the gate calls them new.
_FORMAT_1_PERCENTILES = {
    "first_delta_ms": ("p50", "p95", "p99"),
    "total_duration_ms": ("p50", "p95", "p99"),
}
_FORMAT_1_SAMPLES = ("first_delta_ms", "total_duration_ms")


def summary_from_dict(
    data: Mapping[str, Any],
    cell_id: str,
    prompt_id: str,
    fields: _Fields,
    version: int = FORMAT_VERSION,
) -> PromptSummary:
    """One prompt's summary; figures newer than the file's format are None (compared as new)."""
    complete = version >= 2
    where = f"prompts.{prompt_id}"
    cold = fields.mapping(data, "cold", where)
    warm = fields.mapping(data, "warm", where)
    samples = fields.mapping(data, "samples", where)
    at = {name: f"{where}.{name}" for name in ("cold", "warm", "samples")}
    percentiles: dict[str, float | None] = {}
    for metric in WARM_METRICS:
        required = PERCENTILE_NAMES if complete else _FORMAT_1_PERCENTILES.get(metric, ())
        found = (
            fields.mapping(warm, metric, at["warm"])
            if required
            else fields.optional_mapping(warm, metric, at["warm"])
        )
        for name in PERCENTILE_NAMES:
            read = fields.number if name in required else fields.optional_number
            percentiles[f"warm_{metric}_{name}"] = read(found, name, f"{at['warm']}.{metric}")
    raw = {
        field: fields.numbers(samples, field, at["samples"])
        if complete or field in _FORMAT_1_SAMPLES
        else ()
        for field in SAMPLE_FIELDS
    }
    coalesced = fields.count(warm, "coalesced", at["warm"]) if complete else 0
    return PromptSummary(
        cell_id=cell_id,
        prompt_id=prompt_id,
        prompt_sha256=fields.text(data, "prompt_sha256", where),
        n_cold=fields.count(cold, "n", at["cold"]),
        n_cold_ok=fields.count(cold, "n_ok", at["cold"]),
        cold_kind=fields.text(cold, "kind", at["cold"]),
        cold_first_delta_ms=fields.number(cold, "first_delta_ms", at["cold"]),
        cold_total_duration_ms=fields.number(cold, "total_duration_ms", at["cold"]),
        n_warm=fields.count(warm, "n", at["warm"]),
        n_warm_ok=fields.count(warm, "n_ok", at["warm"]),
        warm_coalesced=coalesced,
        samples=WarmSamples(**raw),
        **percentiles,
    )


def baseline_from_dict(data: Any, source: str) -> CellBaseline:
    """Validate a parsed baseline file; `source` (the file) is named in every error."""
    fields = _Fields(source)
    if not isinstance(data, dict):
        raise fields.fail("top level", f"expected an object, got {_kind(data)}")
    version = fields.count(data, "format", "")
    if version > FORMAT_VERSION:
        raise GpubenchError(
            f"{source}: baseline format {version} is newer than this pytest-gpubench understands "
            f"({FORMAT_VERSION}); upgrade pytest-gpubench"
        )
    cell_id = fields.text(data, "cell_id", "")
    if not cell_id:
        raise fields.fail("cell_id", "must be a non-empty string")
    provenance = fields.mapping(data, "provenance", "")
    gpus = fields.get(provenance, "gpus", "provenance")
    if not isinstance(gpus, list):
        raise fields.fail("provenance.gpus", f"expected a list, got {_kind(gpus)}")
    prompts = fields.mapping(data, "prompts", "")
    summaries = []
    for prompt_id in sorted(prompts):
        entry = prompts[prompt_id]
        if not isinstance(entry, dict):
            raise fields.fail(f"prompts.{prompt_id}", f"expected an object, got {_kind(entry)}")
        summaries.append(summary_from_dict(entry, cell_id, prompt_id, fields, version))
    return CellBaseline(
        cell_id=cell_id,
        provenance=Provenance(
            benchmark_run_id=fields.text(provenance, "benchmark_run_id", "provenance"),
            git_sha=fields.text(provenance, "git_sha", "provenance"),
            engine_version=fields.text(provenance, "engine_version", "provenance"),
            model_digest=fields.text(provenance, "model_digest", "provenance"),
            gpus=tuple(gpus),
            date=fields.text(provenance, "date", "provenance"),
        ),
        prompts=tuple(summaries),
    )


def loads_baseline(text: str, source: str) -> CellBaseline:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GpubenchError(
            f"{source}: corrupt baseline: not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}); {_REPAIR}"
        ) from None
    return baseline_from_dict(data, source)


# -- from a run (pure) ------------------------------------------------------------------------


def run_descriptions(
    records: Iterable[Mapping[str, Any]],
) -> tuple[Mapping[str, Any], dict[str, Mapping[str, Any]]]:
    """The ledger's meta record and the first cell record of each cell id."""
    meta: Mapping[str, Any] = {}
    cells: dict[str, Mapping[str, Any]] = {}
    for record in records:
        kind = record.get("type")
        if kind == "meta" and not meta:
            meta = record
        elif kind == "cell" and isinstance(record.get("cell_id"), str):
            cells.setdefault(record["cell_id"], record)
    return meta, cells


def cell_provenance(meta: Mapping[str, Any], cell: Mapping[str, Any]) -> Provenance:
    return Provenance(
        benchmark_run_id=_optional_text(meta.get("benchmark_run_id")),
        git_sha=_optional_text(meta.get("git_sha")),
        engine_version=_optional_text(cell.get("engine_version")),
        model_digest=_optional_text(cell.get("model_digest")),
        gpus=tuple(cell.get("gpus") or ()),
        date=_optional_text(meta.get("started_at_utc")),
    )


def _optional_text(value: Any) -> str | None:
    return None if value is None else str(value)


def baselines_from_records(records: Iterable[Mapping[str, Any]]) -> list[CellBaseline]:
    """A baseline per cell that has call records, sorted by cell id."""
    records = list(records)
    meta, cells = run_descriptions(records)
    by_cell: dict[str, list[PromptSummary]] = {}
    for summary in summarize(records):
        by_cell.setdefault(summary.cell_id, []).append(summary)
    return [
        CellBaseline(cell_id, cell_provenance(meta, cells.get(cell_id, {})), tuple(summaries))
        for cell_id, summaries in sorted(by_cell.items())
    ]


def refusal(baseline: CellBaseline, min_success_rate: float) -> str | None:
    """Why this cell's numbers must not become its baseline, or None when they may."""
    no_warm = [p.prompt_id for p in baseline.prompts if p.n_warm == 0]
    if no_warm:
        return f"no warm calls measured for {', '.join(no_warm)} (run the warm cases too)"
    failing = [
        f"{p.prompt_id} {p.warm_success_rate:.2f} ({p.n_warm_ok}/{p.n_warm})"
        for p in baseline.prompts
        if p.warm_success_rate is not None and p.warm_success_rate < min_success_rate
    ]
    if failing:
        return f"warm success rate below {min_success_rate:.2f}: {', '.join(failing)}"
    return None


def plan_update(
    records: Iterable[Mapping[str, Any]],
    min_success_rate: float | Mapping[str, float] = DEFAULT_MIN_SUCCESS_RATE,
) -> tuple[list[CellBaseline], dict[str, str]]:
    """The baselines to write and, per cell id, why each of the others is not written."""
    records = list(records)
    accepted: list[CellBaseline] = []
    refused: dict[str, str] = {}
    for baseline in baselines_from_records(records):
        reason = refusal(baseline, _minimum_for(min_success_rate, baseline.cell_id))
        if reason is None:
            accepted.append(baseline)
        else:
            refused[baseline.cell_id] = reason
    measured = {baseline.cell_id for baseline in accepted} | set(refused)
    for record in records:
        cell_id = record.get("cell_id")
        if record.get("type") != "skipped" or not isinstance(cell_id, str) or cell_id in measured:
            continue
        refused.setdefault(cell_id, f"skipped: {record.get('reason') or 'no reason given'}")
    return accepted, refused


def _minimum_for(minimum: float | Mapping[str, float], cell_id: str) -> float:
    if isinstance(minimum, Mapping):
        return float(minimum.get(cell_id, DEFAULT_MIN_SUCCESS_RATE))
    return float(minimum)


# -- disk -------------------------------------------------------------------------------------


def load_baseline(path: Path) -> CellBaseline:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GpubenchError(f"{path}: baseline file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GpubenchError(f"{path}: cannot read baseline: {exc}") from None
    return loads_baseline(text, str(path))


def find_baseline(baselines_dir: Path, cell_id: str) -> CellBaseline | None:
    """The cell's baseline, or None when it has none yet."""
    path = baseline_path(baselines_dir, cell_id)
    if not path.exists():
        return None
    baseline = load_baseline(path)
    if baseline.cell_id != cell_id:
        raise GpubenchError(
            f"{path}: holds the baseline of cell '{baseline.cell_id}', not '{cell_id}': the two "
            "cell ids map to the same file name; rename one of the cells"
        )
    return baseline


def load_baselines(baselines_dir: Path) -> list[CellBaseline]:
    """Every baseline file in the directory, sorted by cell id."""
    if not baselines_dir.is_dir():
        raise GpubenchError(f"{baselines_dir}: not a baselines directory")
    baselines = [load_baseline(path) for path in sorted(baselines_dir.glob("*.json"))]
    return sorted(baselines, key=lambda baseline: baseline.cell_id)


def baseline_summaries(baselines_dir: Path, cell_ids: Iterable[str]) -> list[PromptSummary]:
    """The baseline summaries of these cells (cells without a baseline contribute none)."""
    summaries: list[PromptSummary] = []
    for cell_id in sorted(set(cell_ids)):
        baseline = find_baseline(baselines_dir, cell_id)
        if baseline is not None:
            summaries.extend(baseline.prompts)
    return summaries


def load_summaries(path: Path) -> list[PromptSummary]:
    """Summaries from a ledger file, or from every baseline in a baselines directory."""
    if path.is_dir():
        return [summary for baseline in load_baselines(path) for summary in baseline.prompts]
    if not path.exists():
        raise GpubenchError(f"{path}: no such ledger or baselines directory")
    return summarize(read_ledger(path))


def write_baseline(baselines_dir: Path, baseline: CellBaseline) -> Path:
    """Write atomically (a crash leaves the old file or the new one, never half of one)."""
    path = baseline_path(baselines_dir, baseline.cell_id)
    if path.exists():
        find_baseline(baselines_dir, baseline.cell_id)  # refuses to overwrite another cell's file
    text = dumps_baseline(baseline)
    try:
        baselines_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot write baseline: {exc.strerror}") from None
    return path


def update_baselines(
    baselines_dir: Path,
    records: Iterable[Mapping[str, Any]],
    min_success_rate: float | Mapping[str, float] = DEFAULT_MIN_SUCCESS_RATE,
) -> BaselineUpdate:
    """--baseline-update: write the cells that ran and passed the success bar, explain the rest."""
    accepted, refused = plan_update(records, min_success_rate)
    written = {baseline.cell_id: write_baseline(baselines_dir, baseline) for baseline in accepted}
    return BaselineUpdate(written=written, refused=refused)
