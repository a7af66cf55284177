"""An undecided figure measured until it is decided (pure): which (cell, prompt)s a session
samples on past its planned runs (a gated figure `blind` or `inconclusive` the worse way, judged
within the run or an A/B candidate's against its reference, where more calls or pairs can
tell), its budget (runs and seconds per (cell, prompt); an A/B candidate's runs are pairs),
the looks at which it is judged again, the level of each look's tests (ALPHA's equal share, as
sequential sampling spends it), and what a verdict still undecided says of the budget."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from pytest_gpubench.results.decision import ALPHA, MAX_LOOKS, look_schedule
from pytest_gpubench.results.gate import Verdict
from pytest_gpubench.results.metric import GATED_METRICS

# The field of a call record measured past the planned runs (ledger/schema.SampledOnFields).
SAMPLED_ON = "sampled_on"
_HIGHER_IS_BETTER = {metric.name: metric.higher_is_better for metric in GATED_METRICS}

Key = tuple[str, str]
# The verdicts that decide a figure against its reference.
_DECIDED = ("ok", "regression", "win")


def undecided(verdicts: Iterable[Verdict]) -> list[Key]:
    """The (cell, prompt)s whose gated figure more calls of this run could decide, sorted; not
    an A/B candidate with a figure already a regression against its reference (its pairs stop
    at the look that found one, results/paired.decide)."""
    given = list(verdicts)
    failed = {
        v.key
        for v in given
        if v.verdict == "regression" and v.reference is not None and v.metric in _HIGHER_IS_BETTER
    }
    return sorted({v.key for v in given if more_calls_could_decide(v)} - failed)


def more_calls_could_decide(verdict: Verdict) -> bool:
    """A gated figure `blind`, or `inconclusive` the worse way, judged within the run or (an A/B
    candidate's) over its pairs: not one judged between runs (a figure judged so is one draw of
    its run, whatever the calls), nor an unsteady machine (not made steady by more calls; an A/B
    pair's uneven share of the machine is not evened by more pairs on the same machine)."""
    if verdict.metric not in _HIGHER_IS_BETTER:
        return False
    if verdict.verdict != "blind" and not _worse_inconclusive(verdict):
        return False
    return verdict.reference is not None or (verdict.noise or "").startswith("within")


def _worse_inconclusive(verdict: Verdict) -> bool:
    """An `inconclusive` change the worse way (an undecided improvement holds nothing back)."""
    if verdict.verdict != "inconclusive" or verdict.change_ratio is None:
        return verdict.verdict == "inconclusive"
    return (verdict.change_ratio < 1.0) == _HIGHER_IS_BETTER[verdict.metric]


def budget_runs(planned: int, sample_on_runs: int | None) -> int:
    """The calls a (cell, prompt) may take past its `planned` ones."""
    return planned if sample_on_runs is None else sample_on_runs


def looks(planned: int, budget: int) -> tuple[int, ...]:
    """The call counts at which a figure sampled on is judged: the planned runs' (the first
    look), then evenly up to the budget's end."""
    return look_schedule(planned, planned + budget, MAX_LOOKS) if budget > 0 else (planned,)


def counts(calls: Iterable[Mapping[str, Any]]) -> dict[Key, tuple[int, int]]:
    """Per (cell, prompt) with calls sampled on: (its planned warm calls, those sampled on)."""
    found: dict[Key, list[int]] = {}
    for call in calls:
        if call.get("phase") != "warm":
            continue
        key = (str(call.get("cell_id")), str(call.get("prompt_id")))
        tally = found.setdefault(key, [0, 0])
        tally[1 if call.get(SAMPLED_ON) else 0] += 1
    return {key: (planned, more) for key, (planned, more) in found.items() if more}


def alphas(calls: Iterable[Mapping[str, Any]], sample_on_runs: int | None) -> dict[Key, float]:
    """Per (cell, prompt) sampled on: the level of its tests, ALPHA's share per look."""
    return {
        key: ALPHA / len(looks(planned, budget_runs(planned, sample_on_runs)))
        for key, (planned, _) in counts(calls).items()
    }


def with_budget(
    verdicts: Sequence[Verdict],
    calls: Iterable[Mapping[str, Any]],
    sample_on_runs: int | None,
    sample_on_seconds: float,
) -> list[Verdict]:
    """The verdicts of a (cell, prompt) sampled on: each gated figure decided says after how
    many calls; each still undecided says what the budget was, what was spent and what would
    settle it."""
    sampled = counts(calls)
    still = set(undecided(verdicts))
    noted = []
    for verdict in verdicts:
        found = sampled.get(verdict.key)
        if found is None or verdict.metric not in _HIGHER_IS_BETTER:
            noted.append(verdict)
            continue
        planned, more = found
        unit = "pairs" if verdict.reference is not None else "calls"
        if verdict.verdict in _DECIDED:
            note = f"; decided with {more} more {unit} sampled on after the planned {planned}"
            noted.append(replace(verdict, message=verdict.message + note))
            continue
        if verdict.key not in still or not more_calls_could_decide(verdict):
            # Undecided for a reason more calls do not reach (said so), or beside a regression.
            noted.append(verdict)
            continue
        runs = budget_runs(planned, sample_on_runs)
        spent = "its runs" if more >= runs else "its seconds"
        other = (
            "or both engines placed alike on a quieter machine"
            if verdict.reference is not None
            else "a baseline of more runs, or runs of history (`gpubench calibrate`)"
        )
        note = (
            f"; sampled on: {more} more {unit} after the planned {planned} left it undecided "
            f"(budget {runs} runs and {sample_on_seconds:g} s per (cell, prompt); {spent} spent): "
            f"settle it with a larger budget (--gpubench-sample-on-runs {2 * max(runs, 1)}, "
            f"--gpubench-sample-on-seconds), {other}"
        )
        noted.append(replace(verdict, message=verdict.message + note))
    return noted
