"""Baselines on disk: one stable, sorted JSON file per cell under baselines/, read and written."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.files import atomic_write
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.results.gate import run_figures
from pytest_gpubench.results.run_history import History, RunFigures, appended
from pytest_gpubench.results.stats import (
    PERCENTILE_NAMES,
    REASONING_METRICS,
    SAMPLE_FIELDS,
    WARM_METRICS,
    PromptSummary,
    WarmSamples,
    summarize,
)
from pytest_gpubench.targets.gpu import gpu_summary

# 2: p90s, the decode, TPOT, end-to-end and engine-side metrics and samples, the coalesced count;
# the mean of per-call tokens/s of format 1 is no longer written (and ignored when read).
# 3: the model's identity beside its digest (model_identity, model_root, max_model_len) and the
# stream's system_fingerprint in the provenance; older files read them as unknown. A file may hold
# prompts and phases measured by different runs of the same setup (--baseline-update merges).
# 4: per prompt, `history`: the figures of its last ratified runs (run_history.py), and the
# control call's figures and samples (`control_ms`); an older file reads with no history and no
# control (the gate then says the noise floor is unknown).
# 5: the CPU pressure's figures and samples (`cpu_pressure`) beside the control call's, and its p50
# in each history entry; an older file reads without them (the gate then compares the control).
FORMAT_VERSION = 5
DEFAULT_MIN_SUCCESS_RATE = 0.95
# Anything but these becomes "_" in a file name; the exact cell id is kept inside the file.
_UNSAFE_IN_FILE_NAME = re.compile(r"[^A-Za-z0-9._-]")
_REPAIR = "restore it with `git checkout -- <file>` or write it again with --baseline-update"


@dataclass(frozen=True)
class Provenance:
    """Where a baseline's numbers came from: the run that last wrote them (run id, git sha, date)
    and the setup every number in the file was measured on (engine, model, GPUs)."""

    benchmark_run_id: str | None = None
    git_sha: str | None = None
    engine_version: str | None = None
    # A content digest only (Ollama's, the sha256 of a managed GGUF); never a name or a path.
    model_digest: str | None = None
    gpus: tuple[Any, ...] = ()
    # When the run that measured them started (the ledger's meta record), not when written.
    date: str | None = None
    # What identifies the model where there is no digest: "digest", "path", "name and root",
    # "name only" (an OpenAI-compatible server that says nothing more than the name it serves).
    model_identity: str | None = None
    # vLLM's /v1/models: what the served name was loaded from, and the context it was given.
    model_root: str | None = None
    max_model_len: int | None = None
    # The OpenAI-compatible stream's backend configuration, where every call carried the same.
    system_fingerprint: str | None = None


# The facts that make two runs comparable, each with its label and how it is shown. A fact that
# is unknown on either side (an older file, an engine that does not say) is not a difference.
def _gpu_text(provenance: Provenance) -> str:
    return gpu_summary(provenance.gpus)


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 20 else text[:19] + "…"


COMPARED_FACTS: tuple[tuple[str, Callable[[Provenance], object]], ...] = (
    ("engine version", lambda p: p.engine_version),
    ("model digest", lambda p: p.model_digest),
    ("model root", lambda p: p.model_root),
    ("max model length", lambda p: p.max_model_len),
    ("system fingerprint", lambda p: p.system_fingerprint),
    ("GPU", _gpu_text),
)


def provenance_changes(baseline: Provenance, current: Provenance) -> list[str]:
    """What differs between the setup a baseline was measured on and this run's, in words:
    `engine version b4100 → b4200`, `GPU 1 × RTX 4090 → 1 × A100`; empty when comparable."""
    changes = []
    for label, read in COMPARED_FACTS:
        old, new = read(baseline), read(current)
        if old is None or new is None or old == new:
            continue
        if label == "system fingerprint" and _is_build(baseline) and _is_build(current):
            continue  # llama-server's fingerprint is its build: named once, as its version
        shown = (str(old), str(new)) if label == "GPU" else (_short(old), _short(new))
        changes.append(f"{label} {shown[0]} → {shown[1]}")
    return changes


def _is_build(provenance: Provenance) -> bool:
    return provenance.system_fingerprint == provenance.engine_version


def merged_provenance(old: Provenance, new: Provenance) -> Provenance:
    """The provenance of a merged file: this run's, with the setup facts it did not learn kept
    from the file (they describe the same setup: a file never mixes two)."""
    kept = {
        name: getattr(old, name)
        for name in ("engine_version", "model_digest", "model_identity", "model_root",
                     "max_model_len", "system_fingerprint")
        if getattr(new, name) is None
    }  # fmt: skip
    return dataclasses.replace(new, **kept)


@dataclass(frozen=True)
class CellBaseline:
    """The committed numbers of one cell: a summary per prompt, their provenance, and per prompt
    the figures of its last ratified runs (its between-run history, oldest first)."""

    cell_id: str
    provenance: Provenance
    prompts: tuple[PromptSummary, ...]
    history: Mapping[str, History] = field(default_factory=dict)

    def prompt(self, prompt_id: str) -> PromptSummary | None:
        return next((p for p in self.prompts if p.prompt_id == prompt_id), None)

    def runs(self, prompt_id: str) -> History:
        return tuple(self.history.get(prompt_id, ()))


class _RunEntry(BaseModel):
    """One run of a prompt's history, as the file holds it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    benchmark_run_id: str | None = None
    date: str | None = None
    n: int = Field(default=0, ge=0)
    figures: dict[str, float | None] = Field(default_factory=dict)
    control_ms: float | None = None
    cpu_pressure: float | None = Field(default=None, ge=0.0, le=1.0)


