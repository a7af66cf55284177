"""Load patterns: the `LoadPattern` protocol every pattern follows, and the factory that makes
the pattern of a load point (`c<N>` closed loop, `r<rate>` open loop; `sweep` runs several)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pytest_gpubench.config.load_profile import LoadProfile
    from pytest_gpubench.run.load.driver import LoadRun


class LoadPattern(Protocol):
    """How the requests of one load point are sent."""

    @property
    def connections(self) -> int:
        """The kept-alive connections opened before the point's clock starts."""
        ...

    @property
    def offered_rate(self) -> float | None:
        """Requests/s the pattern offers (None: a closed loop offers what the engine takes)."""
        ...

    async def drive(self, run: LoadRun) -> None:
        """Send requests through `run` until its bounds say stop, then wait for the last."""
        ...

    def facts(self) -> dict[str, object]:
        """What the load record says of the pattern: its kind (`pattern`) and its setting."""
        ...


def make_pattern(profile: LoadProfile, point: str) -> LoadPattern:
    """The pattern of a point id of `profile.points` (not `sweep`: load/sweep.py)."""
    from pytest_gpubench.run.load.ramp import ramp_of

    ramp = ramp_of(profile.ramp_s, profile.ramp, profile.ramp_from)
    if point.startswith("c") and point[1:].isdigit():
        from pytest_gpubench.run.load.closed_loop import ClosedLoop

        return ClosedLoop(int(point[1:]), ramp)
    if point.startswith("r") and not point.startswith("trace"):
        from pytest_gpubench.run.load.open_loop import OpenLoop

        return OpenLoop(
            float(point[1:]), profile.arrival, profile.burstiness, profile.seed, ramp=ramp
        )
    if point.startswith("trace-x") and profile.trace is not None:
        from pytest_gpubench.config.traces import read_trace
        from pytest_gpubench.run.load.trace_replay import TraceReplay

        entries = read_trace(profile.trace, "load.trace")
        return TraceReplay(tuple(entry.at_s for entry in entries), float(point[len("trace-x") :]))
    raise ValueError(f"not a load point of a single pattern: {point!r}")


def ramp_seconds(pattern: LoadPattern) -> float:
    """How long the pattern's ramp lasts (0 without one): its requests' window."""
    ramp = getattr(pattern, "ramp", None)
    return float(ramp.seconds) if ramp is not None else 0.0
