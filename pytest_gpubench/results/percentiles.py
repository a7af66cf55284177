"""Percentiles of a load point's samples and their distribution-free intervals (pure): the
p50/p90/p99 a load summary reports, each with the order statistics that bound it at CONFIDENCE
whatever the distribution, and the fewest samples that bound it on both sides."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

PERCENTILES = (50, 90, 99)
# The confidence of each percentile's interval (percentile_interval).
CONFIDENCE = 0.95


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, linear between order statistics (numpy's default); None if empty."""
    ordered = sorted(value for value in values if not math.isnan(value))
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    value = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return round(value, 4)


def interval_ranks(
    n: int, q: float, confidence: float = CONFIDENCE
) -> tuple[int | None, int | None]:
    """The 0-based ranks (low, high) of the order statistics that bound the q-th percentile of
    n samples with at least `confidence`, whatever the distribution (the binomial method: of n
    draws, the number below the true percentile is Binomial(n, q/100); the interval between the
    sorted samples at ranks low and high holds the percentile with probability
    F(high) - F(low), at least `confidence` with each tail at most (1 - confidence) / 2). None
    for a side the sample cannot bound: too few samples below (above) the percentile."""
    from scipy.stats import binom

    if n < 1:
        return None, None
    p = q / 100.0
    tail = (1.0 - confidence) / 2.0
    # The largest k with F(k) <= tail: the lower bound is the (k+1)-th smallest sample.
    low = int(binom.ppf(tail, n, p))
    if float(binom.cdf(low, n, p)) > tail:
        low -= 1
    # The smallest k with F(k) >= 1 - tail: the upper bound is the (k+1)-th smallest sample.
    high = int(binom.ppf(1.0 - tail, n, p))
    return (low if low >= 0 else None), (high if high <= n - 1 else None)


def fewest_for_interval(q: float, confidence: float = CONFIDENCE) -> int:
    """The fewest samples whose q-th percentile has an interval bounded on both sides (p99 at
    95 %: 368; below it the p99's upper bound is nothing the sample holds)."""
    p = q / 100.0
    tail = (1.0 - confidence) / 2.0
    # The upper bound exists once the chance that every sample lies below the percentile,
    # p^n, is at most the tail (and the lower once (1 - p)^n is).
    return max(
        math.ceil(math.log(tail) / math.log(p)), math.ceil(math.log(tail) / math.log(1.0 - p))
    )


def percentile_interval(
    values: Sequence[float], q: float, confidence: float = CONFIDENCE
) -> list[float | None]:
    """[low, high] of the q-th percentile's distribution-free interval (interval_ranks); an
    open side is None."""
    ordered = sorted(value for value in values if not math.isnan(value))
    low, high = interval_ranks(len(ordered), q, confidence)
    return [
        round(ordered[low], 4) if low is not None else None,
        round(ordered[high], 4) if high is not None else None,
    ]


def percentile_intervals(figures: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Per figure: the n behind its percentiles and each one's interval ([low, high], None an
    open side), and `too_few`: the percentiles whose sample cannot bound them on both sides."""
    intervals: dict[str, Any] = {
        "confidence": CONFIDENCE,
        "method": "order statistics (binomial)",
        # The fewest samples that bound each percentile on both sides.
        "fewest": {f"p{q}": fewest_for_interval(q) for q in PERCENTILES},
    }
    too_few = []
    for name, values in figures.items():
        row: dict[str, Any] = {"n": len(values)}
        for q in PERCENTILES:
            row[f"p{q}"] = percentile_interval(values, q)
            if values and None in row[f"p{q}"]:
                too_few.append(f"{name}_p{q}")
        intervals[name] = row
    intervals["too_few"] = too_few
    return intervals
