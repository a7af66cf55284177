"""What became of each planned cell: measured, failed (with its stage and reason), skipped on
purpose (`skip:` in cells.yaml), or missing (never run, or an optional cell that could not be
measured). Pure: records in, outcomes out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, TypedDict, cast

CellStatus = Literal["measured", "failed", "skipped", "missing"]


class CellOutcomeRecord(TypedDict):
    """What became of one planned cell, in the end record's manifest (ledger/schema.EndRecord):
    a record type here, beside what builds it, so that ledger/schema.py (which imports the
    measurement's types) is not needed to judge outcomes."""

    cell_id: str
    node: str
    status: CellStatus
    optional: bool
    stage: str | None
    reason: str | None
    calls: int
    ok_calls: int
    gpu_summary: str | None
    engine_version: str | None


@dataclass(frozen=True)
class PlannedCell:
    """A cell the run planned to measure, as its settings describe it (results/judging.py)."""

    cell_id: str
    node: str
    optional: bool = False
    # cells.yaml's `skip:` reason: the cell is skipped on purpose.
    skip: str | None = None


@dataclass(frozen=True)
class CellOutcome:
    cell_id: str
    node: str
    status: CellStatus
    optional: bool
    stage: str | None = None
    reason: str | None = None
    calls: int = 0
    ok_calls: int = 0
    gpu_summary: str | None = None
    engine_version: str | None = None

    @property
    def unmeasured(self) -> bool:
        return self.status in ("failed", "missing")

    @property
    def fails_run(self) -> bool:
        """Not measured, and not allowed to be: the run fails (status.EXIT_UNMEASURED)."""
        return self.unmeasured and not self.optional

    def to_record(self) -> CellOutcomeRecord:
        """Built-in types only: the end record's manifest."""
        return cast(CellOutcomeRecord, asdict(self))


def cell_outcomes(
    planned: Sequence[PlannedCell],
    *,
    cells: Mapping[str, Mapping[str, Any]],
    skips: Iterable[Mapping[str, Any]],
    calls: Iterable[Mapping[str, Any]],
) -> list[CellOutcome]:
    """One outcome per planned cell, in the matrix's order."""
    first_skip: dict[str, Mapping[str, Any]] = {}
    for skip in skips:
        cell_id = str(skip.get("cell_id"))
        # A case of a kind the engine cannot send (issue 35) gives way to any other reason.
        kept = first_skip.get(cell_id)
        if kept is None or (kept.get("kind_unsupported") and not skip.get("kind_unsupported")):
            first_skip[cell_id] = skip
    counts: dict[str, list[int]] = {}
    first_error: dict[str, str] = {}
    for call in calls:
        cell_id = str(call.get("cell_id"))
        count = counts.setdefault(cell_id, [0, 0])
        count[0] += 1
        if call.get("error") is None:
            count[1] += 1
        elif cell_id not in first_error:
            first_error[cell_id] = str(call.get("error"))
    return [
        _outcome(
            cell, cells.get(cell.cell_id, {}), first_skip.get(cell.cell_id), counts, first_error
        )
        for cell in planned
    ]


def _outcome(
    cell: PlannedCell,
    described: Mapping[str, Any],
    skip: Mapping[str, Any] | None,
    counts: Mapping[str, list[int]],
    first_error: Mapping[str, str],
) -> CellOutcome:
    n_calls, n_ok = counts.get(cell.cell_id, [0, 0])
    gpus, version = described.get("gpu_summary"), described.get("engine_version")
    missing = CellOutcome(
        cell_id=cell.cell_id,
        node=cell.node,
        status="missing",
        optional=cell.optional,
        reason="no case of this cell ran",
        calls=n_calls,
        ok_calls=n_ok,
        gpu_summary=None if gpus is None else str(gpus),
        engine_version=None if version is None else str(version),
    )
    if cell.skip:
        return replace(missing, status="skipped", reason=cell.skip)
    outcome = _measured_or_failed(missing, skip, first_error.get(cell.cell_id))
    # An optional cell that could not be measured is missing from the results, and allowed to be.
    if outcome.status == "failed" and cell.optional:
        return replace(outcome, status="missing")
    return outcome


def _measured_or_failed(
    missing: CellOutcome, skip: Mapping[str, Any] | None, first_error: str | None
) -> CellOutcome:
    n_calls, n_ok = missing.calls, missing.ok_calls
    if n_ok:
        return replace(missing, status="measured", reason=None)
    if n_calls:
        error = first_error or "no reason given"
        return replace(
            missing, status="failed", stage="benchmark", reason=f"every call failed: {error}"
        )
    if skip is not None and skip.get("kind_unsupported"):
        # Every case it had was of a kind its engine cannot send: skipped, not failed.
        return replace(missing, status="skipped", reason=str(skip.get("reason")))
    if skip is not None:
        stage = skip.get("stage")
        return replace(
            missing,
            status="failed",
            stage=None if stage is None else str(stage),
            reason=str(skip.get("reason")),
        )
    return missing
