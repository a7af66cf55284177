"""An undecided figure measured until it is decided: at the session's end, before the
re-measure, each (cell, prompt) whose gated figure the planned runs left `blind` or
`inconclusive` (results/sample_on.py) takes more warm calls, round by round in a shuffled order
with the others, and is judged again at each planned look, until decided either way or its
budget (runs and seconds) is spent. Its calls are the first pass's, marked `sampled_on`. An A/B
candidate samples on in pairs: its call and its reference's, of one run_idx, in the order the
session's A/B seed draws for that pair (config/cases.pair_order)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from pytest_gpubench.config.cases import ab_groups, pair_order
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.results.sample_on import SAMPLED_ON, Key, budget_runs, looks, undecided
from pytest_gpubench.results.verdict import Verdict
from pytest_gpubench.run.harness import Harness
from pytest_gpubench.run.remeasure import make_live, warm_case, why_not_remeasured

log = logging.getLogger(__name__)


def measure_call(
    harness: Harness,
    cell_id: str,
    prompt_id: str,
    run_idx: int,
    live: dict[str, bool],
    *,
    pair: tuple[str, int] | None = None,
) -> list[dict[str, Any]]:
    """One more warm call of a (cell, prompt), its cell made live first where it was given back
    (`live`: the cells made so far): its records (stage records, the call marked `sampled_on`);
    no call where its cell could not be made live. `pair`: an A/B group's (reference, place in
    the pair's order), written on the call as a planned pair's is."""
    made: list[dict[str, Any]] = []
    if not live.setdefault(cell_id, make_live(harness, cell_id, prompt_id, made)):
        return made
    case = warm_case(harness, cell_id, prompt_id, run_idx)
    if pair is not None:
        group = ab_groups(harness.matrix)[pair[0]]
        case = replace(case, pair_reference=pair[0], pair_group=group[0].index, pair_order=pair[1])
    try:
        record, others = harness.run_case(case)
    except GpubenchError as exc:
        log.warning("sampling on %s %s failed: %s", cell_id, prompt_id, exc)
        return made
    record[SAMPLED_ON] = True
    return [*made, record, *others]


def measure_pair(
    harness: Harness,
    cell_id: str,
    prompt_id: str,
    run_idx: int,
    live: dict[str, bool],
    seed: int,
) -> list[dict[str, Any]]:
    """One more pair of an A/B candidate: its call and its reference's, of one run_idx, in the
    order `seed` (the session's A/B seed) draws for the pair; where the first could not be
    measured, not the second."""
    reference = str(harness.matrix.cell(cell_id).reference)
    records: list[dict[str, Any]] = []
    for place, member in enumerate(
        pair_order(seed, reference, prompt_id, run_idx, [reference, cell_id])
    ):
        made = measure_call(harness, member, prompt_id, run_idx, live, pair=(reference, place))
        records.extend(made)
        if not any(r.get(SAMPLED_ON) for r in made):
            break
    return records


def _seconds(records: Sequence[Mapping[str, Any]], waited: float) -> float:
    """What the calls sampled on spent of their (cell, prompt)'s budget: their own durations
    where their records say them (making the cell live again, an engine start, is not the
    figure's cost), else the time waited for them."""
    durations = [
        float(record["total_duration_ms"]) / 1000.0
        for record in records
        if record.get(SAMPLED_ON) and isinstance(record.get("total_duration_ms"), int | float)
    ]
    return sum(durations) if durations else waited


def _measurable(harness: Harness, cell_id: str, prompt_id: str) -> bool:
    """Whether the harness alone can measure the (cell, prompt) again, and an A/B candidate's
    reference too."""
    reference = harness.matrix.cell(cell_id).reference
    return all(
        why_not_remeasured(harness.matrix, cell, prompt_id) is None
        for cell in (cell_id, *([reference] if reference else []))
    )


def sample_on(
    harness: Harness,
    judge: Callable[[], Sequence[Verdict]],
    collect: Callable[[list[dict[str, Any]]], str | None],
    planned: dict[Key, int],
    *,
    runs: int | None,
    seconds: float,
    seed: int | None = None,
    pair_seed: int = 0,
) -> dict[Key, int]:
    """Sample on each (cell, prompt) of `planned` (its planned warm calls) that `judge()` finds
    undecided, until decided or its budget is spent; the calls each took, by key (an A/B
    candidate's: its pairs, in the order `pair_seed` draws)."""
    order = random.Random(seed)
    todo = [key for key in undecided(judge()) if key in planned and _measurable(harness, *key)]
    taken = dict.fromkeys(todo, 0)
    live: dict[str, bool] = {}
    spent = dict.fromkeys(todo, 0.0)
    schedule = {key: looks(planned[key], budget_runs(planned[key], runs)) for key in todo}
    while todo:
        order.shuffle(todo)
        for key in list(todo):
            started = time.monotonic()
            run_idx = planned[key] + taken[key]
            records = (
                measure_pair(harness, *key, run_idx, live, pair_seed)
                if harness.matrix.cell(key[0]).reference is not None
                else measure_call(harness, *key, run_idx, live)
            )
            spent[key] += _seconds(records, time.monotonic() - started)
            if collect(records) is not None:
                return taken  # the ledger can no longer be written: the end says so
            if not any(r.get(SAMPLED_ON) for r in records):
                todo.remove(key)  # its cell could not be made live: judged as it stands
                continue
            taken[key] += 1
        at_look = [k for k in todo if planned[k] + taken[k] in schedule[k]]
        still = set(undecided(judge())) if at_look else set()
        todo = [
            key
            for key in todo
            if (key not in at_look or key in still)
            and taken[key] < budget_runs(planned[key], runs)
            and spent[key] < seconds
        ]
    return taken
