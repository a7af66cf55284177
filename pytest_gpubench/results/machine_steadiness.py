"""The machine's steadiness while a (cell, prompt) ran, read from its summary, its baseline's and
the baseline's runs (pure): the control call, the CPU pressure (the engine's own wait, the other
processes' share, or the machine's), the client's wait, steal and the GPU's own signals, for the
decision core (results/steadiness.Steadiness): `steadiness` from the samples, `machine_steadiness`
from the summaries."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from pytest_gpubench.config.metrics import CLOCK_EVENTS
from pytest_gpubench.results.decision import ALPHA, MIN_HISTORY, mwu_method, scipy_stats
from pytest_gpubench.results.run_history import (
    History,
    control_figures,
    engine_wait_figures,
    neighbour_figures,
    pressure_figures,
)
from pytest_gpubench.results.stats import PromptSummary
from pytest_gpubench.results.steadiness import (
    DEFAULT_STEADY_FLOOR,
    STEADY_FLOOR_MIN,
    PressureSource,
    Steadiness,
)


def steadiness(
    control: Sequence[float],
    baseline_control: Sequence[float],
    control_history: Sequence[float] = (),
    *,
    pressure: Sequence[float] = (),
    baseline_pressure: Sequence[float] = (),
    runs_pressure: Sequence[float] = (),
    pressure_source: PressureSource = "machine",
    client_wait: Sequence[float] = (),
    steal: Sequence[float] = (),
    gpu: str | None = None,
    neighbours: float | None = None,
) -> Steadiness | None:
    """The control's movement: this run's control samples (in call order) against the baseline's
    (the geometric mean of its history's p50s when it has MIN_HISTORY runs, else the baseline
    run's samples), and its later half against its earlier half. A movement counts only when it
    is beyond the floor and also significant on the control's own samples (two-sided
    Mann-Whitney U): one slow control call is the scheduler's noise, not a drift. The CPU
    pressure's p50 against the baseline's (`baseline_pressure`: its runs' p50s, or its run's
    samples), and its halves when they differ significantly; `runs_pressure`: the p50 of each
    run in the baseline's history (its busiest run counts). `pressure_source`: what those
    readings are (Steadiness.pressure_source); `client_wait`: the harness's own threads' wait
    per ms they ran, per call; `steal`: the share of the CPUs' time a hypervisor stole, per
    call; `gpu`: what the GPU's signals showed (Steadiness.gpu); `neighbours`: the other
    processes' busiest CPU share (Steadiness.neighbours). None when this run has neither control
    nor pressure."""
    if not control and not pressure:
        return None
    against: float | None = None
    within: float | None = None
    floor = DEFAULT_STEADY_FLOOR
    if control:
        now = statistics.median(control)
        history = [value for value in control_history if value > 0]
        if len(history) >= MIN_HISTORY:
            spread = statistics.stdev(math.log(v) for v in history)
            floor = max(STEADY_FLOOR_MIN, 3.0 * spread)
            against = now / math.exp(statistics.fmean(math.log(v) for v in history))
        elif baseline_control and _differ(control, baseline_control):
            against = now / statistics.median(baseline_control)
        half = len(control) // 2
        if half >= 3 and _differ(control[half:], control[:half]):
            within = statistics.median(control[half:]) / statistics.median(control[:half])
    halves: tuple[float, float] | None = None
    half = len(pressure) // 2
    if half >= 3 and _differ(pressure[half:], pressure[:half]):
        halves = (statistics.median(pressure[:half]), statistics.median(pressure[half:]))
    return Steadiness(
        against,
        within,
        floor,
        pressure=statistics.median(pressure) if pressure else None,
        baseline_pressure=statistics.median(baseline_pressure) if baseline_pressure else None,
        pressure_halves=halves,
        baseline_pressure_max=max(runs_pressure) if runs_pressure else None,
        pressure_source=pressure_source,
        client_wait=statistics.median(client_wait) if client_wait else None,
        steal=statistics.median(steal) if steal else None,
        gpu=gpu,
        neighbours=neighbours,
    )


def _differ(first: Sequence[float], second: Sequence[float]) -> bool:
    """Whether two sets of control samples differ significantly (two-sided)."""
    if min(len(first), len(second)) < 3:
        return False
    method = mwu_method(len(first), len(second))
    result = scipy_stats().mannwhitneyu(first, second, alternative="two-sided", method=method)
    return bool(result.pvalue < ALPHA)


def machine_steadiness(
    current: PromptSummary, baseline: PromptSummary, history: History = ()
) -> Steadiness | None:
    """The control call's movement and the CPU pressure while this (cell, prompt) ran: against
    the baseline's runs, and within this run; None when this run checked neither. Where this
    run and the baseline both read a local engine's own wait (per ms of its CPU), that wait is
    the pressure: the machine's counts the client, a proxy of the path and neighbours that take
    nothing from the engine. Where not, and both read the machine's CPU time, the other
    processes' share of it (the engine's and the client's own taken out) is the pressure; else
    the machine's pressure, as runs before either was measured. The harness's own threads' wait
    (the client's) and a hypervisor's steal count beside each: either past the limit made the
    machine busy too."""
    engine_runs = engine_wait_figures(history)
    engine_now = current.samples["engine_wait_per_cpu"]
    engine_then = engine_runs or baseline.samples["engine_wait_per_cpu"]
    neighbour_runs = neighbour_figures(history)
    neighbours_now = current.samples["neighbour_cpu_share"]
    neighbours_then = neighbour_runs or baseline.samples["neighbour_cpu_share"]
    source: PressureSource = "machine"
    if engine_now and engine_then:
        source, now, then, runs = "engine", engine_now, engine_then, engine_runs
    elif neighbours_now and neighbours_then:
        source, now, then, runs = "neighbours", neighbours_now, neighbours_then, neighbour_runs
    else:
        runs = pressure_figures(history)
        now, then = current.samples["cpu_pressure"], runs or baseline.samples["cpu_pressure"]
    return steadiness(
        current.samples["control_ms"],
        baseline.samples["control_ms"],
        control_figures(history),
        pressure=now,
        baseline_pressure=then,
        runs_pressure=runs,
        pressure_source=source,
        client_wait=current.samples["client_wait_per_cpu"],
        steal=current.samples["steal_share"],
        gpu=gpu_signals(current, baseline),
        neighbours=(
            None
            if source == "machine"
            else busiest_neighbours(neighbours_now, neighbours_then, neighbour_runs)
        ),
    )


def busiest_neighbours(
    now: Sequence[float], then: Sequence[float], runs: Sequence[float]
) -> float | None:
    """The other processes' busiest CPU share (p50) of this run, the baseline's run and its
    history's runs; None unless this run and the baseline both read it."""
    if not now or not then:
        return None
    return max(statistics.median(now), statistics.median(then), *runs)


def gpu_signals(current: PromptSummary, baseline: PromptSummary) -> str | None:
    """What the GPU's own signals (NVML, beside each call) showed that no CPU reading sees:
    another compute process on the GPU during this run's calls, and clocks held down (thermal,
    power cap, a hardware slowdown) by reasons the baseline's calls did not show (a GPU at its
    power cap under every run's load is the same GPU); None where neither, or not read."""
    reasons = []
    others = current.samples["gpu_other_processes"]
    shared = sum(1 for count in others if count > 0)
    if shared:
        reasons.append(
            f"another process ran on the GPU during {shared} of {len(others)} calls "
            f"(up to {max(others):.0f} besides the engine's)"
        )
    events = current.samples["gpu_clock_events"]
    then = 0
    for bits in baseline.samples["gpu_clock_events"]:
        then |= int(bits)
    held = {
        name: sum(1 for bits in events if int(bits) & bit)
        for bit, name in CLOCK_EVENTS.items()
        if not then & bit
    }
    named = [f"{name} in {count} of {len(events)} calls" for name, count in held.items() if count]
    if named:
        reasons.append(
            f"the GPU's clocks were held down ({', '.join(named)}), unlike the baseline's"
        )
    return "; ".join(reasons) if reasons else None
