"""Sequential sampling of A/B pairs while a session runs: each warm call of an A/B group is noted
as it is measured, and once a candidate's verdict for a prompt is decided either way (the rule
of results/paired.py), its remaining pairs are not run but skipped, with the reason."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any

from pytest_gpubench.config.cases import Case
from pytest_gpubench.config.matrix import Cell, Matrix

if TYPE_CHECKING:
    from pytest_gpubench.results.paired import Pairs


class SequentialPairs:
    """The pairs measured so far of every candidate with `min_runs`, and the decided ones."""

    def __init__(self, matrix: Matrix, runs_override: int | None = None) -> None:
        self.matrix = matrix
        self.runs_override = runs_override
        self.pairs: dict[tuple[str, str], Pairs] = {}
        # (candidate, prompt): why its remaining pairs are skipped.
        self.decided: dict[tuple[str, str], str] = {}

    @cached_property
    def candidates(self) -> dict[str, list[Cell]]:
        """{reference cell id: its candidates}, read from the matrix on first use."""
        found: dict[str, list[Cell]] = {}
        for cell in self.matrix.cells:
            if cell.reference is not None:
                found.setdefault(cell.reference, []).append(cell)
        return found

    def _max_pairs(self, cell: Cell) -> int:
        return self.runs_override or cell.runs

    def observe(self, case: Case, record: Mapping[str, Any]) -> None:
        """Note a measured warm call of an A/B group; decide its candidates' pairs it completes."""
        if case.phase != "warm" or case.pair_reference is None or case.load_point is not None:
            return
        # Here, not at the top: the plugin's import must not load scipy (test_architecture).
        from pytest_gpubench.results.paired import Pairs, sequential_stop

        for cell in self.candidates.get(case.pair_reference, []):
            if cell.spec.min_runs is None:
                continue
            if case.cell_id not in (cell.cell_id, case.pair_reference):
                continue
            key = (cell.cell_id, case.prompt_id)
            if key in self.decided:
                continue
            pairs = self.pairs.setdefault(key, Pairs())
            side = pairs.candidate if case.cell_id == cell.cell_id else pairs.reference
            side[case.run_idx] = record
            max_pairs = self._max_pairs(cell)
            stop = sequential_stop(pairs, cell.thresholds, cell.spec.min_runs, max_pairs)
            if stop is not None:
                decision, count = stop
                self.decided[key] = (
                    f"sequential sampling: {cell.cell_id} {case.prompt_id} decided "
                    f"({decision}) after {count} of {max_pairs} pairs against "
                    f"{case.pair_reference}"
                )

    def stopped(self, case: Case) -> str | None:
        """Why this warm case of an A/B group is not run, or None: its candidate's verdict is
        decided, or (the reference's case) every candidate it serves has been decided."""
        if case.phase != "warm" or case.pair_reference is None or case.load_point is not None:
            return None
        if case.cell_id != case.pair_reference:
            return self.decided.get((case.cell_id, case.prompt_id))
        served = self.candidates.get(case.cell_id, [])
        reasons = [self.decided.get((cell.cell_id, case.prompt_id)) for cell in served]
        if not reasons or None in reasons:
            return None
        return "; ".join(reason for reason in reasons if reason is not None)
