"""SlurmTarget against a real single-node Slurm cluster on loopback (see slurm_fixtures.py).

The job's program here is Python's own http.server (a stand-in for an engine: something that
listens on a port); the managed llama-server as a Slurm job is in test_slurm_cells.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from pytest_gpubench.config.nodes import SlurmNode
from pytest_gpubench.targets.protocol import Rental
from pytest_gpubench.targets.slurm import SlurmTarget, open_slurm_target
from pytest_gpubench.targets.stages import StageError

pytestmark = pytest.mark.slurm

if TYPE_CHECKING:
    from support.slurm_fixtures import SlurmCluster

pytest_plugins = ["support.slurm_fixtures"]


def _target(cluster: SlurmCluster, tmp_path: Path, ended: list[Rental], **keys: Any) -> SlurmTarget:
    node = SlurmNode(
        kind="slurm",
        partition=cluster.partition,
        slurm_conf=str(cluster.conf),
        work_dir=str(tmp_path),
        bind_host="127.0.0.1",
        **keys,
    )
    return open_slurm_target("cluster", node, on_job_ended=ended.append)


def _http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def _get(url: str, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return httpx.get(url, timeout=2.0, trust_env=False).status_code
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_job_runs_is_reached_and_is_cancelled(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    ended: list[Rental] = []
    target = _target(slurm_cluster, tmp_path, ended)
    try:
        port = target.free_port()
        job = target.start(_http_server(port), log_path=str(tmp_path / "engine-a.log"))
        assert slurm_cluster.job_field(job.job_id, "JobState") == "RUNNING"
        assert job.node_name == slurm_cluster.node_name
        host, reached_port = target.reach("127.0.0.1", port)
        assert (host, reached_port) == ("127.0.0.1", port)  # the node's NodeAddr
        assert _get(f"http://{host}:{reached_port}/") == 200
        assert job.alive()
        described = target.describe()
        assert described["slurm_job_id"] == job.job_id
        assert described["host"] == slurm_cluster.node_name
        script = (tmp_path / "engine-a.sbatch").read_text()
        assert f"#SBATCH --partition={slurm_cluster.partition}" in script
    finally:
        target.close()
    assert slurm_cluster.job_field(job.job_id, "JobState") == "CANCELLED"
    assert job.job_id not in slurm_cluster.jobs()
    assert [(e["slurm_job_id"], e["state"], e["kind"]) for e in ended] == [
        (job.job_id, "CANCELLED", "slurm")
    ]
    assert isinstance(ended[0]["elapsed_s"], int)


def test_a_job_left_pending_fails_the_queue_stage_with_squeues_reason(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """More CPUs than the only node has: Slurm queues the job and never starts it."""
    ended: list[Rental] = []
    target = _target(
        slurm_cluster, tmp_path, ended, cpus_per_task=slurm_cluster.cpus + 62, queue_timeout_s=3
    )
    try:
        started = time.monotonic()
        with pytest.raises(StageError) as failure:
            target.start(_http_server(target.free_port()), log_path=str(tmp_path / "e.log"))
        waited = time.monotonic() - started
    finally:
        target.close()
    assert failure.value.stage == "queue"
    assert "still PENDING after 3 s (reason: PartitionConfig)" in str(failure.value)
    assert waited >= 3
    assert [e["state"] for e in ended] == ["CANCELLED"]
    assert not slurm_cluster.jobs()


def test_a_job_sbatch_refuses_fails_the_queue_stage_with_sbatchs_words(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """A GPU the cluster has none of: sbatch rejects the job at once."""
    target = _target(slurm_cluster, tmp_path, [], gres="gpu:1")
    try:
        with pytest.raises(StageError) as failure:
            target.start(_http_server(target.free_port()), log_path=str(tmp_path / "e.log"))
    finally:
        target.close()
    assert failure.value.stage == "queue"
    assert "sbatch refused the job" in str(failure.value)
    assert "Requested node configuration is not available" in str(failure.value)


def test_a_job_whose_program_exits_fails_with_its_log_tail(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    target = _target(slurm_cluster, tmp_path, [])
    argv = [sys.executable, "-c", "import sys; print('no GPU here'); sys.exit(3)"]
    try:
        job = target.start(argv, log_path=str(tmp_path / "e.log"))
        deadline = time.monotonic() + 20
        while job.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not job.alive()
        assert "no GPU here" in job.log_tail()
    except StageError as exc:
        # The program may end before squeue ever lists it as RUNNING.
        assert "ended before its engine started" in str(exc)
        assert "no GPU here" in str(exc)
    finally:
        target.close()