def _history_from_list(value: Any, where: str, fields: _Fields) -> History:
    """A prompt's history, validated by its model; a problem names the entry and its key."""
    if not isinstance(value, list):
        raise fields.fail(where, f"expected a list, got {_kind(value)}")
    runs = []
    for index, item in enumerate(value):
        try:
            entry = _RunEntry.model_validate(item)
        except ValidationError as exc:
            error = exc.errors()[0]
            key = ".".join(str(part) for part in error["loc"])
            at = f"{where}[{index}]" + (f".{key}" if key else "")
            raise fields.fail(at, str(error["msg"]).lower()) from None
        runs.append(RunFigures(**entry.model_dump()))
    return tuple(runs)


def _history_to_list(history: History) -> list[dict[str, Any]]:
    return [
        _RunEntry(
            benchmark_run_id=run.benchmark_run_id,
            date=run.date,
            n=run.n,
            figures=dict(run.figures),
            control_ms=run.control_ms,
            cpu_pressure=run.cpu_pressure,
        ).model_dump()
        for run in history
    ]


@dataclass(frozen=True)
class BaselineUpdate:
    """What --baseline-update did: files written per cell, why the other cells (or some of a
    written cell's prompts) were not, corrupt files replaced, and files that could not be written.
    """

    written: dict[str, Path] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    replaced: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


class CorruptBaseline(GpubenchError):
    """A baseline file that cannot be read as one (not JSON, a key missing or of the wrong type):
    --baseline-update replaces it. A newer format or an unreadable file is not corrupt."""


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
        figures = {name: summary.warm_percentile(metric, name) for name in PERCENTILE_NAMES}
        # A model that does not reason has no reasoning figures: left out, not written as nulls.
        if metric not in REASONING_METRICS or any(v is not None for v in figures.values()):
            warm[metric] = figures
    samples = {
        field: list(getattr(summary.samples, field))
        for field in SAMPLE_FIELDS
        if field not in REASONING_METRICS or getattr(summary.samples, field)
    }
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
        "samples": samples,
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
            "model_identity": provenance.model_identity,
            "model_root": provenance.model_root,
            "max_model_len": provenance.max_model_len,
            "system_fingerprint": provenance.system_fingerprint,
        },
        "prompts": {
            summary.prompt_id: {
                **summary_to_dict(summary),
                "history": _history_to_list(baseline.runs(summary.prompt_id)),
            }
            for summary in baseline.prompts
        },
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

    def fail(self, where: str, problem: str) -> CorruptBaseline:
        # A key is any JSON string: a newline in a prompt id must not break the one-line error.
        shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in where)
        return CorruptBaseline(f"{self.source}: corrupt baseline: {shown}: {problem}; {_REPAIR}")

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

    def optional_text(self, data: Mapping[str, Any], key: str, where: str) -> str | None:
        return self.text(data, key, where) if key in data else None

    def optional_count(self, data: Mapping[str, Any], key: str, where: str) -> int | None:
        return self.count(data, key, where) if data.get(key) is not None else None

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
    if value is None:
        return "null"
    try:
        shown = json.dumps(value)[:40]
    except RecursionError:  # json's writer recurses less deep than its reader
        shown = "(nested too deeply to show)"
    return f"{type(value).__name__} {shown}"


