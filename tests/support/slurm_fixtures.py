"""Fixtures for a real single-node Slurm cluster on loopback that the Slurm tests submit jobs to.

Debian's slurmctld, slurmd and munged (installed by `scripts/setup-slurm.sh`) run in the
foreground from a private slurm.conf, munge key and state directories in a temporary folder, on
free loopback ports; the clients (sbatch, squeue, scancel, scontrol) find the cluster through
`SLURM_CONF`, which a slurm node of cells.yaml names with its `slurm_conf` key. The container has
no systemd and no writable cgroup tree, so processes are tracked by `proctrack/linuxproc` and
tasks are not bound (`task/none`). There is no slurmdbd (it needs MySQL), so `sacct` answers
"accounting storage is disabled" and the target reads a job's final state from `scontrol`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SETUP_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "setup-slurm.sh"
DAEMONS = (Path("/usr/sbin/munged"), Path("/usr/sbin/slurmctld"), Path("/usr/sbin/slurmd"))
NODE_NAME = "gpubench1"
PARTITION = "bench"
READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SlurmCluster:
    """A running single-node cluster: its config file, node, partition and CPU count."""

    conf: Path
    node_name: str
    partition: str
    cpus: int
    base_dir: Path

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with the cluster's SLURM_CONF, for client commands."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def client(self, *argv: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (squeue, scontrol, ...) against this cluster."""
        return subprocess.run(
            list(argv), capture_output=True, text=True, env=self.env, timeout=timeout_s, check=False
        )

    def job_field(self, job_id: str, name: str) -> str | None:
        """One field of `scontrol show job` (JobState, RunTime, ...); None once it is forgotten."""
        shown = self.client("scontrol", "show", "job", "-o", job_id)
        for word in shown.stdout.split():
            key, _, value = word.partition("=")
            if key == name:
                return value
        return None

    def jobs(self) -> list[str]:
        """The ids of the jobs the cluster knows of that have not ended."""
        listed = self.client("squeue", "-h", "-o", "%i")
        return listed.stdout.split()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _ensure_installed() -> None:
    if all(daemon.exists() for daemon in DAEMONS) and shutil.which("sbatch"):
        return
    setup = subprocess.run(
        ["bash", str(SETUP_SCRIPT)], capture_output=True, text=True, check=False, timeout=900
    )
    if setup.returncode != 0 or not all(daemon.exists() for daemon in DAEMONS):
        pytest.skip(
            f"Slurm or munge missing and {SETUP_SCRIPT.name} failed (status "
            f"{setup.returncode}): {setup.stderr.strip()[-300:]}"
        )


def slurm_conf(base: Path, *, cpus: int, memory_mib: int, ports: tuple[int, int]) -> str:
    """A single-node cluster's slurm.conf: everything under base, daemons on loopback."""
    controller_port, node_port = ports
    return "\n".join(
        [
            "ClusterName=gpubench",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={controller_port}",
            f"SlurmdPort={node_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={base / 'munge' / 'munge.socket'}",
            "CredType=cred/munge",
            f"StateSaveLocation={base / 'state'}",
            f"SlurmdSpoolDir={base / 'spool'}",
            f"SlurmctldPidFile={base / 'slurmctld.pid'}",
            f"SlurmdPidFile={base / 'slurmd.pid'}",
            f"SlurmctldLogFile={base / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={base / 'log' / 'slurmd.log'}",
            # No systemd, no writable cgroups in this container.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={base / 'log' / 'jobcomp.txt'}",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "GresTypes=gpu",
            "MpiDefault=none",
            "ReturnToService=2",
            # Ended jobs stay in scontrol's memory long enough to read their final state.
            "MinJobAge=600",
            # A cancelled job's processes get SIGKILL this many seconds after SIGTERM.
            "KillWait=5",
            f"NodeName={NODE_NAME} NodeAddr=127.0.0.1 NodeHostname=localhost CPUs={cpus} "
            f"RealMemory={memory_mib} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={NODE_NAME} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _memory_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 // 2
    return 1024


def _start(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def _wait_idle(cluster: SlurmCluster, daemons: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    state = ""
    while time.monotonic() < deadline:
        for daemon in daemons:
            if daemon.poll() is not None:
                raise RuntimeError(
                    f"{daemon.args!s} exited with {daemon.returncode}; logs in "
                    f"{cluster.base_dir / 'log'}"
                )
        shown = cluster.client("sinfo", "-h", "-n", cluster.node_name, "-o", "%T")
        state = shown.stdout.strip()
        if state == "idle":
            return
        time.sleep(0.2)
    raise RuntimeError(f"Slurm node {cluster.node_name} not idle after start (state {state!r})")


def _cancel_every_job(cluster: SlurmCluster) -> None:
    """Jobs outlive slurmd (slurmstepd runs them): cancel them and wait until they are gone."""
    jobs = cluster.jobs()
    if jobs:
        cluster.client("scancel", "--full", *jobs)
    deadline = time.monotonic() + 20.0
    while cluster.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)


@contextlib.contextmanager
def running_cluster() -> Iterator[SlurmCluster]:
    """munged, slurmctld and slurmd from a fresh temporary folder; every job cancelled and the
    daemons stopped on leaving."""
    base = Path(tempfile.mkdtemp(prefix="gpubench-slurm-"))
    base.chmod(0o755)
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        for folder in ("state", "spool", "log", "munge", "munge-key"):
            (base / folder).mkdir()
        # munged wants its key private and its socket's folder open to every client.
        (base / "munge").chmod(0o755)
        (base / "munge-key").chmod(0o700)
        key = base / "munge-key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        cpus = os.cpu_count() or 1
        conf = base / "slurm.conf"
        conf.write_text(
            slurm_conf(
                base, cpus=cpus, memory_mib=_memory_mib(), ports=(_free_port(), _free_port())
            ),
            encoding="ascii",
        )
        cluster = SlurmCluster(conf, NODE_NAME, PARTITION, cpus, base)
        logs = base / "log"
        daemons.append(
            _start(
                [
                    str(DAEMONS[0]), "--foreground", "--force",
                    f"--socket={base / 'munge' / 'munge.socket'}",
                    f"--key-file={key}",
                    f"--pid-file={base / 'munge' / 'munged.pid'}",
                    f"--log-file={logs / 'munged.log'}",
                    f"--seed-file={base / 'munge-key' / 'munged.seed'}",
                ],
                logs / "munged.out",
            )
        )  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (base / "munge" / "munge.socket").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        daemons.append(_start([str(DAEMONS[1]), "-D", "-f", str(conf)], logs / "slurmctld.out"))
        daemons.append(
            _start([str(DAEMONS[2]), "-D", "-f", str(conf), "-N", NODE_NAME], logs / "slurmd.out")
        )
        _wait_idle(cluster, daemons)
        yield cluster
    finally:
        if len(daemons) == len(DAEMONS):
            _cancel_every_job(SlurmCluster(base / "slurm.conf", NODE_NAME, PARTITION, 0, base))
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A single-node cluster for the session; stopped (and its jobs with it) after."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm tests start slurmd, which runs jobs as their user only as root")
    _ensure_installed()
    with running_cluster() as cluster:
        yield cluster
