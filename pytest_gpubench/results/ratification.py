"""Ratification, part of the judgement: what --baseline-update writes of a run, decided from the
settings its ledger recorded (results/judging.py), never from cells.yaml as it is at the end; what
the writing ratified (notes, the cells whose changed setup it accepted, the load points); and what
`gpubench gate` says a --baseline-update ledger ratified. The session's end writes the files
(run/controller.py), the rules of writing are results/baseline.py's."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.ledger.schema import LoadRecord
from pytest_gpubench.results.decision import MIN_HISTORY
from pytest_gpubench.results.run_history import current_segment
from pytest_gpubench.results.steadiness import PRESSURE_LIMIT

if TYPE_CHECKING:
    from pytest_gpubench.results.baseline_update import BaselineUpdate
    from pytest_gpubench.results.judging import Judgement, RunRecords
    from pytest_gpubench.results.judging_settings import JudgingSettings

SMOKE_NOT_WRITTEN = "baselines NOT written: --smoke measures one call, too few to judge against"


@dataclass(frozen=True)
class BaselineUpdatePlan:
    """What --baseline-update writes of a run, decided from the settings it recorded (never from
    cells.yaml as it is at the end): its warm baselines from `records` (its meta, cells, first
    pass calls and skips), each cell held to its success rate minimum and to the runs a later
    run measures (its configured runs, not this run's --gpubench-runs); its load points.
    `refused` says why nothing is written (--smoke)."""

    records: list[Mapping[str, Any]] = field(default_factory=list)
    min_success_rate: dict[str, float] = field(default_factory=dict)
    future_runs: dict[str, int] = field(default_factory=dict)
    loads: list[LoadRecord] = field(default_factory=list)
    refused: str | None = None
    # The calibration the run was one run of (--gpubench-calibration).
    calibration: str | None = None


def baseline_update_plan(run: RunRecords, settings: JudgingSettings) -> BaselineUpdatePlan | None:
    """The plan of a --baseline-update run (None for a run that ratifies nothing)."""
    if not settings.baseline_update:
        return None
    if settings.smoke:
        # One call per cell can never reach significance: every later run would be
        # "inconclusive" against it.
        return BaselineUpdatePlan(refused=SMOKE_NOT_WRITTEN)
    from pytest_gpubench.results.metric import success_threshold

    meta = [run.meta] if run.meta is not None else []
    return BaselineUpdatePlan(
        records=[*meta, *run.cells.values(), *run.calls, *run.skips],
        min_success_rate={
            cell_id: success_threshold(cell.thresholds) for cell_id, cell in settings.cells.items()
        },
        future_runs={cell_id: cell.runs for cell_id, cell in settings.cells.items()},
        loads=list(run.loads),
        calibration=settings.calibration,
    )


def take_baseline_update(judgement: Judgement, update: BaselineUpdate, baselines_dir: Path) -> None:
    """What the warm baselines' update (results/baseline_update.BaselineUpdate) ratified, into the
    judgement: a note per file written, replaced or refused (and what its history lets the gate
    know), the cells whose changed setup it ratified, and the files it could not write."""
    notes = judgement.baseline_notes
    for _cell_id, reason in sorted(update.replaced.items()):
        notes.append(f"{reason}: replaced with this run's numbers")
    for cell_id, path in sorted(update.written.items()):
        notes.append(f"baseline written: {cell_id} -> {path}")
        notes.extend(history_notes(baselines_dir, cell_id))
        changes = judgement.changed_setups.get(cell_id)
        if changes is not None:
            judgement.ratified.add(cell_id)
            notes.append(f"baseline of {cell_id} ratified for this setup: {changes}")
    for cell_id, reason in sorted(update.refused.items()):
        notes.append(f"baseline NOT written for {cell_id}: {reason}")
    if update.failed:
        judgement.gate_error = "; ".join(update.failed[c] for c in sorted(update.failed))
        judgement.write_failed = True


def take_load_update(judgement: Judgement, plan: BaselineUpdatePlan, notes: Sequence[str]) -> None:
    """What the load baselines' update ratified: its notes, and each valid point it wrote (an
    `incomparable` point's new request or settings no longer fails the run)."""
    from pytest_gpubench.results.load_gate import gated, is_result, point_key

    judgement.baseline_notes.extend(notes)
    judgement.ratified_points.update(
        (str(record.get("cell_id")), point_key(record))
        for record in plan.loads
        if gated(record) and is_result(record)
    )


def history_notes(baselines_dir: Path, cell_id: str) -> list[str]:
    """What a written baseline's history lets the gate know: a note while it is too short."""
    from pytest_gpubench.results.baseline import find_baseline

    try:
        baseline = find_baseline(baselines_dir, cell_id)
    except GpubenchError:
        return []
    if baseline is None:
        return []

    # The runs the gate judges by: those since the last ratified step.
    runs = {s.prompt_id: len(current_segment(baseline.runs(s.prompt_id))) for s in baseline.prompts}
    short = sorted(
        f"{summary.prompt_id} ({runs[summary.prompt_id]})"
        for summary in baseline.prompts
        if summary.n_warm and runs[summary.prompt_id] < MIN_HISTORY
    )
    if not short:
        return []
    notes = [
        f"baseline of {cell_id}: runs of history {', '.join(short)}: the between-run noise floor "
        f"is still unknown until {MIN_HISTORY} (seed it with `gpubench calibrate`)"
    ]
    busiest = max(
        (s.figure("cpu_pressure") or 0.0 for s in baseline.prompts if s.n_warm), default=0.0
    )
    if busiest > PRESSURE_LIMIT:
        # The within-run test cannot tell such a machine from a change (results/decision.py): a
        # regression or win against this baseline is `unsteady` until the history has its runs.
        notes.append(
            f"baseline of {cell_id} measured on a busy machine (tasks waited for a CPU "
            f"{busiest:.0%} of the calls' time): until it has {MIN_HISTORY} runs of history, a "
            "change against it is unsteady, not judged; ratify on a quiet machine or seed its "
            "history with `gpubench calibrate`"
        )
    return notes


def planned_update(plan: BaselineUpdatePlan, baselines_dir: Path) -> BaselineUpdate:
    """What the plan's update of the warm baselines does against `baselines_dir` as it is now,
    writing nothing there: results/baseline_update.update_baselines, its rules whole, run on a
    scratch copy of the run's cells' files; its paths are named in `baselines_dir`."""
    from pytest_gpubench.results.baseline import baseline_path
    from pytest_gpubench.results.baseline_update import update_baselines
    from pytest_gpubench.results.gate import too_few_samples

    cells = {str(record.get("cell_id")) for record in plan.records if record.get("type") == "call"}
    with tempfile.TemporaryDirectory(prefix="gpubench-ratify-") as scratch:
        copy = Path(scratch)
        for cell_id in sorted(cells):
            path = baseline_path(baselines_dir, cell_id)
            if path.is_file():
                shutil.copyfile(path, baseline_path(copy, cell_id))
        update = update_baselines(
            copy,
            plan.records,
            plan.min_success_rate,
            future_runs=plan.future_runs,
            sample_check=too_few_samples,
            calibration=plan.calibration,
        )
    written = {cell: baseline_path(baselines_dir, cell) for cell in update.written}
    return replace(update, written=written)


def ratify_ledger(
    judgement: Judgement, run: RunRecords, settings: JudgingSettings, baselines_dir: Path
) -> None:
    """`gpubench gate` on a --baseline-update ledger: what its session ratified, decided as the
    session decided it (against the baselines as they are now; before the run wrote them, the
    same decisions), into the judgement: the notes, the changed setups and the load points it
    ratified, so that the exit status is the session's."""
    plan = baseline_update_plan(run, settings)
    if plan is None:
        return
    if plan.refused is not None:
        if run.calls and "warm" not in judgement.unjudged_parts:
            judgement.notes.append(plan.refused)
        return
    if run.calls and "warm" not in judgement.unjudged_parts:
        try:
            update = planned_update(plan, baselines_dir)
        except (GpubenchError, OSError) as exc:
            # Where the session's update failed as well (its run exited 9): said, not raised.
            judgement.notes.append(f"what the run ratified cannot be told: {exc}")
            return
        for cell_id, path in sorted(update.written.items()):
            judgement.notes.append(f"ratified (--baseline-update): {cell_id} -> {path}")
            if cell_id in judgement.changed_setups:
                judgement.ratified.add(cell_id)
        judgement.notes.extend(
            f"baseline NOT written for {cell_id}: {reason}"
            for cell_id, reason in sorted(update.refused.items())
        )
    if run.loads:
        take_load_update(judgement, plan, [])