# What a format 1 file must have; format 2 must have every figure. A format 1 file's
# `tokens_per_sec_mean` and `tokens_per_sec` samples (another definition of tokens/s) are ignored:
# its decode rate and the figures it predates are None, and the gate calls them new.
_FORMAT_1_PERCENTILES = {
    "first_delta_ms": ("p50", "p95", "p99"),
    "total_duration_ms": ("p50", "p95", "p99"),
}
_FORMAT_1_SAMPLES = ("first_delta_ms", "total_duration_ms")
# The format that added a figure: an older file lacks it (its runs did not measure it).
_ADDED_IN = {"control_ms": 4, "cpu_pressure": 5}


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
        if version < _ADDED_IN.get(metric, 0) or metric in REASONING_METRICS:
            required = ()
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
        if (complete or field in _FORMAT_1_SAMPLES)
        and version >= _ADDED_IN.get(field, 0)
        and (field not in REASONING_METRICS or field in samples)
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
    history: dict[str, History] = {}
    for prompt_id in sorted(prompts):
        entry = prompts[prompt_id]
        if not isinstance(entry, dict):
            raise fields.fail(f"prompts.{prompt_id}", f"expected an object, got {_kind(entry)}")
        summaries.append(summary_from_dict(entry, cell_id, prompt_id, fields, version))
        if version >= 4:
            runs = fields.get(entry, "history", f"prompts.{prompt_id}")
            history[prompt_id] = _history_from_list(runs, f"prompts.{prompt_id}.history", fields)
    # Format 3's identity facts: unknown (None) in an older file.
    text = fields.text if version >= 3 else fields.optional_text
    if version >= 3:
        fields.get(provenance, "max_model_len", "provenance")
    return CellBaseline(
        cell_id=cell_id,
        provenance=Provenance(
            benchmark_run_id=fields.text(provenance, "benchmark_run_id", "provenance"),
            git_sha=fields.text(provenance, "git_sha", "provenance"),
            engine_version=fields.text(provenance, "engine_version", "provenance"),
            model_digest=fields.text(provenance, "model_digest", "provenance"),
            gpus=tuple(gpus),
            date=fields.text(provenance, "date", "provenance"),
            model_identity=text(provenance, "model_identity", "provenance"),
            model_root=text(provenance, "model_root", "provenance"),
            max_model_len=fields.optional_count(provenance, "max_model_len", "provenance"),
            system_fingerprint=text(provenance, "system_fingerprint", "provenance"),
        ),
        prompts=tuple(summaries),
        history={prompt_id: runs for prompt_id, runs in history.items() if runs},
    )


def loads_baseline(text: str, source: str) -> CellBaseline:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CorruptBaseline(
            f"{source}: corrupt baseline: not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}); {_REPAIR}"
        ) from None
    except (ValueError, RecursionError) as exc:
        # An integer longer than Python reads (4,300 digits), or nesting deeper than it recurses.
        what = "nested too deeply" if isinstance(exc, RecursionError) else "a number too long"
        raise CorruptBaseline(f"{source}: corrupt baseline: {what} to read; {_REPAIR}") from None
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


def cell_provenance(
    meta: Mapping[str, Any],
    cell: Mapping[str, Any],
    calls: Iterable[Mapping[str, Any]] = (),
) -> Provenance:
    """The provenance of a cell's numbers in a run: the ledger's meta record, the cell record's
    facts, and the system_fingerprint that every successful call of the cell carried (None when
    they carried none, or different ones: it was not stable)."""
    fingerprints = {
        call.get("system_fingerprint")
        for call in calls
        if call.get("cell_id") == cell.get("cell_id") and call.get("error") is None
    }
    fingerprint = fingerprints.pop() if len(fingerprints) == 1 else None
    max_model_len = cell.get("max_model_len")
    return Provenance(
        benchmark_run_id=_optional_text(meta.get("benchmark_run_id")),
        git_sha=_optional_text(meta.get("git_sha")),
        engine_version=_optional_text(cell.get("engine_version")),
        model_digest=_optional_text(cell.get("model_digest")),
        gpus=tuple(cell.get("gpus") or ()),
        date=_optional_text(meta.get("started_at_utc")),
        model_identity=_optional_text(cell.get("model_identity")),
        model_root=_optional_text(cell.get("model_root")),
        max_model_len=max_model_len
        if isinstance(max_model_len, int) and not isinstance(max_model_len, bool)
        else None,
        system_fingerprint=_optional_text(fingerprint),
    )


