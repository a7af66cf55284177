"""The rule that picks the session's exit status when several findings apply."""

from __future__ import annotations

import pytest

from pytest_gpubench.core.status import (
    EXIT_INCOMPARABLE,
    EXIT_REGRESSION,
    EXIT_UNMEASURED,
    EXIT_WRITE_FAILED,
    SEVERITY,
    describe,
    most_severe,
    session_status,
)

OK = int(pytest.ExitCode.OK)


def test_nothing_found_keeps_ok() -> None:
    assert session_status(OK) == OK


def test_each_finding_has_its_own_status() -> None:
    assert session_status(OK, regressed=True) == EXIT_REGRESSION
    assert session_status(OK, incomparable=True) == EXIT_INCOMPARABLE
    assert session_status(OK, unmeasured=True) == EXIT_UNMEASURED
    assert session_status(OK, unjudged=True) == pytest.ExitCode.USAGE_ERROR
    assert session_status(OK, write_failed=True) == EXIT_WRITE_FAILED


def test_the_most_serious_finding_wins() -> None:
    every = {"regressed": True, "incomparable": True, "unmeasured": True}
    assert session_status(OK, **every) == EXIT_UNMEASURED
    assert session_status(OK, unjudged=True, **every) == pytest.ExitCode.USAGE_ERROR
    assert session_status(OK, write_failed=True, unjudged=True, **every) == EXIT_WRITE_FAILED
    assert session_status(OK, regressed=True, incomparable=True) == EXIT_INCOMPARABLE


def test_pytest_s_own_failure_stands_except_against_lost_records() -> None:
    failed = int(pytest.ExitCode.TESTS_FAILED)
    interrupted = int(pytest.ExitCode.INTERRUPTED)
    assert session_status(failed, regressed=True, unmeasured=True) == failed
    assert session_status(interrupted, unmeasured=True) == interrupted
    # The run stops itself when the ledger cannot be written: that is not a Ctrl-C.
    assert session_status(interrupted, write_failed=True) == EXIT_WRITE_FAILED


def test_one_severity_order_serves_a_session_and_a_merge_of_shards() -> None:
    """The merge of a job array's ledgers ranks the shards' statuses by the same table that
    picks a session's own status from its findings."""
    no_tests = int(pytest.ExitCode.NO_TESTS_COLLECTED)
    findings = {"unjudged": 4, "unmeasured": 7, "incomparable": 8, "regressed": 6}
    for first, first_status in findings.items():
        for second, second_status in findings.items():
            found = {first: True, second: True}
            assert session_status(OK, **found) == most_severe([first_status, second_status])
    # Nothing collected is failure enough to stop CI, but it does not hide a finding.
    assert most_severe([no_tests, EXIT_UNMEASURED]) == EXIT_UNMEASURED
    assert session_status(no_tests, unmeasured=True) == EXIT_UNMEASURED
    assert most_severe([OK, no_tests]) == no_tests and most_severe([]) == OK
    assert most_severe([EXIT_REGRESSION, 42]) == EXIT_REGRESSION and most_severe([42, 5]) == 42
    assert SEVERITY[0] == EXIT_WRITE_FAILED and SEVERITY[-1] == OK


def test_the_last_line_names_the_status_and_its_meaning() -> None:
    assert describe(6) == "exit status 6: benchmarks ran and at least one regressed"
    assert describe(42) == "exit status 42"
