"""The node pool: one target per node, opened by its first cell and shared by its others, each
node's stage clock, and what rented nodes cost once given back."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from pytest_gpubench.config.matrix import Cell, LocalNode, ProviderNode, SlurmNode, SshNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.secrets import SecretScrubber
from pytest_gpubench.targets import Target, TargetHook, open_target
from pytest_gpubench.targets.stages import Stage, StageClock, StageError, StageOutcome

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
        # The provider APIs and Slurm clusters whose leaked leases (the journal) this run has
        # given back.
        self.released_apis: set[str] = set()
        self.stage_outcomes: list[StageOutcome] = []
        # What each rented node cost, reported by the rental itself when it is given back.
        self.rentals: list[dict[str, Any]] = []

    def target(self, cell: Cell) -> Target:
        """The cell's node, opened once; a node that failed to open fails again at once."""
        node_id = cell.spec.node
        failure = self.failures.get(node_id)
        if failure is not None:
            raise failure
        if node_id not in self.targets:
            if isinstance(cell.node, ProviderNode):
                self._release_leaked(cell.node)
            elif isinstance(cell.node, SlurmNode):
                self._cancel_leaked_jobs(cell.node)
            elif isinstance(cell.node, SshNode):
                self._stop_leaked_servers(cell.node)
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

    def _release_leaked(self, node: ProviderNode) -> None:
        """Give back the sessions of this API that a killed run left (the rental journal), once
        per API; each one's cost is reported as a rental given back now."""
        api = str(node.api).rstrip("/")
        if api in self.released_apis:
            return
        self.released_apis.add(api)
        from pytest_gpubench.targets.leases import RentalJournal
        from pytest_gpubench.targets.provider.leases import release_rental

        journal = RentalJournal()
        for entry in journal.leaked(api):
            log.warning(
                "node %s: session %s was left rented by a run that was killed; giving it back",
                entry.facts.get("node"),
                entry.session_id,
            )
            self._rental_closed(release_rental(entry, journal))

    def _cancel_leaked_jobs(self, node: SlurmNode) -> None:
        """Cancel the Slurm jobs on this node's cluster that a killed run left (the lease
        journal), once per cluster; each is reported as a job given back now."""
        from pytest_gpubench.targets.leases import RentalJournal
        from pytest_gpubench.targets.slurm.leases import cluster_key, leaked_jobs
        from pytest_gpubench.targets.slurm.release import release_job

        cluster = cluster_key(node)
        if cluster in self.released_apis:
            return
        self.released_apis.add(cluster)
        journal = RentalJournal()
        for entry in leaked_jobs(journal, node):
            self._rental_closed(release_job(entry, journal))

    def _stop_leaked_servers(self, node: SshNode) -> None:
        """Stop the managed servers on this ssh node that a killed run left (the lease
        journal), once per node; each is reported as a lease given back now."""
        from pytest_gpubench.targets.leases import RentalJournal
        from pytest_gpubench.targets.ssh.leases import leaked_servers, node_key
        from pytest_gpubench.targets.ssh.release import release_server

        key = node_key(node.host, node.port, node.user or "")
        if key in self.released_apis:
            return
        self.released_apis.add(key)
        journal = RentalJournal()
        for entry in leaked_servers(journal, node):
            self._rental_closed(release_server(entry, journal))

    def clock(self, cell: Cell) -> StageClock:
        """The stage clock of the cell's node, made when the node is first opened; a local
        node's stages are timed but not recorded."""
        node_id = cell.spec.node
        if node_id not in self.clocks:
            node = cell.node
            report = (lambda outcome: None) if isinstance(node, LocalNode) else self._stage_done
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

    def _rental_closed(self, facts: dict[str, Any]) -> None:
        self.rentals.append(self.scrub.record(facts))

    def take(self, node_ids: Iterable[str] | None = None) -> dict[str, Target]:
        """Remove the open targets of these nodes (all when None) from the pool, to close them."""
        chosen = list(self.targets) if node_ids is None else list(node_ids)
        return {node_id: self.targets.pop(node_id) for node_id in chosen if node_id in self.targets}


def plain_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def opening_error(cell: Cell, exc: Exception) -> StageError:
    """A node that could not be opened for a reason no target named: still a failed stage."""
    stage: Stage = "ssh_connect" if isinstance(cell.node, SshNode) else "provision"
    return StageError(stage, f"node {cell.spec.node}: {plain_error(exc)}")
