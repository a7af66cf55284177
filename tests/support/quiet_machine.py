"""A real-engine test on a machine that will not hold still: wait a bounded time for quiet before
measuring again, and when every attempt moved, fail with the readings under CI (where a skip would
stop testing what the test names without a word) or skip with them elsewhere (a developer's
shared machine)."""

from __future__ import annotations

import os
import time
from typing import NoReturn

import pytest

# How long to wait for quiet before another attempt, and what quiet is: the 1-minute load
# average per CPU the test may use below this.
QUIET_WAIT_S = 30.0
QUIET_LOAD_PER_CPU = 1.0


def load_per_cpu() -> float:
    """The 1-minute load average over the CPUs this process may use."""
    with open("/proc/loadavg", encoding="ascii") as loadavg:
        one_minute = float(loadavg.read().split()[0])
    return one_minute / max(1, len(os.sched_getaffinity(0)))


def wait_for_quiet(limit_s: float = QUIET_WAIT_S, poll_s: float = 1.0) -> str:
    """Wait until the machine is quiet (QUIET_LOAD_PER_CPU) or `limit_s` has passed; the
    reading it ended on, for the test's message."""
    deadline = time.monotonic() + limit_s
    while (load := load_per_cpu()) >= QUIET_LOAD_PER_CPU and time.monotonic() < deadline:
        time.sleep(poll_s)
    state = "quiet" if load < QUIET_LOAD_PER_CPU else f"not quiet after {limit_s:g} s"
    return f"load {load:.2f} per CPU ({state})"


def machine_moved(message: str) -> NoReturn:
    """Every attempt moved: a failure with the readings under CI, a skip with them elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI: a machine that will not hold still fails the test)", False)
    pytest.skip(message)
