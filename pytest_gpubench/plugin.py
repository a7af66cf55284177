"""The pytest plugin: options, hooks and the case fixture; each hook delegates to a role module."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from pytest_gpubench.cases import Case, build_cases, escaped_id, param_id, smoke_case
from pytest_gpubench.errors import GpubenchError
from pytest_gpubench.matrix import load_matrix
from pytest_gpubench.run import BenchRun
from pytest_gpubench.settings import Settings, addoption

CASE_FIXTURE = "gpubench_case"
RUN_KEY = pytest.StashKey["BenchRun"]()
RECORDS_KEY = pytest.StashKey[list[dict[str, Any]]]()
NODES_KEY = pytest.StashKey[list[dict[str, Any]]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    addoption(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_gpubench import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cold: first call after the model was forced out of memory")
    config.addinivalue_line("markers", "warm: a call preceded by one to the same model within 60 s")
    settings = Settings.from_config(config)
    matrix = None
    if settings.cells_named or settings.cells_path.exists():
        try:
            matrix = load_matrix(
                settings.cells_path,
                settings.prompts_path,
                engine_kinds=_kinds(config.hook.pytest_gpubench_engine_kinds()),
                node_kinds=_kinds(config.hook.pytest_gpubench_node_kinds()),
            )
        except GpubenchError as exc:
            raise pytest.UsageError(str(exc)) from None
    workerinput = getattr(config, "workerinput", {})
    run_id = workerinput.get("gpubench_run_id")
    bench = BenchRun(config, settings, matrix, run_id)
    config.stash[RUN_KEY] = bench
    # The run object receives every test report (pytest_runtest_logreport) to write the ledger.
    config.pluginmanager.register(bench, "gpubench-run")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistHooks(config), "gpubench-xdist")


def _kinds(answers: list[Sequence[str] | str]) -> tuple[str, ...]:
    """The kinds every plugin named, each once, in the order they were first named."""
    named = [kind for kinds in answers for kind in ([kinds] if isinstance(kinds, str) else kinds)]
    return tuple(dict.fromkeys(named))


def _bench(config: pytest.Config) -> BenchRun:
    return config.stash[RUN_KEY]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if CASE_FIXTURE not in metafunc.fixturenames:
        return
    bench = _bench(metafunc.config)
    if bench.matrix is None:
        raise pytest.UsageError(
            f"{bench.settings.cells_path}: not found; {metafunc.function.__name__} needs the cell "
            "matrix (write cells.yaml at the rootdir or pass --gpubench-cells PATH)"
        )
    params = [
        pytest.param(case, id=case.case_id, marks=bench.case_marks(case))
        for case in build_cases(bench.matrix, bench.settings.runs)
    ]
    metafunc.parametrize(CASE_FIXTURE, params, indirect=True)


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    cases = [item for item in items if _case_of(item) is not None]
    if not cases:
        return
    others = [item for item in items if _case_of(item) is None]
    cases.sort(key=lambda item: _case_of(item))  # type: ignore[arg-type, return-value]
    bench = _bench(config)
    if bench.settings.smoke:
        chosen = smoke_case([c for c in (_case_of(i) for i in cases) if c], bench.skipped_cells())
        kept = [item for item in cases if _case_of(item) == chosen][:1]
        config.hook.pytest_deselected(items=[item for item in cases if item not in kept])
        cases = kept
    items[:] = others + cases


def pytest_collection_finish(session: pytest.Session) -> None:
    """After every deselection: check the guards and open the ledger if any case will run."""
    bench = _bench(session.config)
    bench.release_after = _last_case_of_each_node(session.items, bench)
    planned = sum(1 for item in session.items if _case_of(item) is not None)
    if not planned or not bench.writes_ledger or session.config.option.collectonly:
        return
    try:
        bench.begin(planned)
    except GpubenchError as exc:
        raise pytest.UsageError(str(exc)) from None


def _last_case_of_each_node(items: list[pytest.Item], bench: BenchRun) -> dict[str, str]:
    """{node id of the item: the node it is the last case of}, in the final run order (after
    every plugin that reorders); a node is given back after that case, and not before."""
    if bench.matrix is None:
        return {}
    last: dict[str, str] = {}
    for item in items:
        case = _case_of(item)
        if case is not None:
            last[bench.matrix.cell(case.cell_id).spec.node] = item.nodeid
    return {nodeid: node for node, nodeid in last.items()}


def _case_of(item: pytest.Item) -> Case | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    param = callspec.params.get(CASE_FIXTURE)
    return param if isinstance(param, Case) else None


@dataclass
class BenchCase:
    """What a benchmark test gets: the case, and `run()` to measure it once."""

    case: Case
    bench: BenchRun
    records: list[dict[str, Any]] = field(default_factory=list)
    record: dict[str, Any] | None = None

    def run(self) -> dict[str, Any]:
        assert self.bench.session is not None  # cases exist only when the matrix loaded
        self.record = self.bench.session.run_case(self.case)
        self.records.append(self.record)
        return self.record


@pytest.fixture
def gpubench_case(request: pytest.FixtureRequest) -> BenchCase:
    """The (cell, prompt, phase, run_idx) this test measures, with its engine ready."""
    case: Case = request.param
    bench = _bench(request.config)
    records = request.node.stash.setdefault(RECORDS_KEY, [])
    reason = bench.prepare_cell(case, records)
    if reason is not None:
        if bench.settings.for_publication:
            pytest.fail(f"--for-publication: {case.cell_id} is unavailable: {reason}", False)
        pytest.skip(reason)
    return BenchCase(case, bench, records)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    # Records ride on the report (built-in types only) so xdist carries them to the controller.
    pending = item.stash.get(RECORDS_KEY, [])
    if pending:
        report.gpubench_records = list(pending)  # type: ignore[attr-defined]
        pending.clear()
    released = item.stash.get(NODES_KEY, [])
    if released:
        report.gpubench_nodes = list(released)  # type: ignore[attr-defined]
        released.clear()
    return report


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """After a node's last case, give the node back (under xdist the node's whole scope runs
    on one worker, so that worker runs its last case too)."""
    bench = _bench(item.config)
    node = bench.release_after.get(item.nodeid)
    if node is None or bench.session is None:
        return
    # Giving a rented node back may take minutes: not within the case's pytest-timeout.
    cancel_timeout = getattr(item, "cancel_timeout", None)
    if callable(cancel_timeout):
        cancel_timeout()
    released = bench.release_node(node)
    if released:
        item.stash[NODES_KEY] = released


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    bench = _bench(session.config)
    if not bench.settings.probe or bench.matrix is None or hasattr(session.config, "workerinput"):
        return None
    session.testsfailed = bench.probe()
    return True


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    bench = _bench(session.config)
    status = bench.finish(int(exitstatus))
    if status is not None:
        session.exitstatus = status


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    _bench(terminalreporter.config).summarize(terminalreporter)


class XdistHooks:
    """Registered only when pytest-xdist is installed: the controller side of a distributed run."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput["gpubench_run_id"] = _bench(self.config).run_id

    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        """With the default `--dist load`, keep a node's cases on one worker, in order."""
        bench = _bench(config)
        if config.getvalue("dist") != "load" or bench.matrix is None:
            return None
        from pytest_gpubench.xdist_scheduling import NodeScheduling

        matrix = bench.matrix
        nodes = {
            escaped_id(case.case_id): matrix.cell(case.cell_id).spec.node
            for case in build_cases(matrix, bench.settings.runs)
        }
        return NodeScheduling(config, log, nodes, lambda: bench.startup_error is not None)

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """A worker gave back its rented nodes; their cost goes into the controller's ledger."""
        output = getattr(node, "workeroutput", None) or {}
        # pop: xdist calls this hook twice for a worker that was interrupted.
        _bench(self.config).add_worker_nodes(output.pop("gpubench_nodes", []))

    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        bench = _bench(self.config)
        if bench.matrix is None or bench.started:
            return
        case_ids = {
            escaped_id(case.case_id) for case in build_cases(bench.matrix, bench.settings.runs)
        }
        count = sum(1 for test_id in ids if param_id(test_id) in case_ids)
        if count:
            bench.begin_or_stop(count)
