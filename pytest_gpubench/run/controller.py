"""The run controller: begins the run (guards, ledger, meta), collects every record, and at the
end has it judged (results/judging.py) and closes the ledger. It never draws. Only a session
that read a cell matrix builds one: a session without benchmarks pays for nothing here."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpubench.config.cases import seed_of_run
from pytest_gpubench.config.shards import shard_facts, shard_matrix
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.secrets import SecretScrubber
from pytest_gpubench.core.signals import TerminateAsInterrupt
from pytest_gpubench.core.status import session_status
from pytest_gpubench.engines.protocol import EngineFacts
from pytest_gpubench.ledger.records import end_record, meta_record
from pytest_gpubench.ledger.schema import as_json
from pytest_gpubench.ledger.writer import Ledger, LedgerWriteError
from pytest_gpubench.reports.frame_cache import ColumnCacheWriter
from pytest_gpubench.reports.pr_summary import render_pr_summary, report_pointer, write_pr_summary
from pytest_gpubench.results.judging import (
    Judgement,
    RunRecords,
    first_pass_verdicts,
    judge_run,
    judged_end,
    not_remeasured_record,
    pair_verdicts,
)
from pytest_gpubench.results.judging_settings import JudgingSettings
from pytest_gpubench.results.ratification import (
    BaselineUpdatePlan,
    baseline_update_plan,
    take_baseline_update,
    take_load_update,
)
from pytest_gpubench.run import guards
from pytest_gpubench.run.guards import FrozenRequests
from pytest_gpubench.run.harness import Harness
from pytest_gpubench.run.remeasure import why_not_remeasured

if TYPE_CHECKING:
    from pytest_gpubench.config.cases import Case
    from pytest_gpubench.config.cell import Cell
    from pytest_gpubench.config.matrix import Matrix
    from pytest_gpubench.config.options import Options
    from pytest_gpubench.config.shards import ShardFacts
    from pytest_gpubench.ledger.outcomes import CellOutcome
    from pytest_gpubench.ledger.schema import (
        CallRecord,
        CellRecord,
        EndRecord,
        LoadRecord,
        MetaRecord,
    )
    from pytest_gpubench.results.verdict import Verdict
    from pytest_gpubench.targets.protocol import Rental


@dataclass(frozen=True)
class ProbeRow:
    """One cell's health as --probe found it."""

    cell_id: str
    engine_version: str | None
    model_digest: str | None
    status: str


