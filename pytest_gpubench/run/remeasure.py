"""Confirmation before failing: the (cell, prompt) cases suspected of a regression are measured
again at the session's end, interleaved with each other and with the control call (each call is
preceded by it), their call records marked `pass: 2`; results/confirm.py decides on both passes."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

from pytest_gpubench.config.cases import Case
from pytest_gpubench.config.matrix import Matrix
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.run.harness import Harness

log = logging.getLogger(__name__)
REMEASURE_PASS = 2


def why_not_remeasured(matrix: Matrix, cell_id: str, prompt_id: str) -> str | None:
    """Why a suspect cannot be measured again by the harness alone, or None when it can."""
    judged = {judged for judged, _, _ in matrix.cell(cell_id).case_prompts()}
    if prompt_id not in matrix.prompts and prompt_id not in judged:
        return "a test's own requests are measured by the test: not re-measured"
    if matrix.cell(cell_id).spec.duration_s is not None:
        return "a timed cell (duration_s) is not re-measured"
    return None


def remeasure(
    harness: Harness, suspects: Sequence[tuple[str, str, int]], *, seed: int | None = None
) -> list[dict[str, Any]]:
    """Measure each suspect (cell, prompt, runs) `runs` more warm calls, round by round in a
    shuffled order (a drift in the machine then falls on every suspect alike); the records made,
    in order. A cell that cannot be made live again is left out (its suspects stay unconfirmed)."""
    order = random.Random(seed)
    records: list[dict[str, Any]] = []
    harness.measure_pass = REMEASURE_PASS
    live: dict[str, bool] = {}
    try:
        for round_idx in range(max((runs for _, _, runs in suspects), default=0)):
            todo = [s for s in suspects if s[2] > round_idx]
            order.shuffle(todo)
            for cell_id, prompt_id, _ in todo:
                if not live.setdefault(cell_id, make_live(harness, cell_id, prompt_id, records)):
                    continue
                case = warm_case(harness, cell_id, prompt_id, round_idx)
                try:
                    record, others = harness.run_case(case)
                except GpubenchError as exc:
                    log.warning("re-measure of %s %s failed: %s", cell_id, prompt_id, exc)
                    continue
                records.extend([record, *others])
    finally:
        harness.measure_pass = 1
    return records


def warm_case(harness: Harness, cell_id: str, prompt_id: str, run_idx: int) -> Case:
    """A warm case of the suspect (its adapter where its cell chooses them per request)."""
    cell = harness.matrix.cell(cell_id)
    adapter = next((a for judged, _, a in cell.case_prompts() if judged == prompt_id), None)
    return Case(0, 0, 1, 0, run_idx, cell_id, prompt_id, "warm", adapter=adapter)


def make_live(
    harness: Harness, cell_id: str, prompt_id: str, records: list[dict[str, Any]]
) -> bool:
    """The cell live again (its node was given back after its last case): True when it is."""
    reason, made = harness.prepare(Case(0, 0, 1, 0, 0, cell_id, prompt_id, "warm"))
    records.extend(r for r in made if r.get("type") == "stage")
    return reason is None
