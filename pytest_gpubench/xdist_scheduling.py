"""xdist scheduling that sends all of a node's cases to one worker, one cell after another."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

from pytest_gpubench.cases import param_id


class NodeScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """One scope per node; every other test is a scope of its own, as under `--dist load`.

    A node's cells share its GPU, its SSH connection and its rental: run side by side they
    would measure each other and rent the machine twice. Different nodes run in parallel.

    Why not `--dist loadgroup` with an xdist_group mark: xdist 3.8 renames items through
    `item._nodeid`, which pytest 9.2 no longer reads, so the groups silently fall apart.
    """

    def __init__(
        self, config: pytest.Config, log: Any, nodes: dict[str, str], refused: Callable[[], bool]
    ) -> None:
        super().__init__(config, log)
        self._nodes = nodes
        self._refused = refused

    def schedule(self) -> None:
        """Hand out nothing when a reproducibility guard refused the run."""
        if not self._refused():
            super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        node = self._nodes.get(param_id(nodeid))
        return f"gpubench-node:{node}" if node else nodeid
