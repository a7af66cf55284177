"""The gate's one decision core (pure): a number of this run against its baseline, its between-run
history and the machine's steadiness, decided as ok, blind, inconclusive, unsteady, regression or
win, with the smallest change the run could have caught. The warm gate, the load gate and users'
own benchmark tests all decide here."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from pytest_gpubench.results.steadiness import Steadiness, signed_percent

VerdictKind = Literal[
    "regression",
    "incomparable",
    "unsteady",
    "inconclusive",
    "blind",
    "win",
    "ok",
    "new",
    "ungated",
]
# The worst first: a (cell, prompt) takes the verdict of its worst metric. `unsteady` (the machine
# drifted: nothing could be told) sits under the findings that fail a run for what was measured,
# `blind` (nothing past the threshold seen, but the run could not have seen one) over a plain pass;
# `ungated` last: a figure the prompt cannot measure, not judged (its replies too short to time).
VERDICT_ORDER: tuple[VerdictKind, ...] = get_args(VerdictKind)

# The verdicts of a figure the run could not tell (the machine moved, or the evidence allows a
# change of the threshold's size either way): neither a pass nor a regression; a run with one
# exits 10 (core/status.py), never 0.
UNDECIDED: tuple[VerdictKind, ...] = ("unsteady", "inconclusive", "blind")

ALPHA = 0.05

# The power the smallest detectable change is stated at: a change that large is caught in 80 %
# of runs (one-sided test at ALPHA).
POWER = 0.80
_Z_POWER = statistics.NormalDist().inv_cdf(POWER)
_Z_ALPHA = statistics.NormalDist().inv_cdf(1.0 - ALPHA)

# Sequential sampling (an A/B pair's, a (cell, prompt)'s against its baseline) looks at most this
# many times: the first look, then evenly up to the last; each look spends an equal share of
# ALPHA (Bonferroni), so deciding early at some look is no likelier by chance than a fixed-N
# verdict at ALPHA. Its bootstrap intervals: their resamples and seed (the same calls give the
# same interval).
MAX_LOOKS = 4
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20261125


def look_schedule(first: int, last: int, count: int) -> tuple[int, ...]:
    """`count` looks from `first` evenly up to `last` (the last always among them)."""
    if count <= 1 or first >= last:
        return (last,)
    step = math.ceil((last - first) / (count - 1))
    return (*range(first, last, step), last)


def scipy_stats() -> Any:
    """scipy.stats, imported when a figure is first tested: a run that only ratifies
    (--baseline-update) or is not judged never pays its import (about a second of CPU)."""
    from scipy import stats

    return stats


# Mann-Whitney U's efficiency against a t-test on normal data is 3/π: it needs 1/0.955 × the
# samples, so its detectable shift is sqrt(π/3) × the t-test's.
_MWU_EFFICIENCY = math.sqrt(math.pi / 3.0)
# Up to this many samples on the smaller side the exact U distribution is used (scipy's own
# cut-off); its p-value can never fall below 1 / C(n1 + n2, n1).
EXACT_TEST_MAX_N = 8
# Runs of history needed before the between-run spread is trusted (two points give one degree of
# freedom: a t quantile of 6.3, which would make every change undetectable).
MIN_HISTORY = 3
# The share of a robust standard deviation in a median absolute deviation (normal data).
_MAD_SCALE = 1.4826
Direction = Literal["worse", "better"]


@dataclass(frozen=True)
class Evidence:
    """One gated number of one run, and what it is judged against.

    `history`: the figure in each of the baseline's last ratified runs (oldest first, the
    baseline's own run among them); with MIN_HISTORY or more, the change is judged against the
    spread between those runs, otherwise against the samples of the baseline's run alone.
    """

    label: str
    higher_is_better: bool
    threshold: float
    baseline: float | None
    current: float | None
    current_samples: Sequence[float] = ()
    baseline_samples: Sequence[float] = ()
    history: Sequence[float] = ()
    steadiness: Steadiness | None = None
    # What to tell a user whose samples are too few ("re-run with --gpubench-runs 20").
    more_samples_hint: str = ""
    # Why there is no current figure, when there is none.
    missing: str = "not measured"
    # The level each test is at: ALPHA, or its share at each look of a figure sampled on until
    # decided (results/sample_on.py: the error rate held as sequential sampling holds it).
    alpha: float = ALPHA


@dataclass(frozen=True)
class Decision:
    """What the core found: the verdict and the figures behind it, and the text of its finding
    (without the cell and prompt: the caller names them and adds what it knows, the attribution).
    """

    kind: VerdictKind
    text: str
    baseline: float | None = None
    ratio: float | None = None
    p_value: float | None = None
    # The smallest change (current / baseline, in the worse direction) this run would catch in
    # POWER of runs like it: 1.18 is "could detect ≥ +18 %"; inf when no change could be caught.
    detectable_ratio: float | None = None
    # Why the gate is blind here (the detectable change exceeds the threshold), or None.
    blind_reason: str | None = None
    # The noise model used: "between runs (k runs of history)" or "within this run".
    noise: str | None = None
    direction: Direction | None = None


def change_direction(
    old: float, new: float, threshold: float, *, higher_is_better: bool
) -> Direction | None:
    """Whether new is at least `threshold` worse than old, or as large an improvement.

    Slower by 30 % means new ≥ 1.3 × old, so a win is old ≥ 1.3 × new; lower by 30 % means
    new ≤ 0.7 × old, so a win is old ≤ 0.7 × new. Written this way (no division), swapping
    old and new turns a regression into a win exactly, in floating point too.
    """
    if higher_is_better:
        if new <= old * (1.0 - threshold):
            return "worse"
        if old <= new * (1.0 - threshold):
            return "better"
        return None
    if new >= old * (1.0 + threshold):
        return "worse"
    if old >= new * (1.0 + threshold):
        return "better"
    return None


def alternative(higher_is_better: bool, direction: Direction) -> Literal["greater", "less"]:
    """The one-sided hypothesis about the current samples relative to the baseline's."""
    current_larger = (direction == "worse") != higher_is_better
    return "greater" if current_larger else "less"


