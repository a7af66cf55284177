"""Baselines on disk: one stable, sorted JSON file per cell under baselines/, read and written."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pytest_gpubench.config.metrics import MEASURE_BY_NAME, PERCENTILE_NAMES
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.files import atomic_write
from pytest_gpubench.ledger.schema import CallRecord, CellRecord, MetaRecord, meta_of, records_of
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.results.baseline_format import (
    FORMAT_VERSION,
    REPAIR,
    BaselineFile,
    Cold,
    CorruptBaseline,
    Percentiles,
    Prompt,
    RunEntry,
    Samples,
    Warm,
    read_json,
    sample_values,
    validated,
    warm_percentiles,
)
from pytest_gpubench.results.baseline_format import Provenance as FileProvenance
from pytest_gpubench.results.gate import run_figures
from pytest_gpubench.results.run_history import History, RunFigures
from pytest_gpubench.results.stats import (
    SAMPLE_FIELDS,
    WARM_METRICS,
    PromptSummary,
    WarmSamples,
    summarize,
)
from pytest_gpubench.targets.gpu import gpu_summary

DEFAULT_MIN_SUCCESS_RATE = 0.95
# The field of a call measured in a later run of a first --baseline-update (run/history_runs.py):
# its run's number, 1 on (the planned calls are run 0).
HISTORY_RUN = "history_run"
# Anything but these becomes "_" in a file name; the exact cell id is kept inside the file.
_UNSAFE_IN_FILE_NAME = re.compile(r"[^A-Za-z0-9._-]")


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


# -- names ------------------------------------------------------------------------------------


def baseline_file_name(cell_id: str) -> str:
    """`local:llamacpp:qwen3.5:0.8b` -> `local_llamacpp_qwen3.5_0.8b.json`."""
    return _UNSAFE_IN_FILE_NAME.sub("_", cell_id) + ".json"


def baseline_path(baselines_dir: Path, cell_id: str) -> Path:
    return baselines_dir / baseline_file_name(cell_id)


# -- to and from JSON (pure) ------------------------------------------------------------------


def _percentiles(summary: PromptSummary, metric: str) -> Percentiles:
    # `None`: the fields set are those given (the first argument of model_construct).
    return Percentiles.model_construct(
        None, **{name: summary.figure(metric, name) for name in PERCENTILE_NAMES}
    )


def _written(summary: PromptSummary, name: str) -> bool:
    """Whether a measure's figures and samples are written: always for one every baseline holds;
    a reasoning model's, or one only some engines give (a local engine's own wait), only where
    the run measured it (left out, not written as nulls or empty lists: files of runs without
    it keep their shape)."""
    measure = MEASURE_BY_NAME[name]
    if measure.always_in_baseline:
        return True
    samples = summary.samples.get(name, ())
    return bool(samples) or any(summary.figure(name, p) is not None for p in PERCENTILE_NAMES)


def _prompt_model(summary: PromptSummary, history: History) -> Prompt:
    """A summary as the current format holds it. Built without validation (model_construct):
    the file holds the summary's values exactly as they are, so the same numbers give the same
    bytes; only the fields given are written (model_dump(exclude_unset=True))."""
    warm = Warm.model_construct(
        None,
        n=summary.n_warm,
        n_ok=summary.n_warm_ok,
        success_rate=summary.warm_success_rate,
        coalesced=summary.warm_coalesced,
        **{
            metric: _percentiles(summary, metric)
            for metric in WARM_METRICS
            if _written(summary, metric)
        },
    )
    cold = Cold.model_construct(
        n=summary.n_cold,
        n_ok=summary.n_cold_ok,
        kind=summary.cold_kind,
        first_delta_ms=summary.cold_first_delta_ms,
        total_duration_ms=summary.cold_total_duration_ms,
    )
    samples = Samples.model_construct(
        None,
        **{name: list(summary.samples[name]) for name in SAMPLE_FIELDS if _written(summary, name)},
    )
    runs = [
        RunEntry.model_construct(
            benchmark_run_id=run.benchmark_run_id,
            date=run.date,
            n=run.n,
            figures=dict(run.figures),
            control_ms=run.control_ms,
            cpu_pressure=run.cpu_pressure,
            engine_wait_per_cpu=run.engine_wait_per_cpu,
            neighbour_cpu_share=run.neighbour_cpu_share,
            **_calibration(run),
        )
        for run in history
    ]
    return Prompt.model_construct(
        prompt_sha256=summary.prompt_sha256, cold=cold, warm=warm, samples=samples, history=runs
    )


def _calibration(run: RunFigures) -> dict[str, Any]:
    """A history entry's calibration, written only for a run of one (older files stay as they
    were, byte for byte)."""
    return {} if run.calibration is None else {"calibration": run.calibration}


def baseline_to_dict(baseline: CellBaseline) -> dict[str, Any]:
    provenance = baseline.provenance
    model = BaselineFile.model_construct(
        format=FORMAT_VERSION,
        cell_id=baseline.cell_id,
        provenance=FileProvenance.model_construct(
            **{**dataclasses.asdict(provenance), "gpus": list(provenance.gpus)}
        ),
        prompts={
            summary.prompt_id: _prompt_model(summary, baseline.runs(summary.prompt_id))
            for summary in baseline.prompts
        },
    )
    return model.model_dump(exclude_unset=True)


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


def _summary(cell_id: str, prompt_id: str, prompt: Prompt) -> PromptSummary:
    """One prompt's summary; a measure the file lacks (a later one) is None (compared as new)."""
    warm, cold = prompt.warm, prompt.cold
    figures = {
        metric: {name: getattr(warm_percentiles(warm, metric), name) for name in PERCENTILE_NAMES}
        for metric in WARM_METRICS
    }
    samples = {name: tuple(sample_values(prompt.samples, name)) for name in SAMPLE_FIELDS}
    return PromptSummary(
        cell_id=cell_id,
        prompt_id=prompt_id,
        prompt_sha256=prompt.prompt_sha256,
        n_cold=cold.n,
        n_cold_ok=cold.n_ok,
        cold_kind=cold.kind,
        cold_first_delta_ms=cold.first_delta_ms,
        cold_total_duration_ms=cold.total_duration_ms,
        n_warm=warm.n,
        n_warm_ok=warm.n_ok,
        warm=figures,
        warm_coalesced=warm.coalesced,
        samples=WarmSamples(**samples),
    )


