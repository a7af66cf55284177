"""A load point's client tasks as an `srun` step of K tasks on a Slurm node (`targets.Launch`):
started from this machine, or over SSH from the node's login node."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytest_gpubench.config.nodes import SlurmNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.targets.protocol import (
    CLIENT_TASK_MODULE,
    CLIENTS_END_TIMEOUT_S,
    NO_REQUESTS,
    Launch,
    write_plan,
)
from pytest_gpubench.targets.ssh.clients import session_ended
from pytest_gpubench.targets.ssh.target import SshLineStream, SshTarget


def slurm_launch(node_id: str, node: SlurmNode, python: str | None) -> Launch:
    """The step started from this machine, or over SSH from the node's `login:`."""
    if node.login is not None:
        return LoginSrunLaunch(node_id, node, python)
    return SrunLaunch(node, python)


def srun_argv(node: SlurmNode, tasks: int, plan: Path, python: str | None = None) -> list[str]:
    """The step: K tasks on one node of the node's partition, each Python on the plan."""
    argv = ["srun", f"--ntasks={tasks}", "--nodes=1", "--kill-on-bad-exit=0"]
    if node.partition:
        argv.append(f"--partition={node.partition}")
    if node.time_limit:
        argv.append(f"--time={node.time_limit}")
    if node.account:
        argv.append(f"--account={node.account}")
    if node.qos:
        argv.append(f"--qos={node.qos}")
    return [*argv, python or sys.executable, "-m", CLIENT_TASK_MODULE, str(plan)]


class SrunLaunch:
    """An `srun` step of K tasks on a Slurm node: the plan written (mode 600) to the node's
    `work_dir` (a folder the compute node shares), each task's share its SLURM_PROCID."""

    shares_clock = False

    def __init__(self, node: SlurmNode, python: str | None) -> None:
        self.node, self.python = node, python
        work_dir = Path(node.work_dir) if node.work_dir else Path(tempfile.gettempdir())
        work_dir.mkdir(parents=True, exist_ok=True)
        self.plan = work_dir / f"gpubench-load-plan-{secrets.token_hex(6)}.pkl"
        self.step: subprocess.Popen[str] | None = None
        # srun's stderr: a file, not a pipe nobody reads while the point runs (a task's 64 KiB
        # of warnings would stall srun's forwarding, and with it the tasks).
        self.said = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())

    def address(self, coordinator: str, port: int) -> tuple[str, int]:
        return coordinator, port

    def start(self, plan: bytes, tasks: int) -> None:
        write_plan(self.plan, plan)
        env = {
            **os.environ,
            **({"SLURM_CONF": self.node.slurm_conf} if self.node.slurm_conf else {}),
        }
        self.step = subprocess.Popen(
            srun_argv(self.node, tasks, self.plan, self.python),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.said,
            text=True,
        )

    def ended(self) -> str | None:
        if self.step is None or self.step.poll() is None:
            return None
        self.said.seek(0)
        said = self.said.read().strip()[-300:]
        return f"srun ended ({self.step.returncode}): {said}"

    def how_lost(self, task: int) -> str:
        if self.step is None or self.step.poll() is None:
            return NO_REQUESTS
        return f"{NO_REQUESTS} (srun exit status {self.step.returncode})"

    def close(self) -> None:
        if self.step is not None:
            try:
                self.step.wait(timeout=CLIENTS_END_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # SIGTERM first: srun cancels its step (a SIGKILLed srun can leave it running).
                self.step.terminate()
                try:
                    self.step.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.step.kill()
                    self.step.wait()
        self.said.close()
        self.plan.unlink(missing_ok=True)


class LoginSrunLaunch:
    """An `srun` step of K tasks started on a Slurm node's login node (its `login:`) over SSH:
    the plan written (mode 600) to the node's `work_dir` (shared with the compute nodes) through
    the SSH connection, srun run in an SSH session of its own whose shell says srun's pid first
    (so that a step still running after the point is cancelled: SIGTERM to srun, then KILL)."""

    shares_clock = False

    def __init__(self, node_id: str, node: SlurmNode, python: str | None) -> None:
        login = node.login
        assert login is not None
        self.node, self.python = node, python
        self.target = SshTarget.of_connection(
            node_id, login, command_timeout_s=node.command_timeout_s, forward=False
        )
        work_dir = node.work_dir or self.target.work_dir
        self.plan = f"{work_dir}/gpubench-load-plan-{secrets.token_hex(6)}.pkl"
        self.session: SshLineStream | None = None
        self.pid: int | None = None

    def address(self, coordinator: str, port: int) -> tuple[str, int]:
        return coordinator, port

    def start(self, plan: bytes, tasks: int) -> None:
        self.target.write_file(self.plan, plan)
        conf = ["env", f"SLURM_CONF={self.node.slurm_conf}"] if self.node.slurm_conf else []
        argv = [*conf, *srun_argv(self.node, tasks, Path(self.plan), self.python)]
        self.session = self.target.stream(["sh", "-c", 'echo "$$"; exec "$@"', "sh", *argv])
        line = self.session.readline()
        self.pid = int(line) if line and line.strip().isdigit() else None

    def ended(self) -> str | None:
        status = self.session.exit_status() if self.session is not None else None
        if status is None:
            return None
        assert self.session is not None
        said = self.session.rest().strip()[-300:]
        return f"srun on the login node ended ({status}): {said}"

    def how_lost(self, task: int) -> str:
        status = self.session.exit_status() if self.session is not None else None
        return NO_REQUESTS if status is None else f"{NO_REQUESTS} (srun exit status {status})"

    def close(self) -> None:
        # Best effort, as SshLaunch's: a connection lost meanwhile must not hide why the point
        # failed.
        try:
            session = self.session
            if session is not None:
                ended = session_ended(session, time.monotonic() + CLIENTS_END_TIMEOUT_S)
                if not ended and self.pid is not None:
                    # SIGTERM first: srun cancels its step (a SIGKILLed srun can leave it).
                    for signal_name, wait_s in (("-TERM", 10.0), ("-KILL", 0.0)):
                        with contextlib.suppress(GpubenchError):
                            self.target.run(["kill", signal_name, str(self.pid)], timeout_s=10)
                        if session_ended(session, time.monotonic() + wait_s):
                            break
                session.close()
            with contextlib.suppress(GpubenchError):
                self.target.run(["rm", "-f", self.plan], timeout_s=10)
        finally:
            self.target.close()