def verdict_of(
    direction: Direction | None, p_value: float | None, smallest_p: float, alpha: float
) -> VerdictKind:
    """The rule every gate applies once it has a change's direction and its test's p (warm
    calls against a baseline, load points, A/B pairs): within the threshold is `ok`; past it,
    `inconclusive` when the test cannot be significant with these samples (`smallest_p` ≥
    alpha) or is not; else a `regression` or a `win`. (Whether a pass could have seen a change
    at all, `blind`, and the machine's steadiness come before it in decide().)"""
    if direction is None:
        return "ok"
    if smallest_p >= alpha or p_value is None or not p_value < alpha:
        return "inconclusive"
    return "regression" if direction == "worse" else "win"


def change_word(direction: Direction, higher_is_better: bool) -> str:
    """slower / faster, or lower / higher for a figure where higher is better."""
    if direction == "worse":
        return "lower" if higher_is_better else "slower"
    return "higher" if higher_is_better else "faster"


def describe_change(
    label: str, old: float, new: float, direction: Direction, higher_is_better: bool
) -> str:
    """`warm TTFT p50 +30.2% (slower: 52.84 → 68.8)`: a change past the threshold, as every
    verdict on it says it."""
    word = change_word(direction, higher_is_better)
    return f"{label} {signed_percent(new / old)} ({word}: {_number(old)} → {_number(new)})"


def mwu_method(n_current: int, n_baseline: int) -> Literal["exact", "asymptotic"]:
    return "exact" if min(n_current, n_baseline) <= EXACT_TEST_MAX_N else "asymptotic"


def min_achievable_p(n_current: int, n_baseline: int) -> float:
    """The smallest one-sided p-value the test can give for these sample sizes."""
    if n_current == 0 or n_baseline == 0:
        return 1.0
    if mwu_method(n_current, n_baseline) == "exact":
        return 1.0 / math.comb(n_current + n_baseline, n_current)
    # The normal approximation's extreme: every current sample above every baseline sample.
    separated = tuple(float(n_baseline + i) for i in range(n_current))
    return one_sided_p(separated, tuple(float(i) for i in range(n_baseline)), "greater")


def one_sided_p(
    current: Sequence[float], baseline: Sequence[float], alternative: Literal["greater", "less"]
) -> float:
    """Mann-Whitney U: p of current being stochastically `alternative` than baseline."""
    if not current or not baseline:
        return 1.0
    result = scipy_stats().mannwhitneyu(
        current, baseline, alternative=alternative, method=mwu_method(len(current), len(baseline))
    )
    p_value = float(result.pvalue)
    # All values tied: the asymptotic variance is zero and scipy gives NaN; nothing to see there.
    return 1.0 if math.isnan(p_value) else p_value


