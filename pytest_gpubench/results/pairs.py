"""One A/B candidate's pairs and what one metric's pairs say (pure): its warm calls and its
reference's by pair index (run_idx), and per metric the ratio of medians with its bootstrap
interval and the one-sided Wilcoxon signed-rank p of the paired log-ratios (results/paired.py
turns them into verdicts)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from pytest_gpubench.results.decision import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, scipy_stats
from pytest_gpubench.results.gate import ALPHA, change_direction
from pytest_gpubench.results.metric import GATED_METRICS, Metric
from pytest_gpubench.results.stats import field_number, is_success

# The level of the bootstrap interval of the ratio of medians (its resamples and seed, and the
# most looks of sequential sampling: results/decision.py).
INTERVAL_LEVEL = 0.95
# The figures an A/B pair is judged on (config/metrics.GATED: `paired`), from each call record.
PAIRED_METRICS = tuple(metric for metric in GATED_METRICS if metric.figure.paired)


@dataclass
class Pairs:
    """One (candidate, prompt)'s warm calls and its reference's, by pair index (run_idx)."""

    candidate: dict[int, Mapping[str, Any]] = field(default_factory=dict)
    reference: dict[int, Mapping[str, Any]] = field(default_factory=dict)

    def values(self, metric: Metric) -> tuple[list[float], list[float]]:
        """The metric's (candidate, reference) values of the pairs where both calls have it,
        in pair order."""
        candidate, reference = [], []
        for index in sorted(set(self.candidate) & set(self.reference)):
            new, old = _value(self.candidate[index], metric), _value(self.reference[index], metric)
            if new is not None and old is not None:
                candidate.append(new)
                reference.append(old)
        return candidate, reference

    @property
    def kind(self) -> str:
        """The request kind of the prompt (config/prompts.py; a chat call's record has none)."""
        first = next(iter(self.candidate.values()), {})
        return str(first.get("kind") or "chat")

    def complete_indices(self) -> list[int]:
        """The pair indices whose two calls both succeeded, in pair order."""
        return [
            index
            for index in sorted(set(self.candidate) & set(self.reference))
            if is_success(self.candidate[index]) and is_success(self.reference[index])
        ]

    @property
    def complete(self) -> int:
        """Pairs whose two calls both succeeded."""
        return len(self.complete_indices())

    def busy_seconds(self) -> float:
        """How long the calls held the engines: the sum of their total durations."""
        records = [*self.candidate.values(), *self.reference.values()]
        durations = (_finite(r.get("total_duration_ms")) for r in records)
        return sum(d for d in durations if d is not None and d > 0) / 1000.0

    def engine_waits(self) -> tuple[float, float] | None:
        """Each side's engine's wait for a CPU per ms it ran (engine_wait_per_cpu, a local
        engine's), its median over the complete pairs: (candidate, reference); None where
        either side's engine was not read on at least half of them (a remote engine)."""
        both = self.complete_indices()
        candidate = [_wait(self.candidate[index]) for index in both]
        reference = [_wait(self.reference[index]) for index in both]
        found = [w for w in candidate if w is not None], [w for w in reference if w is not None]
        if not both or min(len(found[0]), len(found[1])) * 2 < len(both):
            return None
        return float(np.median(found[0])), float(np.median(found[1]))

    def pinned_alike(self) -> str | None:
        """The CPUs both sides' engines were pinned to (engine_cpus, a local engine's), where
        every complete pair's two calls say the same; None where either was not pinned."""
        found = {
            str(record.get("engine_cpus") or "")
            for index in self.complete_indices()
            for record in (self.candidate[index], self.reference[index])
        }
        return found.pop() if len(found) == 1 and "" not in found else None

    def decode_gaps(self) -> int | None:
        """The gaps between tokens a decode figure is measured over: the median of the complete
        pairs' calls' completion tokens less one; None where no call says (older ledgers)."""
        counts = [
            int(tokens) - 1
            for index in self.complete_indices()
            for record in (self.candidate[index], self.reference[index])
            if (tokens := _finite(record.get("completion_tokens"))) is not None and tokens >= 1
        ]
        return int(np.median(counts)) if counts else None

    def prefix(self, count: int) -> Pairs:
        """The first `count` complete pairs (a sequential look sees only those)."""
        kept = self.complete_indices()[:count]
        return Pairs({i: self.candidate[i] for i in kept}, {i: self.reference[i] for i in kept})


def _finite(value: Any) -> float | None:
    """A record's field as a finite number, else None (not a number, too large, NaN, ±inf)."""
    number = field_number(value)
    return number if number is not None and math.isfinite(number) else None


def _wait(record: Mapping[str, Any]) -> float | None:
    wait = _finite(record.get("engine_wait_per_cpu"))
    return wait if wait is not None and wait >= 0 else None


def _value(record: Mapping[str, Any], metric: Metric) -> float | None:
    value = _finite(record.get(metric.measure.field)) if is_success(record) else None
    return value if value is not None and value > 0 else None


@dataclass(frozen=True)
class PairedResult:
    """One metric of one (candidate, prompt) over its pairs."""

    metric: Metric
    pairs: int
    reference_median: float | None
    candidate_median: float | None
    ratio: float | None
    interval: tuple[float, float] | None
    p_value: float | None
    # Where the candidate lies: past the threshold "worse" or "better", or None within it.
    direction: Literal["worse", "better"] | None
    # No change past the threshold either way, with confidence (what stops a sequential pair
    # as unchanged).
    within: bool


def judge_pairs(
    metric: Metric, candidate: Sequence[float], reference: Sequence[float], threshold: float,
    *, alpha: float = ALPHA,
) -> PairedResult:  # fmt: skip
    """The ratio of medians (candidate / reference) with its bootstrap interval, and the
    one-sided Wilcoxon signed-rank p of the paired log-ratios in the direction of the change."""
    n = len(candidate)
    if n == 0:
        return PairedResult(metric, 0, None, None, None, None, None, None, False)
    new, old = float(np.median(candidate)), float(np.median(reference))
    ratio = new / old
    direction = change_direction(old, new, threshold, higher_is_better=metric.higher_is_better)
    log_ratios = np.log(np.asarray(candidate) / np.asarray(reference))
    p_value: float | None = None
    if direction is not None:
        larger = (direction == "worse") != metric.higher_is_better
        p_value = signed_rank_p(log_ratios, "greater" if larger else "less")
    return PairedResult(
        metric=metric,
        pairs=n,
        reference_median=old,
        candidate_median=new,
        ratio=ratio,
        interval=ratio_interval(candidate, reference),
        p_value=p_value,
        direction=direction,
        within=direction is None and _within(metric, candidate, reference, threshold, alpha),
    )


def signed_rank_p(log_ratios: np.ndarray, alternative: Literal["greater", "less"]) -> float:
    """Wilcoxon signed-rank: p of the paired log-ratios lying `alternative` than zero."""
    if len(log_ratios) == 0 or not np.any(log_ratios):
        return 1.0
    result = scipy_stats().wilcoxon(log_ratios, alternative=alternative)
    p_value = float(result.pvalue)
    return 1.0 if math.isnan(p_value) else p_value


def min_signed_rank_p(pairs: int) -> float:
    """The smallest one-sided p the exact signed-rank test gives for this many pairs."""
    return 0.5**pairs if pairs else 1.0


def ratio_interval(
    candidate: Sequence[float], reference: Sequence[float], level: float = INTERVAL_LEVEL
) -> tuple[float, float] | None:
    """The bootstrap interval of median(candidate) / median(reference), pairs resampled whole
    (a pair's two calls share the machine's state: kept together, its drift still cancels)."""
    if len(candidate) < 3:
        return None
    result = scipy_stats().bootstrap(
        (np.asarray(candidate), np.asarray(reference)),
        lambda new, old, axis: np.median(new, axis=axis) / np.median(old, axis=axis),
        paired=True,
        vectorized=True,
        n_resamples=BOOTSTRAP_RESAMPLES,
        confidence_level=level,
        method="percentile",
        rng=np.random.default_rng(BOOTSTRAP_SEED),
    )
    low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    return (low, high)


def _within(
    metric: Metric,
    candidate: Sequence[float],
    reference: Sequence[float],
    threshold: float,
    alpha: float,
) -> bool:
    """Whether the ratio of medians lies inside the threshold both ways with confidence: its
    bootstrap interval at 1 - 2·alpha (each bound a one-sided test at alpha) falls short of a
    change the gate would call worse or better."""
    interval = ratio_interval(candidate, reference, level=1.0 - 2.0 * alpha)
    if interval is None:
        return False
    low, high = interval
    if metric.higher_is_better:
        return 1.0 - threshold < low and high * (1.0 - threshold) < 1.0
    return low * (1.0 + threshold) > 1.0 and high < 1.0 + threshold
