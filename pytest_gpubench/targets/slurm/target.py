"""The Slurm node kind: a managed engine runs as a batch job, reached on its compute node.

`start` submits a job that runs the engine's argv and waits (within the node's
`queue_timeout_s`) until it runs; `reach` then points at the job's compute node, directly or
through the SSH login node. Every job is cancelled when its engine stops, when the node is given
back (a Ctrl-C or SIGTERM ends the run through the same path) and when waiting for it fails; its
final state and elapsed time go to the `on_job_ended` callback (the end record's `nodes`).
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from pytest_gpubench.config.nodes import SlurmNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.targets.gpu import nvidia_smi_argv, parse_nvidia_smi
from pytest_gpubench.targets.leases import RentalJournal
from pytest_gpubench.targets.protocol import (
    LOOPBACK_HOSTS,
    CommandResult,
    NodeFacts,
    RentalClosed,
    Target,
)
from pytest_gpubench.targets.slurm.commands import ACTIVE_STATES, QueueState, SlurmClient
from pytest_gpubench.targets.slurm.leases import begin_job, job_submitted
from pytest_gpubench.targets.slurm.script import in_job_argv, job_env_path, job_name, job_script
from pytest_gpubench.targets.stages import StageError

log = logging.getLogger(__name__)

QUEUE_POLL_S = 0.5
# How long alive() trusts squeue's last answer: the managed server asks many times a second.
ALIVE_CACHE_S = 1.0
# How long a cancelled job may take to leave the queue (Slurm's KillWait is 30 s by default).
CANCEL_WAIT_S = 40.0
# How long a running job may take to write its environment file (its script's first line).
JOB_ENV_WAIT_S = 10.0
# Writes a job script on the login node; values arrive as positional parameters only.
WRITE_SCRIPT = 'mkdir -p "$1" && printf %s "$2" > "$3"'


class SlurmJob:
    """An engine's batch job (a `BackgroundProcess`): alive while it is queued or running."""

    def __init__(self, target: SlurmTarget, job_id: str, name: str, log_path: str) -> None:
        self.target = target
        self.job_id = job_id
        self.name = name
        self.log_path = log_path
        self.node_name: str | None = None
        self.address: str | None = None
        self.ended = False
        self.env_path = job_env_path(log_path)
        # Its entry in the lease journal, struck off once it has ended.
        self.lease: Path | None = None
        self._checked_at = 0.0
        self._alive = True

    def alive(self) -> bool:
        if self.ended:
            return False
        now = time.monotonic()
        if now - self._checked_at >= ALIVE_CACHE_S:
            state = self.target.client.queue_state(self.job_id)
            self._alive = state is not None and state.active
            self._checked_at = now
        return self._alive

    def stop(self, timeout_s: float = 10.0) -> None:
        """scancel, wait until the job has left the queue, then report how it ended."""
        if self.ended:
            return
        self.target.client.cancel(self.job_id)
        deadline = time.monotonic() + max(timeout_s, CANCEL_WAIT_S)
        while time.monotonic() < deadline:
            state = self.target.client.queue_state(self.job_id)
            if state is None or not state.active:
                break
            time.sleep(QUEUE_POLL_S)
        self.ended = True
        self.target.job_ended(self)
        with contextlib.suppress(Exception):  # the job's environment: no longer needed
            self.target.login.run(["rm", "-f", self.env_path], timeout_s=10)

    def log_tail(self, max_bytes: int = 4000) -> str:
        result = self.target.login.run(
            ["tail", "-c", str(max_bytes), self.log_path], timeout_s=self.target.client.timeout_s
        )
        return result.stdout if result.ok else ""


class JobShell:
    """The running job's node as a target for commands: each runs as a step of the job (srun
    --overlap) with the job's environment, so nvidia-smi reports the job's GPUs, not the login
    node's. Everything else is the Slurm target's."""

    def __init__(self, target: SlurmTarget, job: SlurmJob) -> None:
        self.target = target
        self.job = job
        self.node_id = target.node_id

    def run(self, argv: Sequence[str], *, timeout_s: float) -> CommandResult:
        return self.target.client.run(self.target.in_job(argv))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