def _z(quantile: float) -> float:
    return statistics.NormalDist().inv_cdf(quantile)


def _logs(values: Sequence[float]) -> list[float]:
    return [math.log(value) for value in values if value > 0]


def _robust_sd(logs: Sequence[float]) -> float:
    """A spread that one wild sample does not blow up: the scaled median absolute deviation."""
    if len(logs) < 2:
        return 0.0
    middle = statistics.median(logs)
    return _MAD_SCALE * statistics.median(abs(value - middle) for value in logs)


def between_run_spread(history: Sequence[float]) -> float | None:
    """The standard deviation of log(figure) between the history's runs; None when too short."""
    logs = _logs(history)
    if len(logs) < MIN_HISTORY:
        return None
    return statistics.stdev(logs)


def detectable_log_change(evidence: Evidence) -> tuple[float, str, str | None]:
    """The smallest log-change this run could detect, the noise model it came from, and why it
    is infinite (no change could be caught) or None."""
    spread = between_run_spread(evidence.history)
    if spread is not None:
        k = len(_logs(evidence.history))
        t_quantile = float(scipy_stats().t.ppf(1.0 - evidence.alpha, k - 1))
        noise = f"between runs ({k} runs of history)"
        return (t_quantile + _Z_POWER) * spread * math.sqrt(1.0 + 1.0 / k), noise, None
    n, m = len(evidence.current_samples), len(evidence.baseline_samples)
    noise = "within this run (between-run noise floor unknown: history too short)"
    floor = min_achievable_p(n, m)
    if floor >= evidence.alpha:
        return math.inf, noise, f"too few runs: {n} samples against the baseline's {m}"
    pooled = [
        *(
            v - statistics.median(_logs(evidence.current_samples))
            for v in _logs(evidence.current_samples)
        ),
        *(
            v - statistics.median(_logs(evidence.baseline_samples))
            for v in _logs(evidence.baseline_samples)
        ),
    ]
    sd = _robust_sd(pooled)
    z_alpha = _Z_ALPHA if evidence.alpha == ALPHA else _z(1.0 - evidence.alpha)
    change = (z_alpha + _Z_POWER) * _MWU_EFFICIENCY * sd * math.sqrt(1.0 / n + 1.0 / m)
    return change, noise, None


def _between_run_p(evidence: Evidence, ratio: float, direction: Direction) -> float:
    """One-sided p of this run's figure against the history's runs (a prediction interval: the
    new run is one more draw from the same spread)."""
    logs = _logs(evidence.history)
    k = len(logs)
    spread = statistics.stdev(logs)
    if spread == 0.0:
        return 0.0 if ratio != 1.0 else 1.0
    statistic = math.log(ratio) / (spread * math.sqrt(1.0 + 1.0 / k))
    worse_is_up = not evidence.higher_is_better
    upward = (direction == "worse") == worse_is_up
    return float(scipy_stats().t.sf(statistic if upward else -statistic, k - 1))


def reference_value(evidence: Evidence) -> float | None:
    """What the run is compared with: the geometric mean of the history's runs when the history
    is long enough to judge by, else the baseline's figure."""
    logs = _logs(evidence.history)
    if len(logs) >= MIN_HISTORY:
        return math.exp(statistics.fmean(logs))
    return evidence.baseline


