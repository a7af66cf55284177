"""The one judgement of a run: its records, its baselines and the settings it ran with in; every
verdict, what became of each planned cell and the exit status out. The session's end, `gpubench
gate` (a finished or merged ledger) and the re-measure's first look all call `judge_run`; nothing
else decides. The settings are written into the ledger's meta record as the run starts, so a
ledger is judged from itself and its baselines alone, on any machine, at any later time."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pytest_gpubench.config.cases import LOAD_PHASE
from pytest_gpubench.config.cell import node_of
from pytest_gpubench.config.metrics import GATED, LOAD_GATED, MEASURE_BY_NAME
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.status import session_status
from pytest_gpubench.ledger.outcomes import CellOutcome, PlannedCell, cell_outcomes
from pytest_gpubench.ledger.schema import (
    CallRecord,
    CellRecord,
    JudgedEnd,
    LoadCallRecord,
    LoadRecord,
    MetaRecord,
    SkippedRecord,
)
from pytest_gpubench.results.baseline_format import CorruptBaseline
from pytest_gpubench.results.decision import ALPHA, MIN_HISTORY, UNDECIDED
from pytest_gpubench.results.engine_checks import check_verdicts, engine_checks
from pytest_gpubench.results.judging_settings import CellJudging, JudgingSettings
from pytest_gpubench.telemetry.aggregate import telemetry_summaries

if TYPE_CHECKING:
    from pytest_gpubench.results.engine_checks import EngineChecks
    from pytest_gpubench.results.run_history import History
    from pytest_gpubench.results.stats import PromptSummary
    from pytest_gpubench.results.verdict import Verdict
    from pytest_gpubench.telemetry.aggregate import TelemetrySummary

# A suspect that the re-measure could not measure again: its reason, in a record of its own.
NOT_REMEASURED = "not_remeasured"


@dataclass
class RunRecords:
    """A run's records by kind, as the session collects them and as a ledger holds them."""

    meta: MetaRecord | None = None
    cells: dict[str, CellRecord] = field(default_factory=dict)
    # Warm and cold calls of the first pass; the re-measure's (`pass: 2`), judged on their own
    # and then with the first pass's (results/confirm.py); the suspects it could not measure.
    calls: list[CallRecord] = field(default_factory=list)
    remeasured: list[CallRecord] = field(default_factory=list)
    not_remeasured: dict[tuple[str, str], str] = field(default_factory=dict)
    load_calls: list[LoadCallRecord] = field(default_factory=list)
    loads: list[LoadRecord] = field(default_factory=list)
    skips: list[SkippedRecord] = field(default_factory=list)
    # False for a ledger that has no end record: its run died before it could end.
    ended: bool = True

    def add(self, record: Mapping[str, Any]) -> bool:
        """Keep one record by its kind; False for a cell already described (each xdist worker
        that ran a cell describes it: the first is kept, and only it goes into the ledger)."""
        kind = record.get("type")
        if kind == "call" and record.get("phase") == LOAD_PHASE:
            self.load_calls.append(cast(LoadCallRecord, record))
        elif kind == "call" and record.get("pass", 1) != 1:
            self.remeasured.append(cast(CallRecord, record))
        elif kind == "call":
            self.calls.append(cast(CallRecord, record))
        elif kind == "load":
            self.loads.append(cast(LoadRecord, record))
        elif kind == "skipped":
            self.skips.append(cast(SkippedRecord, record))
        elif kind == NOT_REMEASURED:
            key = (str(record.get("cell_id")), str(record.get("prompt_id")))
            self.not_remeasured[key] = str(record.get("reason"))
        elif kind == "cell":
            cell_id = str(record.get("cell_id"))
            if cell_id in self.cells:
                return False
            self.cells[cell_id] = cast(CellRecord, record)
        elif kind == "meta" and self.meta is None:
            self.meta = cast(MetaRecord, record)
        return True

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]]) -> RunRecords:
        run = cls(ended=False)
        for record in records:
            if record.get("type") == "end":
                run.ended = True
            else:
                run.add(record)
        return run

    @property
    def planned(self) -> list[str]:
        return [] if self.meta is None else [str(c) for c in self.meta.get("cells_planned", [])]


def not_remeasured_record(run_id: str, cell_id: str, prompt_id: str, reason: str) -> dict[str, Any]:
    """A suspect the re-measure left alone, and why: its regression stands, saying so."""
    return {
        "type": NOT_REMEASURED,
        "benchmark_run_id": run_id,
        "cell_id": cell_id,
        "prompt_id": prompt_id,
        "reason": reason,
    }


