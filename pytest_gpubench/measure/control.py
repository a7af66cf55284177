"""The machine's steadiness beside each measured call: the control call, a fixed piece of work
run on one thread before each warm call (and before and after each load point), and two figures
from it: its wall time (`control_ms`), and the CPU pressure (`cpu_pressure`), the share of that
wall time in which the control's thread did not run although it had work to do — its CPU time
against its wall time. On a machine with a core to spare the control runs whole (pressure 0);
when busy neighbours leave no core free it waits as the engine's own threads and the client's
do (two busy processes on two cores: about 0.5). An unchanged engine's calls slow down when the
pressure rises; a slower engine's do not.

One thread, not one per core: a single task's share is what a client thread or an engine's host
thread needs, and it reads 0.000 on a quiet machine, where threads on every core read the
scheduler's every wake-up (measured: 0.24-0.60 on a quiet 2-core machine, and no different with
a busy process beside it). An engine that computes on every core (llama.cpp on CPU with `threads`
= cores) is slowed by one busy neighbour before the control sees it: its own timings show that."""

from __future__ import annotations

import hashlib
import statistics
import time
from dataclasses import dataclass

# The work: a sha256 of 8 MiB, a few milliseconds on one core: longer than the scheduler's time
# slice, so that a busy neighbour shows (a millisecond of work after a sleep runs at once even
# beside one, the scheduler favouring a task that wakes).
_CHUNK = bytes(8 << 20)
# Each control call is the median of this many rounds: one preempted round is the scheduler's
# noise, not the machine's state.
ROUNDS = 3


@dataclass(frozen=True)
class ControlReading:
    """One control call: its wall time in ms, and the share of it its thread waited (0 to 1)."""

    ms: float
    pressure: float


class ControlCall:
    """Runs the control work on the calling thread (hashlib releases the GIL for buffers this
    large: other threads of the process are not held up)."""

    def measure(self) -> ControlReading:
        """The median wall time and the median pressure of ROUNDS rounds."""
        walls, pressures = [], []
        for _ in range(ROUNDS):
            cpu_started, started = time.thread_time(), time.perf_counter()
            hashlib.sha256(_CHUNK).digest()
            wall = time.perf_counter() - started
            cpu = time.thread_time() - cpu_started
            walls.append(wall * 1000.0)
            pressures.append(min(1.0, max(0.0, 1.0 - cpu / wall)) if wall > 0 else 0.0)
        return ControlReading(statistics.median(walls), statistics.median(pressures))

    def close(self) -> None:
        """Nothing to release (kept for the harness's shutdown)."""
