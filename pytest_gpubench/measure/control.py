"""The machine's steadiness beside each measured call: the control call, a fixed piece of work
timed on one thread before each warm call (`control_ms`: how fast this machine runs a task now),
and the CPU pressure during the call itself (`cpu_pressure`: the share of the call's wall time in
which some task on the machine waited for a CPU, from Linux's pressure-stall information; over a
load point, the point's). An unchanged engine's calls slow down when the pressure rises; a slower
engine's do not.

Measured on 2026-11-25 beside the real llama-server (one thread, a 55 ms prefill) on a 2-core
machine, the median over calls: the pressure during the call read 0.005 on a quiet machine, 0.068
beside one busy process (the engine had the other core: TTFT unchanged) and 0.52 beside two (TTFT
+63 %). Read while a control call kept every core busy it was 0.24-0.60 even on a quiet machine;
and a control call's own wait, read just before the call, missed the two busy processes (the
scheduler had left it a core between the engine's calls)."""

from __future__ import annotations

import hashlib
import statistics
import time
from pathlib import Path

# The work: a sha256 of 8 MiB on one thread, a few milliseconds: longer than a scheduler's time
# slice (a millisecond of work after a sleep runs at once even beside a busy process).
_CHUNK = bytes(8 << 20)
# Each control call is the median of this many rounds: one preempted round is the scheduler's
# noise, not the machine's state.
ROUNDS = 3
# Linux's pressure-stall information for CPUs (kernel 4.20+): `some ... total=<µs>` is how long, in
# all, at least one runnable task waited for a CPU.
PRESSURE_FILE = Path("/proc/pressure/cpu")


class ControlCall:
    """Times the control work on the calling thread (hashlib releases the GIL for buffers this
    large: the process's other threads are not held up)."""

    def measure_ms(self) -> float:
        """The control work's wall time in milliseconds (the median of ROUNDS rounds)."""
        rounds = []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            hashlib.sha256(_CHUNK).digest()
            rounds.append((time.perf_counter() - started) * 1000.0)
        return statistics.median(rounds)


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