@dataclass
class Judgement:
    """Every verdict of a run (the warm calls', the A/B pairs', the load points'), what became of
    each planned cell, and why anything went unjudged."""

    settings: JudgingSettings = field(default_factory=JudgingSettings)
    summaries: list[PromptSummary] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    # Per load point (results/load_gate.py), kept apart: the warm table never shows them.
    load_verdicts: list[Verdict] = field(default_factory=list)
    # Per (cell, prompt): the warm calls' resource telemetry (telemetry/aggregate.py).
    telemetry: list[TelemetrySummary] = field(default_factory=list)
    # Per (cell, prompt): the warm calls' checks against the engine (results/engine_checks.py).
    checks: list[EngineChecks] = field(default_factory=list)
    outcomes: list[CellOutcome] = field(default_factory=list)
    gate_error: str | None = None
    # The run's parts whose baselines could not be read, so went unjudged ("warm", "load").
    unjudged_parts: set[str] = field(default_factory=set)
    write_failed: bool = False
    # What judging had to assume (a ledger that recorded no settings), or was told.
    notes: list[str] = field(default_factory=list)
    baseline_notes: list[str] = field(default_factory=list)
    # Per cell id: what differs between its baseline's setup and this run's; and the cells whose
    # new setup --baseline-update ratified (wrote).
    changed_setups: dict[str, str] = field(default_factory=dict)
    ratified: set[str] = field(default_factory=set)
    # The load points (cell id, point key) --baseline-update wrote: an `incomparable` point's
    # new request or settings ratified.
    ratified_points: set[tuple[str, str]] = field(default_factory=set)

    @property
    def every_verdict(self) -> list[Verdict]:
        return [*self.verdicts, *self.load_verdicts]

    def failing_incomparables(self) -> list[Verdict]:
        """The `incomparable` verdicts that fail the run: those not ratified (a warm cell's
        setup, a load point's request or settings)."""
        from pytest_gpubench.results.gate import incomparables

        warm = [v for v in incomparables(self.verdicts) if v.cell_id not in self.ratified]
        load = [
            v
            for v in incomparables(self.load_verdicts)
            if (v.cell_id, v.prompt_id) not in self.ratified_points
        ]
        return warm + load

    def failing_regressions(self) -> list[Verdict]:
        """The regressions that fail the run: with --baseline-update, only an A/B candidate's
        (it is judged against its reference, not a baseline: ratifying does not accept it)."""
        from pytest_gpubench.results.gate import regressions

        found = regressions(self.every_verdict)
        if self.settings.baseline_update:
            return [verdict for verdict in found if verdict.reference is not None]
        return found

    def undecided(self) -> list[Verdict]:
        """The figures the run could not tell, which hold it back (exit 10): an unsteady machine,
        a pass that could not have seen a change of the threshold's size (`blind`), a change
        past it not decided (`inconclusive`) the worse way or of a figure not measured. An
        undecided improvement holds nothing: it cannot hide a regression."""
        return [verdict for verdict in self.every_verdict if holds_back(verdict)]

    @property
    def unjudged(self) -> bool:
        return bool(self.unjudged_parts)

    def fail_to_judge(self, part: str, error: GpubenchError) -> None:
        """A part of the run ("warm", "load") left unjudged: its baselines could not be read."""
        self.gate_error = str(error)
        self.unjudged_parts.add(part)

    @property
    def unmeasured(self) -> list[CellOutcome]:
        return [outcome for outcome in self.outcomes if outcome.fails_run]

    def exit_status(self, pytest_status: int = 0, *, write_failed: bool = False) -> int:
        """The run's exit status from these findings (core/status.py ranks them)."""
        unsteady = bool(self.undecided())
        return session_status(
            pytest_status,
            write_failed=write_failed or self.write_failed,
            unjudged=self.unjudged,
            unmeasured=bool(self.unmeasured),
            incomparable=bool(self.failing_incomparables()),
            regressed=bool(self.failing_regressions()),
            unsteady=unsteady and not self.settings.baseline_update,
        )


def holds_back(verdict: Verdict) -> bool:
    """Whether a figure the run could not tell holds it back (exit 10): unsteady, blind, or
    inconclusive but for an undecided improvement, which cannot hide a regression."""
    if verdict.verdict not in UNDECIDED:
        return False
    if verdict.verdict != "inconclusive" or verdict.change_ratio is None:
        return True
    better = (verdict.change_ratio > 1.0) == (verdict.metric in _higher_is_better())
    return not better


