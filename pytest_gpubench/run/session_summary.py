"""What a session writes on the terminal at its end, from its run (plugin.py's
pytest_terminal_summary delegates here): the startup error, the probe table, the rentals, each
cell's outcome, the gate's and the load points' lines, where the ledger and the pull request
summary went, and the findings pytest's summary line counts; secrets cut out of every line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpubench.reports import terminal as report
from pytest_gpubench.results.decision import UNDECIDED

if TYPE_CHECKING:
    from pytest_gpubench.run.controller import RunController


def write_session_summary(
    terminalreporter: pytest.TerminalReporter,
    run: RunController,
    rentals: Sequence[Mapping[str, Any]],
) -> None:
    """The lines of the session's end, written as they come: what came before the ledger's part
    first (the startup error, the probe table, the rentals), then under its own rule the ledger's
    (outcomes, the gate, the load points, where things were written)."""
    lines: list[report.TerminalLine] = []
    if run.startup_error is not None:
        lines.append(report.TerminalLine(f"ERROR: {run.startup_error}", red=True))
    if run.probe_rows:
        terminalreporter.write_sep("=", "gpubench probe")
        lines.append(report.TerminalLine(report.render_probe(run.probe_rows)))
    lines.extend(report.rental_lines(rentals))
    if run.ledger is not None:
        _write(terminalreporter, run, lines)
        lines = []
        terminalreporter.write_sep("=", "gpubench")
        judgement = run.judgement
        lines.extend(report.outcome_lines(run.outcomes))
        lines.extend(
            report.gate_lines(
                judgement.summaries,
                judgement.verdicts,
                baseline_notes=judgement.baseline_notes,
                gate_error=judgement.gate_error,
                baseline_update=run.options.baseline_update,
                baselines_dir=run.options.baselines_dir,
                telemetry=judgement.telemetry,
                checks=judgement.checks,
            )
        )
        lines.extend(
            report.load_lines(
                run.loads, judgement.load_verdicts, baseline_update=run.options.baseline_update
            )
        )
        if run.write_error is not None:
            lines.append(report.TerminalLine(f"ERROR: {run.write_error}", red=True))
        lines.append(report.TerminalLine(f"ledger: {run.ledger.path}"))
        if run.summary_path is not None:
            lines.append(report.TerminalLine(f"pull request summary: {run.summary_path}"))
        if run.summary_error is not None:
            lines.append(report.TerminalLine(f"WARNING: {run.summary_error}", red=True))
        # Beside pytest's own counts ("24 passed, 2 regressed in 9.1s"): its tests passed, and
        # the run did not.
        for word, found in _findings(run).items():
            if found:
                terminalreporter.stats.setdefault(word, []).extend(found)
    _write(terminalreporter, run, lines)


def _findings(run: RunController) -> dict[str, list[Any]]:
    """What fails the run that no test failed, by the word pytest's summary line counts it
    under: the required cells not measured, the incomparable baselines, the regressions, and
    each figure that could not be told and holds the run back (exit 10), by its verdict:
    `unsteady`, `blind`, `inconclusive` (a ratified regression against a baseline is none, and
    a baseline update is held back by none)."""
    judgement = run.judgement
    held = [] if judgement.settings.baseline_update else judgement.undecided()
    return {
        "unmeasured": judgement.unmeasured,
        "incomparable": judgement.failing_incomparables(),
        "regressed": judgement.failing_regressions(),
        **{word: [v for v in held if v.verdict == word] for word in UNDECIDED},
    }


def _write(terminalreporter: pytest.TerminalReporter, run: RunController, lines: list[Any]) -> None:
    """The terminal is one of the two exits (the ledger is the other): secrets cut out here."""
    for line in lines:
        terminalreporter.write_line(run.scrub(line.text), red=line.red)
