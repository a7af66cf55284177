"""Sequential sampling of a (cell, prompt) judged against its baseline (pure): at each planned
look, its warm calls so far against the baseline run's samples, decided as a regression (past
the threshold the worse way and significant at the look's share of ALPHA: one-sided Mann-Whitney
U) or as unchanged (the bootstrap interval of the ratio of medians, at the look's share of ALPHA
each way, inside the threshold both ways), or not yet. An unchanged engine then costs fewer calls;
the gate judges the calls measured as it judges any run."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from pytest_gpubench.config.cell import Thresholds
from pytest_gpubench.results.decision import (
    ALPHA,
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    MAX_LOOKS,
    alternative,
    change_direction,
    look_schedule,
    one_sided_p,
    scipy_stats,
    verdict_of,
)
from pytest_gpubench.results.gate import reply_gaps
from pytest_gpubench.results.metric import GATED_METRICS, ratio_threshold, too_short_to_time
from pytest_gpubench.results.stats import PromptSummary, is_success

Stop = Literal["regression", "unchanged"]


# The figures a look decides on (config/metrics.GATED: `sequential`).
_METRICS = tuple(metric for metric in GATED_METRICS if metric.figure.sequential)


def looks(min_runs: int, max_runs: int) -> tuple[int, ...]:
    """The call counts at which a (cell, prompt) is judged: from min_runs evenly to max_runs."""
    first = min(min_runs, max_runs)
    return look_schedule(first, max_runs, max(1, min(MAX_LOOKS, max_runs - first + 1)))


def sequential_stop(
    calls: Sequence[Mapping[str, Any]],
    baseline: PromptSummary,
    thresholds: Thresholds,
    min_runs: int,
    max_runs: int,
) -> tuple[Stop, int] | None:
    """(what was decided, after how many successful calls) at the first look that decided; None
    while undecided. The last look is never an early stop: it is the run's own verdict."""
    succeeded = [call for call in calls if is_success(call)]
    planned = looks(min_runs, max_runs)
    alpha = ALPHA / len(planned)
    for count in planned:
        if count > len(succeeded) or count == max_runs:
            return None
        decided = _look(succeeded[:count], baseline, thresholds, alpha)
        if decided is not None:
            return decided, count
    return None


def _look(
    calls: Sequence[Mapping[str, Any]],
    baseline: PromptSummary,
    thresholds: Thresholds,
    alpha: float,
) -> Stop | None:
    """A regression as soon as one figure is one; unchanged once every figure is."""
    unchanged = []
    kind = str(calls[0].get("kind") or "chat") if calls else "chat"
    gaps = next(iter(reply_gaps(calls).values()), None)
    for metric in _METRICS:
        if kind not in metric.measure.kinds:
            continue  # a figure the prompt's request kind has not (an embedding's TTFT)
        if metric.measure.decode and too_short_to_time(gaps) is not None:
            continue  # not gated for this prompt (replies too short to time)
        source = metric.measure.field
        now = [float(call[source]) for call in calls if call.get(source) is not None]
        then = list(metric.samples(baseline))
        if len(now) < 3 or len(then) < 3:
            return None
        threshold = ratio_threshold(thresholds, metric.threshold_field)
        old, new = statistics.median(then), statistics.median(now)
        better = metric.higher_is_better
        direction = change_direction(old, new, threshold, higher_is_better=better)
        p_value = None
        if direction is not None:
            p_value = one_sided_p(now, then, alternative(better, direction))
        kind = verdict_of(direction, p_value, 0.0, alpha)
        if kind == "regression":
            return "regression"
        unchanged.append(kind == "ok" and _within(now, then, threshold, alpha))
    return "unchanged" if all(unchanged) else None


def _within(now: Sequence[float], then: Sequence[float], threshold: float, alpha: float) -> bool:
    """Whether the bootstrap interval of median(now) / median(then), at 1 - 2·alpha (each bound
    a one-sided test at alpha), lies inside the threshold both ways."""
    result = scipy_stats().bootstrap(
        (np.asarray(now), np.asarray(then)),
        lambda new, old, axis: np.median(new, axis=axis) / np.median(old, axis=axis),
        vectorized=True,
        n_resamples=BOOTSTRAP_RESAMPLES,
        confidence_level=1.0 - 2.0 * alpha,
        method="percentile",
        rng=np.random.default_rng(BOOTSTRAP_SEED),
    )
    low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    if not (math.isfinite(low) and math.isfinite(high)):
        return False
    return low * (1.0 + threshold) > 1.0 and high < 1.0 + threshold
