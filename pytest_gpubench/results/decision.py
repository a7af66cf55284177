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
# How far the control may move (on a log scale) before the machine counts as unsteady when its
# history is too short to say: 25 %. With history, three standard deviations of the control's own
# between-run spread, but never less than STEADY_FLOOR_MIN (a quiet machine still jitters).
DEFAULT_STEADY_FLOOR = math.log(1.25)
STEADY_FLOOR_MIN = math.log(1.15)
# The share of a robust standard deviation in a median absolute deviation (normal data).
_MAD_SCALE = 1.4826
Direction = Literal["worse", "better"]


# How far the CPU pressure (the share of a call's time in which some task on the machine waited
# for a CPU, measure/control.py) may move, against the baseline's runs or between the halves of
# this run, before the machine counts as unsteady, and the level over which the machine counts as
# busy: 10 points (measured: 0.005 on a quiet 2-core machine, 0.52 beside two busy processes).
PRESSURE_LIMIT = 0.10
# Where the engine is a local process its own threads' run-queue wait per ms of the CPU they got
# (measure/engine_wait.py) stands in for the machine's pressure, with the same limit: 0.10 ms per
# ms is CPU work taking a tenth longer than on a free CPU. Measured beside the real llama-server
# (one thread) on a 2-core machine (benchmarks_dev/steadiness_signals.py): 0.10-0.11 while two
# other engineers' test suites ran, 0.94 beside two busy processes, 0.74 beside one copying
# 512 MiB over and over; 0.17 with its replies paced by a slower proxy, where the machine's pressure
# reads whatever the proxy and the client add. The engine's is the engine's alone: a slower
# engine waits in proportion to its longer running, a slower path around it changes neither.
# Where the engine's own wait is not read (a remote engine, one in a container), the neighbours'
# share of the machine's CPU time over the call, the engine's (where read) and the client's own
# taken out (measure/control.MachineCpu), stands in for the pressure, with the same limit: the
# pressure counts the engine and the client waiting for each other (issue 43: an idle 2-core
# machine read 34-36 % with an engine started by hand). A hypervisor's steal (a VM's CPU time the
# host gave to others, which no in-guest pressure sees) past the limit is a busy machine too.
PressureSource = Literal["machine", "engine", "neighbours"]
# Which way the machine leaned in this run against the baseline's runs (Steadiness.lean).
Lean = Literal["busier", "quieter"]
# How far a pressure reading (its p50) must move against the baseline's before it says which way
# the machine leaned: half the limit (two p50s of one machine's pressure a few points apart say
# nothing about which run its neighbours slowed more).
LEAN_MARGIN = PRESSURE_LIMIT / 2