def _optional_text(value: Any) -> str | None:
    return None if value is None else str(value)


def baselines_from_records(records: Iterable[Mapping[str, Any]]) -> list[CellBaseline]:
    """A baseline per cell that has call records, sorted by cell id."""
    records = list(records)
    meta, cells = run_descriptions(records)
    calls = [record for record in records if record.get("type") == "call"]
    by_cell: dict[str, list[PromptSummary]] = {}
    for summary in summarize(records):
        by_cell.setdefault(summary.cell_id, []).append(summary)
    return [
        CellBaseline(
            cell_id,
            cell_provenance(meta, cells.get(cell_id, {"cell_id": cell_id}), calls),
            tuple(summaries),
        )
        for cell_id, summaries in sorted(by_cell.items())
    ]


# -- the update rules (pure) ------------------------------------------------------------------

# The fields of a PromptSummary that belong to its cold phase; all others are warm.
COLD_FIELDS = ("n_cold", "n_cold_ok", "cold_kind", "cold_first_delta_ms", "cold_total_duration_ms")


# (baseline samples, later samples) -> why they can never be significant, or None: the gate's
# rule (gate.too_few_samples), passed in by the caller.
SampleCheck = Callable[[int, int], "str | None"]


def prompt_refusals(
    summary: PromptSummary,
    old: PromptSummary | None,
    *,
    min_success_rate: float,
    future_runs: int | None,
    sample_check: SampleCheck | None = None,
) -> tuple[str, str] | None:
    """Why this (cell, prompt)'s numbers must not be written: (rule, detail), or None.

    A warm sample count that can never reach significance against `future_runs` later samples
    (the cell's configured runs) would make every later verdict "inconclusive".
    """
    if summary.n_warm == 0:
        if old is not None and old.n_warm > 0:
            return None  # cold only: the warm figures already there are kept
        return ("no warm calls measured for", summary.prompt_id)
    rate = summary.warm_success_rate
    if rate is not None and rate < min_success_rate:
        detail = f"{summary.prompt_id} {rate:.2f} ({summary.n_warm_ok}/{summary.n_warm})"
        return (f"warm success rate below {min_success_rate:.2f}:", detail)
    samples = len(summary.samples.first_delta_ms)
    future = future_runs if future_runs is not None else samples
    why = sample_check(samples, future) if sample_check is not None else None
    if why is not None:
        return (TOO_FEW, f"{summary.prompt_id} {why}")
    return None


TOO_FEW = "too few warm samples ever to be significant against the cell's runs:"


_HINTS = {
    "no warm calls measured for": "(run the warm cases too)",
    TOO_FEW: "(measure more warm runs: --gpubench-runs N)",
}


def _refusal_text(refusals: list[tuple[str, str]]) -> str:
    """Refusals grouped by rule: `warm success rate below 0.95: P-EASY 0.90 (18/20), …`."""
    grouped: dict[str, list[str]] = {}
    for rule, detail in refusals:
        grouped.setdefault(rule, []).append(detail)
    parts = []
    for rule, details in grouped.items():
        hint = _HINTS.get(rule)
        parts.append(f"{rule} {', '.join(sorted(details))}" + (f" {hint}" if hint else ""))
    return "; ".join(parts)


def merge_prompt(old: PromptSummary | None, new: PromptSummary) -> PromptSummary:
    """This run's figures of a prompt over the file's, per phase: a phase it did not measure
    (n = 0) keeps the file's figures."""
    if old is None:
        return new
    merged = new
    if new.n_cold == 0:
        merged = dataclasses.replace(merged, **{name: getattr(old, name) for name in COLD_FIELDS})
    if new.n_warm == 0:
        warm = {
            f.name: getattr(old, f.name)
            for f in dataclasses.fields(PromptSummary)
            if f.name not in (*COLD_FIELDS, "cell_id", "prompt_id", "prompt_sha256")
        }
        merged = dataclasses.replace(merged, **warm)
    return merged