def baseline_from_dict(data: Any, source: str) -> CellBaseline:
    """Validate a parsed baseline file by the model of its format; `source` (the file) is named
    in the one line of any error."""
    model = validated(data, source)
    cell_id = str(model.cell_id)
    history: dict[str, History] = {}
    for prompt_id, prompt in model.prompts.items():
        if prompt.history:
            history[prompt_id] = tuple(RunFigures(**run.model_dump()) for run in prompt.history)
    facts = model.provenance
    return CellBaseline(
        cell_id=cell_id,
        provenance=Provenance(**{**facts.model_dump(exclude={"gpus"}), "gpus": tuple(facts.gpus)}),
        prompts=tuple(
            _summary(cell_id, prompt_id, model.prompts[prompt_id])
            for prompt_id in sorted(model.prompts)
        ),
        history=dict(sorted(history.items())),
    )


def loads_baseline(text: str, source: str) -> CellBaseline:
    return baseline_from_dict(read_json(text, source), source)


# -- from a run (pure) ------------------------------------------------------------------------


def run_descriptions(
    records: Iterable[Mapping[str, Any]],
) -> tuple[MetaRecord, dict[str, CellRecord]]:
    """The ledger's meta record (an empty one where it has none: every fact unknown) and the
    first cell record of each cell id."""
    records = list(records)
    cells: dict[str, CellRecord] = {}
    for cell in records_of(records, "cell"):
        if isinstance(cell.get("cell_id"), str):
            cells.setdefault(cell["cell_id"], cell)
    return meta_of(records) or cast(MetaRecord, {}), cells


