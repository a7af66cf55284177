"""A load point sent by K clients, with one coordinator: `processes: N` client processes on
this machine, or `clients: {node, tasks}` client tasks on a node of cells.yaml (an `srun` step
of K tasks on a Slurm node, or K SSH sessions on an ssh node). They differ only in how the plan
reaches them and they start (a `targets.Launch`: `launch_here`, or the node kind's). This
process coordinates: it listens for the tasks (multiprocessing's authenticated connections),
measures each task's clock offset to its own by timestamp exchanges (not for processes of this
machine: they read its clock), starts them at one barrier time, and merges their requests raw
into its own clock; a task that ends without its requests is a lost client (the point is then
invalid, run/load/runner.py). Each client sends its share: its streams of a closed loop, or
rate/N of an open loop."""

from __future__ import annotations

import asyncio
import os
import pickle
import secrets
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

from pytest_gpubench.config.load_profile import TUNNEL, LoadProfile
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.run.load import LoadPattern, ramp_seconds
from pytest_gpubench.run.load.closed_loop import ClosedLoop
from pytest_gpubench.run.load.driver import LoadRun, Sent, Target, wait_until
from pytest_gpubench.run.load.open_loop import OpenLoop
from pytest_gpubench.targets import Launch

# The start is set this far ahead of the moment every task said it was ready.
START_AHEAD_NS = 200_000_000
# How long the tasks may take to start and connect (spawn, srun, ssh, Python's imports), then to
# be ready.
CONNECT_TIMEOUT_S = 120.0
# Timestamp exchanges per task; the one with the smallest round trip gives the offset.
EXCHANGES = 8


@dataclass(frozen=True)
class ClusterResult:
    """What the tasks sent, in this process's clock, and what became of them."""

    started_ns: int
    sent: list[Sent]
    lost: list[str]
    # Per task (by SLURM_PROCID): its clock minus ours, and the bound on that offset's error
    # (half the exchange's round trip), in ms (0 for processes of this machine).
    offsets_ms: list[float]
    offset_errors_ms: list[float]


@dataclass(frozen=True)
class Clients:
    """A point's clients as a reason names them: the profile's key, how many, and each one."""

    key: str
    tasks: int
    noun: str
    where: str = ""

    @staticmethod
    def of(profile: LoadProfile) -> Clients:
        if profile.clients is None:
            return Clients("processes", profile.processes, "client process")
        node = profile.clients.node
        return Clients("clients", profile.clients.tasks, "client task", f" on node '{node}'")

    def name(self, task: int) -> str:
        return f"{self.noun} {task} of {self.tasks}{self.where}"

    def names(self) -> dict[int, str]:
        return {task: self.name(task) for task in range(self.tasks)}


def share(pattern: LoadPattern, process: int, processes: int) -> LoadPattern:
    """What one client sends: its streams of a closed loop (spread as evenly as they go), or
    rate/N of an open loop (Poisson and gamma with a seed of its own: N independent Poisson
    arrivals at rate/N are one Poisson at the rate; constant ones interleave)."""
    if isinstance(pattern, ClosedLoop):
        base, extra = divmod(pattern.concurrency, processes)
        return ClosedLoop(base + (1 if process < extra else 0), pattern.ramp)
    if isinstance(pattern, OpenLoop):
        rate = pattern.rate / processes
        return replace(
            pattern,
            rate=rate,
            seed=pattern.seed * 1000 + process,
            offset_s=process / pattern.rate if pattern.arrival == "constant" else 0.0,
        )
    raise GpubenchError(f"processes: cannot split a {type(pattern).__name__} load")


def profile_share(profile: LoadProfile, process: int, processes: int) -> LoadProfile:
    """One client's profile: its share of `requests` (spread as evenly as they go)."""
    if profile.requests is None:
        return profile
    base, extra = divmod(profile.requests, processes)
    return profile.model_copy(update={"requests": max(1, base + (1 if process < extra else 0))})


