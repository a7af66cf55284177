"""The pytest plugin: hooks and fixtures only; each hook delegates to the run controller, the
harness, the report or the xdist module.

Free when unused: the plugin loads in every pytest session of its environment, so what a
benchmark needs (the matrix's pydantic, the harness's HTTP clients) is imported only by a
session that has a cells file or a benchmark test (tests/test_architecture.py checks it)."""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpubench import xdist
from pytest_gpubench.config.options import Options, add_aliases, addoption, option_warnings
from pytest_gpubench.core.errors import GpubenchError

if TYPE_CHECKING:
    from pytest_gpubench.benchmark import BenchCase, BenchEngine, ChatCall
    from pytest_gpubench.config.cases import Case
    from pytest_gpubench.config.matrix import Matrix
    from pytest_gpubench.run.controller import RunController
    from pytest_gpubench.run.guards import FrozenRequests
    from pytest_gpubench.targets import Target
    from pytest_gpubench.targets.protocol import Rental

# What benchmark tests import from here (their annotations): defined in benchmark.py, imported
# on first use (__getattr__).
__all__ = ["BenchCase", "BenchEngine", "ChatCall"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from pytest_gpubench import benchmark

        return getattr(benchmark, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


CASE_FIXTURE = "gpubench_case"
ENGINE_FIXTURE = "gpubench_engine"
# Every benchmark test's parameter, under the three fixtures: its Case. A test that asks for any
# of them is parametrized over the matrix (pytest_generate_tests).
PARAM_FIXTURE = "_gpubench_param"
# Generous on purpose: the engine's own stream timeout (the cell's timeout_s) must fire first, so
# that a slow call is still recorded; this only catches a hang in the harness itself.
CASE_TIMEOUT_FACTOR = 2.0
CASE_TIMEOUT_SLACK_S = 180.0
OPTIONS_KEY = pytest.StashKey[Options]()
# The run of a session that read a cell matrix; none in a session without benchmarks.
RUN_KEY: pytest.StashKey[RunController] = pytest.StashKey()
# {test node id: the cells.yaml node it is the last case of}, in the final run order.
RELEASE_KEY = pytest.StashKey[dict[str, str]]()
RECORDS_KEY = pytest.StashKey[list[dict[str, Any]]]()
RENTALS_KEY: pytest.StashKey[list[Rental]] = pytest.StashKey()
# The short option aliases another plugin or conftest had already taken.
TAKEN_ALIASES_KEY = pytest.StashKey[tuple[str, ...]]()
# Why a benchmark test collected no cases (the matrix file is missing): a usage error, one line,
# raised once collection is over (an error raised while collecting would be a traceback).
MISSING_MATRIX_KEY = pytest.StashKey[str]()
# A test's gpubench marker (or its name) is wrong: a usage error, raised the same way.
MARKER_ERROR_KEY = pytest.StashKey[str]()
FROZEN_KEY: pytest.StashKey[FrozenRequests] = pytest.StashKey()
# A case skipped because its required cell could not be measured: a skipped test that fails
# the run (exit 7), shown as `u` / UNMEASURED rather than a plain `s` (docs/exit-statuses.md).
# The report carries it as a built-in attribute (xdist sends it to the controller).
UNMEASURED_KEY = pytest.StashKey[bool]()
UNMEASURED_ATTR = "gpubench_unmeasured"
NOTHING_MEASURED = (
    "{nodeid} asked for gpubench_case but never called gpubench_case.run(): nothing was measured"
)
NOTHING_MEASURED_ENGINE = (
    "{nodeid} asked for gpubench_engine but never called gpubench_engine.chat(): nothing was "
    "measured"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    addoption(parser)


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> Generator[None, None, None]:
    """The short aliases go in after the initial conftests, so theirs win any clash."""
    yield
    early_config.stash[TAKEN_ALIASES_KEY] = add_aliases(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_gpubench import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cold: first call after the model was forced out of memory")
    config.addinivalue_line("markers", "warm: a call preceded by one to the same model within 60 s")
    config.addinivalue_line(
        "markers", "load: many requests at once at one load point of a cell's load: profile"
    )
    config.addinivalue_line(
        "markers",
        "gpubench(cells=None, phases=None, runs=None): the cases of a test that asks for "
        "gpubench_engine: `cells` the cell ids it runs on (None: every cell of cells.yaml), "
        "`phases` cold and/or warm (None: each cell's), `runs` warm runs per cell (None: the "
        "cell's; --gpubench-runs overrides)",
    )
    options = Options.from_config(config)
    config.stash[OPTIONS_KEY] = options
    config.stash[RELEASE_KEY] = {}
    _warn_about_options(config)
    matrix = None if options.skip else _matrix(config, options)
    if matrix is None:
        return  # no benchmark can run: nothing more is built
    from pytest_gpubench.run.controller import RunController

    run = RunController(
        options,
        matrix,
        root=options.anchor,
        argv=list(config.invocation_params.args),
        writes_ledger=not xdist.is_worker(config),
        run_id=xdist.worker_run_id(config),
        hooks=config.hook,
    )
    config.stash[RUN_KEY] = run
    config.pluginmanager.register(ReportReader(config, run), "gpubench-reports")
    if not xdist.is_worker(config):
        from pytest_gpubench.run.progress import ProgressLine

        config.pluginmanager.register(ProgressLine(config, _case_of), "gpubench-progress")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(
            xdist.XdistHooks(config, lambda: config.stash[RUN_KEY]), "gpubench-xdist"
        )


def _warn_about_options(config: pytest.Config) -> None:
    for warning in option_warnings(config, config.stash.get(TAKEN_ALIASES_KEY, ())):
        config.issue_config_time_warning(pytest.PytestConfigWarning(warning), stacklevel=2)


def _matrix(config: pytest.Config, options: Options) -> Matrix | None:
    if not (options.cells_named or options.cells_path.exists()):
        return None
    from pytest_gpubench.config.matrix import read_matrix

    try:
        return read_matrix(
            options.cells_path,
            options.prompts_path,
            engine_kinds=_kinds(config.hook.pytest_gpubench_engine_kinds()),
            node_kinds=_kinds(config.hook.pytest_gpubench_node_kinds()),
        )
    except GpubenchError as exc:
        raise pytest.UsageError(str(exc)) from None


def _kinds(answers: list[Sequence[str] | str]) -> tuple[str, ...]:
    """The kinds every plugin named, each once, in the order they were first named."""
    named = [kind for kinds in answers for kind in ([kinds] if isinstance(kinds, str) else kinds)]
    return tuple(dict.fromkeys(named))


def _options(config: pytest.Config) -> Options:
    return config.stash[OPTIONS_KEY]


def _run(config: pytest.Config) -> RunController | None:
    return config.stash.get(RUN_KEY, None)


def _benchmark_run(config: pytest.Config) -> RunController:
    """The run of a benchmark case: cases exist only where the matrix was read."""
    return config.stash[RUN_KEY]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if PARAM_FIXTURE not in metafunc.fixturenames:
        return
    options = _options(metafunc.config)
    if options.skip:
        return  # deselected in pytest_collection_modifyitems
    run = _run(metafunc.config)
    if run is None:
        missing = (
            f"{options.cells_path}: not found; {metafunc.function.__name__} needs the cell "
            f"matrix (looked in {options.anchor_kind}; run `gpubench init` there, or pass "
            "--gpubench-cells PATH)"
        )
        if xdist.is_worker(metafunc.config):
            pytest.fail(missing, pytrace=False)  # the controller shows it as a collection error
        metafunc.config.stash[MISSING_MATRIX_KEY] = missing
        metafunc.parametrize(PARAM_FIXTURE, [], indirect=True)
        return
    from pytest_gpubench.config.cases import build_cases
    from pytest_gpubench.config.marker import marked_test_cases

    matrix = run.matrix
    if CASE_FIXTURE in metafunc.fixturenames:
        cases = build_cases(matrix, run.options.runs, seed=run.ab_seed)
    else:
        try:
            cases = marked_test_cases(metafunc, matrix, run.options.runs, run.ab_seed)
        except GpubenchError as exc:
            if xdist.is_worker(metafunc.config):
                pytest.fail(str(exc), pytrace=False)
            metafunc.config.stash.setdefault(MARKER_ERROR_KEY, str(exc))
            cases = []
    params = [
        pytest.param(case, id=case.case_id, marks=_case_marks(matrix, case)) for case in cases
    ]
    metafunc.parametrize(PARAM_FIXTURE, params, indirect=True)


def _case_marks(matrix: Matrix, case: Case) -> list[pytest.MarkDecorator]:
    cell = matrix.cell(case.cell_id)
    timeout = cell.timeout_s * CASE_TIMEOUT_FACTOR + CASE_TIMEOUT_SLACK_S
    if case.load_point is not None and cell.load is not None:
        timeout += cell.load.longest_s
    return [getattr(pytest.mark, case.phase), pytest.mark.timeout(timeout)]


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if _options(config).skip:
        benchmarks = [item for item in items if PARAM_FIXTURE in getattr(item, "fixturenames", ())]
        if benchmarks:
            config.hook.pytest_deselected(items=benchmarks)
            items[:] = [item for item in items if item not in benchmarks]
        return
    cases = [item for item in items if _case_of(item) is not None]
    if not cases:
        return
    others = [item for item in items if _case_of(item) is None]
    cases.sort(key=_case_of)  # type: ignore[arg-type]
    run = _benchmark_run(config)
    if run.options.smoke:
        from pytest_gpubench.config.cases import smoke_case

        skipped = {cell.cell_id for cell in run.matrix.cells if cell.spec.skip}
        chosen = smoke_case([c for c in (_case_of(i) for i in cases) if c], skipped)
        kept = [item for item in cases if _case_of(item) == chosen][:1]
        config.hook.pytest_deselected(items=[item for item in cases if item not in kept])
        cases = kept
    items[:] = others + cases


def pytest_collection_finish(session: pytest.Session) -> None:
    """After every deselection: check the guards and open the ledger if any case will run."""
    missing_matrix = session.config.stash.get(MISSING_MATRIX_KEY, None)
    if missing_matrix is not None:
        raise pytest.UsageError(missing_matrix)
    marker_error = session.config.stash.get(MARKER_ERROR_KEY, None)
    if marker_error is not None:
        raise pytest.UsageError(marker_error)
    run = _run(session.config)
    if run is None:
        return  # no matrix, so no case: nothing to plan
    session.config.stash[RELEASE_KEY] = _last_case_of_each_node(session.items, run.matrix)
    # A test that asks only for gpubench_target measures nothing: its cells are not planned.
    planned = [
        case
        for case, item in ((_case_of(item), item) for item in session.items)
        if case is not None and ENGINE_FIXTURE in getattr(item, "fixturenames", ())
    ]
    if not planned or not run.writes_ledger or _measures_nothing(session.config):
        return
    try:
        run.begin(planned)
    except GpubenchError as exc:
        raise pytest.UsageError(str(exc)) from None


# pytest's options for runs that list or plan and run no test: they measure nothing by design,
# so they write no ledger and claim no status of their own.
MEASURES_NOTHING = (
    "collectonly",
    "showfixtures",
    "show_fixtures_per_test",
    "setupplan",
    "setuponly",
    "markers",
    "help",
    "version",
)


def _measures_nothing(config: pytest.Config) -> bool:
    return any(getattr(config.option, name, False) for name in MEASURES_NOTHING)


def _last_case_of_each_node(items: list[pytest.Item], matrix: Matrix) -> dict[str, str]:
    """{node id of the item: the node it is the last case of}, in the final run order (after
    every plugin that reorders); a node is given back after that case, and not before."""
    last: dict[str, str] = {}
    for item in items:
        case = _case_of(item)
        if case is not None:
            last[matrix.cell(case.cell_id).spec.node] = item.nodeid
    return {nodeid: node for node, nodeid in last.items()}


def _case_of(item: pytest.Item) -> Case | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None or PARAM_FIXTURE not in callspec.params:
        return None  # not a benchmark: nothing to import
    from pytest_gpubench.config.cases import Case

    param = callspec.params[PARAM_FIXTURE]
    return param if isinstance(param, Case) else None


@pytest.fixture
def _gpubench_param(request: pytest.FixtureRequest) -> Case:
    """The case a benchmark test was parametrized with (pytest_generate_tests)."""
    case: Case = request.param
    return case


def _unavailable(item: pytest.Item, run: RunController, case: Case, reason: str) -> None:
    if run.options.for_publication:
        pytest.fail(f"--for-publication: {case.cell_id} is unavailable: {reason}", False)
    spec = run.matrix.cell(case.cell_id).spec if run.matrix is not None else None
    item.stash[UNMEASURED_KEY] = spec is not None and not spec.optional and spec.skip is None
    pytest.skip(reason)


@pytest.fixture
def gpubench_target(request: pytest.FixtureRequest, _gpubench_param: Case) -> Target:
    """The case's node (targets.Target: run commands, copy files), opened by the first case that
    needs it, shared by the node's cells, and given back after the node's last case."""
    run = _benchmark_run(request.config)
    records = request.node.stash.setdefault(RECORDS_KEY, [])
    reason, prepared, target = run.harness.open_node(_gpubench_param)
    records.extend(prepared)
    if reason is not None:
        _unavailable(request.node, run, _gpubench_param, reason)
    assert target is not None
    return target


@pytest.fixture
def gpubench_engine(
    request: pytest.FixtureRequest, _gpubench_param: Case, gpubench_target: Target
) -> BenchEngine:
    """The case's engine on its node: started (managed) and health-checked. Each call of
    chat() is made cold (a restart, an unload) or warm (an unrecorded call first, unless the
    model answered within 60 s) for the case's phase, just before it is measured."""
    from pytest_gpubench.benchmark import BenchEngine
    from pytest_gpubench.run.guards import FrozenRequests

    case = _gpubench_param
    run = _benchmark_run(request.config)
    records = request.node.stash.setdefault(RECORDS_KEY, [])
    # Sequential sampling: a pair whose verdict is decided runs no more; its cases say why.
    stopped, skipped = run.harness.stopped_early(case)
    if stopped is not None:
        records.extend(skipped)
        pytest.skip(stopped)
    reason, prepared = run.harness.prepare(case)
    records.extend(prepared)
    if reason is not None and any(record.get("kind_unsupported") for record in prepared):
        # A kind the cell's engine cannot send: skipped on purpose, as its cell's outcome says
        # (`skipped`, the run not failed for it), not shown as an unmeasured required cell.
        pytest.skip(reason)
    if reason is not None:
        _unavailable(request.node, run, case, reason)
    frozen = request.config.stash.setdefault(FROZEN_KEY, FrozenRequests(run.options.baselines_dir))
    return BenchEngine(
        case,
        run.harness,
        frozen,
        request.node.nodeid,
        records,
        properties=request.node.user_properties,
    )


@pytest.fixture
def gpubench_case(gpubench_engine: BenchEngine) -> BenchCase:
    """The (cell, prompt, phase, run_idx) this test measures, with its engine ready."""
    from pytest_gpubench.benchmark import BenchCase

    return BenchCase(
        gpubench_engine.case,
        gpubench_engine.harness,
        gpubench_engine.records,
        properties=gpubench_engine.properties,
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    funcargs = getattr(item, "funcargs", {})
    if call.when == "call" and report.passed and (ENGINE_FIXTURE in funcargs):
        from pytest_gpubench.benchmark import BenchCase, BenchEngine

        bench, engine = funcargs.get(CASE_FIXTURE), funcargs.get(ENGINE_FIXTURE)
        if isinstance(bench, BenchCase):
            if bench.record is None:
                report.outcome = "failed"
                report.longrepr = NOTHING_MEASURED.format(nodeid=item.nodeid)
        elif isinstance(engine, BenchEngine) and not engine.calls:
            report.outcome = "failed"
            report.longrepr = NOTHING_MEASURED_ENGINE.format(nodeid=item.nodeid)
    if report.skipped and item.stash.get(UNMEASURED_KEY, False):
        setattr(report, UNMEASURED_ATTR, True)
    # Records ride on the report (built-in types only) so xdist carries them to the controller.
    records, rentals = item.stash.get(RECORDS_KEY, []), item.stash.get(RENTALS_KEY, [])
    for pending, attr in ((records, xdist.RECORDS_ATTR), (rentals, xdist.RENTALS_ATTR)):
        if pending:
            setattr(report, attr, list(pending))
            pending.clear()
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(
    report: pytest.TestReport | pytest.CollectReport,
) -> tuple[str, str, tuple[str, Mapping[str, bool]]] | None:
    """Counted as skipped, shown as what it is: a required cell not measured fails the run."""
    if report.skipped and getattr(report, UNMEASURED_ATTR, False):
        return "skipped", "u", ("UNMEASURED", {"red": True})
    return None


class ReportReader:
    """Registered in pytest_configure: pytest_runtest_logreport is given no config, so this
    object holds the run it feeds. In the writing process it keeps every record a case produced
    (wherever it ran) and the rentals a worker gave back (known here even if the run is
    interrupted before the worker ends)."""

    def __init__(self, config: pytest.Config, run: RunController) -> None:
        self.config = config
        self.run = run

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not self.run.writes_ledger:
            return
        records = getattr(report, xdist.RECORDS_ATTR, None)
        if records:
            stop = self.run.collect(records)
            if stop is not None:
                _stop_session(self.config, stop)
        self.run.add_worker_rentals(getattr(report, xdist.RENTALS_ATTR, None) or [])


def _stop_session(config: pytest.Config, reason: str) -> None:
    """No case may start once nothing more can be recorded (pytest's own -x mechanism)."""
    for name in ("session", "dsession"):
        plugin = config.pluginmanager.get_plugin(name)
        if plugin is not None:
            plugin.shouldstop = reason


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """After a node's last case, give the node back (under xdist the node's whole scope runs
    on one worker, so that worker runs its last case too)."""
    run = _run(item.config)
    node = item.config.stash[RELEASE_KEY].get(item.nodeid)
    if node is None or run is None:
        return
    # Giving a rented node back may take minutes: not within the case's pytest-timeout.
    cancel_timeout = getattr(item, "cancel_timeout", None)
    if callable(cancel_timeout):
        cancel_timeout()
    rentals = run.release_node(node)
    if rentals:
        item.stash[RENTALS_KEY] = rentals
    if not run.writes_ledger:
        # On an xdist worker the node's collect and cleanup stages ride on this teardown report.
        item.stash.setdefault(RECORDS_KEY, []).extend(run.harness.stage_records())


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    run = _run(session.config)
    if run is None or not run.options.probe or xdist.is_worker(session.config):
        return None
    run.probe()  # an unhealthy required cell makes the session's status EXIT_UNMEASURED
    return True


# First: the JUnit XML plugin writes its file in its own pytest_sessionfinish.
@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    run = _run(session.config)
    if run is None:
        return
    status = run.finish(int(exitstatus), xdist.workeroutput(session.config))
    if status != exitstatus:
        session.exitstatus = status
    if run.ledger is not None:
        from pytest_gpubench.reports.junit import add_gate_failures

        add_gate_failures(session.config, run.judgement)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    run = _run(terminalreporter.config)
    if run is None:
        return
    rentals = run.rentals()
    if run.startup_error is None and not run.probe_rows and not rentals and run.ledger is None:
        return  # nothing of ours to say: the report's modules (pandas, scipy) stay unloaded
    from pytest_gpubench.run.session_summary import write_session_summary

    write_session_summary(terminalreporter, run, rentals)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The last line a person reads is the status the process really exits with."""
    run = _run(config)
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if run is None or run.exit_status is None or terminal is None:
        return
    if run.ledger is None and not run.probe_rows and run.startup_error is None:
        return
    from pytest_gpubench.core.status import describe

    missing = [o.cell_id for o in run.outcomes if o.optional and o.unmeasured]
    terminal.write_line(
        f"gpubench: {describe(run.exit_status, missing_optional=missing)}",
        red=run.exit_status != 0,
    )