def cell_provenance(
    meta: MetaRecord,
    cell: CellRecord,
    calls: Iterable[CallRecord] = (),
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


def _unknown_cell(cell_id: str) -> CellRecord:
    """A cell the ledger has no cell record of: its facts unknown."""
    return cast(CellRecord, {"cell_id": cell_id})


def _optional_text(value: Any) -> str | None:
    return None if value is None else str(value)


def baselines_from_records(records: Iterable[Mapping[str, Any]]) -> list[CellBaseline]:
    """A baseline per cell that has call records, sorted by cell id."""
    records = list(records)
    meta, cells = run_descriptions(records)
    calls = records_of(records, "call")
    by_cell: dict[str, list[PromptSummary]] = {}
    for summary in summarize(records):
        by_cell.setdefault(summary.cell_id, []).append(summary)
    run_id = meta.get("benchmark_run_id") if meta else None
    date = meta.get("started_at_utc") if meta else None
    runs = history_runs(calls, run_id=run_id, date=date)
    return [
        CellBaseline(
            cell_id,
            cell_provenance(meta, cells.get(cell_id) or _unknown_cell(cell_id), calls),
            tuple(summaries),
            {p: found for (c, p), found in runs.items() if c == cell_id},
        )
        for cell_id, summaries in sorted(by_cell.items())
    ]


def history_runs(
    calls: Iterable[Mapping[str, Any]], *, run_id: str | None, date: str | None
) -> dict[tuple[str, str], History]:
    """Per (cell, prompt) a first update measured in several runs (its calls' `history_run`,
    run/history_runs.py): each run's figures, in order, as the history's entries (run ids
    `<run id>#<n>`); none for a (cell, prompt) measured in one run."""
    groups: dict[tuple[str, str], dict[int, list[Mapping[str, Any]]]] = {}
    for call in calls:
        if call.get("phase") != "warm" or call.get("pass", 1) != 1:
            continue
        key = (str(call.get("cell_id")), str(call.get("prompt_id")))
        number = call.get(HISTORY_RUN)
        groups.setdefault(key, {}).setdefault(number if isinstance(number, int) else 0, [])
        groups[key][number if isinstance(number, int) else 0].append(call)
    found: dict[tuple[str, str], History] = {}
    for key, by_run in groups.items():
        if len(by_run) < 2:
            continue
        entries = []
        for number in sorted(by_run):
            summaries = summarize(by_run[number])
            if len(summaries) != 1 or not summaries[0].n_warm_ok:
                continue  # a run with no successful call says nothing of the spread
            entries.append(
                run_figures(
                    summaries[0],
                    run_id=None if run_id is None else f"{run_id}#{number}",
                    date=date,
                )
            )
        if len(entries) >= 2:
            found[key] = tuple(entries)
    return found


# -- disk -------------------------------------------------------------------------------------


def read_baseline(path: Path) -> CellBaseline:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GpubenchError(f"{path}: baseline file not found") from None
    except UnicodeDecodeError as exc:
        raise CorruptBaseline(f"{path}: corrupt baseline: not UTF-8 ({exc}); {REPAIR}") from None
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot read baseline: {exc}") from None
    return loads_baseline(text, str(path))


def baseline_exists(path: Path) -> bool:
    """Whether a baseline file is there; a path that cannot even be looked up (a cell id too
    long for a file name, in a hand-edited ledger: ENAMETOOLONG) is one line, not a traceback."""
    try:
        return path.exists()
    except OSError as exc:
        raise GpubenchError(f"{str(path)[:200]}: cannot look up baseline: {exc.strerror}") from None


def find_baseline(baselines_dir: Path, cell_id: str) -> CellBaseline | None:
    """The cell's baseline, or None when it has none yet."""
    path = baseline_path(baselines_dir, cell_id)
    if not baseline_exists(path):
        return None
    baseline = read_baseline(path)
    if baseline.cell_id != cell_id:
        if baseline_path(baselines_dir, baseline.cell_id) != path:
            # Not another cell's file (its id would be written elsewhere): an edited one.
            raise CorruptBaseline(
                f"{path}: corrupt baseline: cell_id: '{baseline.cell_id}' is not the cell this "
                f"file is named for ('{cell_id}'); {REPAIR}"
            )
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
