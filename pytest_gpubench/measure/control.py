"""The machine's steadiness beside each measured call: the control call, a fixed piece of work
timed before the call (its time says how much of the machine the engine's neighbours left), and
the CPU pressure while it ran (the share of its wall time in which some task on the machine waited
for a CPU, from Linux's pressure-stall information; over a load point, the point's). An unchanged
engine's calls slow down when the control does and the pressure rises; a slower engine's do not."""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The work: a sha256 of 8 MiB on every core at once (hashlib releases the GIL for buffers this
# large), a few milliseconds per round. Long enough to span several of the scheduler's time slices:
# a millisecond of work after a sleep runs at once even beside a busy process (the scheduler
# favours a task that wakes), and so showed nothing of it. On every core, because an engine uses
# them all: one busy process beside it shows in the control as it shows in the engine.
_CHUNK = bytes(8 << 20)
# Each control call is the median of this many rounds: one preempted round is the scheduler's
# noise, not the machine's state.
ROUNDS = 3
# Linux's pressure-stall information for CPUs (kernel 4.20+): `some ... total=<µs>` is how long, in
# all, at least one runnable task waited for a CPU.
PRESSURE_FILE = Path("/proc/pressure/cpu")


class ControlCall:
    """Times the control work; one pool of threads per session, made on first use."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or os.cpu_count() or 1
        self._pool: ThreadPoolExecutor | None = None

    def measure_ms(self) -> float:
        """The control work's wall time in milliseconds (the median of ROUNDS rounds)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="gpubench-control")
            # The first round starts the threads: not a measurement.
            list(self._pool.map(_work, range(self.workers)))
        rounds = []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            list(self._pool.map(_work, range(self.workers)))
            rounds.append((time.perf_counter() - started) * 1000.0)
        return statistics.median(rounds)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _work(_: int) -> bytes:
    return hashlib.sha256(_CHUNK).digest()


class CpuPressure:
    """The share of a window's wall time in which some task on this machine waited for a CPU;
    None on a machine without pressure-stall information (not Linux, an old kernel, a container
    that hides /proc/pressure)."""

    def __init__(self, path: Path = PRESSURE_FILE) -> None:
        self.path = path

    def start(self) -> tuple[int, float] | None:
        """A window's opening mark: the stall total so far and the clock."""
        stalled = self._stalled_us()
        return None if stalled is None else (stalled, time.perf_counter())

    def share(self, mark: tuple[int, float] | None) -> float | None:
        """The share (0 to 1) of the wall time since `mark` in which some task waited."""
        if mark is None:
            return None
        stalled, wall = self._stalled_us(), time.perf_counter() - mark[1]
        if stalled is None or wall <= 0:
            return None
        return min(1.0, max(0.0, (stalled - mark[0]) / 1e6 / wall))

    def _stalled_us(self) -> int | None:
        try:
            some = self.path.read_text().splitlines()[0]
            return int(some.rsplit("total=", 1)[1].split()[0])
        except (OSError, IndexError, ValueError):
            return None
