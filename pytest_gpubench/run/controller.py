"""The run controller: begins the run (guards, ledger, meta), collects every record, and at the
end judges against the baselines and closes the ledger. It decides; it never draws."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.secrets import SecretScrubber
from pytest_gpubench.core.signals import TerminateAsInterrupt
from pytest_gpubench.core.status import session_status
from pytest_gpubench.ledger.writer import LedgerWriteError

# A session without benchmarks makes a controller too (the plugin loads in every session of its
# environment): what a run needs (the matrix's pydantic, the harness's HTTP clients, the ledger's
# records) is imported where a run begins, so that such a session does not pay for it.
if TYPE_CHECKING:
    from pytest_gpubench.config.cases import Case
    from pytest_gpubench.config.matrix import Cell, Matrix
    from pytest_gpubench.config.options import Options
    from pytest_gpubench.config.shards import ShardFacts
    from pytest_gpubench.ledger.outcomes import CellOutcome
    from pytest_gpubench.ledger.schema import (
        CallRecord,
        CellRecord,
        EndRecord,
        LoadCallRecord,
        LoadRecord,
        MetaRecord,
        SkippedRecord,
    )
    from pytest_gpubench.ledger.writer import Ledger
    from pytest_gpubench.results.gate import Verdict
    from pytest_gpubench.results.stats import PromptSummary
    from pytest_gpubench.run.harness import Harness
    from pytest_gpubench.telemetry.aggregate import TelemetrySummary


@dataclass(frozen=True)
class ProbeRow:
    """One cell's health as --probe found it."""

    cell_id: str
    engine_version: str | None
    model_digest: str | None
    status: str


@dataclass
class Judgement:
    """What the gate found at the end of a run (empty until then)."""

    summaries: list[PromptSummary] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    # Per load point (load/gate.py), kept apart: the warm table and its notes never show them.
    load_verdicts: list[Verdict] = field(default_factory=list)
    # Per (cell, prompt): the warm calls' resource telemetry (telemetry/aggregate.py).
    telemetry: list[TelemetrySummary] = field(default_factory=list)
    gate_error: str | None = None
    # The baselines could not be read (nothing was judged) or written.
    unjudged: bool = False
    write_failed: bool = False
    baseline_notes: list[str] = field(default_factory=list)
    # Per cell id: what differs between its baseline's setup and this run's; and the cells whose
    # new setup --baseline-update ratified (wrote).
    changed_setups: dict[str, str] = field(default_factory=dict)
    ratified: set[str] = field(default_factory=set)

    def failing_incomparables(self) -> list[Verdict]:
        """The `incomparable` verdicts that fail the run: those not ratified."""
        from pytest_gpubench.results.gate import incomparables

        return [v for v in incomparables(self.verdicts) if v.cell_id not in self.ratified]


