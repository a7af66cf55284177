"""`clients: {node, tasks}`: one load point sent by K client tasks on a node of cells.yaml: an
`srun` step of K tasks on a Slurm node, or K SSH sessions on an ssh node. Both share one
mechanism (`run_clients`), and differ only in how the plan reaches the node and the tasks start
(a `Launch`). This process coordinates: it listens for the tasks (multiprocessing's authenticated
connections), measures each task's clock offset to its own by timestamp exchanges, starts them at
one barrier time, and merges their requests raw into its own clock; a task that ends without
its requests is a lost client (the point is then invalid, run/load/runner.py)."""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pytest_gpubench.config.load_profile import TUNNEL, LoadProfile
from pytest_gpubench.config.nodes import SlurmNode, SshNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.run.load import LoadPattern, ramp_seconds
from pytest_gpubench.run.load.driver import LoadRun, Sent, Target, wait_until
from pytest_gpubench.run.load.processes import profile_share, share

if TYPE_CHECKING:
    from pytest_gpubench.targets.ssh.forward import RemoteForward
    from pytest_gpubench.targets.ssh.target import SshLineStream, SshTarget

# The start is set this far ahead of the moment every task said it was ready.
START_AHEAD_NS = 200_000_000
# How long the tasks may take to start and connect (srun, ssh, Python's imports), then to be
# ready.
CONNECT_TIMEOUT_S = 120.0
# Timestamp exchanges per task; the one with the smallest round trip gives the offset.
EXCHANGES = 8
# How long the tasks may take to end once the point is over, before they are killed.
END_TIMEOUT_S = 30.0
TASK_MODULE = "pytest_gpubench.run.load.client_task"


@dataclass(frozen=True)
class ClusterResult:
    """What the tasks sent, in this process's clock, and what became of them."""

    started_ns: int
    sent: list[Sent]
    lost: list[str]
    # Per task (by SLURM_PROCID): its clock minus ours, and the bound on that offset's error
    # (half the exchange's round trip), in ms.
    offsets_ms: list[float]
    offset_errors_ms: list[float]


def clock_offset(exchanges: list[tuple[int, int, int, int]]) -> tuple[float, float]:
    """(offset ns, error bound ns) from NTP's four timestamps per exchange (ours at send t0,
    theirs at receipt t1 and reply t2, ours at receipt t3): the exchange with the smallest round
    trip (t3 - t0) - (t2 - t1) gives ((t1 - t0) + (t2 - t3)) / 2, right within half that trip."""
    t0, t1, t2, t3 = min(exchanges, key=lambda e: (e[3] - e[0]) - (e[2] - e[1]))
    return ((t1 - t0) + (t2 - t3)) / 2.0, ((t3 - t0) - (t2 - t1)) / 2.0


class Launch(Protocol):
    """How K client tasks start on a node, given their plan: what differs between an `srun`
    step and SSH sessions. Everything else (the plan, barrier, offsets, merge, loss) is
    run_clients'."""

    def address(self, coordinator: str, port: int) -> tuple[str, int]:
        """Where the tasks connect to reach this machine's listener on `port`: `coordinator`'s
        address, or (`tunnel`, on an ssh node) a port on the node's loopback carried back."""

    def start(self, plan: bytes, tasks: int) -> None:
        """Put the plan where the tasks read it, and start them."""

    def ended(self) -> str | None:
        """Why the launch ended before every task connected (its own last words), else None."""

    def lost_detail(self, task: int) -> str:
        """What is known of how a lost task ended (may be empty)."""

    def close(self) -> None:
        """Wait for the tasks to end (killed past END_TIMEOUT_S) and remove the plan."""


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
    return [*argv, python or sys.executable, "-m", TASK_MODULE, str(plan)]


