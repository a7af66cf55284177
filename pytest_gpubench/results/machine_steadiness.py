"""The machine's steadiness while a (cell, prompt) ran, read from its summary, its baseline's and
the baseline's runs (pure): the control call, the CPU pressure (the engine's own wait, the other
processes' share, or the machine's), the client's wait, steal and the GPU's own signals, for the
decision core (results/decision.steadiness)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pytest_gpubench.config.metrics import CLOCK_EVENTS
from pytest_gpubench.results.decision import PressureSource, Steadiness, steadiness
from pytest_gpubench.results.run_history import (
    History,
    control_figures,
    engine_wait_figures,
    neighbour_figures,
    pressure_figures,
)
from pytest_gpubench.results.stats import PromptSummary


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
