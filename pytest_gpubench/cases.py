"""The cases: every (cell, prompt, phase, run_idx) a benchmark test is parametrized over."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_gpubench.matrix import PHASES, Matrix

COLD_RUNS = 1


@dataclass(frozen=True, order=True)
class Case:
    # Field order is the run order: a node's cells together (so that a rented node can be given
    # back after its last case), a cell's cases together, its cold cases first.
    node_index: int
    cell_index: int
    phase_index: int
    prompt_index: int
    run_idx: int
    cell_id: str
    prompt_id: str
    phase: str

    @property
    def case_id(self) -> str:
        return f"{self.cell_id}-{self.prompt_id}-{self.phase}-{self.run_idx}"


def build_cases(matrix: Matrix, runs_override: int | None = None) -> list[Case]:
    """All cases in a deterministic order (xdist needs the same order on every worker)."""
    cases = []
    node_order = list(dict.fromkeys(cell.spec.node for cell in matrix.cells))
    for cell in matrix.cells:
        for phase in cell.spec.phases:
            runs = COLD_RUNS if phase == "cold" else (runs_override or cell.runs)
            for prompt_index, prompt_id in enumerate(cell.prompt_ids):
                for run_idx in range(runs):
                    cases.append(
                        Case(
                            node_index=node_order.index(cell.spec.node),
                            cell_index=cell.index,
                            phase_index=PHASES.index(phase),
                            prompt_index=prompt_index,
                            run_idx=run_idx,
                            cell_id=cell.cell_id,
                            prompt_id=prompt_id,
                            phase=phase,
                        )
                    )
    return sorted(set(cases))


def smoke_case(cases: list[Case], skipped_cells: set[str]) -> Case | None:
    """The case --smoke runs: the first runnable cell's first prompt, one run, warm if it can."""
    runnable = [case for case in cases if case.cell_id not in skipped_cells] or cases
    if not runnable:
        return None
    first_cell = runnable[0].cell_id
    of_cell = [case for case in runnable if case.cell_id == first_cell]
    warm = [case for case in of_cell if case.phase == "warm"]
    return (warm or of_cell)[0]


def param_id(node_id: str) -> str:
    """The parameter id of a node id (`test_generate[<case id>]` -> `<case id>`)."""
    if "[" not in node_id:
        return ""
    return node_id.split("[", 1)[1].rsplit("]", 1)[0]


# pytest escapes non-ASCII and non-printable characters in parameter ids (_pytest.compat's
# ascii_escaped), so a node id names `modèle` as `mod\xe8le`.
_NON_PRINTABLE = {i: f"\\x{i:02x}" for i in range(128) if i not in range(32, 127)}
_NON_PRINTABLE.update({ord("\t"): "\\t", ord("\r"): "\\r", ord("\n"): "\\n"})


def escaped_id(case_id: str) -> str:
    """A case id as it appears inside a pytest node id."""
    return case_id.encode("unicode_escape").decode("ascii").translate(_NON_PRINTABLE)