@dataclass(frozen=True)
class CellPlan:
    """What --baseline-update writes for one cell (None: nothing) and why not the rest."""

    baseline: CellBaseline | None
    refused: str | None = None


def plan_cell(
    new: CellBaseline,
    old: CellBaseline | None,
    *,
    min_success_rate: float = DEFAULT_MIN_SUCCESS_RATE,
    future_runs: int | None = None,
    sample_check: SampleCheck | None = None,
) -> CellPlan:
    """Merge a cell's numbers of this run into its baseline file's, per (prompt, phase): what
    this run did not measure stays as it was. Each prompt is refused on its own. A file is
    never made of two setups: when this run's differs (engine, model, GPU), it replaces the file
    whole or not at all."""
    kept = {summary.prompt_id: summary for summary in (old.prompts if old else ())}
    refusals: list[tuple[str, str]] = []
    written: dict[str, PromptSummary] = {}
    for summary in new.prompts:
        refusal = prompt_refusals(
            summary,
            kept.get(summary.prompt_id),
            min_success_rate=min_success_rate,
            future_runs=future_runs,
            sample_check=sample_check,
        )
        if refusal is None:
            written[summary.prompt_id] = summary
        else:
            refusals.append(refusal)
    refused = _refusal_text(refusals) if refusals else None
    if not written:
        return CellPlan(None, refused)
    provenance = new.provenance
    if old is not None:
        changes = provenance_changes(old.provenance, new.provenance)
        left = [
            f"{s.prompt_id} {phase}"
            for s in old.prompts
            for phase, n in (("cold", s.n_cold), ("warm", s.n_warm))
            if n and not _measured(written.get(s.prompt_id), phase)
        ]
        if changes and left:
            because = (
                f"this run's setup differs from the baseline's ({', '.join(changes)}) and it "
                f"did not measure {', '.join(left)}: a baseline never mixes two setups; ratify "
                "with a run of every prompt and phase"
            )
            return CellPlan(None, "; ".join(filter(None, [refused, because])))
        if not changes:
            provenance = merged_provenance(old.provenance, new.provenance)
    merged = dict(kept)
    # A new setup starts a new history: runs of another engine or GPU say nothing of this one's
    # noise. An old file's history otherwise goes on, this run appended to each warm prompt.
    same_setup = old is not None and not provenance_changes(old.provenance, new.provenance)
    history = {p: old.runs(p) for p in kept} if old is not None and same_setup else {}
    for prompt_id, summary in written.items():
        merged[prompt_id] = merge_prompt(kept.get(prompt_id), summary)
        if summary.n_warm:
            run = run_figures(
                summary, run_id=new.provenance.benchmark_run_id, date=new.provenance.date
            )
            history[prompt_id] = appended(history.get(prompt_id, ()), run)
    prompts = tuple(merged[prompt_id] for prompt_id in sorted(merged))
    history = {p: runs for p, runs in sorted(history.items()) if runs and p in merged}
    return CellPlan(CellBaseline(new.cell_id, provenance, prompts, history), refused)


def _measured(summary: PromptSummary | None, phase: str) -> bool:
    if summary is None:
        return False
    return (summary.n_cold if phase == "cold" else summary.n_warm) > 0


def _skipped_cells(records: Iterable[Mapping[str, Any]], measured: set[str]) -> dict[str, str]:
    refused: dict[str, str] = {}
    for record in records:
        cell_id = record.get("cell_id")
        if record.get("type") != "skipped" or not isinstance(cell_id, str) or cell_id in measured:
            continue
        refused.setdefault(cell_id, f"skipped: {record.get('reason') or 'no reason given'}")
    return refused


def _for_cell(value: Any, cell_id: str, default: Any) -> Any:
    if isinstance(value, Mapping):
        return value.get(cell_id, default)
    return default if value is None else value


# -- disk -------------------------------------------------------------------------------------


def read_baseline(path: Path) -> CellBaseline:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GpubenchError(f"{path}: baseline file not found") from None
    except UnicodeDecodeError as exc:
        raise CorruptBaseline(f"{path}: corrupt baseline: not UTF-8 ({exc}); {_REPAIR}") from None
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot read baseline: {exc}") from None
    return loads_baseline(text, str(path))


