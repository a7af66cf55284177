"""A finished run's ledger judged from itself (`gpubench gate`, `compare`, `merge`): the
settings its meta record holds, results/judging.judge_run, and, for a --baseline-update run,
what it ratified (results/ratification.py), into the exit status its session had."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.results.judging import Judgement, RunRecords, judge_run
from pytest_gpubench.results.judging_settings import settings_of_ledger
from pytest_gpubench.results.ratification import ratify_ledger


@dataclass(frozen=True)
class LedgerJudgement:
    """`gpubench gate` on a finished ledger: the run's judgement, and the exit status that a
    session with those findings has."""

    judgement: Judgement
    exit_status: int


def judge_ledger(
    records: Sequence[Mapping[str, Any]],
    baselines_dir: Path,
    *,
    source: str = "the ledger",
    cells_path: Path | None = None,
) -> LedgerJudgement:
    """A finished (or merged) ledger judged as its session judged it: with the settings its meta
    record holds, against the baselines in `baselines_dir`; its tests' own status (pytest's, in
    its end record: a failed test) stands as it stood in the session."""
    return judge_finished(
        RunRecords.from_records(records),
        baselines_dir,
        source=source,
        cells_path=cells_path,
        pytest_status=_pytest_status(records),
    )


def judge_finished(
    run: RunRecords,
    baselines_dir: Path,
    *,
    source: str = "the ledger",
    cells_path: Path | None = None,
    pytest_status: int = 0,
) -> LedgerJudgement:
    """A finished run's records (a ledger's, a merge's) judged with the settings its meta record
    holds; `pytest_status`, its pytest sessions' own, ranks with the findings as at the session's
    end (core/status.session_status)."""
    if run.meta is None:
        raise GpubenchError(f"{source}: the ledger has no meta record")
    settings, notes = settings_of_ledger(run.meta, source, cells_path=cells_path)
    judgement = judge_run(run, settings, baselines_dir)
    judgement.notes[:0] = notes
    if settings.baseline_update:
        judgement.notes.append(
            "the run ratified its numbers (--baseline-update): judged against the baselines as "
            "they are now, which it may have written"
        )
        ratify_ledger(judgement, run, settings, baselines_dir)
    return LedgerJudgement(judgement, judgement.exit_status(pytest_status))


def _pytest_status(records: Sequence[Mapping[str, Any]]) -> int:
    """The status pytest's session itself ended with, as the end record says (0 without one:
    a run that died before its end is judged on what it measured)."""
    for record in reversed(records):
        if record.get("type") == "end":
            status = record.get("pytest_exitstatus")
            return status if isinstance(status, int) and not isinstance(status, bool) else 0
    return 0
