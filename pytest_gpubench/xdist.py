"""Everything xdist: the controller's hooks (registered only when pytest-xdist is installed), the
scheduler that keeps a node's cases on one worker, and the worker -> controller hand-off."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpubench.core.errors import GpubenchError

if TYPE_CHECKING:
    from pytest_gpubench.config.matrix import Matrix
    from pytest_gpubench.run.controller import RunController

# Worker -> controller: the records of a case and the rentals given back ride on its test report
# (built-in types only), the rentals left at a worker's end on its workeroutput.
RECORDS_ATTR = "gpubench_records"
RENTALS_ATTR = "gpubench_rentals"
RUN_ID_INPUT = "gpubench_run_id"


def worker_run_id(config: pytest.Config) -> str | None:
    """The run id the controller gave this worker; None outside a worker."""
    workerinput: dict[str, Any] = getattr(config, "workerinput", {})
    run_id = workerinput.get(RUN_ID_INPUT)
    return str(run_id) if run_id else None


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def workeroutput(config: pytest.Config) -> dict[str, Any] | None:
    output: dict[str, Any] | None = getattr(config, "workeroutput", None)
    return output


class XdistHooks:
    """The controller side of a distributed run."""

    def __init__(self, config: pytest.Config, run: Callable[[], RunController]) -> None:
        self.config = config
        self.run = run

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[RUN_ID_INPUT] = self.run().run_id

    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        """With the default `--dist load`, keep a node's cases on one worker, in order."""
        run = self.run()
        if config.getvalue("dist") != "load":
            return None
        from pytest_gpubench.config.cases import build_cases, escaped_id

        matrix = run.matrix
        nodes = {
            escaped_id(case.case_id): matrix.cell(case.cell_id).spec.node
            for case in build_cases(matrix, run.options.runs)
        }
        scheduling = node_scheduling_class()
        return scheduling(config, log, nodes, lambda: run.startup_error is not None, matrix)

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """A worker gave back its rented nodes; their cost goes into the controller's ledger."""
        output = getattr(node, "workeroutput", None) or {}
        # pop: xdist calls this hook twice for a worker that was interrupted.
        self.run().add_worker_rentals(output.pop(RENTALS_ATTR, []))

    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        """Under xdist the controller learns of the cases only from the workers' collections."""
        run = self.run()
        if run.started:
            return
        from pytest_gpubench.config.cases import build_cases, escaped_id, own_case_of_id, param_id

        by_id = {
            escaped_id(case.case_id): case for case in build_cases(run.matrix, run.options.runs)
        }
        cases = [
            case
            for case in (
                by_id.get(param_id(test_id)) or own_case_of_id(run.matrix, param_id(test_id))
                for test_id in ids
            )
            if case is not None
        ]
        if not cases:
            return
        try:
            run.begin(cases)
        except GpubenchError as exc:
            run.refuse(exc)
            # The distributed session stops at its next turn; NodeScheduling hands out nothing.
            dsession = self.config.pluginmanager.getplugin("dsession")
            if dsession is not None:
                dsession.shouldstop = run.startup_error


@cache
def node_scheduling_class() -> type[Any]:
    """The scheduler class, built on first use: importing xdist costs a session that has none."""
    from xdist.scheduler import LoadScopeScheduling

    from pytest_gpubench.config.cases import own_case_of_id, param_id

    class NodeScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """One scope per node; every other test is a scope of its own, as under `--dist load`.

        A node's cells share its GPU, its SSH connection and its rental: run side by side they
        would measure each other and rent the machine twice. Different nodes run in parallel.

        Why not `--dist loadgroup` with an xdist_group mark: xdist 3.8 renames items through
        `item._nodeid`, which pytest 9.2 no longer reads, so the groups silently fall apart.
        """

        def __init__(
            self,
            config: pytest.Config,
            log: Any,
            nodes: dict[str, str],
            refused: Callable[[], bool],
            matrix: Matrix,
        ) -> None:
            super().__init__(config, log)
            self._nodes = nodes
            self._refused = refused
            self._matrix = matrix

        def schedule(self) -> None:
            """Hand out nothing when a reproducibility guard refused the run."""
            if not self._refused():
                super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            param = param_id(nodeid)
            node = self._nodes.get(param)
            if node is None:  # a test's own case (its marker is read on the workers)
                case = own_case_of_id(self._matrix, param)
                node = self._matrix.cell(case.cell_id).spec.node if case is not None else None
            return f"gpubench-node:{node}" if node else nodeid

    return NodeScheduling
