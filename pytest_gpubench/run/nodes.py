"""The node pool: one target per node, opened by its first cell and shared by its others, each
node's stage clock, and what rented nodes cost once given back."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pytest_gpubench.config.cell import Cell
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.secrets import SecretScrubber
from pytest_gpubench.targets import (
    Target,
    TargetHook,
    open_target,
    opening_stage,
    records_stages,
    release_leaked,
)
from pytest_gpubench.targets.leases import RentalJournal
from pytest_gpubench.targets.stages import StageClock, StageError, StageOutcome

if TYPE_CHECKING:
    from pytest_gpubench.targets.protocol import Rental

log = logging.getLogger(__name__)


class NodePool:
    """One target per node, opened by its first cell and shared by the others (one SSH
    connection, one rented machine); a node that failed to open fails its other cells the same
    way. Keeps what each rented node cost once it is given back."""

    def __init__(self, scrub: SecretScrubber, target_hook: TargetHook | None = None) -> None:
        self.scrub = scrub
        self.target_hook = target_hook
        self.targets: dict[str, Target] = {}
        self.failures: dict[str, GpubenchError] = {}
        # Each remote node's stage clock (its stage timeouts and budget), and the stage outcomes
        # not yet turned into records.
        self.clocks: dict[str, StageClock] = {}
        # The provider APIs, Slurm clusters and SSH hosts whose leaked leases (the journal) this
        # run has given back.
        self.released_places: set[str] = set()
        self.stage_outcomes: list[StageOutcome] = []
        # What each rented node cost, reported by the rental itself when it is given back.
        self.rentals: list[Rental] = []

    def target(self, cell: Cell) -> Target:
        """The cell's node, opened once; a node that failed to open fails again at once."""
        node_id = cell.spec.node
        failure = self.failures.get(node_id)
        if failure is not None:
            raise failure
        if node_id not in self.targets:
            for released in release_leaked(cell.node, RentalJournal(), self.released_places):
                self._rental_closed(released)
            try:
                self.targets[node_id] = open_target(
                    node_id,
                    cell.node,
                    plugin_hook=self.target_hook,
                    on_rental_closed=self._rental_closed,
                    clock=self.clock(cell),
                )
            except Exception as exc:
                failure = exc if isinstance(exc, GpubenchError) else opening_error(cell, exc)
                self.failures[node_id] = failure
                raise failure from None
        return self.targets[node_id]

    def clock(self, cell: Cell) -> StageClock:
        """The stage clock of the cell's node, made when the node is first opened; a local
        node's stages are timed but not recorded."""
        node_id = cell.spec.node
        if node_id not in self.clocks:
            node = cell.node
            report = self._stage_done if records_stages(node) else (lambda outcome: None)
            self.clocks[node_id] = StageClock(
                node_id,
                report=report,
                timeouts=getattr(node, "stage_timeouts", None),
                budget_s=getattr(node, "budget_s", None),
            )
        return self.clocks[node_id]

    def _stage_done(self, outcome: StageOutcome) -> None:
        self.stage_outcomes.append(outcome)

    def take_stage_outcomes(self) -> list[StageOutcome]:
        taken, self.stage_outcomes = self.stage_outcomes, []
        return taken

    def _rental_closed(self, facts: Rental) -> None:
        self.rentals.append(self.scrub.record(facts))

    def take(self, node_ids: Iterable[str] | None = None) -> dict[str, Target]:
        """Remove the open targets of these nodes (all when None) from the pool, to close them."""
        chosen = list(self.targets) if node_ids is None else list(node_ids)
        return {node_id: self.targets.pop(node_id) for node_id in chosen if node_id in self.targets}


def plain_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def opening_error(cell: Cell, exc: Exception) -> StageError:
    """A node that could not be opened for a reason no target named: still a failed stage."""
    return StageError(opening_stage(cell.node), f"node {cell.spec.node}: {plain_error(exc)}")