@dataclass(frozen=True)
class Steadiness:
    """What the control call and the CPU pressure showed about the machine while this (cell,
    prompt) ran.

    `against_baseline`: the control's p50 in this run / in the baseline's runs (the machine as a
    whole faster or slower than when the baseline was measured); `within_run`: the control's p50
    over the later half of the calls / over the earlier half (the machine drifted during the run).
    `floor`: how far either may move (log scale) before the machine counts as unsteady.
    `pressure`, `baseline_pressure`: the CPU pressure's p50 in this run and in the baseline's runs
    (the share of each call's time in which some task on the machine waited for a CPU);
    `pressure_halves`: its p50 over the earlier and the later half of this run, when they differ
    significantly.
    """

    against_baseline: float | None
    within_run: float | None
    floor: float = DEFAULT_STEADY_FLOOR
    pressure: float | None = None
    baseline_pressure: float | None = None
    pressure_halves: tuple[float, float] | None = None
    # The busiest of the baseline's runs (its history's highest pressure p50): a between-run
    # spread learned while the machine was busy in some runs is the machine's, not the engine's.
    baseline_pressure_max: float | None = None
    # False where the pressure includes the run's own load (a load point's concurrent requests
    # keep tasks waiting by design): then only its change against the baseline counts.
    contention_counts: bool = True
    # The time the pressure was read over, for the messages.
    pressure_window: str = "the calls' time"
    # What `pressure` is: the share of the time in which some task on the machine waited for a
    # CPU ("machine"), or the engine's own threads' wait per ms of CPU they got ("engine").
    pressure_source: PressureSource = "machine"
    # The harness's own threads' wait per ms they ran, p50 over this run's calls (None where not
    # read): a client that waited for a CPU read the engine's bytes late, whatever the engine's.
    client_wait: float | None = None
    # The share of the CPUs' time the hypervisor stole, p50 over this run's calls (None: not read).
    steal: float | None = None
    # What the GPU's own signals showed beside the engine during this run's calls, where they
    # moved against the baseline's (another process on it, clocks held down), or None.
    gpu: str | None = None
    # The other processes' share of the machine's CPU time (the benchmark's own engine and
    # client taken out), the busiest p50 of this run's and the baseline's runs, where both read
    # it; None where not. At or under the limit nothing but the benchmark ran: an engine's or a
    # client's wait is then for the benchmark's own threads (an engine with more compute threads
    # than CPUs, the client beside it on two cores), which no re-run removes, and neither makes
    # the machine busy or unsteady (issue 43). Over it, the waits count as before.
    neighbours: float | None = None

    @property
    def own_waits_only(self) -> bool:
        """Whether the other processes took no more than the limit of the CPUs' time in this run
        and the baseline's: a wait read then is the benchmark's own."""
        return self.neighbours is not None and self.neighbours <= PRESSURE_LIMIT

    def _waited(self, value: float) -> str:
        if self.pressure_source == "engine":
            return f"the engine's threads waited {value:.2f} ms for a CPU per ms they ran"
        if self.pressure_source == "neighbours":
            return f"other processes used {value:.0%} of the CPUs' time during the calls"
        return f"tasks waited for a CPU {value:.0%} of {self.pressure_window}"

    def _level(self, value: float) -> str:
        return f"{value:.2f}" if self.pressure_source == "engine" else f"{value:.0%}"

    @property
    def drift(self) -> str | None:
        """Why the machine counts as unsteady, or None when it held."""
        reasons = []
        limit = f"±{math.exp(self.floor) - 1.0:.0%}"
        if self.against_baseline and abs(math.log(self.against_baseline)) > self.floor:
            ran = signed_percent(self.against_baseline)
            reasons.append(f"the control call ran {ran} against the baseline's (beyond {limit})")
        if self.within_run and abs(math.log(self.within_run)) > self.floor:
            reasons.append(
                f"the control call drifted {signed_percent(self.within_run)} during the run "
                f"(beyond {limit})"
            )
        now, then = self.pressure, self.baseline_pressure
        # An engine that waited for its own threads (nothing else ran) waits as its build does.
        own_engine = self.pressure_source == "engine" and self.own_waits_only
        if own_engine:
            now = then = None
        if now is not None and then is not None and abs(now - then) > PRESSURE_LIMIT:
            limit = (
                f"±{PRESSURE_LIMIT:.2f}"
                if self.pressure_source == "engine"
                else f"±{PRESSURE_LIMIT * 100:.0f} points"
            )
            reasons.append(
                f"{self._waited(now)} against {self._level(then)} in the baseline's runs "
                f"(beyond {limit})"
            )
        if self.pressure_halves is not None and not own_engine:
            early, late = self.pressure_halves
            if abs(late - early) > PRESSURE_LIMIT:
                what = {
                    "engine": "the engine's wait per ms of CPU",
                    "neighbours": "the other processes' CPU share",
                }.get(self.pressure_source, "the CPU pressure")
                reasons.append(
                    f"{what} went from {self._level(early)} to {self._level(late)} "
                    + (
                        "during the run"
                        if self.pressure_source == "engine"
                        else f"of {self.pressure_window} during the run"
                    )
                )
        if self.gpu is not None:
            reasons.append(self.gpu)
        return "; ".join(reasons) if reasons else None

    @property
    def lean(self) -> Lean | None:
        """Which way the machine leaned in this run against the baseline's runs, where every
        reading that compares the two agrees: "busier" (the control call slower, the engine or
        the machine waiting more than in the baseline's runs) or "quieter". None where they
        disagree, where none compares the two, or where a reading has nothing of the baseline's
        to compare with (the control drifting during the run, the client's wait, steal, the
        GPU's signals): then which way the machine moved the figure is not known.

        A busier machine only slows a run: a figure that came out within the threshold or better
        on it is not worse on a quiet one; a quieter machine cannot have made a run slower
        (decide)."""
        if self.gpu is not None or (self.steal is not None and self.steal > PRESSURE_LIMIT):
            return None
        own = self.own_waits_only
        if self.client_wait is not None and self.client_wait > PRESSURE_LIMIT and not own:
            return None
        if self.within_run and abs(math.log(self.within_run)) > self.floor:
            return None
        signs: list[int] = []
        # The control call counts where it moved beyond the floor (within it, it held).
        if self.against_baseline and abs(math.log(self.against_baseline)) > self.floor:
            signs.append(1 if self.against_baseline > 1.0 else -1)
        then = self.baseline_pressure
        if then is not None and not (own and self.pressure_source == "engine"):
            readings = self.pressure_halves or (
                (self.pressure, self.pressure) if self.pressure is not None else None
            )
            if readings is not None:
                low, high = min(readings), max(readings)
                if low - then > LEAN_MARGIN:
                    signs.append(1)
                elif then - high > LEAN_MARGIN:
                    signs.append(-1)
                else:
                    return None
        if not signs or len(set(signs)) > 1:
            return None
        return "busier" if signs[0] > 0 else "quieter"

    def machine_factor(self) -> tuple[float, str]:
        """How far the machine alone may have moved this run's figures against the baseline's
        runs within the steadiness limits, as a factor of a time (0.92: 8 % faster, 1.08: 8 %
        slower, 1.0: not at all), and the reading that says so: a local engine's own wait, where
        a ms of its CPU work took 1 + wait ms of the call's time, so (1 + now) / (1 + then). A
        quiet machine's few hundredths of wait move a figure by a few per cent; a run that a
        drift within the limit sped up by 8 % can pass a 30 % slowdown as +19 % (issue 43: an
        on/off neighbour's off phase against a baseline taken in its on phase)."""
        now, then = self.pressure, self.baseline_pressure
        engine = self.pressure_source == "engine" and not self.own_waits_only
        if not engine or now is None or then is None:
            return 1.0, ""
        said = (
            f"the engine's threads waited {now:.2f} ms for a CPU per ms they ran against "
            f"{then:.2f} in the baseline's runs"
        )
        return (1.0 + now) / (1.0 + then), said

    @property
    def contended(self) -> str | None:
        """How busy the machine was when it was busy beyond PRESSURE_LIMIT in this run or in any
        of the baseline's runs (steadily: a drift is `drift`), or None. On such a machine the
        engine's speed is partly its neighbours' to decide: a verdict that cannot tell (blind,
        inconclusive) is `unsteady` there, never a silent pass."""
        if not self.contention_counts:
            return None
        readings = (self.pressure, self.baseline_pressure, self.baseline_pressure_max)
        busiest = max((p for p in readings if p is not None), default=None)
        waits = []
        own = self.own_waits_only
        own_engine = own and self.pressure_source == "engine"
        if busiest is not None and busiest > PRESSURE_LIMIT and not own_engine:
            waits.append(self._waited(busiest))
        if self.client_wait is not None and self.client_wait > PRESSURE_LIMIT and not own:
            waits.append(
                f"the client's threads waited {self.client_wait:.2f} ms for a CPU per ms they ran"
            )
        if self.steal is not None and self.steal > PRESSURE_LIMIT:
            waits.append(f"the hypervisor took {self.steal:.0%} of the CPUs' time (steal)")
        return f"the machine was busy: {' and '.join(waits)}" if waits else None


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
    if found.kind in ("ok", "regression") and found.ratio is not None:
        moved = _machine_moved(evidence, found.ratio, found.kind)
        if moved is not None:
            seen = found.text.partition("; could")[0] if found.kind == "ok" else found.text
            held = f"{seen}, but not judged: {moved}; re-run on a steady machine"
            return replace(found, kind="unsteady", text=held)
    steady = evidence.steadiness
    lean = steady.lean if found.kind == "unsteady" and steady is not None else None
    if lean is None:
        return found
    plain = _decide(replace(evidence, steadiness=None))
    trusted = ("regression",) if lean == "quieter" else ("ok", "win")
    if plain.kind not in trusted:
        return found
    why = (steady.drift or steady.contended) if steady is not None else None
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
        return replace(base, text=f"{within}; {could}")
    word = change_word(direction, evidence.higher_is_better)
    change = f"{label} {signed_percent(ratio)} ({word}: {_number(old)} → {_number(new)})"
    hint = f"; {evidence.more_samples_hint}" if evidence.more_samples_hint else ""
    within_run = between_run_spread(evidence.history) is None
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
            f"{change}, p = {p_value:.3g} ({test}), but not judged: {busy}, and without "
            f"{MIN_HISTORY} runs of history the gate cannot tell the machine from a change; "
            "settle it with `gpubench calibrate` (runs of history) or a `reference:` cell (A/B), "
            "or re-run on a quiet machine"
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
        f"the baseline's it would be {signed_percent(undone)}"
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


def signed_percent(ratio: float) -> str:
    """A ratio as the change every verdict and report writes: 1.352 -> "+35.2%"."""
    return f"{ratio - 1.0:+.1%}"


def _number(value: float) -> str:
    return f"{value:.4g}"
