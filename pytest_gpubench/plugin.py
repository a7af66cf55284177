"""The pytest plugin: hooks and fixtures only; each hook delegates to the run controller, the
harness, the report or the xdist module."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from pytest_gpubench import xdist
from pytest_gpubench.cases import Case, build_cases, smoke_case
from pytest_gpubench.controller import RunController
from pytest_gpubench.errors import GpubenchError
from pytest_gpubench.harness import Harness
from pytest_gpubench.matrix import Matrix, load_matrix
from pytest_gpubench.options import Options, add_aliases, addoption, option_warnings

CASE_FIXTURE = "gpubench_case"
# Generous on purpose: the engine's own stream timeout (the cell's timeout_s) must fire first, so
# that a slow call is still recorded; this only catches a hang in the harness itself.
CASE_TIMEOUT_FACTOR = 2.0
CASE_TIMEOUT_SLACK_S = 180.0
RUN_KEY = pytest.StashKey[RunController]()
# {test node id: the cells.yaml node it is the last case of}, in the final run order.
RELEASE_KEY = pytest.StashKey[dict[str, str]]()
RECORDS_KEY = pytest.StashKey[list[dict[str, Any]]]()
RENTALS_KEY = pytest.StashKey[list[dict[str, Any]]]()
# The short option aliases another plugin or conftest had already taken.
TAKEN_ALIASES_KEY = pytest.StashKey[tuple[str, ...]]()
# Why a benchmark test collected no cases (the matrix file is missing): a usage error, one line,
# raised once collection is over (an error raised while collecting would be a traceback).
MISSING_MATRIX_KEY = pytest.StashKey[str]()
NOTHING_MEASURED = (
    "{nodeid} asked for gpubench_case but never called gpubench_case.run(): nothing was measured"
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
    options = Options.from_config(config)
    _warn_about_options(config)
    run = RunController(
        options,
        None if options.skip else _matrix(config, options),
        root=options.anchor,
        argv=list(config.invocation_params.args),
        writes_ledger=not xdist.is_worker(config),
        run_id=xdist.worker_run_id(config),
        hooks=config.hook,
    )
    config.stash[RUN_KEY] = run
    config.stash[RELEASE_KEY] = {}
    config.pluginmanager.register(ReportReader(config, run), "gpubench-reports")
    if not xdist.is_worker(config):
        from pytest_gpubench.progress import ProgressLine

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
    try:
        return load_matrix(
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


def _run(config: pytest.Config) -> RunController:
    return config.stash[RUN_KEY]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if CASE_FIXTURE not in metafunc.fixturenames:
        return
    run = _run(metafunc.config)
    if run.options.skip:
        return  # deselected in pytest_collection_modifyitems
    if run.matrix is None:
        missing = (
            f"{run.options.cells_path}: not found; {metafunc.function.__name__} needs the cell "
            f"matrix (looked in {run.options.anchor_kind}; run `gpubench init` there, or pass "
            "--gpubench-cells PATH)"
        )
        if xdist.is_worker(metafunc.config):
            pytest.fail(missing, pytrace=False)  # the controller shows it as a collection error
        metafunc.config.stash[MISSING_MATRIX_KEY] = missing
        metafunc.parametrize(CASE_FIXTURE, [], indirect=True)
        return
    matrix = run.matrix
    params = [
        pytest.param(case, id=case.case_id, marks=_case_marks(matrix, case))
        for case in build_cases(matrix, run.options.runs)
    ]
    metafunc.parametrize(CASE_FIXTURE, params, indirect=True)


def _case_marks(matrix: Matrix, case: Case) -> list[pytest.MarkDecorator]:
    timeout = matrix.cell(case.cell_id).timeout_s * CASE_TIMEOUT_FACTOR + CASE_TIMEOUT_SLACK_S
    return [getattr(pytest.mark, case.phase), pytest.mark.timeout(timeout)]


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if _run(config).options.skip:
        benchmarks = [item for item in items if CASE_FIXTURE in getattr(item, "fixturenames", ())]
        if benchmarks:
            config.hook.pytest_deselected(items=benchmarks)
            items[:] = [item for item in items if item not in benchmarks]
        return
    cases = [item for item in items if _case_of(item) is not None]
    if not cases:
        return
    others = [item for item in items if _case_of(item) is None]
    cases.sort(key=_case_of)  # type: ignore[arg-type]
    run = _run(config)
    if run.options.smoke and run.matrix is not None:
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
    run = _run(session.config)
    session.config.stash[RELEASE_KEY] = _last_case_of_each_node(session.items, run.matrix)
    planned = [case for case in map(_case_of, session.items) if case is not None]
    if not planned or not run.writes_ledger or session.config.option.collectonly:
        return
    try:
        run.begin(planned)
    except GpubenchError as exc:
        raise pytest.UsageError(str(exc)) from None


def _last_case_of_each_node(items: list[pytest.Item], matrix: Matrix | None) -> dict[str, str]:
    """{node id of the item: the node it is the last case of}, in the final run order (after
    every plugin that reorders); a node is given back after that case, and not before."""
    if matrix is None:
        return {}
    last: dict[str, str] = {}
    for item in items:
        case = _case_of(item)
        if case is not None:
            last[matrix.cell(case.cell_id).spec.node] = item.nodeid
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
    harness: Harness
    records: list[dict[str, Any]] = field(default_factory=list)
    record: dict[str, Any] | None = None
    # The test item's user_properties: the call's figures go into the JUnit XML from here.
    properties: list[tuple[str, object]] = field(default_factory=list)

    def run(self) -> dict[str, Any]:
        """Measure the case once; returns its call record (README: "The call record")."""
        from pytest_gpubench.junit import call_properties

        self.record = self.harness.run_case(self.case)
        self.records.append(self.record)
        self.properties.extend(call_properties(self.record))
        return self.record


@pytest.fixture
def gpubench_case(request: pytest.FixtureRequest) -> BenchCase:
    """The (cell, prompt, phase, run_idx) this test measures, with its engine ready."""
    case: Case = request.param
    run = _run(request.config)
    assert run.harness is not None  # cases exist only when the matrix loaded
    records = request.node.stash.setdefault(RECORDS_KEY, [])
    reason, prepared = run.harness.prepare(case)
    records.extend(prepared)
    if reason is not None:
        if run.options.for_publication:
            pytest.fail(f"--for-publication: {case.cell_id} is unavailable: {reason}", False)
        pytest.skip(reason)
    return BenchCase(case, run.harness, records, properties=request.node.user_properties)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.when == "call" and report.passed:
        bench = getattr(item, "funcargs", {}).get(CASE_FIXTURE)
        if isinstance(bench, BenchCase) and bench.record is None:
            report.outcome = "failed"
            report.longrepr = NOTHING_MEASURED.format(nodeid=item.nodeid)
    # Records ride on the report (built-in types only) so xdist carries them to the controller.
    for key, attr in ((RECORDS_KEY, xdist.RECORDS_ATTR), (RENTALS_KEY, xdist.RENTALS_ATTR)):
        pending = item.stash.get(key, [])
        if pending:
            setattr(report, attr, list(pending))
            pending.clear()
    return report


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
    if node is None or run.harness is None:
        return
    # Giving a rented node back may take minutes: not within the case's pytest-timeout.
    cancel_timeout = getattr(item, "cancel_timeout", None)
    if callable(cancel_timeout):
        cancel_timeout()
    rentals = run.release_node(node)
    if rentals:
        item.stash[RENTALS_KEY] = rentals


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    run = _run(session.config)
    if not run.options.probe or run.matrix is None or xdist.is_worker(session.config):
        return None
    run.probe()  # an unhealthy required cell makes the session's status EXIT_UNMEASURED
    return True


# First: the JUnit XML plugin writes its file in its own pytest_sessionfinish.
@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    run = _run(session.config)
    status = run.finish(int(exitstatus), xdist.workeroutput(session.config))
    if status != exitstatus:
        session.exitstatus = status
    if run.ledger is not None:
        from pytest_gpubench.junit import add_gate_failures

        add_gate_failures(session.config, run)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from pytest_gpubench import report

    run = _run(terminalreporter.config)
    lines: list[report.TerminalLine] = []
    if run.startup_error is not None:
        lines.append(report.TerminalLine(f"ERROR: {run.startup_error}", red=True))
    if run.probe_rows:
        terminalreporter.write_sep("=", "gpubench probe")
        lines.append(report.TerminalLine(report.render_probe(run.probe_rows)))
    lines.extend(report.rental_lines(run.rentals()))
    if run.ledger is not None:
        _write(terminalreporter, run, lines)
        lines = []
        terminalreporter.write_sep("=", "gpubench")
        judgement = run.judgement
        lines.extend(report.outcome_lines(run.outcomes))
        lines.extend(
            report.gate_lines(
                judgement.summaries,
                judgement.verdicts,
                baseline_notes=judgement.baseline_notes,
                gate_error=judgement.gate_error,
                baseline_update=run.options.baseline_update,
                baselines_dir=run.options.baselines_dir,
            )
        )
        if run.write_error is not None:
            lines.append(report.TerminalLine(f"ERROR: {run.write_error}", red=True))
        lines.append(report.TerminalLine(f"ledger: {run.ledger.path}"))
    _write(terminalreporter, run, lines)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The last line a person reads is the status the process really exits with."""
    run = config.stash.get(RUN_KEY, None)
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if run is None or run.exit_status is None or terminal is None:
        return
    if run.ledger is None and not run.probe_rows and run.startup_error is None:
        return
    from pytest_gpubench.status import describe

    terminal.write_line(f"gpubench: {describe(run.exit_status)}", red=run.exit_status != 0)


def _write(terminalreporter: pytest.TerminalReporter, run: RunController, lines: list[Any]) -> None:
    """The terminal is one of the two exits (the ledger is the other): secrets cut out here."""
    for line in lines:
        terminalreporter.write_line(run.scrub(line.text), red=line.red)
