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
import os
import statistics
import time
from dataclasses import dataclass
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
# The kernel's CPU time counters since boot, per state, in clock ticks (USER_HZ): the first line
# sums every CPU's; a `cpuN` line per online CPU.
STAT_FILE = Path("/proc/stat")


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


@dataclass(frozen=True)
class CpuTimes:
    """The machine's CPU time counters at one moment, in ms summed over its CPUs: busy (user,
    nice, system, irq, softirq; a guest's time is inside user), stolen by the hypervisor
    (`steal`: a virtual machine's CPU time the host gave to others), and all of it (idle and
    iowait too); and how many CPUs."""

    busy_ms: float
    steal_ms: float
    total_ms: float
    cpus: int


@dataclass(frozen=True)
class Neighbours:
    """Over a window: the share of the machine's CPU time that neither the engine nor this
    process used (`cpu_share`: the neighbours'), and the share the hypervisor stole
    (`steal_share`)."""

    cpu_share: float
    steal_share: float


class MachineCpu:
    """The machine's CPU time over a window, from /proc/stat, with the benchmark's own tasks
    taken out: what the neighbours used, and what a hypervisor stole. None where the kernel
    does not say (not Linux), or the window was shorter than a clock tick on every CPU.

    The CPU pressure (CpuPressure) counts any task that waited, the engine and the client waiting
    for each other too: on an idle 2-core machine it read an engine started by hand and its
    client as a busy machine (issue 43). The CPU time the engine and this process used is theirs;
    what is left of the busy time is the neighbours'. The counters tick at USER_HZ (100 per
    second): over a 100 ms call on 2 CPUs a share is known to about 0.05, and the gate reads the
    p50 over the calls. Steal is what no in-guest pressure sees: a VM's vCPU that did not run."""

    def __init__(self, path: Path = STAT_FILE) -> None:
        self.path = path
        try:
            self.tick_ms = 1000.0 / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            self.tick_ms = 10.0

    def read(self) -> CpuTimes | None:
        try:
            lines = self.path.read_text().splitlines()
            fields = [int(value) for value in lines[0].split()[1:]]
        except (OSError, IndexError, ValueError):
            return None
        if not lines[0].startswith("cpu ") or len(fields) < 8:
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
        cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        tick = self.tick_ms
        busy = user + nice + system + irq + softirq
        return CpuTimes(
            busy_ms=busy * tick,
            steal_ms=steal * tick,
            total_ms=(busy + idle + iowait + steal) * tick,
            cpus=max(cpus, 1),
        )

    def neighbours(
        self, start: CpuTimes | None, own_cpu_ms: float, end: CpuTimes | None = None
    ) -> Neighbours | None:
        """Since `start`: the neighbours' share of the CPU time (the busy time less `own_cpu_ms`,
        the engine's and this process's CPU time over the window, as their schedstat counted
        it), and the stolen share; each between 0 and 1."""
        if start is None:
            return None
        now = end if end is not None else self.read()
        if now is None:
            return None
        total = now.total_ms - start.total_ms
        if total <= 0:
            return None
        others = (now.busy_ms - start.busy_ms) - own_cpu_ms
        stolen = now.steal_ms - start.steal_ms
        return Neighbours(
            cpu_share=min(1.0, max(0.0, others / total)),
            steal_share=min(1.0, max(0.0, stolen / total)),
        )
