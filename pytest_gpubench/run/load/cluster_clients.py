"""`clients: {node, tasks}`: one load point sent by K client tasks of an `srun` step on a Slurm
node. This process coordinates: it listens for the tasks (multiprocessing's authenticated
connections), measures each task's clock offset to its own by timestamp exchanges, starts them at
one barrier time, and merges their requests raw into its own clock; a task that ends without
its requests is a lost client (the point is then invalid, run/load/runner.py)."""

from __future__ import annotations

import os
import pickle
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any

from pytest_gpubench.config.load_profile import LoadProfile
from pytest_gpubench.config.nodes import SlurmNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.run.load import LoadPattern, ramp_seconds
from pytest_gpubench.run.load.driver import LoadRun, Sent, Target, wait_until
from pytest_gpubench.run.load.processes import profile_share, share

# The start is set this far ahead of the moment every task said it was ready.
START_AHEAD_NS = 200_000_000
# How long the tasks may take to start and connect (srun, Python's imports), then to be ready.
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
    # (half the exchange's round trip), in ms.
    offsets_ms: list[float]
    offset_errors_ms: list[float]


def clock_offset(exchanges: list[tuple[int, int, int, int]]) -> tuple[float, float]:
    """(offset ns, error bound ns) from NTP's four timestamps per exchange (ours at send t0,
    theirs at receipt t1 and reply t2, ours at receipt t3): the exchange with the smallest round
    trip (t3 - t0) - (t2 - t1) gives ((t1 - t0) + (t2 - t3)) / 2, right within half that trip."""
    t0, t1, t2, t3 = min(exchanges, key=lambda e: (e[3] - e[0]) - (e[2] - e[1]))
    return ((t1 - t0) + (t2 - t3)) / 2.0, ((t3 - t0) - (t2 - t1)) / 2.0


def srun_argv(node: SlurmNode, tasks: int, plan: Path) -> list[str]:
    """The step: K tasks on one node of the node's partition, each this Python on the plan."""
    argv = ["srun", f"--ntasks={tasks}", "--nodes=1", "--kill-on-bad-exit=0"]
    if node.partition:
        argv.append(f"--partition={node.partition}")
    if node.time_limit:
        argv.append(f"--time={node.time_limit}")
    if node.account:
        argv.append(f"--account={node.account}")
    if node.qos:
        argv.append(f"--qos={node.qos}")
    return [*argv, sys.executable, "-m", "pytest_gpubench.run.load.client_task", str(plan)]


def run_on_cluster(
    target: Target,
    profile: LoadProfile,
    pattern: LoadPattern,
    node: SlurmNode,
) -> ClusterResult:
    assert profile.clients is not None
    tasks = profile.clients.tasks
    authkey = secrets.token_bytes(32)
    listener = Listener(("0.0.0.0", 0), authkey=authkey)
    port = listener.address[1]
    work_dir = Path(node.work_dir) if node.work_dir else Path(tempfile.gettempdir())
    work_dir.mkdir(parents=True, exist_ok=True)
    plan = work_dir / f"gpubench-load-plan-{secrets.token_hex(6)}.pkl"
    # The plan holds the connection's key (and the cell's headers): readable by its owner only.
    descriptor = os.open(plan, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        pickle.dump(
            {
                "coordinator": (profile.clients.coordinator, port),
                "authkey": authkey,
                "target": target,
                "profile": profile,
                "pattern": pattern,
            },
            file,
        )
    env = {**os.environ, **({"SLURM_CONF": node.slurm_conf} if node.slurm_conf else {})}
    step = subprocess.Popen(
        srun_argv(node, tasks, plan),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    accepted: list[Connection] = []

    def accept() -> None:
        while len(accepted) < tasks:
            try:
                accepted.append(listener.accept())
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while len(accepted) < tasks:
            if step.poll() is not None or time.monotonic() > deadline:
                said = (step.stderr.read() if step.stderr else "").strip()[-300:]
                why = (
                    f"srun ended ({step.returncode}): {said}"
                    if step.returncode is not None
                    else f"not within {CONNECT_TIMEOUT_S:g} s"
                )
                raise GpubenchError(
                    f"clients: {len(accepted)} of {tasks} client tasks on node "
                    f"'{profile.clients.node}' reached this machine at "
                    f"{profile.clients.coordinator}:{port}: {why}"
                )
            time.sleep(0.05)
        return _coordinate(accepted, tasks, profile.clients.node, step)
    finally:
        listener.close()
        for connection in accepted:
            connection.close()
        try:
            step.wait(timeout=30)
        except subprocess.TimeoutExpired:
            step.kill()
            step.wait()
        plan.unlink(missing_ok=True)


def _coordinate(
    connections: list[Connection], tasks: int, node: str, step: subprocess.Popen[str]
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
    for task, connection in sorted(by_task.items()):
        wait([connection])
        try:
            kind, value = connection.recv()
        except EOFError:
            step.poll()
            lost.append(
                f"client task {task} of {tasks} on node '{node}' ended without its requests"
                + (f" (srun exit status {step.returncode})" if step.returncode is not None else "")
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


def task_main(plan_path: str) -> None:
    """One client task (`python -m pytest_gpubench.run.load.client_task PLAN`): its share of
    the point, sent from the barrier time the coordinator gives in this task's clock."""
    import asyncio

    with open(plan_path, "rb") as file:
        plan: dict[str, Any] = pickle.load(file)
    task = int(os.environ.get("SLURM_PROCID", "0"))
    tasks = int(os.environ.get("SLURM_NTASKS", "1"))
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
