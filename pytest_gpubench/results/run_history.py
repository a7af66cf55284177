"""A baseline's between-run history (pure): the figures of the last ratified runs of one (cell,
prompt), oldest first, from which the gate learns how far an unchanged engine moves between runs."""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pytest_gpubench.config.metrics import DEFAULT_RATIO_THRESHOLD, GATED
from pytest_gpubench.results.decision import ALPHA, MIN_HISTORY, between_run_spread, scipy_stats

# Runs kept per (cell, prompt): enough for a t quantile near the normal's, few enough that a
# machine's slow change of speed over months leaves the history.
HISTORY_RUNS = 10
# The figures whose move makes a ratified step: every gated figure but an opt-in tail (a p99 of
# ten calls is their slowest, which moves past any interval now and then by itself).
STEP_FIGURES = frozenset(figure.name for figure in GATED if not figure.opt_in)


@dataclass(frozen=True)
class RunFigures:
    """One ratified run of a (cell, prompt): its gated figures by metric name, its warm sample
    count, the control call's p50 during it (the machine's speed then) and the CPU pressure's p50
    (the share of a call's time in which some task waited for a CPU: how busy the machine was)."""

    benchmark_run_id: str | None = None
    date: str | None = None
    n: int = 0
    figures: Mapping[str, float | None] = field(default_factory=dict)
    control_ms: float | None = None
    cpu_pressure: float | None = None
    # The engine's own wait per ms of CPU (p50), where the engine was a local process.
    engine_wait_per_cpu: float | None = None
    # The neighbours' share of the machine's CPU time, the benchmark's own taken out (p50):
    # absent from runs ratified before it was measured.
    neighbour_cpu_share: float | None = None
    # The calibration (`gpubench calibrate`, --gpubench-calibration) this run was one run of.
    calibration: str | None = None

    def figure(self, metric: str) -> float | None:
        return self.figures.get(metric)


History = tuple[RunFigures, ...]


def appended(history: Sequence[RunFigures], run: RunFigures, keep: int = HISTORY_RUNS) -> History:
    """The history with this run last, the oldest dropped past `keep`. A run already in it (the
    same run id: a shard's update written twice, a merge) replaces its entry: a run counts once."""
    kept = [
        entry
        for entry in history
        if run.benchmark_run_id is None or entry.benchmark_run_id != run.benchmark_run_id
    ]
    return (*kept, run)[-keep:]


def ratified_change(
    history: Sequence[RunFigures],
    run: RunFigures,
    *,
    short_steps: bool = False,
    metrics: Collection[str] = STEP_FIGURES,
) -> bool:
    """Whether a ratified run moved one of its gated figures (of `metrics`) away from the
    history before it: beyond the history's own spread (two-sided, at ALPHA, as a new draw of
    it: a prediction interval) and by more than the default threshold (a step worth a user's
    ratifying, not the machine's drift). Needs MIN_HISTORY runs before it: a shorter history has
    no spread. With `short_steps`, after fewer (but at least two), a move past the threshold is
    a step."""
    for metric, value in run.figures.items():
        if metric not in metrics:
            continue
        past = figures(history, metric)
        if value is None or value <= 0 or len(past) < (2 if short_steps else MIN_HISTORY):
            continue
        logs = [math.log(v) for v in past]
        step = math.log(value) - statistics.fmean(logs)
        if abs(step) <= math.log(1.0 + DEFAULT_RATIO_THRESHOLD):
            continue
        spread = between_run_spread(past)
        if spread is None or spread == 0.0:
            return True
        statistic = abs(step) / (spread * math.sqrt(1.0 + 1.0 / len(logs)))
        if 2.0 * float(scipy_stats().t.sf(statistic, len(logs) - 1)) < ALPHA:
            return True
    return False


def current_segment(history: Sequence[RunFigures], metric: str | None = None) -> History:
    """The runs since the last ratified step, oldest first: what the gate judges a run against,
    so that the run after an update that moved a figure is compared with what that update
    ratified, whatever the history held before (issue 43). A step past the prediction interval
    of MIN_HISTORY runs or more already starts a new history in the file; after two runs, which
    bound no interval, a move past the threshold is a step here. The file keeps such runs (a
    machine whose runs drift must still grow a history, and `gpubench calibrate` seed one): the
    gate leaves them out, as the runs before any step, which say nothing of the spread after
    it. With `metric`, only that figure's step counts: a figure the update did not move keeps
    its runs (a new engine that decodes faster says nothing new of its TTFT's spread)."""
    segment: History = ()
    stepping = STEP_FIGURES if metric is None else (metric,)
    for run in history:
        stepped = not same_update(segment[-1], run) if segment else False
        if stepped and ratified_change(segment, run, short_steps=True, metrics=stepping):
            segment = (run,)
        else:
            segment = (*segment, run)
    return segment


def same_update(earlier: RunFigures, later: RunFigures) -> bool:
    """Whether two runs were ratified by one --baseline-update (its runs `<run id>#<n>`,
    run/history_runs.py) or are runs of one calibration (`gpubench calibrate`): such runs are
    never a step from each other, however far the engine's speed moved between them (that is
    the spread they are measured for)."""
    if earlier.calibration is not None and earlier.calibration == later.calibration:
        return True
    first, _, number = (earlier.benchmark_run_id or "").partition("#")
    second, _, other = (later.benchmark_run_id or "").partition("#")
    return bool(first) and bool(number) and bool(other) and first == second


def figures(history: Iterable[RunFigures], metric: str) -> tuple[float, ...]:
    """One metric's figure in each run of the history that has it, oldest first."""
    values = (entry.figure(metric) for entry in history)
    return tuple(value for value in values if value is not None and value > 0)


def control_figures(history: Iterable[RunFigures]) -> tuple[float, ...]:
    return tuple(e.control_ms for e in history if e.control_ms is not None and e.control_ms > 0)


def pressure_figures(history: Iterable[RunFigures]) -> tuple[float, ...]:
    return tuple(e.cpu_pressure for e in history if e.cpu_pressure is not None)


def engine_wait_figures(history: Iterable[RunFigures]) -> tuple[float, ...]:
    return tuple(e.engine_wait_per_cpu for e in history if e.engine_wait_per_cpu is not None)


def neighbour_figures(history: Iterable[RunFigures]) -> tuple[float, ...]:
    return tuple(e.neighbour_cpu_share for e in history if e.neighbour_cpu_share is not None)
