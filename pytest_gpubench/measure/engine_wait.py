"""The engine's own waiting over one call: how long a local engine's threads waited on a run
queue for a CPU, and how much CPU they got (Linux's schedstat of each thread,
/proc/<pid>/task/<tid>/schedstat: nanoseconds on a CPU, nanoseconds waiting, time slices).

The machine's CPU pressure (measure/control.py) counts any task that waited: a nice-19 compile
beside the engine that barely takes its CPU, the client's own threads, a proxy of the delivery
path that a change slowed. The engine's run-queue wait is the engine's alone: a neighbour that
takes its CPU shows in it, a change of the engine or its path does not (it changes the running,
not the waiting)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pytest_gpubench.core.processes import process_tree

PROC = Path("/proc")


@dataclass(frozen=True)
class SchedMark:
    """The engine's threads' counts at one moment, by (pid, tid): (ns on a CPU, ns waiting), and
    when (s)."""

    threads: dict[tuple[int, int], tuple[int, int]]
    at: float

    @property
    def cpu_ns(self) -> int:
        return sum(cpu for cpu, _ in self.threads.values())

    @property
    def wait_ns(self) -> int:
        return sum(wait for _, wait in self.threads.values())


@dataclass(frozen=True)
class EngineWaiting:
    """Over one call: how long the engine's threads waited for a CPU, and ran, in all (ms), the
    wall time between the marks (ms), and the engine's processes the second mark read."""

    wait_ms: float
    cpu_ms: float
    wall_ms: float
    pids: frozenset[int] = frozenset()

    @property
    def share(self) -> float:
        """The wait as a share of the wall time (over 1 where several threads waited at once)."""
        return self.wait_ms / self.wall_ms if self.wall_ms > 0 else 0.0


class EngineWait:
    """Reads the schedstat of a local process's threads and of its descendants' (vLLM's engine
    core and Ollama's runners do the work in child processes); None where the kernel keeps none
    (no schedstat, the process gone, another machine's process). `children`: False reads the
    process's own threads alone (the harness's: a managed engine is its child)."""

    def __init__(self, pid: int, proc: Path = PROC, *, children: bool = True) -> None:
        self.pid = pid
        self.proc = proc
        self.children = children

    def mark(self) -> SchedMark | None:
        threads: dict[tuple[int, int], tuple[int, int]] = {}
        if not (self.proc / str(self.pid)).is_dir():
            return None
        members = process_tree(self.pid, self.proc) if self.children else {self.pid}
        for member in sorted(members):
            try:
                tasks = list((self.proc / str(member) / "task").iterdir())
            except OSError:
                continue  # ended while we looked
            for task in tasks:
                try:
                    fields = (task / "schedstat").read_text().split()
                    threads[(member, int(task.name))] = (int(fields[0]), int(fields[1]))
                except (OSError, ValueError, IndexError):
                    continue  # a thread that ended between the listing and the read
        if not threads:
            return None
        return SchedMark(threads=threads, at=time.monotonic())

    def since(self, start: SchedMark | None) -> EngineWaiting | None:
        """The waiting since `start`, thread by thread: a thread started since counts whole, a
        thread that ended since took its counts with it (its part is lost, never negative)."""
        if start is None:
            return None
        now = self.mark()
        if now is None:
            return None
        wait = cpu = 0
        for key, (cpu_now, wait_now) in now.threads.items():
            cpu_then, wait_then = start.threads.get(key, (0, 0))
            cpu += max(0, cpu_now - cpu_then)
            wait += max(0, wait_now - wait_then)
        return EngineWaiting(
            wait_ms=wait / 1e6,
            cpu_ms=cpu / 1e6,
            wall_ms=(now.at - start.at) * 1000.0,
            pids=frozenset(pid for pid, _ in now.threads),
        )

    def allowed_cpus(self, pids: Iterable[int] = ()) -> set[int] | None:
        """The CPUs the engine's processes may run on (the union of their affinities); None
        where a process ended while we looked or the kernel does not say. `pids`: the processes
        a mark just read (EngineWaiting.pids), else the engine's process tree is walked."""
        allowed: set[int] = set()
        try:
            for member in pids or process_tree(self.pid, self.proc):
                allowed |= os.sched_getaffinity(member)
        except OSError:
            return None  # a process that ended while we looked
        return allowed or None

    def pinned_cpus(self, allowed: set[int] | None = None) -> str | None:
        """The CPUs the engine's processes may run on, as a CPU list ("0", "0-1,4"), where they
        were pinned narrower than this process's own (`taskset` in the cell's `launch:`); None
        where they may run anywhere this process may, or the kernel does not say. `allowed`:
        allowed_cpus() already read."""
        if allowed is None:
            allowed = self.allowed_cpus()
        if not allowed or allowed >= os.sched_getaffinity(0):
            return None
        return cpu_list(allowed)


def client_wait() -> EngineWait:
    """The reader of the harness's own threads' waiting (this process's, not its children's): a
    client that waited for a CPU stamped the engine's bytes late, and delays what it measures."""
    return EngineWait(os.getpid(), children=False)


def cpu_list(cpus: set[int]) -> str:
    """CPUs as the kernel writes a CPU list: runs of consecutive numbers as ranges ("0-2,5")."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
