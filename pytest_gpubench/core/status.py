"""The session's exit statuses (README: "Exit statuses"), all in one place, and the rule that
picks one when several apply."""

from __future__ import annotations

import pytest

# Benchmarks ran and at least one regressed against its baseline.
EXIT_REGRESSION = 6
# A planned cell that is not optional was not measured (unreachable, unhealthy, every call failed,
# or never run): nothing unmeasured passes.
EXIT_UNMEASURED = 7
# A baseline was measured on another engine version, model or GPU: its numbers compare nothing.
EXIT_INCOMPARABLE = 8
# The ledger or a baseline could not be written (a full disk, a read-only directory).
EXIT_WRITE_FAILED = 9
# No regression, but the machine drifted while a (cell, prompt) ran (its control call moved
# beyond the noise floor): its verdict is `unsteady`, neither a pass nor a regression; re-run.
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
    EXIT_UNSTEADY: "the machine was unsteady: some figures could not be judged",
}


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
    the most serious of the gate's findings."""
    if write_failed:
        return EXIT_WRITE_FAILED
    if pytest_status != pytest.ExitCode.OK:
        return pytest_status
    for found, status in (
        (unjudged, int(pytest.ExitCode.USAGE_ERROR)),
        (unmeasured, EXIT_UNMEASURED),
        (incomparable, EXIT_INCOMPARABLE),
        (regressed, EXIT_REGRESSION),
        (unsteady, EXIT_UNSTEADY),
    ):
        if found:
            return status
    return pytest_status


def describe(status: int) -> str:
    """`exit status 6: benchmarks ran and at least one regressed`."""
    meaning = MEANINGS.get(status)
    return f"exit status {status}: {meaning}" if meaning else f"exit status {status}"
