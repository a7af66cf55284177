"""Cells on a Slurm node, end to end through the plugin (docs/slurm.md).

The cluster is a real single-node Slurm (slurmctld, slurmd, munged from Debian's slurm-wlm) on
loopback (slurm_fixtures.py); the managed engine is the real llama-server with the tiny model,
run as a batch job on that node.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.remote_cells import flow_mapping, ledger_of, managed_cell, write_project

from pytest_gpubench.core.status import EXIT_UNMEASURED

pytestmark = [pytest.mark.engine, pytest.mark.slurm]

if TYPE_CHECKING:
    from support.slurm_fixtures import SlurmCluster
    from support.ssh_fixtures import SshServer

pytest_plugins = ["support.slurm_fixtures", "support.ssh_fixtures"]


def slurm_node(cluster: SlurmCluster, work_dir: Path, **extra: Any) -> str:
    options = {
        "kind": "slurm",
        "partition": cluster.partition,
        "slurm_conf": str(cluster.conf),
        "work_dir": str(work_dir),
        "bind_host": "127.0.0.1",
        "queue_timeout_s": 60,
        "time_limit": "10:00",
        **extra,
    }
    return flow_mapping(options)


def test_managed_cell_runs_as_a_slurm_job_is_measured_and_cancelled(
    pytester: pytest.Pytester,
    slurm_cluster: SlurmCluster,
    llama_server: Path,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """The cell's llama-server is a Slurm job: submitted, RUNNING on the node, measured through
    its port, cancelled and started again as a new job for the cold case, cancelled at the end;
    the cell record names the job, the end record each job's final state and elapsed time."""
    write_project(
        pytester,
        {"cluster": slurm_node(slurm_cluster, tmp_path)},
        [managed_cell("cluster", "tiny", (llama_server, tiny_model), runs=2)],
    )
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        ["*slurm node cluster: job * (gpubench-llama-server-*) on gpubench1: CANCELLED after * s"]
    )

    records = ledger_of(pytester)
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert cell["node_kind"] == "slurm"
    assert cell["node_info"]["host"] == slurm_cluster.node_name
    first_job = cell["node_info"]["slurm_job_id"]
    assert first_job.isdigit() and cell["node_info"]["slurm_partition"] == "bench"
    calls = [r for r in records if r["type"] == "call"]
    assert [c["phase"] for c in calls] == ["cold", "warm", "warm"]
    assert all(c["error"] is None and c["completion_tokens"] == 8 for c in calls)
    assert calls[0]["cold_kind"] == "restart" and calls[0]["engine_timings"]["cache_n"] == 0

    # One job for the first start, one for the cold restart: each cancelled, none left.
    jobs = records[-1]["nodes"]
    assert [job["kind"] for job in jobs] == ["slurm", "slurm"]
    assert jobs[0]["slurm_job_id"] == first_job
    assert [job["state"] for job in jobs] == ["CANCELLED", "CANCELLED"]
    assert all(isinstance(job["elapsed_s"], int) for job in jobs)
    for job in jobs:
        assert slurm_cluster.job_field(job["slurm_job_id"], "JobState") == "CANCELLED"
    assert slurm_cluster.jobs() == []
    # The job's script and its output (the engine log) sit in the node's work_dir.
    (script,) = tmp_path.glob("*.sbatch")
    assert "#SBATCH --time=10:00" in script.read_text()
    assert "listening on" in next(tmp_path.glob("llama-server-*.log")).read_text()


