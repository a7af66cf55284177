"""The session's exit statuses (docs/exit-statuses.md), all in one place, and the rule that
picks one when several apply (a session's findings, the shards of a merged run)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

# Benchmarks ran and at least one regressed against its baseline.
EXIT_REGRESSION = 6
# A planned cell that is not optional was not measured (unreachable, unhealthy, every call failed,
# or never run): nothing unmeasured passes.
EXIT_UNMEASURED = 7
# A baseline was measured on another engine version, model or GPU: its numbers compare nothing.
EXIT_INCOMPARABLE = 8
# The ledger or a baseline could not be written once measuring had begun (a disk that fills, a
# read-only baselines folder at --baseline-update): records were lost. A ledger folder that
# cannot be written when the run starts loses nothing: a usage error (4), like a bad matrix.
EXIT_WRITE_FAILED = 9
# No regression, but some figure could not be told: the machine drifted or was busy while it ran
# (`unsteady`), or the evidence allows a change of the threshold's size (`inconclusive`: past the
# threshold but not significant or not found again; `blind`: inside it, but a change of its size
# could not have been seen). Neither a pass nor a regression: re-run (more runs, runs of history,
# a quieter machine). A CI gate never passes what it could not tell.
EXIT_UNSTEADY = 10

MEANINGS = {
    int(pytest.ExitCode.OK): "all benchmarks measured, no regression",
    int(pytest.ExitCode.TESTS_FAILED): "some tests failed",
    int(pytest.ExitCode.INTERRUPTED): "interrupted",
    int(pytest.ExitCode.INTERNAL_ERROR): "internal error",
    int(pytest.ExitCode.USAGE_ERROR): "usage error",
    int(pytest.ExitCode.NO_TESTS_COLLECTED): "no tests collected",
    EXIT_REGRESSION: "benchmarks ran and at least one regressed",
    EXIT_UNMEASURED: "a required cell was not measured",
    EXIT_INCOMPARABLE: "a baseline is not comparable with this run",
    EXIT_WRITE_FAILED: "the ledger or a baseline could not be written",
    EXIT_UNSTEADY: "some figures could not be told (an unsteady machine, or too little evidence): "
    "re-run",
}


# Most serious first: records lost; pytest's own trouble (an internal error, a usage error or a
# gate that could not read its baselines, an interruption, failed tests); then the gate's
# findings (unmeasured, incomparable, regressed, unsteady); no tests collected; all well.
SEVERITY = (
    EXIT_WRITE_FAILED,
    int(pytest.ExitCode.INTERNAL_ERROR),
    int(pytest.ExitCode.USAGE_ERROR),
    int(pytest.ExitCode.INTERRUPTED),
    int(pytest.ExitCode.TESTS_FAILED),
    EXIT_UNMEASURED,
    EXIT_INCOMPARABLE,
    EXIT_REGRESSION,
    EXIT_UNSTEADY,
    int(pytest.ExitCode.NO_TESTS_COLLECTED),
    int(pytest.ExitCode.OK),
)


def _rank(status: int) -> float:
    # A status this table does not know is still a failure: after the findings, before 5 and 0.
    return SEVERITY.index(status) if status in SEVERITY else SEVERITY.index(EXIT_UNSTEADY) + 0.5


def most_severe(statuses: Iterable[int]) -> int:
    """The most serious of several exit statuses (OK when there are none)."""
    return min(statuses, key=_rank, default=int(pytest.ExitCode.OK))


def session_status(
    pytest_status: int,
    *,
    write_failed: bool = False,
    unjudged: bool = False,
    unmeasured: bool = False,
    incomparable: bool = False,
    regressed: bool = False,
    unsteady: bool = False,
) -> int:
    """The run's status. A ledger or baseline that could not be written comes first: records
    were lost (the run stops itself then, which pytest calls an interruption). Otherwise pytest's
    own status when its tests failed or it was interrupted (a benchmark that failed is a failed
    test), then a gate that could not read its baselines (a usage error: nothing was judged), else
    the most serious of the gate's findings: the order of SEVERITY."""
    if write_failed:
        return EXIT_WRITE_FAILED
    if pytest_status not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        return pytest_status  # an interruption stands even where SEVERITY ranks 4 higher
    findings = (
        (unjudged, int(pytest.ExitCode.USAGE_ERROR)),
        (unmeasured, EXIT_UNMEASURED),
        (incomparable, EXIT_INCOMPARABLE),
        (regressed, EXIT_REGRESSION),
        (unsteady, EXIT_UNSTEADY),
    )
    return most_severe([pytest_status, *(status for found, status in findings if found)])


def describe(status: int, *, missing_optional: Sequence[str] = ()) -> str:
    """`exit status 6: benchmarks ran and at least one regressed`; optional cells that were not
    measured are named, so a green run never claims that everything was measured."""
    meaning = MEANINGS.get(status)
    if missing_optional:
        missing = f"optional cells not measured: {', '.join(missing_optional)}"
        meaning = f"no regression; {missing}" if status == 0 else f"{meaning or ''}; {missing}"
    return f"exit status {status}: {meaning}" if meaning else f"exit status {status}"