class RunController:
    """One benchmark run across the pytest session, in the process that writes the ledger
    (the only process under plain pytest, the xdist controller otherwise); on an xdist worker it
    only measures and sends records on."""

    def __init__(
        self,
        options: Options,
        matrix: Matrix,
        *,
        root: Path,
        argv: list[str],
        writes_ledger: bool,
        run_id: str | None = None,
        hooks: Any = None,
    ) -> None:
        self.options = options
        # A shard of a job array runs only its share of the matrix; its meta names them all.
        self.shard: ShardFacts | None = None
        if options.shard is not None:
            self.shard = shard_facts(options.shard, [cell.cell_id for cell in matrix.cells])
            matrix = shard_matrix(matrix, options.shard)
        self.matrix = matrix
        self.root = root
        self.argv = argv
        self.writes_ledger = writes_ledger
        self.scrub = SecretScrubber()
        self.harness = Harness(
            matrix,
            log_dir=options.ledger_dir / "logs",
            scrub=self.scrub,
            run_id=run_id,
            hooks=hooks,
            steadiness=options.steadiness,
        )
        self.harness.frozen = FrozenRequests(options.baselines_dir)
        self.harness.sequential.runs_override = options.runs
        self.harness.sequential_runs.runs_override = options.runs
        # Never while ratifying (a baseline measures every run) or in a smoke run.
        if not options.baseline_update and not options.smoke:
            self.harness.sequential_runs.baselines_dir = options.baselines_dir
        if writes_ledger:
            self.harness.sink = self.collect
        self.ledger: Ledger | None = None
        self.started = False
        self.startup_error: str | None = None
        # What judging the run needs, recorded in its meta record as the run begins.
        self.settings = JudgingSettings.of_cells(
            matrix.cells,
            runs_override=options.runs,
            accept_incomparable=options.accept_incomparable,
            baseline_update=options.baseline_update,
            smoke=options.smoke,
            sample_on_runs=options.sample_on_runs,
            calibration=options.calibration,
            sample_on_seconds=options.sample_on_seconds,
        )
        # Every record of the run by kind (the ledger's lines, as they were appended).
        self.records = RunRecords()
        self.probe_rows: list[ProbeRow] = []
        self.probe_failed = False
        self.judgement = Judgement(settings=self.settings)
        # The cells with at least one selected case, in the matrix's order, and at the end what
        # became of each.
        self.planned: list[Cell] = []
        self.write_error: str | None = None
        self.exit_status: int | None = None
        # The end record as written, and where the pull request summary went.
        self.end: EndRecord | None = None
        self.summary_path: Path | None = None
        self.summary_error: str | None = None
        # SIGTERM (a cancelled CI job) ends the run as Ctrl-C does, while a ledger is open.
        self.catch_signals = TerminateAsInterrupt()
        # Rentals given back in xdist workers (this process's own are in the harness's pool),
        # and on a worker how many of its own it has sent on.
        self.worker_rentals: list[Rental] = []
        self.rentals_sent = 0

    @property
    def meta(self) -> MetaRecord | None:
        return self.records.meta

    @property
    def calls(self) -> list[CallRecord]:
        return self.records.calls

    @property
    def loads(self) -> list[LoadRecord]:
        return self.records.loads

    @property
    def cells(self) -> dict[str, CellRecord]:
        return self.records.cells

    @property
    def outcomes(self) -> list[CellOutcome]:
        return self.judgement.outcomes

    @property
    def run_id(self) -> str:
        return self.harness.run_id

    @property
    def ab_seed(self) -> int:
        """The seed of the A/B pairs' call order (--gpubench-ab-seed, else from the run id)."""
        given = self.options.ab_seed
        return given if given is not None else seed_of_run(self.run_id)

    # -- start ---------------------------------------------------------------------------------

    def begin(self, cases: Sequence[Case]) -> None:
        """Check the guards and open the ledger with its meta record (writing process only)."""
        if self.started or self.options.probe:
            return
        planned = {case.cell_id for case in cases}
        self.planned = [cell for cell in self.matrix.cells if cell.cell_id in planned]
        options = self.options
        git = guards.check_git_tree(self.root, options.ledger_dir, allow_dirty=options.allow_dirty)
        guards.check_load(options.load_threshold, force_load=options.force_load)
        guards.check_frozen_prompts(
            self.matrix,
            options.baselines_dir,
            replacing_corrupt=options.baseline_update and not options.smoke,
        )
        self.started = True
        path = options.ledger_dir / f"{self.run_id}.jsonl"
        # Its columnar cache is written beside it as it grows (no report re-reads a large one).
        self.ledger = Ledger(path, self.scrub, observer=ColumnCacheWriter(path))
        meta = meta_record(
            run_id=self.run_id,
            root=self.root,
            git=git,
            env_names=[*options.env_names, *self.matrix.settings.env],
            cells_planned=[cell.cell_id for cell in self.planned],
            cases_planned=len(cases),
            argv=self.argv,
            cells_path=options.cells_path,
            prompts_path=options.prompts_path,
            shard=self.shard,
            judging=self.settings.to_record(),
        )
        pairs = {cell.cell_id: cell.reference for cell in self.planned if cell.reference}
        if pairs:
            # What repeats this session's A/B call order: --gpubench-ab-seed with this seed.
            as_json(meta)["ab"] = {"seed": self.ab_seed, "pairs": pairs}
        self.records.add(meta)
        self.ledger.append(as_json(meta))
        self.catch_signals.install()

    def refuse(self, error: GpubenchError) -> None:
        """A guard refused the run after the cases were handed out (xdist): nothing may run."""
        self.startup_error = self.scrub(str(error))
        self.started = True

    # -- records -------------------------------------------------------------------------------

    def collect(self, records: list[dict[str, Any]]) -> str | None:
        """Keep a case's records and append them to the ledger; returns why the run must stop
        (the ledger can no longer be written), or None. Records stay in memory either way, so
        the summary still shows them."""
        with self.catch_signals.held():
            for record in records:
                if self.records.add(record):
                    self._append(record)
        return self.write_error

    def _append(self, record: dict[str, Any], *, after_failure: bool = False) -> None:
        """Append to the ledger until a write fails, and after that only what must be tried
        anyway (the end record, in case room was made); the first error is kept."""
        if self.ledger is None or (self.write_error is not None and not after_failure):
            return
        try:
            self.ledger.append(record)
        except LedgerWriteError as exc:
            self.write_error = self.write_error or str(exc)

    def add_worker_rentals(self, rentals: list[Rental]) -> None:
        """Rentals a worker gave back, sent on a test report or at its end; each counted once."""
        known = {(rental.get("node"), rental.get("session_id")) for rental in self.worker_rentals}
        for rental in rentals:
            key = (rental.get("node"), rental.get("session_id"))
            if key not in known:
                self.worker_rentals.append(rental)
                known.add(key)

    def unsent_rentals(self) -> list[Rental]:
        """On a worker: the rentals given back since the last call, for the controller."""
        if self.writes_ledger:
            return []
        own = self.harness.nodes.rentals
        unsent = own[self.rentals_sent :]
        self.rentals_sent = len(own)
        return unsent

    def rentals(self) -> list[Rental]:
        """Every rented node given back in this run, with its cost, by node."""
        own = self.harness.nodes.rentals
        return sorted([*own, *self.worker_rentals], key=lambda rental: str(rental.get("node")))

    def release_node(self, node_id: str) -> list[Rental]:
        """Give a node back after its last case; on a worker, the rentals for the controller."""
        try:
            self.harness.release_node(node_id)
        finally:
            unsent = self.unsent_rentals()
            if self.writes_ledger:
                self.collect(self.harness.stage_records())
        return unsent

    # -- probe ---------------------------------------------------------------------------------

    def probe(self) -> int:
        """Health-check every cell; returns how many required cells are unavailable."""
        unavailable = 0
        for cell in self.matrix.cells:
            live, _ = self.harness.live_cell(cell.cell_id)
            facts = live.facts["engine_facts"] if live.facts is not None else EngineFacts()
            unavailable += live.unavailable is not None and not cell.spec.optional
            self.probe_rows.append(
                ProbeRow(
                    cell.cell_id,
                    facts.get("engine_version"),
                    facts.get("model_digest"),
                    "ok" if live.unavailable is None else self.scrub(live.unavailable),
                )
            )
        self.harness.close()
        self.probe_failed = unavailable > 0
        return unavailable

    # -- end -----------------------------------------------------------------------------------

    def finish(self, exitstatus: int, workeroutput: dict[str, Any] | None) -> int:
        """Give everything back, then judge and close the ledger, even if giving back failed.
        Returns the session's exit status."""
        try:
            if self.ledger is not None:
                self._sample_on_undecided()
                self._remeasure_suspects()
                self._measure_history_runs()
        finally:
            self.catch_signals.restore()
        try:
            self.harness.close()
        finally:
            if self.writes_ledger:
                self.collect(self.harness.stage_records())
            if workeroutput is not None:
                # xdist sends this to the controller, which writes it into the end record.
                workeroutput["gpubench_rentals"] = self.unsent_rentals()
            status = self._close_ledger(exitstatus)
        self.exit_status = status
        self._write_pr_summary(status)
        return status

    def _write_pr_summary(self, status: int) -> None:
        """The pull request's summary (reports/pr_summary.py): appended to
        $GITHUB_STEP_SUMMARY where it is set, else written beside the ledger. Never changes the
        status: a summary that cannot be written is said in the terminal."""

        if self.ledger is None or self.end is None:
            return
        ledger = str(self.ledger.path)
        text = render_pr_summary(
            {**self.end, "exit_status": status},
            self.loads,
            ledger=ledger,
            report=report_pointer(ledger, os.environ),
            summaries=self.judgement.summaries,
            checks=self.judgement.checks,
        )
        try:
            self.summary_path = write_pr_summary(
                self.scrub(text), self.options.ledger_dir, self.run_id
            )
        except OSError as exc:
            self.summary_error = f"the pull request summary was not written: {exc}"

    def _close_ledger(self, exitstatus: int) -> int:
        if self.startup_error is not None:
            return int(pytest.ExitCode.USAGE_ERROR)
        if self.ledger is None:
            return session_status(exitstatus, unmeasured=self.probe_failed)
        judgement = self.judgement = judge_run(
            self.records, self.settings, self.options.baselines_dir
        )
        judgement.gate_error = judgement.gate_error and self.scrub(judgement.gate_error)
        # What --baseline-update writes is the judgement's, from the recorded settings.
        plan = baseline_update_plan(self.records, self.settings)
        if plan is not None and self.calls and "warm" not in judgement.unjudged_parts:
            self._update_baselines(plan)
        if plan is not None and plan.refused is None and self.loads:
            self._update_load_baselines(plan)
        status = judgement.exit_status(exitstatus, write_failed=self.write_error is not None)
        run = self.records
        self.end = end_record(
            run_id=self.run_id,
            pytest_exitstatus=exitstatus,
            calls=len(run.calls) + len(run.load_calls),
            skipped=len(run.skips),
            nodes=self.rentals(),
            **judged_end(judgement, status),
        )
        self._append(as_json(self.end), after_failure=True)
        try:
            self.ledger.close()
        except LedgerWriteError as exc:
            self.write_error = self.write_error or str(exc)
        if self.write_error is not None:
            status = session_status(exitstatus, write_failed=True)
        return status

    def _update_load_baselines(self, plan: BaselineUpdatePlan) -> None:
        """The load points' baselines (baselines/load/) written as the plan says."""
        from pytest_gpubench.results.load_baseline import write_load_baselines

        judgement = self.judgement
        try:
            notes = write_load_baselines(self.options.baselines_dir, plan.loads)
        except GpubenchError as exc:
            judgement.gate_error = self.scrub(str(exc))
            judgement.write_failed = True
            return
        take_load_update(judgement, plan, notes)

    def _sample_on_undecided(self) -> None:
        """Before the re-measure: each (cell, prompt) whose gated figure the planned runs left
        undecided, an A/B candidate's against its reference too, is measured further, within
        its budget (run/sample_on.py). Never while
        ratifying or in a smoke run, nor where the judging itself fails (the end says why)."""
        from pytest_gpubench.run.sample_on import sample_on

        options = self.options
        if options.baseline_update or options.smoke or not self.calls or not self.writes_ledger:
            return
        if self.settings.sample_on_runs == 0 or self.settings.sample_on_seconds <= 0:
            return
        planned: dict[tuple[str, str], int] = {}
        for call in self.calls:
            if call.get("phase") == "warm":
                key = (str(call.get("cell_id")), str(call.get("prompt_id")))
                planned[key] = planned.get(key, 0) + 1

        def judge() -> list[Verdict]:
            return [
                *first_pass_verdicts(self.records, self.settings, options.baselines_dir),
                *pair_verdicts(self.records, self.settings),
            ]

        try:
            sample_on(
                self.harness,
                judge,
                self.collect,
                planned,
                runs=self.settings.sample_on_runs,
                seconds=self.settings.sample_on_seconds,
                pair_seed=self.ab_seed,
            )
        except GpubenchError:
            return  # the baselines could not be read: the judgement says it at the end

    def _measure_history_runs(self) -> None:
        """--baseline-update: each warm (cell, prompt) whose baseline has no history yet is
        measured in more runs, separated in time (run/history_runs.py), so that its first
        baseline holds the spread between runs. Never in a smoke run; a test's own requests and
        timed cells are measured in one run, as before."""
        from pytest_gpubench.results.baseline import find_baseline
        from pytest_gpubench.run.history_runs import measure_history_runs

        options = self.options
        if not options.baseline_update or options.smoke or options.baseline_runs < 2:
            return
        if not self.calls or not self.writes_ledger:
            return
        planned: dict[tuple[str, str], int] = {}
        for call in self.calls:
            key = (str(call.get("cell_id")), str(call.get("prompt_id")))
            if call.get("phase") == "warm" and why_not_remeasured(self.matrix, *key) is None:
                planned[key] = planned.get(key, 0) + 1
        for cell_id in sorted({cell_id for cell_id, _ in planned}):
            try:
                baseline = find_baseline(options.baselines_dir, cell_id)
            except GpubenchError:
                baseline = None  # a corrupt file is replaced: a first baseline
            if baseline is None:
                continue
            for key in [k for k in planned if k[0] == cell_id]:
                if baseline.runs(key[1]):
                    del planned[key]
        if planned:
            measure_history_runs(self.harness, planned, options.baseline_runs, self.collect)

    def _remeasure_suspects(self) -> None:
        """Before anything is given back: judge the first pass, and measure the suspected
        regressions again (run/remeasure.py). Never with --baseline-update or --smoke (nothing is
        failed then), nor where the judging itself fails (the end says why). A suspect that
        cannot be measured again is written into the ledger with the reason."""
        from pytest_gpubench.results.confirm import suspects
        from pytest_gpubench.run.remeasure import remeasure, why_not_remeasured

        options = self.options
        if options.baseline_update or options.smoke or not self.calls or not self.writes_ledger:
            return
        try:
            first = first_pass_verdicts(self.records, self.settings, options.baselines_dir)
        except GpubenchError:
            return  # the judgement says it at the end
        runs: list[tuple[str, str, int]] = []
        left: list[dict[str, Any]] = []
        for cell_id, prompt_id in suspects(first):
            why = why_not_remeasured(self.matrix, cell_id, prompt_id)
            if why is not None:
                left.append(not_remeasured_record(self.run_id, cell_id, prompt_id, why))
                continue
            done = sum(
                1
                for call in self.calls
                if (call.get("cell_id"), call.get("prompt_id"), call.get("phase"))
                == (cell_id, prompt_id, "warm")
            )
            runs.append((cell_id, prompt_id, done))
        if runs:
            self.collect(remeasure(self.harness, runs))
            for cell_id, prompt_id, _ in runs:
                if not any(
                    (c.get("cell_id"), c.get("prompt_id")) == (cell_id, prompt_id)
                    for c in self.records.remeasured
                ):
                    why = "its cell could not be made live"
                    left.append(not_remeasured_record(self.run_id, cell_id, prompt_id, why))
        self.collect(left)

    def _update_baselines(self, plan: BaselineUpdatePlan) -> None:
        """The warm baselines written as the plan (results/ratification.py) says."""
        from pytest_gpubench.results.baseline_update import update_baselines
        from pytest_gpubench.results.gate import too_few_samples

        judgement = self.judgement
        if plan.refused is not None:
            judgement.baseline_notes.append(plan.refused)
            return
        try:
            update = update_baselines(
                self.options.baselines_dir,
                plan.records,
                plan.min_success_rate,
                future_runs=plan.future_runs,
                sample_check=too_few_samples,
                calibration=plan.calibration,
            )
        except GpubenchError as exc:
            judgement.gate_error = self.scrub(str(exc))
            judgement.write_failed = True
            return
        take_baseline_update(judgement, update, self.options.baselines_dir)
        if judgement.gate_error is not None:
            judgement.gate_error = self.scrub(judgement.gate_error)