def decide(evidence: Evidence) -> Decision:
    """Large (past the threshold), significant (between runs when the history allows, else
    within: one-sided Mann-Whitney U), on a steady machine; and what the run could have seen.

    An `ok` the machine alone may have sped past the threshold, or a `regression` it may have
    slowed into one, within the steadiness limits (its engine's wait against the baseline's
    runs: _machine_moved), is `unsteady`. An unsteady or busy machine that leaned one way against
    the baseline's runs (Steadiness.lean) still decides what it cannot have caused: on a busier
    machine a figure within the threshold or better (ok, win), on a quieter one a regression.
    Anything else stays `unsteady`."""
    found = _decide(evidence)
    if found.kind == "regression" and found.ratio is not None:
        moved = _machine_moved(evidence, found.ratio, found.kind)
        if moved is not None:
            return replace(found, kind="unsteady", text=f"{found.text}, but not judged: {moved}")
    steady = evidence.steadiness
    lean = steady.lean if found.kind == "unsteady" and steady is not None else None
    if steady is None or lean is None:
        return found
    plain = _decide(replace(evidence, steadiness=None))
    trusted = ("regression",) if lean == "quieter" else ("ok", "win")
    if plain.kind not in trusted:
        return found
    why = steady.drift or steady.contended
    could = "cannot have slowed it" if lean == "quieter" else "can only have slowed it"
    return replace(
        plain, text=f"{plain.text}; judged though the machine was {lean} than in the baseline's "
        f"runs ({why}), which {could}",
    )  # fmt: skip


def _decide(evidence: Evidence) -> Decision:
    label = evidence.label
    old = reference_value(evidence)
    new = evidence.current
    if old is None or old <= 0:
        return Decision("new", f"the baseline has no {label}")
    if new is None:
        return Decision("inconclusive", f"{label}: {evidence.missing}", baseline=old)
    ratio = new / old
    change_log, noise, undetectable = detectable_log_change(evidence)
    drift = evidence.steadiness.drift if evidence.steadiness is not None else None
    if drift is not None:
        change_log, undetectable = math.inf, f"machine unsteady: {drift}"
    blind = change_log > math.log(1.0 + evidence.threshold)
    why_blind = undetectable or f"the spread {noise.split(' (')[0]} is too wide"
    direction = change_direction(
        old, new, evidence.threshold, higher_is_better=evidence.higher_is_better
    )
    base = Decision(
        "ok",
        "",
        baseline=old,
        ratio=ratio,
        detectable_ratio=_as_ratio(change_log, evidence.higher_is_better),
        blind_reason=why_blind if blind else None,
        noise=noise,
        direction=direction,
    )
    could = could_detect(label, base.detectable_ratio, evidence.higher_is_better)
    if drift is not None:
        seen = f"{label} {signed_percent(ratio)}, not judged: machine unsteady ({drift})"
        return replace(base, kind="unsteady", text=f"{seen}; re-run on a steady machine")
    busy = evidence.steadiness.contended if evidence.steadiness is not None else None
    # Blind because of the spread, on a busy machine: the spread may be the neighbours', and a
    # quiet machine could tell. Blind because of too few samples (`undetectable`) stays blind:
    # no machine could tell, and "re-run on a quiet machine" would not help.
    if busy is not None and blind and direction is None and undetectable is None:
        seen = (
            f"{label} {signed_percent(ratio)}, not judged: {busy}, and the gate could not see the "
        )
        threshold = f"{evidence.threshold:.0%} threshold there ({could}: {why_blind})"
        return replace(base, kind="unsteady", text=f"{seen}{threshold}; re-run on a quiet machine")
    within_run = between_run_spread(evidence.history) is None
    if direction is None:
        within = f"{label} {signed_percent(ratio)} (within the {evidence.threshold:.0%} threshold)"
        # A pass only where a change of the threshold's size would have been seen: however its
        # spread was estimated (between runs, or from this run's samples), a run that could not
        # have seen one says so, and does not pass.
        if blind:
            return replace(
                base, kind="blind", text=f"{within}, but the gate is blind here: {could} "
                f"({why_blind})",
            )  # fmt: skip
        # A pass the machine may have brought under the threshold (_machine_moved), or one judged
        # within the run on a busy machine, as a within-run regression or win below: the calls
        # share the neighbours' doing, which may have moved this run against the baseline's by
        # more than the within-run spread says (issue 43: +30 % passed as +14.8 % beside nice-19
        # neighbours).
        held = _machine_moved(evidence, ratio, "ok") or (
            f"{busy}, and {_without_history('whether the machine hid a change')}"
            if busy is not None and within_run
            else None
        )
        if held is not None:
            return replace(base, kind="unsteady", text=f"{within}, but not judged: {held}")
        return replace(base, text=f"{within}; {could}")
    change = describe_change(label, old, new, direction, evidence.higher_is_better)
    hint = f"; {evidence.more_samples_hint}" if evidence.more_samples_hint else ""
    alpha = evidence.alpha
    if not within_run:
        p_value = _between_run_p(evidence, ratio, direction)
        test = f"between runs, {len(_logs(evidence.history))} runs of history"
    else:
        now, then = evidence.current_samples, evidence.baseline_samples
        floor = min_achievable_p(len(now), len(then))
        if floor >= alpha:
            too_few = (
                f"{change}, but {len(now)} samples against the baseline's {len(then)} cannot be "
                f"significant (smallest possible p = {floor:.3g} ≥ {alpha:.3g}){hint}"
            )
            return replace(base, kind="inconclusive", text=too_few)
        p_value = one_sided_p(now, then, alternative(evidence.higher_is_better, direction))
        test = "within the run; between-run noise floor unknown"
    kind = verdict_of(direction, p_value, 0.0, alpha)
    if busy is not None and within_run and kind in ("regression", "win"):
        # The within-run test takes the calls as independent draws; on a machine that was busy
        # in this run or the baseline's, the calls share the neighbours' doing, and a re-measure
        # in the same state would confirm it. Without runs of history (or a reference cell, A/B)
        # nothing tells the machine from a change.
        why = (
            f"{change}, p = {p_value:.3g} ({test}), but not judged: {busy}, and "
            f"{_without_history('the machine from a change')}"
        )
        return replace(base, kind="unsteady", text=why, p_value=p_value)
    if kind == "inconclusive":
        unsure = f"{change}, but not significant (p = {p_value:.3g} ≥ {alpha:.3g}; {test}){hint}"
        if busy is not None:
            why = f"{unsure}; not judged: {busy}; re-run on a quiet machine"
            return replace(base, kind="unsteady", text=why, p_value=p_value)
        return replace(base, kind="inconclusive", text=unsure, p_value=p_value)
    return replace(base, kind=kind, text=f"{change}, p = {p_value:.3g} ({test})", p_value=p_value)