def find_baseline(baselines_dir: Path, cell_id: str) -> CellBaseline | None:
    """The cell's baseline, or None when it has none yet."""
    path = baseline_path(baselines_dir, cell_id)
    if not path.exists():
        return None
    baseline = read_baseline(path)
    if baseline.cell_id != cell_id:
        raise GpubenchError(
            f"{path}: holds the baseline of cell '{baseline.cell_id}', not '{cell_id}': the two "
            "cell ids map to the same file name; rename one of the cells"
        )
    return baseline


def read_baselines(baselines_dir: Path) -> list[CellBaseline]:
    """Every baseline file in the directory, sorted by cell id."""
    if not baselines_dir.is_dir():
        raise GpubenchError(f"{baselines_dir}: not a baselines directory")
    baselines = [read_baseline(path) for path in sorted(baselines_dir.glob("*.json"))]
    return sorted(baselines, key=lambda baseline: baseline.cell_id)


def baseline_summaries(baselines_dir: Path, cell_ids: Iterable[str]) -> list[PromptSummary]:
    """The baseline summaries of these cells (cells without a baseline contribute none)."""
    summaries: list[PromptSummary] = []
    for cell_id in sorted(set(cell_ids)):
        baseline = find_baseline(baselines_dir, cell_id)
        if baseline is not None:
            summaries.extend(baseline.prompts)
    return summaries


def read_summaries(path: Path) -> list[PromptSummary]:
    """Summaries from a ledger file, or from every baseline in a baselines directory."""
    if path.is_dir():
        return [summary for baseline in read_baselines(path) for summary in baseline.prompts]
    if not path.exists():
        raise GpubenchError(f"{path}: no such ledger or baselines directory")
    return summarize(read_ledger(path))


def write_baseline(
    baselines_dir: Path, baseline: CellBaseline, *, replace_corrupt: bool = False
) -> Path:
    """Write atomically (a crash leaves the old file or the new one, never half of one)."""
    path = baseline_path(baselines_dir, baseline.cell_id)
    if path.exists():
        try:
            find_baseline(baselines_dir, baseline.cell_id)  # never overwrite another cell's file
        except CorruptBaseline:
            if not replace_corrupt:
                raise
    text = dumps_baseline(baseline)
    try:
        atomic_write(path, text)
    except OSError as exc:
        raise BaselineWriteError(f"{path}: cannot write baseline: {exc.strerror}") from None
    return path


class BaselineWriteError(GpubenchError):
    """A baseline file could not be written (a read-only directory, a full disk)."""


def update_baselines(
    baselines_dir: Path,
    records: Iterable[Mapping[str, Any]],
    min_success_rate: float | Mapping[str, float] = DEFAULT_MIN_SUCCESS_RATE,
    future_runs: int | Mapping[str, int] | None = None,
    sample_check: SampleCheck | None = None,
) -> BaselineUpdate:
    """--baseline-update: merge this run's numbers into each cell's file (plan_cell), replacing
    a corrupt file; explain what was not written. A file that cannot be written is reported in
    `failed` and the others are still written. Errors other than a write (a file of another
    cell, a newer format) raise."""
    records = list(records)
    update = BaselineUpdate()
    measured = set()
    for new in baselines_from_records(records):
        measured.add(new.cell_id)
        old: CellBaseline | None = None
        try:
            old = find_baseline(baselines_dir, new.cell_id)
        except CorruptBaseline as exc:
            update.replaced[new.cell_id] = str(exc).split("; restore it")[0]
        plan = plan_cell(
            new,
            old,
            min_success_rate=float(
                _for_cell(min_success_rate, new.cell_id, DEFAULT_MIN_SUCCESS_RATE)
            ),
            future_runs=_for_cell(future_runs, new.cell_id, None),
            sample_check=sample_check,
        )
        if plan.refused is not None:
            update.refused[new.cell_id] = plan.refused
        if plan.baseline is None:
            update.replaced.pop(new.cell_id, None)
            continue
        try:
            update.written[new.cell_id] = write_baseline(
                baselines_dir, plan.baseline, replace_corrupt=new.cell_id in update.replaced
            )
        except BaselineWriteError as exc:
            update.failed[new.cell_id] = str(exc)
            update.replaced.pop(new.cell_id, None)
    for cell_id, reason in _skipped_cells(records, measured).items():
        update.refused.setdefault(cell_id, reason)
    return update
