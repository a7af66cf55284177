"""A benchmark test's own cases (a test that asks for gpubench_engine with requests of its own):
its id in the ledger and the baselines (its name, unique), and its gpubench marker's keywords
(cells, phases, runs) checked, each mistake one line naming the test."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpubench.config.cases import Case, build_test_cases
from pytest_gpubench.config.cell import PHASES
from pytest_gpubench.core.errors import GpubenchError

if TYPE_CHECKING:
    from pytest_gpubench.config.matrix import Matrix

MARKER = "gpubench"
MARKER_KEYS = ("cells", "phases", "runs")
# {test id: the node id of the test that has it}: two tests may not share a name.
TEST_IDS_KEY = pytest.StashKey[dict[str, str]]()


def _test_id(metafunc: pytest.Metafunc) -> str:
    """A test's id in the ledger and the baselines: its name (`TestClass.test_name` in a class)."""
    name = metafunc.function.__name__
    return f"{metafunc.cls.__name__}.{name}" if metafunc.cls is not None else name


def marked_test_cases(
    metafunc: pytest.Metafunc, matrix: Matrix, runs_override: int | None, seed: int
) -> list[Case]:
    """The cases of a test that measures requests of its own, from its gpubench marker."""
    test_id = _test_id(metafunc)
    where = metafunc.definition.nodeid
    taken = metafunc.config.stash.setdefault(TEST_IDS_KEY, {})
    other = taken.setdefault(test_id, where)
    if other != where:
        raise GpubenchError(
            f"{where}: another benchmark test has the name {test_id} ({other}): a test's name is "
            "its id in the ledger and the baselines; rename one of them"
        )
    if test_id in matrix.prompts:
        raise GpubenchError(
            f"{where}: {test_id} is also a prompt id of {matrix.prompts_path}: a test's name is "
            "its id in the ledger and the baselines; rename the test or the prompt"
        )
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        return build_test_cases(matrix, test_id, runs_override=runs_override, seed=seed)
    mark = f"{where}: @pytest.mark.{MARKER}"
    if marker.args:
        raise GpubenchError(f"{mark}: takes keywords only ({', '.join(MARKER_KEYS)})")
    unknown = sorted(set(marker.kwargs) - set(MARKER_KEYS))
    if unknown:
        raise GpubenchError(
            f"{mark}: unknown keyword {unknown[0]!r} (known: {', '.join(MARKER_KEYS)})"
        )
    cells = _names(marker.kwargs.get("cells"), f"{mark}: cells")
    known_cells = [cell.cell_id for cell in matrix.cells]
    for cell_id in cells or ():
        if cell_id not in known_cells:
            raise GpubenchError(
                f"{mark}: cells: '{cell_id}' is not a cell of {matrix.cells_path} "
                f"(cells: {', '.join(known_cells)})"
            )
    phases = _names(marker.kwargs.get("phases"), f"{mark}: phases")
    for phase in phases or ():
        if phase not in PHASES:
            raise GpubenchError(f"{mark}: phases: '{phase}' is not one of {', '.join(PHASES)}")
    runs = marker.kwargs.get("runs")
    if runs is not None and (isinstance(runs, bool) or not isinstance(runs, int) or runs < 1):
        raise GpubenchError(f"{mark}: runs: expected a positive integer, got {runs!r}")
    return build_test_cases(
        matrix,
        test_id,
        cells=cells,
        phases=phases,
        runs=runs,
        runs_override=runs_override,
        seed=seed,
    )


def _names(value: Any, where: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
        raise GpubenchError(f"{where}: expected a non-empty list of names, got {value!r}")
    if not all(isinstance(item, str) for item in value):
        raise GpubenchError(f"{where}: expected a list of names, got {value!r}")
    return list(value)
