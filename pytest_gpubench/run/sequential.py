"""Sequential sampling while a session runs: each warm call of an A/B group, or of a cell judged
against its baseline, is noted as it is measured, and once a candidate's verdict for a prompt
(the rule of results/paired.py), or a (cell, prompt)'s against its baseline (the rule of
results/sequential_runs.py), is decided either way, its remaining runs are not run but skipped,
with the reason."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpubench.config.cases import Case
from pytest_gpubench.config.cell import Cell
from pytest_gpubench.config.matrix import Matrix
from pytest_gpubench.core.errors import GpubenchError

if TYPE_CHECKING:
    from pytest_gpubench.results.baseline import CellBaseline
    from pytest_gpubench.results.pairs import Pairs
    from pytest_gpubench.results.stats import PromptSummary


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
        from pytest_gpubench.results.paired import sequential_stop
        from pytest_gpubench.results.pairs import Pairs

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


class SequentialRuns:
    """Sequential sampling of the (cell, prompt)s judged against a baseline: each cell with
    `min_runs` and no `reference:` has its warm calls noted as they are measured, and once its
    verdict against the baseline is decided either way (results/sequential_runs.py), its
    remaining runs are not run but skipped, with the reason. Off while ratifying a baseline (a
    baseline measures every run) and where no baseline exists yet."""

    def __init__(self, matrix: Matrix) -> None:
        self.matrix = matrix
        self.runs_override: int | None = None
        self.baselines_dir: Path | None = None
        self.calls: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        self.decided: dict[tuple[str, str], str] = {}
        self._baselines: dict[str, CellBaseline | None] = {}

    def _baseline(self, cell_id: str, prompt_id: str) -> PromptSummary | None:
        if self.baselines_dir is None:
            return None
        if cell_id not in self._baselines:
            from pytest_gpubench.results.baseline import find_baseline

            try:
                self._baselines[cell_id] = find_baseline(self.baselines_dir, cell_id)
            except GpubenchError:
                # The gate reports a baseline it cannot read; sampling just runs every call.
                self._baselines[cell_id] = None
        baseline = self._baselines[cell_id]
        return (
            next((p for p in baseline.prompts if p.prompt_id == prompt_id), None)
            if baseline
            else None
        )

    def observe(self, case: Case, record: Mapping[str, Any]) -> None:
        """Note a measured warm call; decide its (cell, prompt) when a planned look does."""
        if case.phase != "warm" or case.pair_reference is not None or case.load_point is not None:
            return
        cell = self.matrix.cell(case.cell_id)
        if cell.spec.min_runs is None or cell.reference is not None:
            return
        key = (case.cell_id, case.prompt_id)
        if key in self.decided:
            return
        baseline = self._baseline(*key)
        if baseline is None:
            return
        from pytest_gpubench.results.sequential_runs import sequential_stop

        calls = self.calls.setdefault(key, [])
        calls.append(record)
        max_runs = self.runs_override or cell.runs
        stop = sequential_stop(calls, baseline, cell.thresholds, cell.spec.min_runs, max_runs)
        if stop is not None:
            decision, count = stop
            self.decided[key] = (
                f"sequential sampling: {case.cell_id} {case.prompt_id} decided ({decision}) "
                f"after {count} of {max_runs} runs against its baseline"
            )

    def stopped(self, case: Case) -> str | None:
        """Why this warm case is not run (its (cell, prompt) decided), or None."""
        if case.phase != "warm" or case.load_point is not None:
            return None
        return self.decided.get((case.cell_id, case.prompt_id))
