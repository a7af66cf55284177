"""Head-to-head A/B verdicts (docs/ab-runs.md): a candidate cell's warm calls judged against its
reference's, pair by pair, so that what the machine did to both cancels; and the bounded
sequential rule that lets a pair stop sampling once its verdict is decided either way. Pure:
call records in, verdicts out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal, Protocol

from pytest_gpubench.config.cell import Thresholds
from pytest_gpubench.results.decision import (
    MAX_LOOKS,
    Decision,
    change_word,
    look_schedule,
    verdict_of,
)
from pytest_gpubench.results.gate import ALPHA, VerdictKind, change_direction
from pytest_gpubench.results.metric import Metric, ratio_threshold, too_short_to_time
from pytest_gpubench.results.pairs import (
    INTERVAL_LEVEL,
    PAIRED_METRICS,
    PairedResult,
    Pairs,
    judge_pairs,
    min_signed_rank_p,
)
from pytest_gpubench.results.sample_on import SAMPLED_ON, budget_runs
from pytest_gpubench.results.sample_on import looks as sample_on_looks
from pytest_gpubench.results.steadiness import PRESSURE_LIMIT, signed_percent
from pytest_gpubench.results.verdict import Verdict, from_decision

PairsDecision = Literal["regression", "win", "unchanged"]
# A decode figure of replies shorter than MIN_DECODE_GAPS gaps between tokens (the median over
# the pairs) is `ungated` (results/metric.py): in issue 37's table an unchanged candidate's
# decode rate of 4-token replies moved -45 % to +131 % per session, and one session in 10-20
# came out significant both by the signed ranks and by its interval.


class PairedCell(Protocol):
    """What judging a candidate needs of its cell's settings
    (results/judging_settings.CellJudging)."""

    @property
    def thresholds(self) -> Thresholds: ...

    @property
    def runs(self) -> int: ...

    @property
    def min_runs(self) -> int | None: ...

    @property
    def reference(self) -> str | None: ...


class PairedSettings(Protocol):
    """A run's settings as A/B judging reads them: each cell's, and the runs override."""

    @property
    def cells(self) -> Mapping[str, PairedCell]: ...

    @property
    def runs_override(self) -> int | None: ...

    @property
    def sample_on_runs(self) -> int | None: ...


# -- sequential sampling -------------------------------------------------------------------------


def looks(min_pairs: int, max_pairs: int) -> tuple[int, ...]:
    """The pair counts at which a sequential pair is judged, at most MAX_LOOKS, the maximum
    last: evenly from the minimum, or from the fewest pairs that can be significant at a look's
    share of ALPHA (7 at four looks: the signed-rank test's smallest p is 1/2^n)."""
    count = max(1, min(MAX_LOOKS, max_pairs - min_pairs + 1))
    first = min(max(min_pairs, _fewest_significant(ALPHA / count)), max_pairs)
    return look_schedule(first, max_pairs, count)


def _fewest_significant(alpha: float) -> int:
    pairs = 1
    while min_signed_rank_p(pairs) >= alpha:
        pairs += 1
    return pairs


def decide(
    pairs: Pairs, thresholds: Thresholds, alpha: float
) -> tuple[PairsDecision | None, list[PairedResult]]:
    """At one look: regression as soon as one metric is significantly worse past its threshold;
    otherwise decided only once every metric with values is (unchanged or a win)."""
    results = []
    for metric in PAIRED_METRICS:
        candidate, reference = pairs.values(metric)
        if candidate:
            threshold = ratio_threshold(thresholds, metric.threshold_field)
            results.append(judge_pairs(metric, candidate, reference, threshold, alpha=alpha))
    decisions: list[PairsDecision | None] = []
    gaps = pairs.decode_gaps()
    for result in results:
        if _too_few_gaps(result.metric, gaps) is not None:
            continue  # not gated for this prompt: nothing to decide
        kind = verdict_of(result.direction, result.p_value, 0.0, alpha)
        if kind in ("regression", "win") and not rules_out_no_change(result):
            decisions.append(None)  # not yet earned: sample on
            continue
        if kind == "regression":
            return "regression", results
        if kind == "win":
            decisions.append("win")
        elif kind == "ok" and result.within:
            decisions.append("unchanged")
        else:
            decisions.append(None)
    if not decisions or None in decisions:
        return None, results
    return ("win" if "win" in decisions else "unchanged"), results


def sequential_stop(
    pairs: Pairs, thresholds: Thresholds, min_pairs: int, max_pairs: int
) -> tuple[PairsDecision, int] | None:
    """(the decision, the pairs it took) when a look at or before `pairs.complete` decided
    it; None while undecided. The harness asks after each pair; the verdict replays it."""
    planned = looks(min_pairs, max_pairs)
    # The last look is the verdict at the end, never an early stop.
    early = [count for count in planned if count < max_pairs]
    return first_decided(pairs, thresholds, early, ALPHA / len(planned))


def first_decided(
    pairs: Pairs, thresholds: Thresholds, schedule: Sequence[int], alpha: float
) -> tuple[PairsDecision, int] | None:
    """(the decision, the pairs it took) of the first look of `schedule` (pair counts, rising)
    that decided, each at `alpha`; None where none of those `pairs.complete` reaches did."""
    for count in schedule:
        if count > pairs.complete:
            return None
        decision, _ = decide(pairs.prefix(count), thresholds, alpha)
        if decision is not None:
            return decision, count
    return None


# -- the verdicts ----------------------------------------------------------------------------------


def collect_pairs(
    calls: Iterable[Mapping[str, Any]], candidates: Mapping[str, str]
) -> dict[tuple[str, str], Pairs]:
    """{(candidate, prompt): its pairs} from warm call records; `candidates`: {candidate cell id:
    its reference's}."""
    found: dict[tuple[str, str], Pairs] = {}
    references: dict[str, list[str]] = {}
    for candidate, reference in candidates.items():
        references.setdefault(reference, []).append(candidate)
    for record in calls:
        if record.get("type") != "call" or record.get("phase") != "warm":
            continue
        cell_id, prompt_id = str(record.get("cell_id")), str(record.get("prompt_id"))
        index = record.get("run_idx")
        if not isinstance(index, int):
            continue
        if cell_id in candidates:
            found.setdefault((cell_id, prompt_id), Pairs()).candidate[index] = record
        for candidate in references.get(cell_id, []):
            found.setdefault((candidate, prompt_id), Pairs()).reference[index] = record
    return {key: pairs for key, pairs in found.items() if pairs.candidate}


def ab_verdicts(calls: Iterable[Mapping[str, Any]], settings: PairedSettings) -> list[Verdict]:
    """Every A/B candidate's verdicts, per prompt and metric, against its reference."""
    candidates = {
        cell_id: cell.reference
        for cell_id, cell in settings.cells.items()
        if cell.reference is not None
    }
    verdicts: list[Verdict] = []
    for (cell_id, prompt_id), pairs in sorted(collect_pairs(calls, candidates).items()):
        verdicts.extend(
            judge_candidate(
                cell_id,
                settings.cells[cell_id],
                prompt_id,
                pairs,
                settings.runs_override,
                settings.sample_on_runs,
            )
        )
    return verdicts


def judge_candidate(
    cell_id: str,
    cell: PairedCell,
    prompt_id: str,
    pairs: Pairs,
    runs_override: int | None = None,
    sample_on_runs: int | None = None,
) -> list[Verdict]:
    """One verdict per metric. Fixed N: large (past the threshold) and significant (Wilcoxon at
    ALPHA). Sequential (`min_runs`), or sampled on past the planned pairs (its budget's runs
    `sample_on_runs`, None: as many again): the look that decided it, or the last, each at its
    share of ALPHA; an early stop as unchanged is `ok`."""
    reference = str(cell.reference)
    max_pairs = runs_override or cell.runs
    min_pairs = min(cell.min_runs or max_pairs, max_pairs)
    alpha, decided_at, stop = ALPHA, None, None
    judged = pairs
    more = sum(1 for record in pairs.candidate.values() if record.get(SAMPLED_ON))
    if more:
        # Sampled on past its planned pairs (run/sample_on.py): judged at the looks of its
        # budget, each at its share of ALPHA, at the first that decided it or else the last.
        planned_pairs = len(pairs.candidate) - more
        budget = budget_runs(planned_pairs, sample_on_runs)
        schedule = sample_on_looks(planned_pairs, budget)
        alpha, max_pairs = ALPHA / len(schedule), planned_pairs + budget
        stop = first_decided(pairs, cell.thresholds, schedule, alpha)
    elif cell.min_runs is not None:
        alpha = ALPHA / len(looks(min_pairs, max_pairs))
        stop = sequential_stop(pairs, cell.thresholds, min_pairs, max_pairs)
    if stop is not None:
        decided_at = stop[1]
        judged = pairs.prefix(decided_at)
    _, results = decide(judged, cell.thresholds, alpha)
    waits, gaps, pinned = judged.engine_waits(), judged.decode_gaps(), judged.pinned_alike()
    by_name = {result.metric.name: result for result in results}
    calls = len(judged.candidate) + len(judged.reference)
    verdicts = []
    for metric in PAIRED_METRICS:
        if pairs.kind not in metric.measure.kinds:
            continue  # a figure the prompt's kind has not (an embedding's TTFT): no verdict
        result = by_name.get(metric.name)
        if result is None:
            result = judge_pairs(metric, [], [], 0.0)
        threshold = ratio_threshold(cell.thresholds, metric.threshold_field)
        kind, message = _word(result, threshold, alpha, decided_at, max_pairs)
        message = f"{message} against {reference}"
        uneven = _uneven_share(kind, result, threshold, waits)
        apart = _placed_apart(kind, result, waits, pinned)
        short = _too_few_gaps(metric, gaps)
        if short is not None:
            change = _change(result, decided_at, max_pairs)
            kind, message = "ungated", f"{change} against {reference}: {short}"
        elif uneven is not None or apart is not None:
            change = _change(result, decided_at, max_pairs)
            kind, message = (
                "unsteady",
                f"{change} against {reference}, not judged: {uneven or apart}",
            )
        decision = Decision(kind, message, result.reference_median, result.ratio, result.p_value)
        verdict = from_decision(
            cell_id, prompt_id, metric.name, decision, current=result.candidate_median
        )
        verdicts.append(
            replace(
                verdict,
                reference=reference,
                interval_low=result.interval[0] if result.interval else None,
                interval_high=result.interval[1] if result.interval else None,
                pairs=result.pairs,
                max_pairs=max_pairs,
                calls=calls,
                busy_s=round(judged.busy_seconds(), 3),
            )
        )
    return verdicts


def _placed_apart(
    kind: VerdictKind,
    result: PairedResult,
    waits: tuple[float, float] | None,
    pinned: str | None,
) -> str | None:
    """Why a verdict beside busy neighbours is not the engines' where they were not pinned alike:
    two processes on a busy machine are not placed alike (which CPU, beside which neighbour,
    how warm its caches are), and A/B cancels only what both sides share. In issue 37's table
    two unchanged engines, unpinned beside two busy processes on 2 cores, differed by -28 % to
    +23 % in the CPU time each took for the same call, session by session, and their TTFT by as
    much: a false regression and a false win, and a +30 % candidate measured +14 %. Any verdict
    but one already undecided is then `unsteady`; where both engines' `launch:` pins them to
    the same CPUs (taskset), or the machine was not busy (both engines waited at most
    PRESSURE_LIMIT for a CPU per ms they ran), the pairs are judged. Remote engines (no wait
    read) are judged on the pairs alone; a figure no pair measured stays as it is."""
    if waits is None or pinned is not None or result.ratio is None:
        return None
    if kind in ("unsteady", "blind"):
        return None
    if max(waits) <= PRESSURE_LIMIT:
        return None
    candidate, reference = waits
    return (
        f"the machine was busy (the candidate's engine waited {candidate:.2f} ms for a CPU per "
        f"ms it ran, the reference's {reference:.2f}; over {PRESSURE_LIMIT:.2f}) and the two "
        "engines were not pinned to the same CPUs, so the machine need not have placed them "
        "alike; pin both (taskset -c in each launch:) or re-run on a quieter machine"
    )


def _too_few_gaps(metric: Metric, gaps: int | None) -> str | None:
    """Why a decode figure of the pairs' replies is not gated for the prompt (too short to
    time: metric.too_short_to_time); None for another figure, long enough replies, or where
    nothing says how long they were."""
    if not metric.measure.decode:
        return None
    return too_short_to_time(gaps)


def _uneven_share(
    kind: VerdictKind,
    result: PairedResult,
    threshold: float,
    waits: tuple[float, float] | None,
) -> str | None:
    """Why a verdict is not the engines' but the machine's: A/B cancels what the machine does to
    both sides only while it shares itself evenly between them. Where each side's engine is a
    local process, its threads' wait for a CPU per ms they ran says how evenly: CPU work takes
    (1 + wait) times as long as on a free CPU, so the candidate's figures were made slower by
    `share` = (1 + its wait) / (1 + the reference's) by the machine alone. The verdict is judged
    again with the ratio (or, for a pass, its interval's worse end) taken back by that factor; a
    regression no longer past the threshold, or a pass or win that no longer holds, is
    `unsteady`. Seen in issue 37's table: an unchanged candidate +25 % TTFT, `regression`, its
    engine waiting 1.00 ms per ms against the reference's 0.67 (share 1.20); and -24.7 % decode
    rate, waiting 0.20 against 0.10 (share 1.09), each beside busy processes on 2 cores."""
    if waits is None or result.ratio is None or kind not in ("regression", "win", "ok"):
        return None
    candidate, reference = waits
    share = (1.0 + candidate) / (1.0 + reference)
    # The ratio as it would have been on an even share: a time taken back by the share, a rate
    # given it back.
    higher = result.metric.higher_is_better

    def even(ratio: float) -> float:
        return ratio * share if higher else ratio / share

    if kind in ("regression", "win"):
        holds = change_direction(1.0, even(result.ratio), threshold, higher_is_better=higher)
        if holds == ("worse" if kind == "regression" else "better"):
            return None
    else:
        worse_end = (
            (result.interval[0] if higher else result.interval[1])
            if result.interval
            else result.ratio
        )
        # Only a regression hiding behind the candidate's better share holds a pass back.
        if change_direction(1.0, even(worse_end), threshold, higher_is_better=higher) != "worse":
            return None
    return (
        "the machine did not share itself evenly: the candidate's engine waited "
        f"{candidate:.2f} ms for a CPU per ms it ran against the reference's {reference:.2f}, "
        f"which alone makes its CPU work {signed_percent(share)}, and the change taken back by "
        f"that is {signed_percent(even(result.ratio))}; re-run on a quieter machine, with both "
        "engines pinned to the same CPUs (taskset -c in each launch:)"
    )


def rules_out_no_change(result: PairedResult) -> bool:
    """Whether the ratio's interval lies wholly on one side of no change (1.0): a regression or
    a win needs it as well as the signed-rank test (without an interval, the test alone)."""
    return result.interval is None or not result.interval[0] <= 1.0 <= result.interval[1]


def _change(result: PairedResult, decided_at: int | None, max_pairs: int) -> str:
    """What the pairs measured: "TTFT p50 +12.3 % [95 % interval …], A/B over 20 pairs"."""
    if result.ratio is None:
        return f"{result.metric.label}: no pair with both calls measured (A/B)"
    interval = (
        f" [{INTERVAL_LEVEL:.0%} interval {signed_percent(result.interval[0])} … "
        f"{signed_percent(result.interval[1])}]"
        if result.interval
        else ""
    )
    over = (
        f"decided after {decided_at} of {max_pairs} pairs"
        if decided_at is not None and decided_at < max_pairs
        else f"over {result.pairs} pairs"
    )
    return f"{result.metric.label} {signed_percent(result.ratio)}{interval}, A/B {over}"


def _word(
    result: PairedResult, threshold: float, alpha: float, decided_at: int | None, max_pairs: int
) -> tuple[VerdictKind, str]:
    metric = result.metric
    change = _change(result, decided_at, max_pairs)
    if result.ratio is None:
        return "inconclusive", change
    smallest_p = min_signed_rank_p(result.pairs)
    kind = verdict_of(result.direction, result.p_value, smallest_p, alpha)
    if result.direction is None:
        within = f"{change} (within the {threshold:.0%} threshold)"
        reach = _worse_reach(result, threshold)
        if reach is not None:
            # A pass only where a change of the threshold's size would have been seen, as
            # against a baseline: here the interval still allows one.
            return "blind", f"{within}, but the gate is blind here: {reach}; raise runs"
        return kind, within
    word = change_word(result.direction, metric.higher_is_better)
    if smallest_p >= alpha:
        return kind, (
            f"{change} ({word}), but {result.pairs} pairs cannot be significant (smallest "
            f"possible p = {smallest_p:.3g} ≥ {alpha:.3g}); raise runs"
        )
    p_value = 1.0 if result.p_value is None else result.p_value
    if kind == "inconclusive":
        return kind, (
            f"{change} ({word}), but not significant (Wilcoxon p = {p_value:.3g} ≥ {alpha:.3g})"
        )
    if not rules_out_no_change(result):
        # Both readings of the pairs must agree: a change their ratio's interval does not tell
        # from none is not earned by the signed-rank test alone (issue 37's table: unchanged
        # candidates at +27.1 % [-0.0 % … +63.0 %] and -50.5 % [-66.1 % … +11.0 %], p < 0.05).
        return "inconclusive", (
            f"{change} ({word}), Wilcoxon p = {p_value:.3g}, but its {INTERVAL_LEVEL:.0%} "
            "interval does not rule out no change; raise runs"
        )
    return kind, f"{change} ({word}), Wilcoxon p = {p_value:.3g}"


def _worse_reach(result: PairedResult, threshold: float) -> str | None:
    """Why the pairs cannot rule out a change of the threshold's size the worse way: the
    interval's far end past it, or no interval (too few pairs); None where they can."""
    if result.interval is None:
        return f"{result.pairs} pairs give no {INTERVAL_LEVEL:.0%} interval"
    low, high = result.interval
    if result.metric.higher_is_better and low < 1.0 - threshold:
        return (
            f"its {INTERVAL_LEVEL:.0%} interval reaches {signed_percent(low)}, past the threshold"
        )
    if not result.metric.higher_is_better and high > 1.0 + threshold:
        return (
            f"its {INTERVAL_LEVEL:.0%} interval reaches {signed_percent(high)}, past the threshold"
        )
    return None
