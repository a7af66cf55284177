"""The control call: a fixed piece of work timed on this machine before each measured call, whose
time says how much of the machine the engine's neighbours left (measure/stream.py times the call
itself). An unchanged engine's calls slow down when its control does; a slower engine's do not."""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

# The work: a sha256 of 1 MiB on every core at once (hashlib releases the GIL for buffers this
# large), about a millisecond on a laptop core. On every core, because an engine uses them all:
# one busy process beside it shows in the control as it shows in the engine.
_CHUNK = bytes(1 << 20)
# Each control call is the median of this many rounds: one preempted round is the scheduler's
# noise, not the machine's state.
ROUNDS = 3


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
