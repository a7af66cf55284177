"""One benchmark run across the pytest session: guards, ledger, per-cell preparation, verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tabulate import tabulate

from pytest_gpubench.baseline import baseline_summaries, find_baseline, update_baselines
from pytest_gpubench.cases import Case
from pytest_gpubench.errors import GpubenchError
from pytest_gpubench.gate import Verdict, compare, regressions, success_threshold
from pytest_gpubench.ledger import Ledger, SecretScrubber, scrub_record
from pytest_gpubench.matrix import Matrix
from pytest_gpubench.provenance import (
    git_state,
    load_average,
    meta_record,
    secret_values,
    utc_now,
)
from pytest_gpubench.report import render_summary
from pytest_gpubench.session import BenchSession
from pytest_gpubench.settings import Settings
from pytest_gpubench.stats import PromptSummary, summarize

# SPEC §12: benchmarks ran and at least one regressed.
EXIT_REGRESSION = 6
# Generous on purpose: the engine's own stream timeout (the cell's timeout_s) must fire first, so
# that a slow call is still recorded; this only catches a hang in the harness itself.
CASE_TIMEOUT_FACTOR = 2.0
CASE_TIMEOUT_SLACK_S = 180.0


class BenchRun:
    """State of the run; registered as a plugin so that it sees every test report."""

    def __init__(
        self, config: pytest.Config, settings: Settings, matrix: Matrix | None, run_id: str | None
    ) -> None:
        self.config = config
        self.settings = settings
        self.matrix = matrix
        self.scrub = SecretScrubber(secret_values())
        self.session: BenchSession | None = None
        if matrix is not None:
            self.session = BenchSession(matrix, scrub=self.scrub, hooks=config.hook)
            if run_id:
                self.session.run_id = run_id
            self.session.log_dir = settings.ledger_dir / "logs"
        self.ledger: Ledger | None = None
        self.started = False
        self.startup_error: str | None = None
        self.calls: list[dict[str, Any]] = []
        self.skips: list[dict[str, Any]] = []
        self.cells: dict[str, dict[str, Any]] = {}
        self.probe_rows: list[list[Any]] = []
        self.meta: dict[str, Any] = {}
        self.summaries: list[PromptSummary] = []
        self.verdicts: list[Verdict] = []
        self.gate_error: str | None = None
        self.baseline_notes: list[str] = []
        # Rented nodes given back by xdist workers (the controller's own are in the session),
        # and on a worker how many of its own it has sent on.
        self.worker_nodes: list[dict[str, Any]] = []
        self.nodes_sent = 0
        # {test node id: the cells.yaml node it is the last case of} (plugin.py fills it).
        self.release_after: dict[str, str] = {}

    @property
    def run_id(self) -> str:
        return self.session.run_id if self.session is not None else ""

    @property
    def writes_ledger(self) -> bool:
        return not hasattr(self.config, "workerinput")

    def case_marks(self, case: Case) -> list[pytest.MarkDecorator]:
        assert self.matrix is not None
        cell = self.matrix.cell(case.cell_id)
        timeout = cell.timeout_s * CASE_TIMEOUT_FACTOR + CASE_TIMEOUT_SLACK_S
        return [
            getattr(pytest.mark, case.phase),
            pytest.mark.timeout(timeout),
        ]

    def skipped_cells(self) -> set[str]:
        assert self.matrix is not None
        return {cell.cell_id for cell in self.matrix.cells if cell.spec.skip}

    # -- start ---------------------------------------------------------------------------------

    def check_guards(self) -> dict[str, Any]:
        """SPEC §9: refuse to measure on a dirty tree or a loaded machine, unless told to."""
        git = git_state(self.config.rootpath)
        ledger_prefix = _relative_prefix(self.settings.ledger_dir, self.config.rootpath)
        if ledger_prefix:
            git["git_dirty_files"] = [
                f for f in git["git_dirty_files"] if not f.startswith(ledger_prefix)
            ]
            git["git_dirty"] = bool(git["git_dirty_files"])
        if git["git_dirty"] and not self.settings.allow_dirty:
            shown = ", ".join(git["git_dirty_files"][:5])
            more = len(git["git_dirty_files"]) - 5
            shown += f" and {more} more" if more > 0 else ""
            raise GpubenchError(
                f"git tree {self.config.rootpath} has uncommitted changes ({shown}): commit them, "
                "or pass --allow-dirty to measure anyway (the dirty files go into the ledger)"
            )
        load = load_average()
        if load > self.settings.load_threshold and not self.settings.force_load:
            raise GpubenchError(
                f"1-minute load average is {load:.2f}, above {self.settings.load_threshold:g}: "
                "numbers measured now would not be comparable; wait, or pass --force-load"
            )
        return git

    def begin(self, cases_planned: int) -> None:
        """Check the guards and open the ledger with its meta record (writing process only)."""
        if self.started or self.matrix is None or self.session is None or self.settings.probe:
            return
        git = self.check_guards()
        self.check_frozen_prompts()
        self.started = True
        path = self.settings.ledger_dir / f"{self.run_id}.jsonl"
        self.ledger = Ledger(path, self.scrub)
        self.meta = scrub_record(
            meta_record(
                run_id=self.run_id,
                root=self.config.rootpath,
                git=git,
                env_names=self.settings.env_names,
                cells_planned=[cell.cell_id for cell in self.matrix.cells],
                cases_planned=cases_planned,
                argv=list(self.config.invocation_params.args),
                cells_path=self.settings.cells_path,
                prompts_path=self.settings.prompts_path,
            ),
            self.scrub,
        )
        self.ledger.append(self.meta)

    def check_frozen_prompts(self) -> None:
        """SPEC §4: a prompt never changes under an id that a baseline was measured with."""
        assert self.matrix is not None
        for cell in self.matrix.cells:
            baseline = find_baseline(self.settings.baselines_dir, cell.cell_id)
            for recorded in baseline.prompts if baseline else []:
                prompt = self.matrix.prompts.get(recorded.prompt_id)
                if prompt is None or recorded.prompt_sha256 is None:
                    continue
                if prompt.sha256() != recorded.prompt_sha256:
                    raise GpubenchError(
                        f"{self.settings.prompts_path}: prompt {recorded.prompt_id} changed since "
                        f"the baseline of {cell.cell_id} was measured (sha256 "
                        f"{recorded.prompt_sha256[:12]} -> {prompt.sha256()[:12]}): shipped "
                        "prompts are frozen; restore it and add the new text under a new id"
                    )

    def begin_or_stop(self, cases_planned: int) -> None:
        """Under xdist the controller learns of the cases only from the workers' collections."""
        try:
            self.begin(cases_planned)
        except GpubenchError as exc:
            self.startup_error = str(exc)
            self.started = True
            # The distributed session stops at its next turn; NodeScheduling hands out nothing.
            dsession = self.config.pluginmanager.getplugin("dsession")
            if dsession is not None:
                dsession.shouldstop = self.startup_error

    # -- per case ------------------------------------------------------------------------------

    def prepare_cell(self, case: Case, records: list[dict[str, Any]]) -> str | None:
        """Make the case's cell ready; return why it cannot run, or None."""
        assert self.session is not None
        runtime, fresh = self.session.runtime(case.cell_id)
        if fresh and runtime.cell_record:
            records.append({**runtime.cell_record, "benchmark_run_id": self.run_id})
        if runtime.unavailable is not None:
            records.append(
                self.session.skipped_record(
                    case, case.cell_id, runtime.unavailable, runtime.unavailable_stage
                )
            )
            return runtime.unavailable
        return None

    def collect(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            kind = record.get("type")
            if kind == "call":
                self.calls.append(record)
            elif kind == "skipped":
                self.skips.append(record)
            elif kind == "cell":
                if record["cell_id"] in self.cells:
                    continue  # each xdist worker that ran the cell describes it; keep the first
                self.cells[record["cell_id"]] = record
            if self.ledger is not None:
                self.ledger.append(record)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not self.writes_ledger:
            return
        records = getattr(report, "gpubench_records", None)
        if records:
            self.collect(records)
        # A worker's rented node, given back after its last case: known here even if the run is
        # interrupted before the worker ends.
        self.add_worker_nodes(getattr(report, "gpubench_nodes", None) or [])

    # -- probe ---------------------------------------------------------------------------------

    def probe(self) -> int:
        """Health-check every cell; returns how many are unavailable."""
        assert self.matrix is not None and self.session is not None
        unavailable = 0
        for cell in self.matrix.cells:
            runtime, _ = self.session.runtime(cell.cell_id)
            record = runtime.cell_record
            status = "ok" if runtime.unavailable is None else runtime.unavailable
            unavailable += runtime.unavailable is not None
            self.probe_rows.append(
                [
                    cell.cell_id,
                    record.get("engine_version") or "-",
                    record.get("model_digest") or "-",
                    self.scrub(status),
                ]
            )
        self.session.close()
        return unavailable if self.settings.for_publication else 0

    # -- end -----------------------------------------------------------------------------------

    def release_node(self, node_id: str) -> list[dict[str, Any]]:
        """Give a node back after its last case; on a worker, the facts for the controller."""
        assert self.session is not None
        try:
            self.session.release_node(node_id)
        finally:
            unsent = self.unsent_nodes()
        return unsent

    def unsent_nodes(self) -> list[dict[str, Any]]:
        if self.writes_ledger or self.session is None:
            return []
        unsent = self.session.closed_nodes[self.nodes_sent :]
        self.nodes_sent = len(self.session.closed_nodes)
        return unsent

    def add_worker_nodes(self, nodes: list[dict[str, Any]]) -> None:
        """Facts a worker sent, on a test report or at its end; each rental counted once."""
        known = {(node.get("node"), node.get("session_id")) for node in self.worker_nodes}
        for node in nodes:
            if (node.get("node"), node.get("session_id")) not in known:
                self.worker_nodes.append(node)
                known.add((node.get("node"), node.get("session_id")))

    def closed_nodes(self) -> list[dict[str, Any]]:
        own = self.session.closed_nodes if self.session is not None else []
        return sorted([*own, *self.worker_nodes], key=lambda node: str(node.get("node")))

    def finish(self, exitstatus: int) -> int | None:
        """Give everything back, then judge and close the ledger, even if giving back failed."""
        try:
            if self.session is not None:
                self.session.close()
        finally:
            workeroutput = getattr(self.config, "workeroutput", None)
            if workeroutput is not None:
                # xdist sends this to the controller, which writes it into the end record.
                workeroutput["gpubench_nodes"] = self.unsent_nodes()
            status = self.close_ledger(exitstatus)
        return status

    def close_ledger(self, exitstatus: int) -> int | None:
        status: int | None = None
        if self.startup_error is not None:
            status = int(pytest.ExitCode.USAGE_ERROR)
        if self.ledger is not None and self.calls:
            status = self.judge(exitstatus) or status
        if self.ledger is not None:
            self.ledger.append(
                {
                    "type": "end",
                    "benchmark_run_id": self.run_id,
                    "finished_at_utc": utc_now(),
                    "load_avg_end": load_average(),
                    "pytest_exitstatus": exitstatus,
                    "calls": len(self.calls),
                    "skipped": len(self.skips),
                    "verdicts": [verdict.to_record() for verdict in self.verdicts],
                    "regressions": len(regressions(self.verdicts)),
                    "gate_error": self.gate_error,
                    "nodes": self.closed_nodes(),
                }
            )
            self.ledger.close()
        return status

    def judge(self, exitstatus: int) -> int | None:
        """Compare with the baselines (SPEC §8); 6 when a benchmark regressed, None otherwise."""
        assert self.matrix is not None
        self.summaries = summarize(self.calls)
        thresholds = {cell.cell_id: cell.thresholds for cell in self.matrix.cells}
        try:
            baselines = baseline_summaries(self.settings.baselines_dir, self.cells_measured())
            self.verdicts = compare(baselines, self.summaries, thresholds)
        except GpubenchError as exc:
            self.gate_error = self.scrub(str(exc))
            return int(pytest.ExitCode.USAGE_ERROR)
        if self.settings.baseline_update:
            self.update_baselines()
            return None
        if regressions(self.verdicts) and exitstatus == pytest.ExitCode.OK:
            return EXIT_REGRESSION
        return None

    def cells_measured(self) -> list[str]:
        return sorted({call["cell_id"] for call in self.calls})

    def update_baselines(self) -> None:
        assert self.matrix is not None
        minimum = {cell.cell_id: success_threshold(cell.thresholds) for cell in self.matrix.cells}
        records = [self.meta, *self.cells.values(), *self.calls, *self.skips]
        try:
            update = update_baselines(self.settings.baselines_dir, records, minimum)
        except GpubenchError as exc:
            self.gate_error = self.scrub(str(exc))
            return
        for cell_id, path in sorted(update.written.items()):
            self.baseline_notes.append(f"baseline written: {cell_id} -> {path}")
        for cell_id, reason in sorted(update.refused.items()):
            self.baseline_notes.append(f"baseline NOT written for {cell_id}: {reason}")

    def summarize(self, reporter: pytest.TerminalReporter) -> None:
        if self.startup_error is not None:
            reporter.write_line(f"ERROR: {self.scrub(self.startup_error)}", red=True)
        if self.probe_rows:
            reporter.write_sep("=", "gpubench probe")
            table = tabulate(
                self.probe_rows, headers=["cell", "engine version", "model digest", "status"]
            )
            reporter.write_line(table)
        self.report_rented_nodes(reporter)
        if self.ledger is None:
            return
        reporter.write_sep("=", "gpubench")
        if self.calls:
            reporter.write_line(self.scrub(render_summary(self.summaries, self.verdicts)))
        for note in self.baseline_notes:
            reporter.write_line(note)

        if self.gate_error is not None:
            reporter.write_line(f"ERROR: {self.gate_error}", red=True)
        found = regressions(self.verdicts)
        if found and not self.settings.baseline_update:
            reporter.write_line(
                f"gpubench: {len(found)} regression(s) against {self.settings.baselines_dir}; "
                f"exit status {EXIT_REGRESSION}",
                red=True,
            )
        reporter.write_line(f"ledger: {self.ledger.path}")

    def report_rented_nodes(self, reporter: pytest.TerminalReporter) -> None:
        """What each rented node cost, and loudly any session that could not be ended."""
        for node in self.closed_nodes():
            done = "marked done" if node.get("session_done") else "NOT marked done: end it by hand"
            reporter.write_line(
                f"rented node {node.get('node')}: {node.get('gpu_name')} at "
                f"{node.get('price_per_hour')}/h for {node.get('elapsed_s')} s, cost "
                f"{node.get('cost')}; session {node.get('session_id')} {done}",
                red=not node.get("session_done"),
            )


def _relative_prefix(path: Path, root: Path) -> str | None:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix().rstrip("/") + "/"
    except ValueError:
        return None
