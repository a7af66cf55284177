"""The parsers of Slurm's command output (formats as Slurm 22.05 prints them).

sacct needs slurmdbd, which the test cluster does not run (it needs MySQL): its line format
(`-n -P -X -o State,ElapsedRaw`: `CANCELLED by 1000|42`) is checked here; the cluster tests read
the same facts from scontrol.
"""

from __future__ import annotations

import pytest

from pytest_gpubench.targets.slurm.commands import (
    FinalState,
    QueueState,
    elapsed_seconds,
    parse_fields,
    parse_job_id,
    parse_queue_line,
    parse_sacct,
)


@pytest.mark.parametrize(
    ("output", "job_id"),
    [("4242\n", "4242"), ("4242;gpu-cluster\n", "4242"), ("", None), ("sbatch: error\n", None)],
)
def test_sbatch_parsable_output(output: str, job_id: str | None) -> None:
    assert parse_job_id(output) == job_id


def test_squeue_line() -> None:
    assert parse_queue_line("PENDING|Resources|\n") == QueueState("PENDING", "Resources", "")
    assert parse_queue_line("RUNNING|None|gpu07\n") == QueueState("RUNNING", "None", "gpu07")
    assert parse_queue_line("RUNNING|None|gpu07\n").active  # type: ignore[union-attr]
    assert not QueueState("CANCELLED", "None", "gpu07").active
    assert parse_queue_line("") is None


def test_scontrol_fields() -> None:
    line = "JobId=7 JobName=x JobState=CANCELLED Reason=None RunTime=00:01:05 NodeAddr=10.0.0.7"
    fields = parse_fields(line)
    assert fields["JobState"] == "CANCELLED" and fields["RunTime"] == "00:01:05"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:00:02", 2), ("01:05", 65), ("1-02:03:04", 93784), ("12:00:00", 43200), ("x", None)],
)
def test_elapsed(text: str, seconds: int | None) -> None:
    assert elapsed_seconds(text) == seconds


def test_sacct_line() -> None:
    assert parse_sacct("CANCELLED by 1000|42\n") == FinalState("CANCELLED", 42, "sacct")
    assert parse_sacct("COMPLETED|7\n") == FinalState("COMPLETED", 7, "sacct")
    assert parse_sacct("") is None
