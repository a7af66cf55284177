"""The gate over a finished ledger (a merged job array's): its verdicts, its unmeasured cells,
and the exit status a run with those findings has (`gpubench gate`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.status import session_status
from pytest_gpubench.ledger.outcomes import CellOutcome
from pytest_gpubench.ledger.schema import (
    CellOutcomeRecord,
    EndRecord,
    MetaRecord,
    meta_of,
    records_of,
)

if TYPE_CHECKING:
    from pytest_gpubench.config.load_profile import LoadThresholds
    from pytest_gpubench.config.matrix import Cell, Thresholds
    from pytest_gpubench.results.gate import Verdict
    from pytest_gpubench.results.stats import PromptSummary


@dataclass
class LedgerJudgement:
    """What the gate found in a ledger: verdicts (the warm calls', the load points'), the cells
    that fail the run unmeasured."""

    verdicts: list[Verdict]
    unmeasured: list[CellOutcomeRecord]
    notes: list[str] = field(default_factory=list)
    exit_status: int = 0
    load_verdicts: list[Verdict] = field(default_factory=list)


def unmeasured_cells(records: Sequence[Mapping[str, Any]]) -> list[CellOutcomeRecord]:
    """The planned cells that fail the run: from the end record's outcomes; every planned cell
    without a successful call when the ledger has no end record (a run that died)."""
    end = cast(EndRecord, records[-1]) if records and records[-1].get("type") == "end" else None
    if end is not None:
        return [
            cell
            for cell in end.get("cells", [])
            if cell.get("status") in ("failed", "missing") and not cell.get("optional")
        ]
    meta = meta_of(records[:1])
    measured = {
        call.get("cell_id") for call in records_of(records, "call") if call.get("error") is None
    }
    return [
        CellOutcome(
            cell_id=cell_id,
            node=cell_id.split(":", 1)[0],
            status="missing",
            optional=False,
            reason="the ledger has no end record",
        ).to_record()
        for cell_id in (meta.get("cells_planned", []) if meta is not None else [])
        if cell_id not in measured
    ]


@dataclass
class _CellThresholds:
    """Each cell's thresholds from the run's cells.yaml: its warm calls', its load points'."""

    warm: dict[str, Thresholds] = field(default_factory=dict)
    load: dict[str, LoadThresholds] = field(default_factory=dict)
    note: str | None = None
    # The run's cells, for its A/B pairs (a candidate's reference, its min_runs).
    cells: tuple[Cell, ...] = ()


def _thresholds(meta: MetaRecord, cells_path: Path | None) -> _CellThresholds:
    """Each cell's thresholds from the run's cells.yaml (the meta's, or the one named); the
    defaults, with a note, where that file is gone."""
    from pytest_gpubench.config.matrix import read_matrix

    cells = cells_path or (Path(meta["cells_file"]) if meta.get("cells_file") else None)
    prompts = Path(meta["prompts_file"]) if meta.get("prompts_file") else None
    if cells is None or prompts is None or not cells.exists() or not prompts.exists():
        return _CellThresholds(
            note="the run's cells.yaml is not here: default thresholds for every cell"
        )
    try:
        matrix = read_matrix(cells, prompts)
    except GpubenchError as exc:
        return _CellThresholds(note=f"default thresholds for every cell: {exc}")
    return _CellThresholds(
        warm={cell.cell_id: cell.thresholds for cell in matrix.cells},
        load={cell.cell_id: cell.load.thresholds for cell in matrix.cells if cell.load},
        cells=matrix.cells,
    )


def runs_given(meta: MetaRecord) -> int | None:
    """The run's --gpubench-runs, read from its command line (None when not given)."""
    argv = [str(arg) for arg in meta.get("command_line") or []]
    for index, arg in enumerate(argv):
        value = None
        if arg == "--gpubench-runs" and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith("--gpubench-runs="):
            value = arg.split("=", 1)[1]
        if value is not None and value.isdigit():
            return int(value)
    return None


def judge_load_points(
    records: Sequence[Mapping[str, Any]],
    baselines_dir: Path,
    thresholds: Mapping[str, LoadThresholds],
) -> list[Verdict]:
    """Each load point of the ledger against its load baseline (baselines/load/<cell>.json),
    as the session's gate does (load/gate.py); none where the ledger has no load records."""
    from pytest_gpubench.results.load_baseline import read_load_baselines
    from pytest_gpubench.results.load_gate import judge_loads

    loads = records_of(records, "load")
    if not loads:
        return []
    baselines = read_load_baselines(baselines_dir, {str(load.get("cell_id")) for load in loads})
    return judge_loads(loads, baselines, thresholds)


def judge_ledger(
    records: Sequence[Mapping[str, Any]],
    baselines_dir: Path,
    *,
    cells_path: Path | None = None,
) -> LedgerJudgement:
    """Compare the ledger's summaries and load points with the baselines (a baseline of another
    setup is `incomparable`), as the session's gate does, and find its unmeasured cells."""
    from pytest_gpubench.results.baseline import cell_provenance, find_baseline, provenance_changes
    from pytest_gpubench.results.gate import compare, incomparables, regressions, telemetry_verdicts
    from pytest_gpubench.results.stats import summarize

    meta = meta_of(records[:1])
    if meta is None:
        raise GpubenchError("gate: the ledger has no meta record")
    every_call = records_of(records, "call")
    # The re-measure's calls (`pass: 2`) decide the suspects with the first pass's, as in the
    # session (results/confirm.py); they are never pooled with them.
    calls = [call for call in every_call if call.get("pass", 1) == 1]
    again = [call for call in every_call if call.get("pass", 1) != 1]
    cells = {str(cell.get("cell_id")): cell for cell in records_of(records, "cell")}
    thresholds = _thresholds(meta, cells_path)
    baselines: list[PromptSummary] = []
    histories: dict[tuple[str, str], Any] = {}
    changed: dict[str, str] = {}
    for cell_id in sorted({str(call.get("cell_id")) for call in calls}):
        baseline = find_baseline(baselines_dir, cell_id)
        if baseline is None:
            continue
        baselines.extend(baseline.prompts)
        histories.update({(cell_id, p): runs for p, runs in baseline.history.items()})
        cell = cells.get(cell_id)
        if cell is not None:
            changes = provenance_changes(baseline.provenance, cell_provenance(meta, cell, calls))
            if changes:
                changed[cell_id] = ", ".join(changes)
    verdicts = compare(
        baselines, summarize(calls), thresholds.warm, changed_setups=changed, histories=histories
    )
    if again:
        from pytest_gpubench.results.confirm import confirm

        second = compare(
            baselines, summarize(again), thresholds.warm, changed_setups=changed,
            histories=histories,
        )  # fmt: skip
        verdicts = confirm(verdicts, second)
    verdicts.extend(telemetry_verdicts(calls, thresholds.warm))
    if any(cell.reference is not None for cell in thresholds.cells):
        from pytest_gpubench.results.paired import ab_verdicts

        verdicts.extend(ab_verdicts(calls, thresholds.cells, runs_given(meta)))
    load_verdicts = judge_load_points(records, baselines_dir, thresholds.load)
    unmeasured = unmeasured_cells(records)
    judgement = LedgerJudgement(
        verdicts,
        unmeasured,
        [thresholds.note] if thresholds.note else [],
        load_verdicts=load_verdicts,
    )
    # As the session's: a load point's regression fails the run; an `incomparable` load point
    # (its request changed) is reported, as in the session, without failing it.
    judgement.exit_status = session_status(
        0,
        unmeasured=bool(unmeasured),
        incomparable=bool(incomparables(verdicts)),
        regressed=bool(regressions([*verdicts, *load_verdicts])),
        unsteady=any(v.verdict == "unsteady" for v in [*verdicts, *load_verdicts]),
    )
    return judgement
