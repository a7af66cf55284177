"""Open loop: requests sent at scheduled times (constant, Poisson or gamma arrivals at a rate),
whether or not earlier ones have ended; a send that is late says so (send lag)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pytest_gpubench.run.load.driver import LoadRun, spin_ns, wait_until
from pytest_gpubench.run.load.ramp import Ramp

# Connections opened ahead: enough for this many seconds of arrivals (more open on demand).
PREOPEN_S = 1.0
PREOPEN_MAX = 256


def arrival_gaps(rate: float, arrival: str, burstiness: float, seed: int) -> Iterator[float]:
    """The seconds between consecutive sends, the same sequence for the same arguments.

    poisson: exponential gaps; gamma: gamma gaps of shape `burstiness` and the same mean 1/rate
    (below 1 burstier than Poisson); constant: 1/rate each."""
    chooser = random.Random(seed)
    while True:
        if arrival == "constant":
            yield 1.0 / rate
        elif arrival == "poisson":
            yield chooser.expovariate(rate)
        else:
            yield chooser.gammavariate(burstiness, 1.0 / (rate * burstiness))


@dataclass(frozen=True)
class OpenLoop:
    rate: float
    arrival: str = "poisson"
    burstiness: float = 1.0
    seed: int = 0
    # The first send, after the point's start (the processes of a constant schedule interleave).
    offset_s: float = 0.0
    # The rate's ramp before the point's own (`ramp_s`), or None.
    ramp: Ramp | None = None

    @property
    def connections(self) -> int:
        return max(1, min(PREOPEN_MAX, int(self.rate * PREOPEN_S) + 1))

    @property
    def offered_rate(self) -> float | None:
        return self.rate

    def facts(self) -> dict[str, object]:
        return {
            "pattern": "open",
            "concurrency": None,
            "rate": self.rate,
            "arrival": self.arrival,
            "burstiness": self.burstiness if self.arrival == "gamma" else None,
            "ramp": self.ramp.facts() if self.ramp is not None else None,
        }

    async def drive(self, run: LoadRun) -> None:
        await send_on_schedule(run, self._due_ns(run.started_ns), spin_ns(self.rate))

    def _due_ns(self, started_ns: int) -> Iterator[int]:
        if self.ramp is not None:
            yield from (started_ns + int(at_s * 1e9) for at_s in self.ramped_s())
            return
        # The first request goes out at the start; each later one a gap after the one before.
        gaps = arrival_gaps(self.rate, self.arrival, self.burstiness, self.seed)
        due_ns = started_ns + int(self.offset_s * 1e9)
        while True:
            yield due_ns
            due_ns += int(next(gaps) * 1e9)

    def ramped_s(self) -> Iterator[float]:
        """The sends of a ramped point, in s from its start: the arrivals of rate 1 (the same
        seeded gaps), each sent when the ramped rate's expected arrivals reach it (a time
        change: Poisson arrivals stay Poisson, of the ramped rate)."""
        assert self.ramp is not None
        gaps = arrival_gaps(1.0, self.arrival, self.burstiness, self.seed)
        arrivals = self.offset_s * self.rate
        while True:
            yield self.ramp.time_of(self.rate, arrivals)
            arrivals += next(gaps)


async def send_on_schedule(run: LoadRun, due_ns: Iterable[int], spin: int) -> None:
    """Each request sent at its due time, whether or not the ones before have answered (the
    open loop's arrivals, a trace's timestamps), until the point's bounds end; then the ones
    still in flight are awaited."""
    in_flight: set[asyncio.Task[None]] = set()
    for due in due_ns:
        await wait_until(due, spin)
        window = run.bounds.window(due)
        if window is None:
            break
        task = asyncio.create_task(run.send(due, window))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.gather(*in_flight)
