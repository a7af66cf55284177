"""The sweep: one request at a time, then as fast as the engine takes (a closed loop at
`max_concurrency`), then k open-loop rates evenly between the two (or up to `up_to` times the
second); the saturation point is the highest rate that met the SLO (without one: that the engine
kept up with). The rates stop rising at the first one whose TTFT and requests in flight both
rose within it (results/load_over_time.saturation_trend): the higher ones are not run, and the
time they would have taken is kept."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pytest_gpubench.config.load_profile import LoadProfile, rate_text
from pytest_gpubench.run.load import LoadPattern
from pytest_gpubench.run.load.closed_loop import ClosedLoop
from pytest_gpubench.run.load.open_loop import OpenLoop

# Without an SLO, a rate is served when the engine completed at least this share of it.
KEPT_UP = 0.9

# Runs one step (its point id, its pattern, its place in the sweep) and returns its summary
# (results/load_summary.py).
StepRunner = Callable[[str, LoadPattern, str], Awaitable[Mapping[str, Any]]]


async def run_sweep(profile: LoadProfile, run_step: StepRunner) -> dict[str, Any]:
    """Run every step; the sweep's own facts: its steps and its saturation point."""
    assert profile.sweep is not None
    steps: list[tuple[str, LoadPattern, Mapping[str, Any]]] = []
    top = profile.sweep.max_concurrency
    first: tuple[tuple[str, LoadPattern], ...] = (
        ("c1", ClosedLoop(1)),
        (f"c{top}", ClosedLoop(top)),
    )
    for step, pattern in first:
        point = f"sweep-{step}"
        steps.append((point, pattern, await run_step(point, pattern, step)))
    low = steps[0][2].get("achieved_rate") or 0.0
    high = steps[1][2].get("achieved_rate") or 0.0
    k = profile.sweep.rates
    top_rate = high * profile.sweep.up_to
    stop: dict[str, Any] | None = None
    skipped: list[str] = []
    for i in range(1, k + 1):
        rate = round(low + (top_rate - low) * i / (k + 1), 3)
        if rate <= 0:
            continue
        if stop is not None:
            skipped.append(f"s{i}")
            stop["time_kept_s"] = round(stop["time_kept_s"] + step_time_s(profile, rate), 3)
            continue
        open_loop = OpenLoop(rate, profile.arrival, profile.burstiness, profile.seed)
        point = f"sweep-r{rate_text(rate)}"
        # Its place (`s<i>`: the i-th rate between the two closed loops), not its rate, names
        # it to the gate: the rates move with the engine's speed from run to run.
        summary = await run_step(point, open_loop, f"s{i}")
        steps.append((point, open_loop, summary))
        trend = summary.get("trend")
        if isinstance(trend, Mapping) and trend.get("saturated"):
            stop = {"load_point": point, "sweep_step": f"s{i}", "rate": rate, **trend,
                    "time_kept_s": 0.0}  # fmt: skip
    if stop is not None:
        stop["skipped"] = skipped
    return {
        "steps": [_step_row(point, pattern, summary) for point, pattern, summary in steps],
        "saturation_rate": saturation_rate(
            [(pattern.offered_rate, summary) for _, pattern, summary in steps]
        ),
        # The rate at which the engine over-saturated, and what was not run above it.
        "saturation_stop": stop,
    }


def step_time_s(profile: LoadProfile, rate: float) -> float:
    """How long an open-loop step at `rate` would run: its windows, or (bounded by requests
    alone) its requests at that rate."""
    measured = profile.duration_s
    if measured is None and profile.requests is not None:
        measured = profile.requests / rate
    return profile.warmup_s + (measured or 0.0) + profile.cooldown_s


def _step_row(point: str, pattern: LoadPattern, summary: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("achieved_rate", "output_tokens_per_sec", "ttft_ms_p99", "tpot_ms_p99", "meets_slo")
    trend = summary.get("trend")
    return {
        "load_point": point,
        "offered_rate": pattern.offered_rate,
        **{key: summary.get(key) for key in keys},
        "valid": summary.get("valid"),
        "saturated": trend.get("saturated") if isinstance(trend, Mapping) else None,
    }


def saturation_rate(steps: list[tuple[float | None, Mapping[str, Any]]]) -> float | None:
    """The highest achieved rate of a valid step that met the SLO, or without an SLO of one
    whose engine kept up with what was offered (a closed loop always does)."""
    served = []
    for offered, summary in steps:
        achieved = summary.get("achieved_rate")
        if not summary.get("valid") or achieved is None:
            continue
        if summary.get("meets_slo") is False:
            continue
        if (
            summary.get("meets_slo") is None
            and offered is not None
            and achieved < KEPT_UP * offered
        ):
            continue
        served.append(float(achieved))
    return max(served) if served else None