def _machine_moved(evidence: Evidence, ratio: float, kind: VerdictKind) -> str | None:
    """Why an `ok` may hide a change past the threshold, or a `regression` may be the machine's:
    the machine alone may have sped this run up (slowed it down) against the baseline's runs by
    more than the margin the figure left (Steadiness.machine_factor); None where it could not."""
    steady = evidence.steadiness
    if steady is None:
        return None
    factor, reading = steady.machine_factor()
    if (kind == "ok" and factor >= 1.0) or (kind == "regression" and factor <= 1.0):
        return None
    # The figure as a machine as busy as the baseline's would have put it: a time moved by
    # `factor` is a rate moved by 1 / factor.
    undone = ratio * factor if evidence.higher_is_better else ratio / factor
    moved = change_direction(
        1.0, undone, evidence.threshold, higher_is_better=evidence.higher_is_better
    )
    if (moved == "worse") == (kind == "regression"):
        return None
    way, by = ("quieter", "sped") if factor < 1.0 else ("busier", "slowed")
    return (
        f"the machine ran {way} than in the baseline's runs ({reading}), which may have {by} "
        f"this run by up to {abs(factor - 1.0) / min(factor, 1.0):.0%}: on a machine as busy as "
        f"the baseline's it would be {signed_percent(undone)}; re-run on a steady machine"
    )


def _without_history(what: str) -> str:
    """What a busy machine's within-run verdict lacks, and what would settle it."""
    return (
        f"without {MIN_HISTORY} runs of history the gate cannot tell {what}; settle it with "
        "`gpubench calibrate` (runs of history) or a `reference:` cell (A/B), or re-run on a "
        "quiet machine"
    )


def _as_ratio(change_log: float, higher_is_better: bool) -> float | None:
    """A detectable log-change as current / baseline in the worse direction; None: none."""
    if math.isinf(change_log):
        return None
    return math.exp(-change_log if higher_is_better else change_log)


def could_detect(label: str, detectable_ratio: float | None, higher_is_better: bool) -> str:
    """`could detect ≥ +18.0% warm TTFT p50` (`≥ -15.0%` for a figure where higher is better);
    `could detect no change of …` when none could be caught."""
    if detectable_ratio is None:
        return f"could detect no change of {label}"
    sign = "≤" if higher_is_better else "≥"
    return f"could detect {sign} {signed_percent(detectable_ratio)} {label}"


def _number(value: float) -> str:
    return f"{value:.4g}"
