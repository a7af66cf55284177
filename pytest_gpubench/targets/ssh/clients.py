"""A load point's client tasks as K SSH sessions on an ssh node (`targets.Launch`)."""

from __future__ import annotations

import contextlib
import secrets
import signal
import sys
import time

from pytest_gpubench.config.load_profile import TUNNEL
from pytest_gpubench.config.nodes import SshNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.targets.protocol import CLIENT_TASK_MODULE, CLIENTS_END_TIMEOUT_S, NO_REQUESTS
from pytest_gpubench.targets.ssh.forward import RemoteForward
from pytest_gpubench.targets.ssh.target import SshLineStream, SshTarget


class SshLaunch:
    """K SSH sessions on an ssh node (targets/ssh/, one connection of its own): the plan
    written (mode 600) to the node's work folder, each session one task, its share given on
    its command line. Each session's shell says the task's pid first, so that a task still
    running after the point can be killed."""

    shares_clock = False

    def __init__(self, node_id: str, node: SshNode, python: str | None) -> None:
        self.python = python or sys.executable
        self.target: SshTarget = SshTarget.of_node(
            node_id, node, connect_timeout_s=node.connect_timeout_s, forward=False
        )
        self.plan = f"{self.target.work_dir}/gpubench-load-plan-{secrets.token_hex(6)}.pkl"
        self.sessions: list[SshLineStream] = []
        self.pids: list[int | None] = []
        self.tunnel: RemoteForward | None = None

    def address(self, coordinator: str, port: int) -> tuple[str, int]:
        if coordinator != TUNNEL:
            return coordinator, port
        self.tunnel = self.target.reach_back(port)
        return "127.0.0.1", self.tunnel.remote_port

    def start(self, plan: bytes, tasks: int) -> None:
        self.target.write_file(self.plan, plan)
        for task in range(tasks):
            argv = [self.python, "-m", CLIENT_TASK_MODULE, self.plan, str(task), str(tasks)]
            self.sessions.append(
                self.target.stream(["sh", "-c", 'echo "$$"; exec "$@"', "sh", *argv])
            )
        for session in self.sessions:
            line = session.readline()
            self.pids.append(int(line) if line and line.strip().isdigit() else None)

    def ended(self) -> str | None:
        for task, session in enumerate(self.sessions):
            status = session.exit_status()
            if status is not None:
                said = session.rest().strip()[-300:]
                return f"the SSH session of task {task} ended (exit status {status}): {said}"
        return None

    def how_lost(self, task: int) -> str:
        status = self.sessions[task].exit_status() if task < len(self.sessions) else None
        if status is None:
            return NO_REQUESTS
        if status == -1:
            return f"{NO_REQUESTS} (its SSH session ended by a signal)"
        if status > 128:
            # The login shell's word for a command a signal ended: 128 + its number.
            with contextlib.suppress(ValueError):
                how = f"killed by {signal.Signals(status - 128).name}"
                return f"{NO_REQUESTS} (its SSH session ended: {how})"
        return f"{NO_REQUESTS} (its SSH session's exit status {status})"

    def close(self) -> None:
        # A connection lost meanwhile must not hide why the point failed: the clean-up is best
        # effort (a task left running fails at its next read of, or write to, its connection to
        # this process, closed by then: at the latest once its share is sent).
        try:
            deadline = time.monotonic() + CLIENTS_END_TIMEOUT_S
            for task, session in enumerate(self.sessions):
                pid = self.pids[task] if task < len(self.pids) else None
                if not session_ended(session, deadline) and pid is not None:
                    with contextlib.suppress(GpubenchError):
                        self.target.run(["kill", "-KILL", str(pid)], timeout_s=10)
                session.close()
            with contextlib.suppress(GpubenchError):
                self.target.run(["rm", "-f", self.plan], timeout_s=10)
            if self.tunnel is not None:
                self.tunnel.close()
        finally:
            self.target.close()


def session_ended(session: SshLineStream, deadline: float) -> bool:
    """Whether an SSH session's command has ended, waiting for it up to `deadline` (monotonic)."""
    while session.exit_status() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return session.exit_status() is not None
