"""The engine's own waiting over one call: how long a local engine's threads waited on a run
queue for a CPU, and how much CPU they got (Linux's schedstat of each thread,
/proc/<pid>/task/<tid>/schedstat: nanoseconds on a CPU, nanoseconds waiting, time slices).

The machine's CPU pressure (measure/control.py) counts any task that waited: a nice-19 compile
beside the engine that barely takes its CPU, the client's own threads, a proxy of the delivery
path that a change slowed. The engine's run-queue wait is the engine's alone: a neighbour that
takes its CPU shows in it, a change of the engine or its path does not (it changes the running,
not the waiting)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class SchedMark:
    """The engine's threads' totals at one moment: waited and on a CPU (ns), and when (s)."""

    wait_ns: int
    cpu_ns: int
    at: float


@dataclass(frozen=True)
class EngineWaiting:
    """Over one call: how long the engine's threads waited for a CPU, and ran, in all (ms), and
    the wall time between the marks (ms)."""

    wait_ms: float
    cpu_ms: float
    wall_ms: float

    @property
    def share(self) -> float:
        """The wait as a share of the wall time (over 1 where several threads waited at once)."""
        return self.wait_ms / self.wall_ms if self.wall_ms > 0 else 0.0


class EngineWait:
    """Reads a local process's threads' schedstat; None where the kernel keeps none (no
    schedstat, the process gone, another machine's process)."""

    def __init__(self, pid: int, proc: Path = PROC) -> None:
        self.tasks = proc / str(pid) / "task"

    def mark(self) -> SchedMark | None:
        wait = cpu = 0
        try:
            threads = list(self.tasks.iterdir())
        except OSError:
            return None
        for thread in threads:
            try:
                fields = (thread / "schedstat").read_text().split()
                cpu += int(fields[0])
                wait += int(fields[1])
            except (OSError, ValueError, IndexError):
                continue  # a thread that ended between the listing and the read
        if not threads:
            return None
        return SchedMark(wait_ns=wait, cpu_ns=cpu, at=time.monotonic())

    def since(self, start: SchedMark | None) -> EngineWaiting | None:
        """The waiting since `start` (a thread that ended since took its counts with it: the
        difference is floored at zero)."""
        if start is None:
            return None
        now = self.mark()
        if now is None:
            return None
        return EngineWaiting(
            wait_ms=max(0, now.wait_ns - start.wait_ns) / 1e6,
            cpu_ms=max(0, now.cpu_ns - start.cpu_ns) / 1e6,
            wall_ms=(now.at - start.at) * 1000.0,
        )
