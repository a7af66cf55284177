"""xdist scheduling that sends all of a cell's cases to one worker, since they share its engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

from pytest_gpubench.cases import param_id


class CellScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """One scope per cell; every other test is a scope of its own, as under `--dist load`.

    Why not `--dist loadgroup` with an xdist_group mark: xdist 3.8 renames items through
    `item._nodeid`, which pytest 9.2 no longer reads, so the groups silently fall apart.
    """

    def __init__(
        self, config: pytest.Config, log: Any, cells: dict[str, str], refused: Callable[[], bool]
    ) -> None:
        super().__init__(config, log)
        self._cells = cells
        self._refused = refused

    def schedule(self) -> None:
        """Hand out nothing when a reproducibility guard refused the run."""
        if not self._refused():
            super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        cell = self._cells.get(param_id(nodeid))
        return f"gpubench-cell:{cell}" if cell else nodeid