@cache
def _higher_is_better() -> frozenset[str]:
    """The verdict metrics where higher is better: the gated figures' and the load points'."""
    return frozenset(m.name for m in LOAD_GATED if m.higher_is_better) | {
        figure.name for figure in GATED if MEASURE_BY_NAME[figure.measure].higher_is_better
    }


@dataclass
class _Baselines:
    """The measured cells' baselines: their summaries, histories and changed setups."""

    summaries: list[PromptSummary] = field(default_factory=list)
    histories: dict[tuple[str, str], History] = field(default_factory=dict)
    changed: dict[str, str] = field(default_factory=dict)


def _read_baselines(run: RunRecords, baselines_dir: Path, *, replacing: bool) -> _Baselines:
    """Each measured cell's baseline; a cell whose baseline came from another setup is named in
    `changed`. A corrupt file counts as none when this run replaces it (--baseline-update)."""
    from pytest_gpubench.results.baseline import cell_provenance, find_baseline, provenance_changes

    found = _Baselines()
    for cell_id in sorted({str(call.get("cell_id")) for call in run.calls}):
        try:
            baseline = find_baseline(baselines_dir, cell_id)
        except CorruptBaseline:
            if not replacing:
                raise
            continue  # --baseline-update replaces it, and says so
        if baseline is None:
            continue
        found.summaries.extend(baseline.prompts)
        for prompt_id, runs in baseline.history.items():
            found.histories[(cell_id, prompt_id)] = runs
        cell = run.cells.get(cell_id)
        if cell is None or run.meta is None:
            continue  # nothing known of this run's setup: nothing to compare
        changes = provenance_changes(
            baseline.provenance, cell_provenance(run.meta, cell, run.calls)
        )
        if changes:
            found.changed[cell_id] = ", ".join(changes)
    return found


def first_pass_verdicts(
    run: RunRecords, settings: JudgingSettings, baselines_dir: Path
) -> list[Verdict]:
    """The warm verdicts of the first pass alone: the re-measure's suspects are among them.
    Raises GpubenchError where the baselines cannot be read (the end then says why)."""
    from pytest_gpubench.results.stats import summarize

    found = _read_baselines(run, baselines_dir, replacing=False)
    return _warm_verdicts(summarize(run.calls), found, settings, run.calls)


def pair_verdicts(run: RunRecords, settings: JudgingSettings) -> list[Verdict]:
    """Each A/B candidate's verdicts against its reference (results/paired.py); none where no
    cell has a `reference:`."""
    if not any(cell.reference is not None for cell in settings.cells.values()):
        return []
    from pytest_gpubench.results.paired import ab_verdicts

    return ab_verdicts(run.calls, settings)


def _warm_verdicts(
    summaries: Sequence[PromptSummary],
    found: _Baselines,
    settings: JudgingSettings,
    calls: Sequence[Mapping[str, Any]],
) -> list[Verdict]:
    from pytest_gpubench.results.gate import compare, reply_gaps
    from pytest_gpubench.results.sample_on import alphas, with_budget

    verdicts = compare(
        found.summaries,
        summaries,
        settings.thresholds(),
        changed_setups=found.changed,
        accept_incomparable=settings.accept_incomparable,
        histories=found.histories,
        decode_gaps=reply_gaps(calls),
        alphas=alphas(calls, settings.sample_on_runs),
    )
    return with_budget(verdicts, calls, settings.sample_on_runs, settings.sample_on_seconds)


def judge_run(run: RunRecords, settings: JudgingSettings, baselines_dir: Path) -> Judgement:
    """The run's judgement: the warm calls against their baselines (a suspect decided on both
    passes), each resource limit, each A/B candidate against its reference, each load point
    against its load baseline, and each planned cell's outcome."""
    judgement = Judgement(settings=settings)
    if run.calls:
        _judge_warm(judgement, run, baselines_dir)
        pairs = pair_verdicts(run, settings)
        if pairs:
            from pytest_gpubench.results.sample_on import with_budget

            judgement.verdicts.extend(
                with_budget(pairs, run.calls, settings.sample_on_runs, settings.sample_on_seconds)
            )
    if run.loads:
        _judge_loads(judgement, run, baselines_dir)
    judgement.outcomes = run_outcomes(run, settings)
    if settings.alpha != ALPHA or settings.min_history != MIN_HISTORY:
        judgement.notes.append(
            f"the ledger was written with alpha {settings.alpha:g} and {settings.min_history} "
            f"runs of history before a between-run verdict; judged with this release's {ALPHA:g} "
            f"and {MIN_HISTORY}"
        )
    return judgement


