"""--baseline-update: which of a run's (cell, prompt) numbers may be written and why not the
rest, each cell's merged into its baseline file's per (prompt, phase) (pure: plan_cell), and every
measured cell's file written (update_baselines)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpubench.config.metrics import GENERATING
from pytest_gpubench.results.baseline import (
    DEFAULT_MIN_SUCCESS_RATE,
    BaselineWriteError,
    CellBaseline,
    baselines_from_records,
    find_baseline,
    merged_provenance,
    provenance_changes,
    write_baseline,
)
from pytest_gpubench.results.baseline_format import CorruptBaseline
from pytest_gpubench.results.gate import run_figures
from pytest_gpubench.results.run_history import appended, ratified_change, same_update
from pytest_gpubench.results.stats import PromptSummary


@dataclass(frozen=True)
class BaselineUpdate:
    """What --baseline-update did: files written per cell, why the other cells (or some of a
    written cell's prompts) were not, corrupt files replaced, and files that could not be written.
    """

    written: dict[str, Path] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    replaced: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


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
    # The first gated figure's samples (TTFT); an embedding or a rerank, which has none, its
    # total's.
    samples = len(
        summary.samples["first_delta_ms" if summary.kind in GENERATING else "total_duration_ms"]
    )
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
    calibration: str | None = None,
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
            measured = new.runs(prompt_id) or (
                run_figures(
                    summary,
                    run_id=new.provenance.benchmark_run_id,
                    date=new.provenance.date,
                    calibration=calibration,
                ),
            )
            for number, run in enumerate(measured):
                before = history.get(prompt_id, ())
                # A ratified change starts a new segment: kept beside the runs before it, the
                # step would widen the between-run spread until it left the history, and the
                # gate would be blind to a change of its size for ten updates. Only an update's
                # first run can be one: its later runs measure the spread between its runs, as
                # the runs of one calibration do.
                stepped = (
                    number == 0
                    and not (before and same_update(before[-1], run))
                    and ratified_change(before, run)
                )
                history[prompt_id] = appended(() if stepped else before, run)
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


def update_baselines(
    baselines_dir: Path,
    records: Iterable[Mapping[str, Any]],
    min_success_rate: float | Mapping[str, float] = DEFAULT_MIN_SUCCESS_RATE,
    future_runs: int | Mapping[str, int] | None = None,
    sample_check: SampleCheck | None = None,
    calibration: str | None = None,
) -> BaselineUpdate:
    """--baseline-update: merge this run's numbers into each cell's file (plan_cell), replacing
    a corrupt file; explain what was not written. A file that cannot be written is reported in
    `failed` and the others are still written. Errors other than a write (a file of another
    cell, a newer format) raise. `calibration`: the calibration this run is one run of
    (--gpubench-calibration), which its history entries name."""
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
            calibration=calibration,
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
