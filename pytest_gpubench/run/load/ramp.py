"""A load point's ramp (`ramp_s`): its rate or concurrency rising from a share of the point's
own to all of it, linearly or exponentially, before the measured window; its requests are sent
in the `ramp` window and left out of the figures. Pure: the schedule only."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pytest_gpubench.ledger.load_figures import RampFacts

SHAPES = ("linear", "exponential")
# Where a ramp starts, as a share of the point's rate or concurrency, when `ramp_from` is not
# given: nothing for a linear one; an exponential one cannot start at nothing.
DEFAULT_FROM = {"linear": 0.0, "exponential": 0.05}


@dataclass(frozen=True)
class Ramp:
    seconds: float
    shape: str = "linear"
    # The share of the point's rate (concurrency) at the ramp's start, below 1.
    start_share: float = 0.0

    def level(self, at_s: float) -> float:
        """The share of the point's rate (concurrency) at `at_s` seconds into the point."""
        if at_s >= self.seconds:
            return 1.0
        at_s = max(0.0, at_s)
        if self.shape == "linear":
            return self.start_share + (1.0 - self.start_share) * at_s / self.seconds
        return float(self.start_share ** (1.0 - at_s / self.seconds))

    def arrivals_by(self, rate: float, at_s: float) -> float:
        """The expected arrivals by `at_s` at a point of `rate` req/s ramped: the integral of
        rate x level."""
        ramp_s, share = self.seconds, self.start_share
        during = min(at_s, ramp_s)
        if self.shape == "linear":
            ramped = rate * (share * during + (1.0 - share) * during**2 / (2.0 * ramp_s))
        else:
            growth = math.log(1.0 / share)
            ramped = rate * share * ramp_s / growth * (math.exp(growth * during / ramp_s) - 1.0)
        return ramped + rate * max(0.0, at_s - ramp_s)

    def time_of(self, rate: float, arrivals: float) -> float:
        """When the expected arrivals reach `arrivals` (the inverse of arrivals_by): an
        arrival schedule of rate 1 sent at these times is the ramped one (a Poisson one stays
        Poisson, of the ramped rate)."""
        ramp_s, share = self.seconds, self.start_share
        in_ramp = self.arrivals_by(rate, ramp_s)
        if arrivals >= in_ramp:
            return ramp_s + (arrivals - in_ramp) / rate
        if arrivals <= 0:
            return 0.0
        if self.shape == "linear":
            a = rate * (1.0 - share) / (2.0 * ramp_s)
            b = rate * share
            return (-b + math.sqrt(b * b + 4.0 * a * arrivals)) / (2.0 * a)
        growth = math.log(1.0 / share)
        return ramp_s / growth * math.log(1.0 + arrivals * growth / (rate * share * ramp_s))

    def stream_starts_s(self, streams: int) -> list[float]:
        """When each stream of a closed loop of `streams` starts: stream j (0-based) once the
        level reaches j / streams (the first at once, all of them before the ramp ends)."""
        return [self._time_at_level(j / streams) for j in range(streams)]

    def _time_at_level(self, level: float) -> float:
        if level <= self.start_share:
            return 0.0
        if self.shape == "linear":
            return self.seconds * (level - self.start_share) / (1.0 - self.start_share)
        return self.seconds * (1.0 - math.log(level) / math.log(self.start_share))

    def facts(self) -> RampFacts:
        """What the load record says of the ramp."""
        return {"ramp_s": self.seconds, "shape": self.shape, "from": self.start_share}


def ramp_of(ramp_s: float | None, shape: str, ramp_from: float | None) -> Ramp | None:
    """The profile's ramp (None without `ramp_s`)."""
    if ramp_s is None:
        return None
    share = DEFAULT_FROM[shape] if ramp_from is None else ramp_from
    return Ramp(ramp_s, shape, share)
