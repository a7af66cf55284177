"""Leases, one journal: a Slurm job is written down before sbatch and struck off once it ended;
after `kill -9` of pytest during a Slurm cell the job still holds its node, and `gpubench leases
--release` (alias `gpubench rentals`) or the next run on the cluster cancels it and records it.

The cluster is the real single-node Slurm of slurm_fixtures.py; the engine the real llama-server
with the tiny model, run as the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.remote_cells import ledger_of, managed_cell, write_project

from pytest_gpubench.cli.main import main

if TYPE_CHECKING:
    from support.slurm_fixtures import SlurmCluster

pytest_plugins = ["support.slurm_fixtures"]


def slurm_node(cluster: SlurmCluster, work_dir: Path) -> str:
    return (
        f"{{kind: slurm, partition: {cluster.partition}, slurm_conf: '{cluster.conf}', "
        f"work_dir: '{work_dir}', bind_host: 127.0.0.1, queue_timeout_s: 60, time_limit: '10:00'}}"
    )


def journal_entries(cache: Path) -> list[dict[str, object]]:
    return [json.loads(path.read_text()) for path in sorted((cache / "rentals").glob("*.json"))]


def kill_during_the_cell(
    pytester: pytest.Pytester, cluster: SlurmCluster, install: tuple[Path, Path], work: Path
) -> str:
    """Start a run whose engine is a Slurm job, kill -9 pytest once it measures; the job id."""
    write_project(
        pytester,
        {"cluster": slurm_node(cluster, work)},
        [managed_cell("cluster", "tiny", install, phases=["warm"], runs=500)],
    )
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "--force-load", "-p", "no:cacheprovider", "-q"],
        cwd=pytester.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    running: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and run.poll() is None:
            running = [j for j in cluster.jobs() if cluster.job_field(j, "JobState") == "RUNNING"]
            ledgers = list(pytester.path.glob("runs/*.jsonl"))
            if running and ledgers and '"type":"call"' in ledgers[0].read_text():
                break
            time.sleep(0.3)
        assert running, "the engine's job never ran"
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
    (job_id,) = running
    return job_id


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A journal of this test's own (the cache directory holds it), for the run and the CLI."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("GPUBENCH_CACHE_DIR", str(folder))
    return folder


def test_a_job_left_by_kill_9_is_cancelled_by_leases_release(
    pytester: pytest.Pytester,
    slurm_cluster: SlurmCluster,
    llama_server: Path,
    tiny_model: Path,
    tmp_path: Path,
    cache: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job_id = kill_during_the_cell(pytester, slurm_cluster, (llama_server, tiny_model), tmp_path)
    time.sleep(2)
    # Killed: nothing cancelled the job, it still holds the node; the journal names it.
    assert slurm_cluster.job_field(job_id, "JobState") == "RUNNING"
    (entry,) = journal_entries(cache)
    assert (entry["kind"], entry["slurm_job_id"], entry["node"]) == ("slurm", job_id, "cluster")

    assert main(["leases"]) == 0
    assert f"job {job_id} " in capsys.readouterr().out  # listed, left by a killed run
    assert main(["rentals", "--release"]) == 0  # the old name still works
    out = capsys.readouterr().out
    assert f"slurm node cluster: left by a killed run, cancelled now: job {job_id}" in out
    assert "CANCELLED" in out
    assert slurm_cluster.job_field(job_id, "JobState") == "CANCELLED"
    assert slurm_cluster.jobs() == []
    assert journal_entries(cache) == []
    assert main(["leases", "--release"]) == 0
    assert capsys.readouterr().out.startswith("no rentals in ")


def test_a_job_left_by_kill_9_is_cancelled_by_the_next_run_and_recorded(
    pytester: pytest.Pytester,
    slurm_cluster: SlurmCluster,
    llama_server: Path,
    tiny_model: Path,
    tmp_path: Path,
    cache: Path,
) -> None:
    install = (llama_server, tiny_model)
    job_id = kill_during_the_cell(pytester, slurm_cluster, install, tmp_path)
    for ledger in pytester.path.glob("runs/*.jsonl"):
        ledger.unlink()  # the killed run's ledger: the next run's is read below
    write_project(
        pytester,
        {"cluster": slurm_node(slurm_cluster, tmp_path)},
        [managed_cell("cluster", "tiny", install, phases=["warm"], runs=1)],
    )
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [f"slurm node cluster: left by a killed run, cancelled now: job {job_id} *: CANCELLED*"]
    )
    assert slurm_cluster.job_field(job_id, "JobState") == "CANCELLED"
    assert slurm_cluster.jobs() == []
    nodes = ledger_of(pytester)[-1]["nodes"]
    (leaked,) = [job for job in nodes if job.get("leaked")]
    assert (leaked["slurm_job_id"], leaked["state"]) == (job_id, "CANCELLED")
    # The run's own job was struck off the journal when it ended, the leaked one when cancelled.
    assert journal_entries(cache) == []