def _judge_warm(judgement: Judgement, run: RunRecords, baselines_dir: Path) -> None:
    from pytest_gpubench.results.gate import ACCEPT_OPTION, telemetry_verdicts
    from pytest_gpubench.results.stats import summarize

    settings = judgement.settings
    judgement.summaries = summarize(run.calls)
    judgement.telemetry = telemetry_summaries(run.calls)
    unchecked = [cid for cid, cell in settings.cells.items() if cell.token_check == "off"]
    judgement.checks = engine_checks(run.calls, unchecked)
    try:
        found = _read_baselines(run, baselines_dir, replacing=settings.writes_baselines)
        judgement.changed_setups = found.changed
        verdicts = _warm_verdicts(judgement.summaries, found, settings, run.calls)
        if run.remeasured or run.not_remeasured:
            from pytest_gpubench.results.confirm import confirm

            second = _warm_verdicts(summarize(run.remeasured), found, settings, run.remeasured)
            verdicts = confirm(verdicts, second, run.not_remeasured)
        verdicts.extend(telemetry_verdicts(run.calls, settings.thresholds()))
        verdicts.extend(check_verdicts(judgement.checks, settings))
    except GpubenchError as exc:
        judgement.fail_to_judge("warm", exc)
        return
    judgement.verdicts = verdicts
    if settings.accept_incomparable and not settings.baseline_update:
        judgement.baseline_notes.extend(
            f"baseline of {cell_id} measured on another setup ({changes}): compared all "
            f"the same ({ACCEPT_OPTION})"
            for cell_id, changes in sorted(found.changed.items())
        )


def _judge_loads(judgement: Judgement, run: RunRecords, baselines_dir: Path) -> None:
    """Each load point against its load baseline (baselines/load/); a load baseline that
    cannot be read is none where this run replaces it."""
    from pytest_gpubench.results.load_baseline import read_load_baselines
    from pytest_gpubench.results.load_gate import judge_loads

    settings = judgement.settings
    cell_ids = {str(record.get("cell_id")) for record in run.loads}
    try:
        baselines = read_load_baselines(baselines_dir, cell_ids)
    except GpubenchError as exc:
        if not settings.writes_baselines:
            judgement.fail_to_judge("load", exc)
            return
        baselines = {}
    judgement.load_verdicts = judge_loads(run.loads, baselines, settings.load_thresholds())


def run_outcomes(run: RunRecords, settings: JudgingSettings) -> list[CellOutcome]:
    """What became of each planned cell (ledger/outcomes.py). A job array's cell whose shard
    left no ledger or no end record is missing, as the merge found (the meta's `cells_lost`);
    in a ledger that has no end record, every cell not measured is missing."""
    planned = [_planned(cell_id, settings.cell(cell_id)) for cell_id in run.planned]
    outcomes = cell_outcomes(
        planned, cells=run.cells, skips=run.skips, calls=[*run.calls, *run.load_calls]
    )
    lost: Mapping[str, str] = (run.meta.get("cells_lost") if run.meta else None) or {}
    return [_as_run_ended(outcome, lost, ended=run.ended) for outcome in outcomes]


def _as_run_ended(outcome: CellOutcome, lost: Mapping[str, str], *, ended: bool) -> CellOutcome:
    """A cell a lost shard took with it is missing; so is every cell not measured in a ledger
    whose run died before its end record."""
    if outcome.cell_id in lost:
        return replace(outcome, status="missing", optional=False, reason=lost[outcome.cell_id])
    if not ended and outcome.unmeasured:
        return replace(outcome, status="missing", reason="the ledger has no end record")
    return outcome


def _planned(cell_id: str, cell: CellJudging | None) -> PlannedCell:
    if cell is None:
        # A cell the settings do not name (a lost shard's): required, as nothing says otherwise.
        return PlannedCell(cell_id=cell_id, node=node_of(cell_id))
    return PlannedCell(cell_id=cell_id, node=cell.node, optional=cell.optional, skip=cell.skip)


def judged_end(judgement: Judgement, exit_status: int) -> JudgedEnd:
    """The end record's judged fields (ledger/records.end_record): every verdict, how many are
    regressions, why judging failed, every planned cell's outcome and the exit status."""
    from pytest_gpubench.results.gate import regressions

    return {
        "verdicts": [verdict.to_record() for verdict in judgement.every_verdict],
        "regressions": len(regressions(judgement.every_verdict)),
        "gate_error": judgement.gate_error,
        "cells": [outcome.to_record() for outcome in judgement.outcomes],
        "exit_status": exit_status,
    }