def test_a_job_left_pending_fails_its_cell_at_the_queue_timeout_with_squeues_reason(
    pytester: pytest.Pytester,
    slurm_cluster: SlurmCluster,
    llama_server: Path,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """More CPUs than the only node has: the job stays PENDING, the cell fails in stage
    `queue` with squeue's reason once queue_timeout_s has passed, and the job is cancelled."""
    node = slurm_node(
        slurm_cluster, tmp_path, cpus_per_task=slurm_cluster.cpus + 62, queue_timeout_s=4
    )
    write_project(
        pytester,
        {"cluster": node},
        [managed_cell("cluster", "tiny", (llama_server, tiny_model), phases=["warm"], runs=1)],
    )
    started = time.monotonic()
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    assert time.monotonic() - started >= 4
    assert result.ret == EXIT_UNMEASURED
    result.stdout.fnmatch_lines(["*still PENDING after 4 s (reason: PartitionConfig)*"])

    records = ledger_of(pytester)
    (skipped,) = [r for r in records if r["type"] == "skipped"]
    assert skipped["stage"] == "queue"
    assert "reason: PartitionConfig" in skipped["reason"]
    (job,) = records[-1]["nodes"]
    assert job["state"] == "CANCELLED"
    (outcome,) = records[-1]["cells"]
    assert outcome["status"] == "failed" and outcome["stage"] == "queue"
    assert slurm_cluster.jobs() == []


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupting_the_run_cancels_the_job(
    pytester: pytest.Pytester,
    slurm_cluster: SlurmCluster,
    llama_server: Path,
    tiny_model: Path,
    tmp_path: Path,
    stop_signal: signal.Signals,
) -> None:
    """Ctrl-C (SIGINT) or a cancelled CI job (SIGTERM) while the engine's job runs: pytest ends
    as interrupted, the job is cancelled, the ledger ends with the job's final state."""
    write_project(
        pytester,
        {"cluster": slurm_node(slurm_cluster, tmp_path)},
        # Many warm runs: the run is still measuring when the signal comes.
        [managed_cell("cluster", "tiny", (llama_server, tiny_model), phases=["warm"], runs=200)],
    )
    log = (tmp_path / "pytest.out").open("wb")
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "--force-load", "-p", "no:cacheprovider", "-q"],
        cwd=pytester.path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        running: list[str] = []
        while time.monotonic() < deadline and run.poll() is None:
            running = [
                job
                for job in slurm_cluster.jobs()
                if slurm_cluster.job_field(job, "JobState") == "RUNNING"
            ]
            if running and any(pytester.path.glob("runs/*.jsonl")):
                ledger = next(pytester.path.glob("runs/*.jsonl")).read_text()
                if '"type":"call"' in ledger:
                    break
            time.sleep(0.3)
        assert running, "the engine's job never ran"
        run.send_signal(stop_signal)
        status = run.wait(timeout=90)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        log.close()
    assert status == pytest.ExitCode.INTERRUPTED, (tmp_path / "pytest.out").read_text()[-2000:]
    (job_id,) = running
    assert slurm_cluster.job_field(job_id, "JobState") == "CANCELLED"
    assert slurm_cluster.jobs() == []
    records = ledger_of(pytester)
    assert records[-1]["type"] == "end"
    (job,) = records[-1]["nodes"]
    assert (job["slurm_job_id"], job["state"]) == (job_id, "CANCELLED")
    assert any(r["type"] == "call" and r["error"] is None for r in records)


@pytest.mark.sshd
def test_a_login_node_over_ssh_submits_the_job_and_forwards_its_port(
    pytester: pytest.Pytester,
    slurm_cluster: SlurmCluster,
    sshd: SshServer,
    llama_server: Path,
    tiny_model: Path,
) -> None:
    """sbatch, squeue and scancel run on the login node (the real sshd, as its unprivileged
    user, whose job it then is); the engine's port on the compute node is reached through the
    SSH connection's forward."""
    install = sshd.remote_dir / "slurm-install"
    install.mkdir(exist_ok=True)
    binary = Path(shutil.copy2(llama_server, install / "llama-server"))
    model = Path(shutil.copy2(tiny_model, install / "tiny.gguf"))
    work_dir = sshd.remote_dir / "slurm-work"
    work_dir.mkdir(exist_ok=True)
    subprocess.run(
        ["chown", "-R", f"{sshd.user}:{sshd.user}", str(install), str(work_dir)], check=True
    )
    login = (
        f"{{host: {sshd.host}, port: {sshd.port}, user: {sshd.user}, "
        f"key_file: '{sshd.key_file}', known_hosts: '{sshd.known_hosts}'}}"
    )
    node = slurm_node(slurm_cluster, work_dir).replace(
        "{kind: 'slurm'", f"{{kind: 'slurm', login: {login}"
    )
    write_project(
        pytester,
        {"cluster": node},
        [managed_cell("cluster", "tiny", (binary, model), phases=["warm"], runs=2)],
    )
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)

    records = ledger_of(pytester)
    (cell,) = [r for r in records if r["type"] == "cell"]
    job_id = cell["node_info"]["slurm_job_id"]
    assert str(slurm_cluster.job_field(job_id, "UserId")).startswith(f"{sshd.user}(")
    assert slurm_cluster.job_field(job_id, "JobState") == "CANCELLED"
    calls = [r for r in records if r["type"] == "call"]
    assert len(calls) == 2 and all(c["error"] is None for c in calls)
    (job,) = records[-1]["nodes"]
    assert (job["slurm_job_id"], job["state"]) == (job_id, "CANCELLED")
    assert slurm_cluster.jobs() == []
    # The engine log, written on the shared filesystem, was read back over SSH.
    (engine_log,) = (pytester.path / "runs" / "logs").glob("cluster-llama-server-*.log")
    assert "listening on" in engine_log.read_text()
