"""A first baseline measured in several runs: after the planned calls of a --baseline-update,
each (cell, prompt) with no history yet is measured in more runs, separated in time (a managed
engine stopped and started again before each, an endpoint's runs spaced apart), so that the
baseline's history holds the spread between runs from its first update (results/baseline.py:
each run's figures one entry). Its calls are marked `history_run`."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.results.baseline import HISTORY_RUN
from pytest_gpubench.run.harness import Harness
from pytest_gpubench.run.remeasure import make_live, warm_case

log = logging.getLogger(__name__)

Key = tuple[str, str]
# How long an endpoint's runs are kept apart (its engine cannot be started again from here).
ENDPOINT_SPACING_S = 5.0


def measure_run(
    harness: Harness, planned: dict[Key, int], number: int, *, seed: int | None = None
) -> list[dict[str, Any]]:
    """Run `number` of the (cell, prompt)s in `planned` (each as many warm calls as planned),
    round by round in a shuffled order, after separating it from the run before: each cell's
    managed engine started again, or a pause where a cell's engine is an endpoint. Its records;
    a cell that cannot be made live again is left out."""
    records: list[dict[str, Any]] = []
    order = random.Random(seed)
    live: dict[str, bool] = {}
    endpoint = False
    for cell_id, prompt_id in sorted(planned):
        if cell_id in live:
            continue
        live[cell_id] = make_live(harness, cell_id, prompt_id, records)
        if live[cell_id]:
            try:
                endpoint |= not harness.cells[cell_id].start_again()
            except GpubenchError as exc:
                log.warning("history run %d: %s could not start again: %s", number, cell_id, exc)
                live[cell_id] = False
    if endpoint:
        time.sleep(ENDPOINT_SPACING_S)
    keys = [key for key in planned if live.get(key[0])]
    for round_idx in range(max((planned[key] for key in keys), default=0)):
        todo = [key for key in keys if planned[key] > round_idx]
        order.shuffle(todo)
        for cell_id, prompt_id in todo:
            run_idx = number * planned[(cell_id, prompt_id)] + round_idx
            try:
                record, others = harness.run_case(warm_case(harness, cell_id, prompt_id, run_idx))
            except GpubenchError as exc:
                log.warning("history run %d of %s %s failed: %s", number, cell_id, prompt_id, exc)
                continue
            record[HISTORY_RUN] = number
            records.extend([record, *others])
    return records


def measure_history_runs(
    harness: Harness,
    planned: dict[Key, int],
    runs: int,
    collect: Callable[[list[dict[str, Any]]], str | None],
) -> None:
    """Runs 1 to `runs` - 1 of each (cell, prompt) in `planned` (the planned calls were run 0)."""
    for number in range(1, runs):
        if collect(measure_run(harness, planned, number)) is not None:
            return  # the ledger can no longer be written: the end says so
