"""An undecided figure measured until it is decided: at the session's end, before the
re-measure, each (cell, prompt) whose gated figure the planned runs left `blind` or
`inconclusive` (results/sample_on.py) takes more warm calls, round by round in a shuffled order
with the others, and is judged again at each planned look, until decided either way or its
budget (runs and seconds) is spent. Its calls are the first pass's, marked `sampled_on`."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.results.sample_on import SAMPLED_ON, Key, budget_runs, looks, undecided
from pytest_gpubench.results.verdict import Verdict
from pytest_gpubench.run.harness import Harness
from pytest_gpubench.run.remeasure import make_live, warm_case, why_not_remeasured

log = logging.getLogger(__name__)


def measure_call(
    harness: Harness, cell_id: str, prompt_id: str, run_idx: int, live: dict[str, bool]
) -> list[dict[str, Any]]:
    """One more warm call of a (cell, prompt), its cell made live first where it was given back
    (`live`: the cells made so far): its records (stage records, the call marked `sampled_on`);
    no call where its cell could not be made live."""
    made: list[dict[str, Any]] = []
    if not live.setdefault(cell_id, make_live(harness, cell_id, prompt_id, made)):
        return made
    try:
        record, others = harness.run_case(warm_case(harness, cell_id, prompt_id, run_idx))
    except GpubenchError as exc:
        log.warning("sampling on %s %s failed: %s", cell_id, prompt_id, exc)
        return made
    record[SAMPLED_ON] = True
    return [*made, record, *others]


def _seconds(records: Sequence[Mapping[str, Any]], waited: float) -> float:
    """What a call sampled on spent of its (cell, prompt)'s budget: its own duration where its
    record says it (making the cell live again, an engine start, is not the figure's cost),
    else the time waited for it."""
    for record in records:
        if record.get(SAMPLED_ON) and isinstance(record.get("total_duration_ms"), int | float):
            return float(record["total_duration_ms"]) / 1000.0
    return waited


def sample_on(
    harness: Harness,
    judge: Callable[[], Sequence[Verdict]],
    collect: Callable[[list[dict[str, Any]]], str | None],
    planned: dict[Key, int],
    *,
    runs: int | None,
    seconds: float,
    seed: int | None = None,
) -> dict[Key, int]:
    """Sample on each (cell, prompt) of `planned` (its planned warm calls) that `judge()` finds
    undecided, until decided or its budget is spent; the calls each took, by key."""
    order = random.Random(seed)
    todo = [
        key
        for key in undecided(judge())
        if key in planned and why_not_remeasured(harness.matrix, *key) is None
    ]
    taken = dict.fromkeys(todo, 0)
    live: dict[str, bool] = {}
    spent = dict.fromkeys(todo, 0.0)
    schedule = {key: looks(planned[key], budget_runs(planned[key], runs)) for key in todo}
    while todo:
        order.shuffle(todo)
        for key in list(todo):
            started = time.monotonic()
            records = measure_call(harness, *key, planned[key] + taken[key], live)
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