class SlurmTarget:
    """A Slurm cluster seen from its login node (this machine, or an SSH host)."""

    def __init__(
        self,
        node_id: str,
        node: SlurmNode,
        login: Target,
        *,
        on_job_ended: RentalClosed,
    ) -> None:
        self.node_id = node_id
        self.node = node
        self.login = login
        self.on_job_ended = on_job_ended
        self.client = SlurmClient(
            node_id, login, slurm_conf=node.slurm_conf, timeout_s=node.command_timeout_s
        )
        self.jobs: list[SlurmJob] = []
        self.current: SlurmJob | None = None
        # Called once a job runs, with a shell inside it (the GPU checks of its node).
        self.on_running: Callable[[Target], None] | None = None
        # Every job is written down before sbatch and struck off once it has ended: a run
        # killed with -9 leaves it for the next run or `gpubench leases --release` to cancel.
        self.journal = RentalJournal()

    @property
    def work_dir(self) -> str:
        return self.node.work_dir or self.login.work_dir

    @property
    def engine_bind_host(self) -> str:
        """The address a managed engine listens on: its compute node is another machine."""
        return self.node.bind_host

    def when_job_runs(self, check: Callable[[Target], None]) -> None:
        """`check` is called with a shell inside each job once it runs (StartsEnginesInJobs)."""
        self.on_running = check

    def run(self, argv: Sequence[str], *, timeout_s: float) -> CommandResult:
        """On the login node, which shares the cluster's filesystem with the compute nodes."""
        return self.login.run(argv, timeout_s=timeout_s)

    def start(self, argv: Sequence[str], *, log_path: str) -> SlurmJob:
        """Submit a job that runs argv, its output to log_path; returns once it is RUNNING."""
        name = job_name(posixpath.basename(log_path).rsplit(".", 1)[0])
        script_path = log_path.rsplit(".", 1)[0] + ".sbatch"
        script = job_script(self.node, argv, cell_label=name, name=name, log_path=log_path)
        written = self.login.run(
            ["sh", "-c", WRITE_SCRIPT, "sh", posixpath.dirname(script_path), script, script_path],
            timeout_s=self.client.timeout_s,
        )
        if not written.ok:
            raise StageError(
                "queue",
                f"node {self.node_id}: cannot write the job script {script_path}: "
                f"{written.stderr.strip()[-300:]}",
            )
        lease = begin_job(self.journal, self.node_id, self.node, name)
        try:
            job_id = self.client.submit(script_path)
        except BaseException:
            self.journal.close(lease)  # a refused job holds nothing; a kill keeps the entry
            raise
        job_submitted(self.journal, lease, job_id)
        job = SlurmJob(self, job_id, name, log_path)
        job.lease = lease
        self.jobs.append(job)
        log.info("node %s: submitted Slurm job %s (%s)", self.node_id, job.job_id, name)
        try:
            state = self._wait_running(job)
            job.node_name = state.node_list
            job.address = self.client.node_address(state.node_list)
            self.current = job
            self._wait_job_env(job)
            if self.on_running is not None:
                self.on_running(cast(Target, JobShell(self, job)))
        except BaseException:
            job.stop()
            raise
        return job

    def _wait_job_env(self, job: SlurmJob) -> None:
        """The job writes its environment first thing; steps inside it use it (its PATH)."""
        deadline = time.monotonic() + JOB_ENV_WAIT_S
        while time.monotonic() < deadline:
            probe = self.login.run(["test", "-e", job.env_path], timeout_s=self.client.timeout_s)
            if probe.ok:
                return
            time.sleep(QUEUE_POLL_S / 5)
        log.warning("node %s: job %s wrote no environment file", self.node_id, job.job_id)

    def in_job(self, argv: Sequence[str]) -> list[str]:
        """argv as a step of the running job (srun --overlap), with the job's environment."""
        job = self.current
        if job is None:
            raise GpubenchError(f"node {self.node_id}: no Slurm job is running")
        return in_job_argv(job.job_id, job.env_path, argv)

    def stream(self, argv: Sequence[str]) -> Any:
        """A long-lived command (a telemetry stream) inside the running job, its output
        streamed back through the login node, as an SSH node's is."""
        prefix = ["env", f"SLURM_CONF={self.node.slurm_conf}"] if self.node.slurm_conf else []
        stream = getattr(self.login, "stream", None)
        if stream is None:
            raise GpubenchError(f"node {self.node_id}: its login node cannot stream a command")
        return stream([*prefix, *self.in_job(argv)])

    def _wait_running(self, job: SlurmJob) -> QueueState:
        """Poll squeue until the job runs; a job still queued at the timeout fails the stage
        with squeue's reason (Resources, Priority, PartitionConfig, ...)."""
        timeout_s = self.node.queue_timeout_s
        deadline = time.monotonic() + timeout_s
        last: QueueState | None = None
        while True:
            state = self.client.queue_state(job.job_id)
            if state is None or not state.active:
                final = self.client.final_state(job.job_id)
                how = final.state if final is not None else "left the queue"
                raise StageError(
                    "queue",
                    f"node {self.node_id}: Slurm job {job.job_id} ended before its engine "
                    f"started ({how}); log tail:\n{job.log_tail(1500)}",
                )
            if state.state == "RUNNING":
                return state
            last = state
            if time.monotonic() >= deadline:
                raise StageError(
                    "queue",
                    f"node {self.node_id}: Slurm job {job.job_id} still {last.state} after "
                    f"{timeout_s:g} s (reason: {last.reason}); cancelled it",
                )
            time.sleep(QUEUE_POLL_S)

    def job_ended(self, job: SlurmJob) -> None:
        """Record how a job ended: its final state and elapsed time, as Slurm accounts them."""
        if self.current is job:
            self.current = None
        final = self.client.final_state(job.job_id)
        if job.lease is not None and not (final is not None and final.state in ACTIVE_STATES):
            self.journal.close(job.lease)
        self.on_job_ended(
            {
                "node": self.node_id,
                "kind": "slurm",
                "session_id": job.job_id,
                "slurm_job_id": job.job_id,
                "job_name": job.name,
                "compute_node": job.node_name,
                "state": final.state if final is not None else None,
                "elapsed_s": final.elapsed_s if final is not None else None,
                "state_source": final.source if final is not None else None,
            }
        )

    def free_port(self) -> int:
        """A port free on the login node. The compute node is not known before the job runs;
        one taken there makes the engine fail to start, with its log tail in the error."""
        return self.login.free_port()

    def reach(self, host: str, port: int) -> tuple[str, int]:
        """host:port as the running job's compute node sees it (loopback means that node)."""
        if host in LOOPBACK_HOSTS and self.current is not None and self.current.address:
            host = self.current.address
        return self.login.reach(host, port)

    def gpu_inventory(self) -> list[dict[str, str]]:
        """nvidia-smi inside the running job's allocation (srun --overlap): its GPUs only."""
        job = self.current
        if job is None:
            return []
        result = self.client.run(self.in_job(nvidia_smi_argv()))
        return parse_nvidia_smi(result.stdout) if result.ok else []

    def describe(self) -> NodeFacts:
        job = self.current
        login = self.login.describe()
        return {
            "host": job.node_name if job is not None else None,
            "slurm_job_id": job.job_id if job is not None else None,
            "slurm_partition": self.node.partition,
            "slurm_gres": self.node.gres,
            "container": self.node.container,
            "login_host": login.get("host"),
        }

    def close(self) -> None:
        """Cancel every job still queued or running, then close the login connection. Each
        step runs even when an earlier one is interrupted (a second Ctrl-C): a job left
        running holds a cluster's GPUs. The first interruption is raised at the end."""
        interrupted: BaseException | None = None
        for job in self.jobs:
            try:
                job.stop()
            except Exception:
                log.warning(
                    "node %s: cancelling job %s failed", self.node_id, job.job_id, exc_info=True
                )
            except BaseException as exc:
                interrupted = interrupted or exc
        self.jobs.clear()
        self.login.close()
        if interrupted is not None:
            raise interrupted