class RunController:
    """One benchmark run across the pytest session, in the process that writes the ledger
    (the only process under plain pytest, the xdist controller otherwise); on an xdist worker it
    only measures and sends records on."""

    def __init__(
        self,
        options: Options,
        matrix: Matrix | None,
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
        if matrix is not None and options.shard is not None:
            from pytest_gpubench.config.shards import shard_facts, shard_matrix

            self.shard = shard_facts(options.shard, [cell.cell_id for cell in matrix.cells])
            matrix = shard_matrix(matrix, options.shard)
        self.matrix = matrix
        self.root = root
        self.argv = argv
        self.writes_ledger = writes_ledger
        self.scrub = SecretScrubber()
        self.harness: Harness | None = None
        if matrix is not None:
            from pytest_gpubench.run.guards import FrozenRequests
            from pytest_gpubench.run.harness import Harness

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
        self.meta: MetaRecord | None = None
        self.calls: list[CallRecord] = []
        # The warm calls of suspects measured again at the end (`pass: 2`), judged on their own
        # and then with the first pass's (results/confirm.py); and the suspects that could not be.
        self.remeasured_calls: list[CallRecord] = []
        self.not_remeasured: dict[tuple[str, str], str] = {}
        # Per (cell, prompt): the baseline's last ratified runs (its between-run history).
        self.histories: dict[tuple[str, str], Any] = {}
        # A load case's call records (phase `load`: judged per load point, never with the warm
        # calls) and its `load` records.
        self.load_calls: list[LoadCallRecord] = []
        self.loads: list[LoadRecord] = []
        self.skips: list[SkippedRecord] = []
        self.cells: dict[str, CellRecord] = {}
        self.probe_rows: list[ProbeRow] = []
        self.probe_failed = False
        self.judgement = Judgement()
        # The cells with at least one selected case, in the matrix's order, and at the end what
        # became of each.
        self.planned: list[Cell] = []
        self.outcomes: list[CellOutcome] = []
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
        self.worker_rentals: list[dict[str, Any]] = []
        self.rentals_sent = 0

    @property
    def run_id(self) -> str:
        return self.harness.run_id if self.harness is not None else ""

    @property
    def ab_seed(self) -> int:
        """The seed of the A/B pairs' call order (--gpubench-ab-seed, else from the run id)."""
        from pytest_gpubench.config.cases import seed_of_run

        given = self.options.ab_seed
        return given if given is not None else seed_of_run(self.run_id)

    # -- start ---------------------------------------------------------------------------------

    def begin(self, cases: Sequence[Case]) -> None:
        """Check the guards and open the ledger with its meta record (writing process only)."""
        if self.started or self.matrix is None or self.options.probe:
            return
        from pytest_gpubench.ledger.records import meta_record
        from pytest_gpubench.ledger.schema import as_json
        from pytest_gpubench.ledger.writer import Ledger
        from pytest_gpubench.reports.frame_cache import ColumnCacheWriter
        from pytest_gpubench.run import guards

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
        self.meta = meta_record(
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
        )
        pairs = {cell.cell_id: cell.reference for cell in self.planned if cell.reference}
        if pairs:
            # What repeats this session's A/B call order: --gpubench-ab-seed with this seed.
            as_json(self.meta)["ab"] = {"seed": self.ab_seed, "pairs": pairs}
        self.ledger.append(as_json(self.meta))
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
        from pytest_gpubench.config.cases import LOAD_PHASE

        with self.catch_signals.held():
            for record in records:
                kind = record.get("type")
                if kind == "call" and record.get("phase") == LOAD_PHASE:
                    self.load_calls.append(cast("LoadCallRecord", record))
                elif kind == "call" and record.get("pass", 1) != 1:
                    self.remeasured_calls.append(cast("CallRecord", record))
                elif kind == "call":
                    self.calls.append(cast("CallRecord", record))
                elif kind == "load":
                    self.loads.append(cast("LoadRecord", record))
                elif kind == "skipped":
                    self.skips.append(cast("SkippedRecord", record))
                elif kind == "cell":
                    if record["cell_id"] in self.cells:
                        continue  # each xdist worker that ran the cell describes it; keep the first
                    self.cells[record["cell_id"]] = cast("CellRecord", record)
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

    def add_worker_rentals(self, rentals: list[dict[str, Any]]) -> None:
        """Rentals a worker gave back, sent on a test report or at its end; each counted once."""
        known = {(rental.get("node"), rental.get("session_id")) for rental in self.worker_rentals}
        for rental in rentals:
            key = (rental.get("node"), rental.get("session_id"))
            if key not in known:
                self.worker_rentals.append(rental)
                known.add(key)

    def unsent_rentals(self) -> list[dict[str, Any]]:
        """On a worker: the rentals given back since the last call, for the controller."""
        if self.writes_ledger or self.harness is None:
            return []
        own = self.harness.nodes.rentals
        unsent = own[self.rentals_sent :]
        self.rentals_sent = len(own)
        return unsent

    def rentals(self) -> list[dict[str, Any]]:
        """Every rented node given back in this run, with its cost, by node."""
        own = self.harness.nodes.rentals if self.harness is not None else []
        return sorted([*own, *self.worker_rentals], key=lambda rental: str(rental.get("node")))

    def release_node(self, node_id: str) -> list[dict[str, Any]]:
        """Give a node back after its last case; on a worker, the rentals for the controller."""
        assert self.harness is not None
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
        assert self.matrix is not None and self.harness is not None
        unavailable = 0
        for cell in self.matrix.cells:
            live, _ = self.harness.live_cell(cell.cell_id)
            facts = live.facts.get("engine_facts", {})
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
            if self.harness is not None and self.ledger is not None:
                self._remeasure_suspects()
        finally:
            self.catch_signals.restore()
        try:
            if self.harness is not None:
                self.harness.close()
        finally:
            if self.harness is not None and self.writes_ledger:
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
        from pytest_gpubench.reports.pr_summary import (
            render_pr_summary,
            report_pointer,
            write_pr_summary,
        )

        if self.ledger is None or self.end is None:
            return
        ledger = str(self.ledger.path)
        text = render_pr_summary(
            {**self.end, "exit_status": status},
            self.loads,
            ledger=ledger,
            report=report_pointer(ledger, os.environ),
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
        from pytest_gpubench.ledger.outcomes import cell_outcomes
        from pytest_gpubench.ledger.records import end_record
        from pytest_gpubench.ledger.schema import as_json
        from pytest_gpubench.results.gate import regressions

        if self.calls:
            self._judge()
            self._judge_pairs()
        if self.loads:
            self._judge_loads()
        self.outcomes = cell_outcomes(
            self.planned, cells=self.cells, skips=self.skips, calls=[*self.calls, *self.load_calls]
        )
        judgement = self.judgement
        verdicts = [*judgement.verdicts, *judgement.load_verdicts]
        regressed = regressions(verdicts)
        status = session_status(
            exitstatus,
            write_failed=self.write_error is not None or judgement.write_failed,
            unjudged=judgement.unjudged,
            unmeasured=any(outcome.fails_run for outcome in self.outcomes),
            incomparable=bool(judgement.failing_incomparables()),
            # An A/B regression is against the reference, not a baseline: ratifying baselines
            # does not accept it.
            regressed=any(v.reference is not None for v in regressed)
            or (bool(regressed) and not self.options.baseline_update),
            unsteady=any(v.verdict == "unsteady" for v in verdicts)
            and not self.options.baseline_update,
        )
        self.end = end_record(
            run_id=self.run_id,
            pytest_exitstatus=exitstatus,
            calls=len(self.calls) + len(self.load_calls),
            skipped=len(self.skips),
            verdicts=[verdict.to_record() for verdict in verdicts],
            regressions=len(regressed),
            gate_error=judgement.gate_error,
            nodes=self.rentals(),
            cells=[outcome.to_record() for outcome in self.outcomes],
            exit_status=status,
        )
        self._append(as_json(self.end), after_failure=True)
        try:
            self.ledger.close()
        except LedgerWriteError as exc:
            self.write_error = self.write_error or str(exc)
        if self.write_error is not None:
            status = session_status(exitstatus, write_failed=True)
        return status

    def _judge(self) -> None:
        """Compare with the baselines (each cell's setup with its baseline's first), and write
        them with --baseline-update."""
        from pytest_gpubench.results.gate import ACCEPT_OPTION, compare, telemetry_verdicts
        from pytest_gpubench.results.stats import summarize
        from pytest_gpubench.telemetry.aggregate import telemetry_summaries

        assert self.matrix is not None
        judgement = self.judgement
        judgement.summaries = summarize(self.calls)
        judgement.telemetry = telemetry_summaries(self.calls)
        thresholds = {cell.cell_id: cell.thresholds for cell in self.matrix.cells}
        writes = self.options.baseline_update and not self.options.smoke
        try:
            baselines = self._baselines(replacing=writes)
            judgement.verdicts = compare(
                baselines,
                judgement.summaries,
                thresholds,
                changed_setups=judgement.changed_setups,
                accept_incomparable=self.options.accept_incomparable,
                histories=self.histories,
            )
            if self.remeasured_calls or self.not_remeasured:
                judgement.verdicts = self._confirmed(judgement.verdicts, baselines, thresholds)
            judgement.verdicts.extend(telemetry_verdicts(self.calls, thresholds))
        except GpubenchError as exc:
            judgement.gate_error = self.scrub(str(exc))
            judgement.unjudged = True
            return
        if self.options.accept_incomparable and not self.options.baseline_update:
            judgement.baseline_notes.extend(
                f"baseline of {cell_id} measured on another setup ({changes}): compared all "
                f"the same ({ACCEPT_OPTION})"
                for cell_id, changes in sorted(judgement.changed_setups.items())
            )
        if self.options.baseline_update:
            if self.options.smoke:
                # One call per cell can never reach significance: every later run would be
                # "inconclusive" against it.
                judgement.baseline_notes.append(
                    "baselines NOT written: --smoke measures one call, too few to judge against"
                )
                return
            self._update_baselines()

    def _judge_pairs(self) -> None:
        """Each A/B candidate against its reference, pair by pair (results/paired.py)."""
        from pytest_gpubench.results.paired import ab_verdicts

        self.judgement.verdicts.extend(ab_verdicts(self.calls, self.planned, self.options.runs))

    def _judge_loads(self) -> None:
        """Each load point against its load baseline (baselines/load/); written with
        --baseline-update (never from --smoke)."""
        from pytest_gpubench.results.load_baseline import read_load_baselines, write_load_baselines
        from pytest_gpubench.results.load_gate import judge_loads

        assert self.matrix is not None
        judgement = self.judgement
        thresholds = {c.cell_id: c.load.thresholds for c in self.matrix.cells if c.load is not None}
        writes = self.options.baseline_update and not self.options.smoke
        cell_ids = {str(record.get("cell_id")) for record in self.loads}
        try:
            baselines = read_load_baselines(self.options.baselines_dir, cell_ids)
        except GpubenchError as exc:
            if not writes:
                judgement.gate_error = self.scrub(str(exc))
                judgement.unjudged = True
                return
            baselines = {}
        judgement.load_verdicts = judge_loads(self.loads, baselines, thresholds)
        if not writes:
            return
        try:
            judgement.baseline_notes.extend(
                write_load_baselines(self.options.baselines_dir, self.loads)
            )
        except GpubenchError as exc:
            judgement.gate_error = self.scrub(str(exc))
            judgement.write_failed = True

    def _baselines(self, *, replacing: bool) -> list[PromptSummary]:
        """The measured cells' baseline summaries; notes in the judgement which cells' baselines
        came from another setup. A corrupt file counts as none when this run replaces it."""
        from pytest_gpubench.results.baseline import (
            cell_provenance,
            find_baseline,
            provenance_changes,
        )
        from pytest_gpubench.results.baseline_format import CorruptBaseline

        summaries: list[PromptSummary] = []
        for cell_id in sorted({call["cell_id"] for call in self.calls}):
            try:
                baseline = find_baseline(self.options.baselines_dir, cell_id)
            except CorruptBaseline:
                if not replacing:
                    raise
                continue  # --baseline-update replaces it, and says so
            if baseline is None:
                continue
            summaries.extend(baseline.prompts)
            for prompt_id, runs in baseline.history.items():
                self.histories[(cell_id, prompt_id)] = runs
            cell = self.cells.get(cell_id)
            if cell is None:
                continue  # nothing known of this run's setup: nothing to compare
            if self.meta is None:
                continue  # the session never started: no run to compare
            current = cell_provenance(self.meta, cell, self.calls)
            changes = provenance_changes(baseline.provenance, current)
            if changes:
                self.judgement.changed_setups[cell_id] = ", ".join(changes)
        return summaries

    def _confirmed(
        self, verdicts: list[Verdict], baselines: list[PromptSummary], thresholds: Any
    ) -> list[Verdict]:
        """The suspects' verdicts decided on both passes (results/confirm.py)."""
        from pytest_gpubench.results.confirm import confirm
        from pytest_gpubench.results.gate import compare
        from pytest_gpubench.results.stats import summarize

        second = compare(
            baselines,
            summarize(self.remeasured_calls),
            thresholds,
            changed_setups=self.judgement.changed_setups,
            accept_incomparable=self.options.accept_incomparable,
            histories=self.histories,
        )
        return confirm(verdicts, second, self.not_remeasured)

    def _remeasure_suspects(self) -> None:
        """Before anything is given back: judge the first pass, and measure the suspected
        regressions again (run/remeasure.py). Never with --baseline-update or --smoke (nothing is
        failed then), nor where the judging itself fails (the end says why)."""
        from pytest_gpubench.results.confirm import suspects
        from pytest_gpubench.results.gate import compare
        from pytest_gpubench.results.stats import summarize
        from pytest_gpubench.run.remeasure import remeasure, why_not_remeasured

        options = self.options
        if options.baseline_update or options.smoke or not self.calls or self.matrix is None:
            return
        if not self.writes_ledger or self.harness is None:
            return
        thresholds = {cell.cell_id: cell.thresholds for cell in self.matrix.cells}
        try:
            baselines = self._baselines(replacing=False)
            first = compare(
                baselines,
                summarize(self.calls),
                thresholds,
                changed_setups=self.judgement.changed_setups,
                accept_incomparable=options.accept_incomparable,
                histories=self.histories,
            )
        except GpubenchError:
            return  # _judge says it at the end
        finally:
            self.judgement.changed_setups.clear()
        runs: list[tuple[str, str, int]] = []
        for cell_id, prompt_id in suspects(first):
            why = why_not_remeasured(self.matrix, cell_id, prompt_id)
            if why is not None:
                self.not_remeasured[(cell_id, prompt_id)] = why
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
                    for c in self.remeasured_calls
                ):
                    self.not_remeasured[(cell_id, prompt_id)] = "its cell could not be made live"

    def _update_baselines(self) -> None:
        from pytest_gpubench.results.baseline import update_baselines
        from pytest_gpubench.results.gate import success_threshold, too_few_samples

        assert self.matrix is not None
        judgement = self.judgement
        minimum = {cell.cell_id: success_threshold(cell.thresholds) for cell in self.matrix.cells}
        # Later runs measure the cell's configured runs (cells.yaml), not this run's override.
        future_runs = {cell.cell_id: cell.runs for cell in self.matrix.cells}
        meta = [self.meta] if self.meta is not None else []
        records = [*meta, *self.cells.values(), *self.calls, *self.skips]
        try:
            update = update_baselines(
                self.options.baselines_dir,
                records,
                minimum,
                future_runs=future_runs,
                sample_check=too_few_samples,
            )
        except GpubenchError as exc:
            judgement.gate_error = self.scrub(str(exc))
            judgement.write_failed = True
            return
        notes = judgement.baseline_notes
        for _cell_id, reason in sorted(update.replaced.items()):
            notes.append(f"{reason}: replaced with this run's numbers")
        for cell_id, path in sorted(update.written.items()):
            notes.append(f"baseline written: {cell_id} -> {path}")
            notes.extend(_history_notes(self.options.baselines_dir, cell_id))
            changes = judgement.changed_setups.get(cell_id)
            if changes is not None:
                judgement.ratified.add(cell_id)
                notes.append(f"baseline of {cell_id} ratified for this setup: {changes}")
        for cell_id, reason in sorted(update.refused.items()):
            notes.append(f"baseline NOT written for {cell_id}: {reason}")
        if update.failed:
            judgement.gate_error = self.scrub(
                "; ".join(update.failed[c] for c in sorted(update.failed))
            )
            judgement.write_failed = True


def _history_notes(baselines_dir: Path, cell_id: str) -> list[str]:
    """What a written baseline's history lets the gate know: a note while it is too short."""
    from pytest_gpubench.results.baseline import find_baseline
    from pytest_gpubench.results.decision import MIN_HISTORY

    try:
        baseline = find_baseline(baselines_dir, cell_id)
    except GpubenchError:
        return []
    if baseline is None:
        return []
    short = sorted(
        f"{summary.prompt_id} ({len(baseline.runs(summary.prompt_id))})"
        for summary in baseline.prompts
        if summary.n_warm and len(baseline.runs(summary.prompt_id)) < MIN_HISTORY
    )
    if not short:
        return []
    return [
        f"baseline of {cell_id}: runs of history {', '.join(short)}: the between-run noise floor "
        f"is still unknown until {MIN_HISTORY} (seed it with `gpubench calibrate`)"
    ]