class SrunLaunch:
    """An `srun` step of K tasks on a Slurm node: the plan written (mode 600) to the node's
    `work_dir` (a folder the compute node shares), each task's share its SLURM_PROCID."""

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
        # The plan holds the connection's key (and the cell's headers): its owner's only.
        descriptor = os.open(self.plan, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(plan)
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

    def lost_detail(self, task: int) -> str:
        if self.step is None or self.step.poll() is None:
            return ""
        return f" (srun exit status {self.step.returncode})"

    def close(self) -> None:
        if self.step is not None:
            try:
                self.step.wait(timeout=END_TIMEOUT_S)
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

    def __init__(self, node_id: str, node: SlurmNode, python: str | None) -> None:
        from pytest_gpubench.targets.ssh.target import SshTarget

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

    def lost_detail(self, task: int) -> str:
        status = self.session.exit_status() if self.session is not None else None
        return "" if status is None else f" (srun exit status {status})"

    def close(self) -> None:
        # Best effort, as SshLaunch's: a connection lost meanwhile must not hide why the point
        # failed.
        try:
            session = self.session
            if session is not None:
                ended = _ended(session, time.monotonic() + END_TIMEOUT_S)
                if not ended and self.pid is not None:
                    # SIGTERM first: srun cancels its step (a SIGKILLed srun can leave it).
                    for signal_name, wait_s in (("-TERM", 10.0), ("-KILL", 0.0)):
                        with contextlib.suppress(GpubenchError):
                            self.target.run(["kill", signal_name, str(self.pid)], timeout_s=10)
                        if _ended(session, time.monotonic() + wait_s):
                            break
                session.close()
            with contextlib.suppress(GpubenchError):
                self.target.run(["rm", "-f", self.plan], timeout_s=10)
        finally:
            self.target.close()


class SshLaunch:
    """K SSH sessions on an ssh node (targets/ssh/, one connection of its own): the plan
    written (mode 600) to the node's work folder, each session one task, its share given on
    its command line. Each session's shell says the task's pid first, so that a task still
    running after the point can be killed."""

    def __init__(self, node_id: str, node: SshNode, python: str | None) -> None:
        from pytest_gpubench.targets.ssh.target import SshTarget

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
            argv = [self.python, "-m", TASK_MODULE, self.plan, str(task), str(tasks)]
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

    def lost_detail(self, task: int) -> str:
        status = self.sessions[task].exit_status() if task < len(self.sessions) else None
        if status is None:
            return ""
        if status == -1:
            return " (its SSH session ended by a signal)"
        if status > 128:
            # The login shell's word for a command a signal ended: 128 + its number.
            try:
                return f" (its SSH session ended: killed by {signal.Signals(status - 128).name})"
            except ValueError:
                pass
        return f" (its SSH session's exit status {status})"

    def close(self) -> None:
        # A connection lost meanwhile must not hide why the point failed: the clean-up is best
        # effort (a task left running fails at its next read of, or write to, its connection to
        # this process, closed by then: at the latest once its share is sent).
        try:
            deadline = time.monotonic() + END_TIMEOUT_S
            for task, session in enumerate(self.sessions):
                pid = self.pids[task] if task < len(self.pids) else None
                if not _ended(session, deadline) and pid is not None:
                    with contextlib.suppress(GpubenchError):
                        self.target.run(["kill", "-KILL", str(pid)], timeout_s=10)
                session.close()
            with contextlib.suppress(GpubenchError):
                self.target.run(["rm", "-f", self.plan], timeout_s=10)
            if self.tunnel is not None:
                self.tunnel.close()
        finally:
            self.target.close()


def _ended(session: SshLineStream, deadline: float) -> bool:
    """Whether an SSH session's command has ended, waiting for it up to `deadline` (monotonic)."""
    while session.exit_status() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return session.exit_status() is not None


def launch_for(profile: LoadProfile, nodes: Any) -> Launch:
    """The launch of `clients:`'s node: an srun step on a Slurm node (from this machine, or
    over SSH from its login node), SSH sessions on an ssh node (config/cell_rules.py has refused
    any other)."""
    assert profile.clients is not None
    node = nodes[profile.clients.node]
    if isinstance(node, SshNode):
        return SshLaunch(profile.clients.node, node, profile.clients.python)
    assert isinstance(node, SlurmNode)
    if node.login is not None:
        return LoginSrunLaunch(profile.clients.node, node, profile.clients.python)
    return SrunLaunch(node, profile.clients.python)


def run_clients(
    target: Target, profile: LoadProfile, pattern: LoadPattern, launch: Launch
) -> ClusterResult:
    """One point sent by the launch's K tasks: listen, start them, wait until all connected
    (or the launch ended first, or CONNECT_TIMEOUT_S), then coordinate (_coordinate)."""
    assert profile.clients is not None
    tasks = profile.clients.tasks
    authkey = secrets.token_bytes(32)
    coordinator = profile.clients.coordinator
    # Through a tunnel the tasks arrive on this machine's loopback, and nowhere else.
    listener = Listener(("127.0.0.1" if coordinator == TUNNEL else "0.0.0.0", 0), authkey=authkey)
    accepted: list[Connection] = []
    try:
        host, port = launch.address(coordinator, listener.address[1])
        plan = pickle.dumps(
            {
                "coordinator": (host, port),
                "authkey": authkey,
                "target": target,
                "profile": profile,
                "pattern": pattern,
            }
        )
        launch.start(plan, tasks)
        threading.Thread(target=accept_tasks, args=(listener, accepted, tasks), daemon=True).start()
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while len(accepted) < tasks:
            ended = launch.ended()
            if ended is not None or time.monotonic() > deadline:
                raise GpubenchError(
                    f"clients: {len(accepted)} of {tasks} client tasks on node "
                    f"'{profile.clients.node}' reached this machine at "
                    + (
                        f"{coordinator}:{port}: "
                        if coordinator != TUNNEL
                        else f"127.0.0.1:{port} on the node (a tunnel back): "
                    )
                    + (ended or f"not within {CONNECT_TIMEOUT_S:g} s")
                )
            time.sleep(0.05)
        # The point's share of time at most, and a margin: a task that hangs cannot hang the
        # session.
        ends_within_s = profile.longest_s + CONNECT_TIMEOUT_S
        try:
            return _coordinate(accepted, tasks, profile.clients.node, launch, ends_within_s)
        except (EOFError, OSError) as exc:
            raise GpubenchError(
                f"clients: a client task on node '{profile.clients.node}' was lost before the "
                f"point started ({type(exc).__name__})"
            ) from None
    finally:
        listener.close()
        for connection in accepted:
            connection.close()
        launch.close()


def accept_tasks(listener: Listener, accepted: list[Connection], tasks: int) -> None:
    """Accept the tasks' connections until there are `tasks` of them or the listener closes; a
    stray connection (a port probe, a wrong key) is not a task and does not stop it, whether it
    ended with a FIN (EOFError) or a reset (ConnectionResetError, BrokenPipeError: an OSError,
    taken before for the listener's closing)."""
    while len(accepted) < tasks:
        try:
            accepted.append(listener.accept())
        except (EOFError, AuthenticationError, ConnectionError):
            continue
        except OSError:
            return  # the listener closed


def _coordinate(
    connections: list[Connection], tasks: int, node: str, launch: Launch, ends_within_s: float
) -> ClusterResult:
    by_task: dict[int, Connection] = {}
    for connection in connections:
        kind, task = connection.recv()
        assert kind == "hello"
        by_task[int(task)] = connection
    offsets_ns: dict[int, float] = {}
    errors_ns: dict[int, float] = {}
    for task, connection in sorted(by_task.items()):
        exchanges = []
        for _ in range(EXCHANGES):
            t0 = time.perf_counter_ns()
            connection.send(("ping",))
            _, t1, t2 = connection.recv()
            exchanges.append((t0, int(t1), int(t2), time.perf_counter_ns()))
        offsets_ns[task], errors_ns[task] = clock_offset(exchanges)
    for connection in by_task.values():
        connection.send(("fill",))
    for task, connection in by_task.items():
        answer = connection.recv() if connection.poll(CONNECT_TIMEOUT_S) else None
        if answer != ("ready",):
            why = answer[1] if isinstance(answer, tuple) and answer[0] == "error" else "no answer"
            raise GpubenchError(
                f"clients: client task {task} of {tasks} on node '{node}' was not ready: {why}"
            )
    started_ns = time.perf_counter_ns() + START_AHEAD_NS
    for task, connection in by_task.items():
        connection.send(("start", started_ns + round(offsets_ns[task])))
    sent: list[Sent] = []
    lost: list[str] = []
    deadline = time.monotonic() + ends_within_s
    for task, connection in sorted(by_task.items()):
        if not wait([connection], timeout=max(0.0, deadline - time.monotonic())):
            lost.append(
                f"client task {task} of {tasks} on node '{node}' sent nothing within "
                f"{ends_within_s:g} s"
            )
            continue
        try:
            kind, value = connection.recv()
        except EOFError:
            time.sleep(0.2)  # the launch's own word on how the task ended comes a moment later
            lost.append(
                f"client task {task} of {tasks} on node '{node}' ended without its requests"
                + launch.lost_detail(task)
            )
            continue
        if kind == "error":
            lost.append(f"client task {task} of {tasks} on node '{node}' failed: {value}")
            continue
        shift = round(offsets_ns[task])
        sent.extend(
            replace(item, scheduled_ns=item.scheduled_ns - shift, sent_ns=item.sent_ns - shift)
            for item in value
        )
    return ClusterResult(
        started_ns,
        sorted(sent, key=lambda item: (item.scheduled_ns, item.process)),
        lost,
        [round(offsets_ns[task] / 1e6, 4) for task in sorted(offsets_ns)],
        [round(errors_ns[task] / 1e6, 4) for task in sorted(errors_ns)],
    )


def task_main(plan_path: str, task_arg: str | None = None, tasks_arg: str | None = None) -> None:
    """One client task (`python -m pytest_gpubench.run.load.client_task PLAN [TASK TASKS]`):
    its share of the point (TASK of TASKS; under srun its SLURM_PROCID of SLURM_NTASKS), sent
    from the barrier time the coordinator gives in this task's clock."""
    import asyncio

    with open(plan_path, "rb") as file:
        plan: dict[str, Any] = pickle.load(file)
    task = int(task_arg if task_arg is not None else os.environ.get("SLURM_PROCID", "0"))
    tasks = int(tasks_arg if tasks_arg is not None else os.environ.get("SLURM_NTASKS", "1"))
    connection = Client(tuple(plan["coordinator"]), authkey=plan["authkey"])
    connection.send(("hello", task))
    profile: LoadProfile = profile_share(plan["profile"], task, tasks)
    pattern = share(plan["pattern"], task, tasks)

    async def main() -> list[Sent]:
        run = LoadRun(plan["target"], profile, task, ramp_seconds(pattern))
        try:
            while True:
                message = connection.recv()
                if message[0] == "ping":
                    received = time.perf_counter_ns()
                    connection.send(("pong", received, time.perf_counter_ns()))
                elif message[0] == "fill":
                    await run.pool.fill(pattern.connections)
                    connection.send(("ready",))
                elif message[0] == "start":
                    run.start(int(message[1]))
                    await wait_until(int(message[1]))
                    await pattern.drive(run)
                    break
        finally:
            await run.close()
        return run.sent

    try:
        connection.send(("sent", asyncio.run(main())))
    except Exception as exc:  # the coordinator turns it into one line
        connection.send(("error", f"{type(exc).__name__}: {exc}"))
    connection.close()