def clock_offset(exchanges: list[tuple[int, int, int, int]]) -> tuple[float, float]:
    """(offset ns, error bound ns) from NTP's four timestamps per exchange (ours at send t0,
    theirs at receipt t1 and reply t2, ours at receipt t3): the exchange with the smallest round
    trip (t3 - t0) - (t2 - t1) gives ((t1 - t0) + (t2 - t3)) / 2, right within half that trip."""
    t0, t1, t2, t3 = min(exchanges, key=lambda e: (e[3] - e[0]) - (e[2] - e[1]))
    return ((t1 - t0) + (t2 - t3)) / 2.0, ((t3 - t0) - (t2 - t1)) / 2.0


def run_clients(
    target: Target, profile: LoadProfile, pattern: LoadPattern, launch: Launch
) -> ClusterResult:
    """One point sent by the launch's K tasks: listen, start them, wait until all connected
    (or the launch ended first, or CONNECT_TIMEOUT_S), then coordinate (_coordinate)."""
    clients = Clients.of(profile)
    tasks = clients.tasks
    share(pattern, 0, tasks)  # a load that cannot be split is one line here, not a lost task
    authkey = secrets.token_bytes(32)
    coordinator = profile.clients.coordinator if profile.clients is not None else "127.0.0.1"
    # Through a tunnel (or to this machine's own address) the tasks arrive on this machine's
    # loopback, and nowhere else.
    local = coordinator in (TUNNEL, "127.0.0.1")
    listener = Listener(("127.0.0.1" if local else "0.0.0.0", 0), authkey=authkey)
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
                    f"{clients.key}: {len(accepted)} of {tasks} {clients.noun}s{clients.where}"
                    " reached this machine at "
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
            return _coordinate(accepted, clients, launch, ends_within_s)
        except (EOFError, OSError) as exc:
            raise GpubenchError(
                f"{clients.key}: a {clients.noun}{clients.where} was lost before the point "
                f"started ({type(exc).__name__})"
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
    connections: list[Connection], clients: Clients, launch: Launch, ends_within_s: float
) -> ClusterResult:
    by_task: dict[int, Connection] = {}
    for connection in connections:
        kind, task = connection.recv()
        assert kind == "hello"
        by_task[int(task)] = connection
    offsets_ns: dict[int, float] = dict.fromkeys(by_task, 0.0)
    errors_ns: dict[int, float] = dict.fromkeys(by_task, 0.0)
    for task, connection in sorted(by_task.items()):
        exchanges = []
        for _ in range(0 if launch.shares_clock else EXCHANGES):
            t0 = time.perf_counter_ns()
            connection.send(("ping",))
            _, t1, t2 = connection.recv()
            exchanges.append((t0, int(t1), int(t2), time.perf_counter_ns()))
        if exchanges:
            offsets_ns[task], errors_ns[task] = clock_offset(exchanges)
    for connection in by_task.values():
        connection.send(("fill",))
    for task, connection in by_task.items():
        answer = connection.recv() if connection.poll(CONNECT_TIMEOUT_S) else None
        if answer != ("ready",):
            why = answer[1] if isinstance(answer, tuple) and answer[0] == "error" else "no answer"
            raise GpubenchError(f"{clients.key}: {clients.name(task)} was not ready: {why}")
    started_ns = time.perf_counter_ns() + START_AHEAD_NS
    for task, connection in by_task.items():
        connection.send(("start", started_ns + round(offsets_ns[task])))
    sent: list[Sent] = []
    lost: list[str] = []
    deadline = time.monotonic() + ends_within_s
    for task, connection in sorted(by_task.items()):
        if not wait([connection], timeout=max(0.0, deadline - time.monotonic())):
            lost.append(f"{clients.name(task)} sent nothing within {ends_within_s:g} s")
            continue
        try:
            kind, value = connection.recv()
        except EOFError:
            time.sleep(0.2)  # the launch's own word on how the task ended comes a moment later
            lost.append(f"{clients.name(task)} {launch.how_lost(task)}")
            continue
        if kind == "error":
            lost.append(f"{clients.name(task)} failed: {value}")
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
