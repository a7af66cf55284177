"""Trace replay: each request of a trace sent at its own time from the point's start (its
arrival in the trace over the speed-up), whether or not earlier ones have ended; a send that is
late says so (send lag), as in the open loop."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_gpubench.run.load.driver import LoadRun, spin_ns
from pytest_gpubench.run.load.open_loop import PREOPEN_MAX, send_on_schedule


@dataclass(frozen=True)
class TraceReplay:
    # Each request's arrival, seconds after the first, at 1x.
    arrivals_s: tuple[float, ...]
    speedup: float = 1.0

    @property
    def span_s(self) -> float:
        return (self.arrivals_s[-1] - self.arrivals_s[0]) / self.speedup if self.arrivals_s else 0.0

    @property
    def connections(self) -> int:
        """Enough for the busiest second of the replay (more open on demand)."""
        busiest, first = 0, 0
        for last, at in enumerate(self.arrivals_s):
            while (at - self.arrivals_s[first]) / self.speedup > 1.0:
                first += 1
            busiest = max(busiest, last - first + 1)
        return max(1, min(PREOPEN_MAX, busiest))

    @property
    def offered_rate(self) -> float | None:
        """The replay's mean rate (requests/s); its send lag is judged as an open loop's."""
        if len(self.arrivals_s) < 2 or self.span_s <= 0:
            return None
        return (len(self.arrivals_s) - 1) / self.span_s

    def facts(self) -> dict[str, object]:
        return {
            "pattern": "trace",
            "concurrency": None,
            "rate": self.offered_rate,
            "speedup": self.speedup,
            "trace_requests": len(self.arrivals_s),
            "trace_span_s": round(self.span_s, 4),
        }

    async def drive(self, run: LoadRun) -> None:
        first = self.arrivals_s[0] if self.arrivals_s else 0.0
        due_ns = (run.started_ns + int((at - first) / self.speedup * 1e9) for at in self.arrivals_s)
        await send_on_schedule(run, due_ns, spin_ns(self.offered_rate or 1.0))
