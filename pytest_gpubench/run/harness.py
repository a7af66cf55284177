"""The harness: runs cases on live cells: measuring one case, timed runs, load cases, telemetry
around them, and giving nodes back."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pytest_gpubench.config.cases import Case
from pytest_gpubench.config.matrix import Matrix
from pytest_gpubench.config.prompts import Prompt, RequestShape
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.provenance import utc_now
from pytest_gpubench.core.secrets import SecretScrubber
from pytest_gpubench.engines import EngineHook, Request
from pytest_gpubench.ledger.records import (
    call_record,
    cell_record,
    checkpoint_record,
    engine_check_fields,
    sample_record,
    skipped_record,
    stage_record,
)
from pytest_gpubench.ledger.schema import SyntheticFields, as_json
from pytest_gpubench.measure.control import ControlCall, CpuPressure, MachineCpu
from pytest_gpubench.measure.steadiness import CallReadings
from pytest_gpubench.run.guards import FrozenRequests
from pytest_gpubench.run.live_cell import LiveCell, failed_stage
from pytest_gpubench.run.nodes import NodePool, plain_error
from pytest_gpubench.run.sequential import SequentialPairs, SequentialRuns
from pytest_gpubench.run.workloads import exact_prompt
from pytest_gpubench.targets import Target
from pytest_gpubench.targets.stages import Outcome, StageClock
from pytest_gpubench.telemetry import CaseSamples, NodeTelemetry, node_telemetry
from pytest_gpubench.telemetry.aggregate import case_aggregates, sample_columns

log = logging.getLogger(__name__)

# A timed run's checkpoint interval when its cell sets none.
DEFAULT_CHECKPOINT_S = 60.0
# Closing a node (stopping its Slurm job, giving a rental back, closing SSH) may hang on a dead
# connection: it gets this long unless stage_timeouts.cleanup says otherwise, and at least
# CLEANUP_GRACE_S even when the node's budget is spent.
DEFAULT_CLEANUP_TIMEOUT_S = 300.0
CLEANUP_GRACE_S = 30.0


class Harness:
    """Runs cases: makes each cell live on its first case, measures, and gives nodes back.

    Every record it hands out has had its secrets cut out."""

    def __init__(
        self,
        matrix: Matrix,
        *,
        log_dir: Path,
        scrub: SecretScrubber,
        run_id: str | None = None,
        hooks: Any = None,
        steadiness: bool = True,
    ) -> None:
        self.matrix = matrix
        # Prompts known only on a live cell (token-exact synthetic ones) are frozen here.
        self.frozen: FrozenRequests | None = None
        self.run_id = run_id or str(uuid.uuid4())
        self.log_dir = log_dir
        self.scrub = scrub
        # pytest's hook relay, for engine and node kinds that plugins add (hookspecs.py).
        self.engine_hook: EngineHook | None = (
            hooks.pytest_gpubench_make_engine if hooks is not None else None
        )
        target_hook = hooks.pytest_gpubench_open_target if hooks is not None else None
        self.nodes = NodePool(scrub, target_hook)
        self.cells: dict[str, LiveCell] = {}
        # Each node's samplers, started with its first live cell (None: all its cells said off).
        self.telemetry: dict[str, NodeTelemetry | None] = {}
        # Where records go the moment they are made (the ledger, when this process writes it):
        # a timed run's checkpoints.
        self.sink: Callable[[list[dict[str, Any]]], object] | None = None
        # Cell records handed out with a case's records but not yet sent to the sink.
        self.unwritten_cells: dict[str, dict[str, Any]] = {}
        # Sequential sampling of A/B pairs: what each candidate's pairs hold so far, and why a
        # case is not run (its pair's verdict decided). --gpubench-runs, when given.
        self.sequential = SequentialPairs(matrix)
        # Sequential sampling of cells judged against their baselines (min_runs, no reference).
        self.sequential_runs = SequentialRuns(matrix)
        # Timed before each warm call (its `control_ms`), and the CPU pressure during the call (its
        # `cpu_pressure`): how steady the machine was. Neither with --gpubench-steadiness off.
        self.steadiness = steadiness
        self.control = ControlCall()
        self.pressure = CpuPressure()
        # The machine's CPU time during the call, the benchmark's own taken out (the neighbours'
        # share) and the hypervisor's steal: where the engine's own wait cannot be read.
        self.machine_cpu = MachineCpu()
        # Which pass of the session's measurements this is: 2 while suspects are re-measured.
        self.measure_pass = 1

    def live_cell(self, cell_id: str) -> tuple[LiveCell, bool]:
        """The cell, made ready on first use; the flag says it was made ready just now."""
        if cell_id in self.cells:
            return self.cells[cell_id], False
        live = LiveCell(
            self.matrix.cell(cell_id),
            self.log_dir,
            self.nodes.target,
            node_clock=self.nodes.clock,
            engine_hook=self.engine_hook,
            scrub=self.scrub,
            learn_secret=self.scrub.add,
        )
        self.cells[cell_id] = live
        live.prepare()
        if live.unavailable is None:
            self._start_telemetry(live)
        return live, True

    def _start_telemetry(self, live: LiveCell) -> None:
        """Start the node's samplers once; settings of all its cells decide what they sample."""
        node_id = live.cell.spec.node
        if node_id in self.telemetry or live.target is None:
            return
        settings = [cell.telemetry for cell in self.matrix.cells if cell.spec.node == node_id]
        telemetry: NodeTelemetry | None = None
        try:
            gpus = live.facts["gpus"] if live.facts is not None else []
            telemetry = node_telemetry(node_id, live.target, settings, gpus)
            if telemetry is not None:
                telemetry.start()
        except Exception:  # telemetry is never worth a case: measure without it
            log.warning("node %s: telemetry not started", node_id, exc_info=True)
            telemetry = None
        self.telemetry[node_id] = telemetry

    def prepare(self, case: Case) -> tuple[str | None, list[dict[str, Any]]]:
        """Make the case's cell ready: why it cannot run (or None), and the records to keep
        (the cell record the first time, a skipped record when it cannot run)."""
        live, fresh = self.live_cell(case.cell_id)
        live.check_benchmark_time()
        records: list[dict[str, Any]] = self.stage_records()
        if fresh and live.facts is not None:
            described = self.scrub.record(
                as_json(
                    cell_record(
                        run_id=self.run_id,
                        cell=live.cell,
                        prompts=self.matrix.prompts,
                        **live.facts,
                    )
                )
            )
            records.append(described)
            # A timed case writes its checkpoints as it goes: its cell record goes first, so
            # that a run killed during it still says what was measured (the controller keeps
            # one cell record per cell, so the copy on the case's report is dropped).
            self.unwritten_cells[case.cell_id] = described
        # A cell that could not start skips its cases in the stage that failed; a kind the
        # engine does not send skips this case, the cell's others run.
        why = live.unavailable
        if why is None:
            prompt = self.matrix.prompts.get(case.source_prompt_id)
            why = live.kind_missing(prompt.kind) if prompt is not None else None
        if why is None:
            return None, records
        reason = self.scrub(why)
        skipped = skipped_record(
            run_id=self.run_id,
            cell=live.cell,
            case=case,
            reason=reason,
            stage=live.unavailable_stage if live.unavailable is not None else None,
            kind_unsupported=live.unavailable is None,
        )
        records.append(as_json(skipped))
        return reason, records

    def stopped_early(self, case: Case) -> tuple[str | None, list[dict[str, Any]]]:
        """Why the case is not run, its pair's verdict decided (sequential sampling), with its
        `skipped` record; (None, []) when it runs."""
        reason = self.sequential.stopped(case) or self.sequential_runs.stopped(case)
        if reason is None:
            return None, []
        cell = self.matrix.cell(case.cell_id)
        skipped = skipped_record(
            run_id=self.run_id, cell=cell, case=case, reason=reason, stage=None
        )
        return reason, [as_json(skipped)]

    def open_node(self, case: Case) -> tuple[str | None, list[dict[str, Any]], Target | None]:
        """The case's node (gpubench_target), opened once and shared by its cells: why it cannot
        be had (or None), the records to keep (a skipped record then), and the node."""
        cell = self.matrix.cell(case.cell_id)
        live = self.cells.get(case.cell_id)
        if cell.spec.skip or (live is not None and live.unavailable is not None):
            reason, records = self.prepare(case)
            return reason, records, None
        try:
            target = self.nodes.target(cell)
        except GpubenchError as exc:
            reason = self.scrub(str(exc))
            stage = failed_stage(cell, exc)
            skipped = skipped_record(
                run_id=self.run_id, cell=cell, case=case, reason=reason, stage=stage
            )
            return reason, [*self.stage_records(), as_json(skipped)], None
        return None, self.stage_records(), target

    def stage_records(self) -> list[dict[str, Any]]:
        """The `stage` records of the stages that ended since the last call."""
        return [
            self.scrub.record(as_json(stage_record(run_id=self.run_id, facts=outcome.to_facts())))
            for outcome in self.nodes.take_stage_outcomes()
        ]

    def run_case(self, case: Case) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Measure one case of a prompts.yaml prompt: its call record (with the case's resource
        figures) and the other records it produced (its `sample` record when its node is
        sampled)."""
        if case.load_point is not None:
            return self.run_load_case(case)
        prompt = self.matrix.prompts[case.source_prompt_id]
        cell = self.matrix.cell(case.cell_id)
        # On a cell that chooses LoRA adapters per request, the case's adapter's fields.
        request = cell.adapter_request(cell.request_for(prompt), case.adapter)
        facts: SyntheticFields = {}
        if prompt.synthetic is not None:
            prompt, facts = self._exact_prompt(case, prompt, request)
        if cell.spec.duration_s is not None and case.phase == "warm":
            return self.run_timed(case, prompt, request)
        record, others, _ = self.measure(case, Request.of(prompt, request), prompt.sha256(request))
        record.update(facts)
        return record, others

    def _exact_prompt(
        self, case: Case, prompt: Prompt, request: RequestShape
    ) -> tuple[Prompt, SyntheticFields]:
        """A synthetic prompt made exact on the case's live cell, frozen from then on like a
        test's own request (its text is known only once the engine counted it)."""
        exact, facts = exact_prompt(self.cells[case.cell_id], prompt)
        if self.frozen is not None:
            self.frozen.check(
                case.cell_id,
                case.prompt_id,
                exact.sha256(request),
                str(self.matrix.prompts_path),
                kind="synthetic prompt",
            )
        return exact, facts

    def run_load_case(self, case: Case) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Measure one load case (load/runner.py): its `load` record, and the call records of
        its requests (and a sweep's per-step load records)."""
        from pytest_gpubench.run.load.runner import run_load_case

        live = self.cells[case.cell_id]
        window = self._begin_sampling(live)
        pressure = self.pressure if self.steadiness else None
        outcome = run_load_case(live, self.matrix, case, self.run_id, pressure)
        samples = self._end_sampling(live, window)
        others = [*outcome.others, *self._sample_records(live, case, samples)]
        return self.scrub.record(outcome.record), [self.scrub.record(r) for r in others]

    def run_timed(
        self, case: Case, prompt: Prompt, request: RequestShape
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A timed warm case: calls one after the other for the cell's duration_s, a checkpoint
        record every checkpoint_s. Where this process writes the ledger (`sink`), each
        checkpoint goes there at once with the calls before it, so that a run killed mid-way
        keeps them; the last call and the last checkpoint travel as a case's records do."""
        spec = self.matrix.cell(case.cell_id).spec
        assert spec.duration_s is not None
        every = spec.checkpoint_s or DEFAULT_CHECKPOINT_S
        described = self.unwritten_cells.pop(case.cell_id, None)
        if self.sink is not None and described is not None:
            self.sink([described])
        started = time.monotonic()
        # Within the cell's benchmark stage: its timeout (or the node's budget) ends it early.
        left = self.cells[case.cell_id].benchmark_left()
        end = started + (spec.duration_s if left is None else max(0.0, min(spec.duration_s, left)))
        pending: list[dict[str, Any]] = []
        window: list[dict[str, Any]] = []
        calls = 0
        checkpoints = 0
        last: dict[str, Any] | None = None
        while last is None or time.monotonic() < end:
            record, others, _ = self.measure(
                case, Request.of(prompt, request), prompt.sha256(request)
            )
            record["timed_idx"] = calls
            calls += 1
            last = record
            pending.extend([record, *others])
            window.append(record)
            now = time.monotonic()
            if now >= end:
                break
            if now - started >= (checkpoints + 1) * every:
                checkpoints += 1
                pending.append(
                    self._checkpoint(case, checkpoints, now - started, window, calls, final=False)
                )
                window = []
                if self.sink is not None:
                    self.sink(pending)
                    pending = []
        checkpoints += 1
        final = self._checkpoint(
            case, checkpoints, time.monotonic() - started, window, calls, final=True
        )
        if self.sink is not None:
            self.sink([record for record in pending if record is not last])
            return last, [final]
        return last, [record for record in pending if record is not last] + [final]

    def _checkpoint(
        self,
        case: Case,
        index: int,
        elapsed_s: float,
        window: list[dict[str, Any]],
        calls: int,
        *,
        final: bool,
    ) -> dict[str, Any]:
        record = checkpoint_record(
            run_id=self.run_id,
            cell=self.matrix.cell(case.cell_id),
            case=case,
            index=index,
            elapsed_s=elapsed_s,
            window=window,
            calls_so_far=calls,
            final=final,
        )
        log.info(
            "cell %s %s: checkpoint %d at %.1f s: %d calls, decode p50 %s tok/s",
            case.cell_id, case.prompt_id, index, elapsed_s, record["calls"],
            record["tokens_per_sec_p50"],
        )  # fmt: skip
        return as_json(record)

    def measure(
        self, case: Case, request: Request, sha256: str
    ) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
        """One measured call of the case, made cold or warm for its phase first: its call record
        (under the case's prompt_id, with `sha256`), the other records it produced (its `sample`
        record) and the answer's text (not recorded). A request without request keys (a test's
        own) takes the cell's."""
        live = self.cells[case.cell_id]
        shape = request.shape or live.cell.spec.request or RequestShape()
        request = replace(request, shape=shape)
        cold_kind = None
        if case.phase == "cold":
            cold_kind = live.make_cold()
        else:
            live.warm_up(request, case.adapter)
        steadiness = self.steadiness and case.phase == "warm"
        # The engine's own counters before the call (outside its timed span), where it has some.
        counters = live.engine_counters() if case.phase == "warm" else None
        counters_before = counters.read() if counters is not None else None
        control_ms = self.control.measure_ms() if steadiness else None
        assert live.engine is not None
        window = self._begin_sampling(live)
        started = utc_now()
        readings = (
            CallReadings(self.pressure, self.machine_cpu, live.engine_wait())
            if steadiness
            else None
        )
        measurement = live.request(request)
        beside = readings.fields() if readings is not None else {}
        live.last_call_end = time.monotonic()
        samples = self._end_sampling(live, window)
        counters_after = (
            counters.read(
                settled=True, since=counters_before, generated=measurement.completion_tokens
            )
            if counters is not None and counters_before is not None
            else None
        )
        record = call_record(
            run_id=self.run_id,
            cell=live.cell,
            case=case,
            prompt_sha256=sha256,
            cold_kind=cold_kind,
            started_at_utc=started,
            measurement=measurement,
            telemetry=(
                case_aggregates(samples, measurement.completion_tokens) if samples else None
            ),
        )
        # The control call's time and a re-measure's pass: open fields, after the others.
        fields = as_json(record)
        if control_ms is not None:
            fields["control_ms"] = round(control_ms, 3)
        fields.update(beside)
        fields.update(
            engine_check_fields(
                measurement, shape, counters_before, counters_after, request.extra_body
            )
        )
        if self.measure_pass > 1:
            fields["pass"] = self.measure_pass
        others = self._sample_records(live, case, samples)
        self.sequential.observe(case, record)
        if self.measure_pass == 1:
            self.sequential_runs.observe(case, as_json(record))
        # An engine may echo a credential in an error message: cut it out before anyone sees it.
        scrubbed_others = [self.scrub.record(other) for other in others]
        return self.scrub.record(as_json(record)), scrubbed_others, measurement.text

    def _begin_sampling(self, live: LiveCell) -> tuple[NodeTelemetry, float] | None:
        """Point the node's samplers at the cell's engine; None when the cell is not sampled."""
        settings = live.cell.telemetry
        telemetry = self.telemetry.get(live.cell.spec.node)
        if telemetry is None or (settings.gpu == "off" and settings.cpu == "off"):
            return None
        pid = live.engine_pid()
        try:
            return telemetry, telemetry.begin_case(pid)
        except Exception:
            log.warning("cell %s: telemetry failed", live.cell.cell_id, exc_info=True)
            return None

    def _end_sampling(
        self, live: LiveCell, window: tuple[NodeTelemetry, float] | None
    ) -> CaseSamples | None:
        if window is None:
            return None
        telemetry, start = window
        settings = live.cell.telemetry
        try:
            return telemetry.end_case(start, gpu=settings.gpu != "off", cpu=settings.cpu != "off")
        except Exception:
            log.warning("cell %s: telemetry failed", live.cell.cell_id, exc_info=True)
            return None

    def _sample_records(
        self, live: LiveCell, case: Case, samples: CaseSamples | None
    ) -> list[dict[str, Any]]:
        """The case's `sample` record, or none where the cell was not sampled."""
        if samples is None:
            return []
        record = sample_record(
            run_id=self.run_id,
            cell=live.cell,
            case=case,
            interval_ms=samples.interval_ms,
            gpu_source=samples.gpu_source,
            cpu_source=samples.cpu_source,
            columns=sample_columns(samples),
            notes=samples.notes,
        )
        return [as_json(record)]

    def release_node(self, node_id: str) -> None:
        """After a node's last case: stop its cells' engines and give the node back now, so a
        rented machine is not paid for while other nodes run. A later case would reopen it."""
        cell_ids = [cid for cid, live in self.cells.items() if live.cell.spec.node == node_id]
        cells = [self.cells.pop(cell_id) for cell_id in cell_ids]
        self._stop_telemetry([node_id])
        self._close(cells, self.nodes.take([node_id]))

    def close(self) -> None:
        """Stop every managed engine, then give back every node (a rented one is marked done)."""
        cells, self.cells = list(self.cells.values()), {}
        self._stop_telemetry(list(self.telemetry))
        self._close(cells, self.nodes.take())

    def _stop_telemetry(self, node_ids: list[str]) -> None:
        """Stop the nodes' samplers before their engines and connections go."""
        for node_id in node_ids:
            telemetry = self.telemetry.pop(node_id, None)
            if telemetry is not None:
                telemetry.stop()

    def _close(self, cells: list[LiveCell], targets: dict[str, Target]) -> None:
        """Each step runs even when an earlier one is interrupted (a second Ctrl-C during a slow
        teardown): a rented node left running costs money. The first interruption is raised
        once everything has been tried."""
        interrupted: BaseException | None = None
        for live in cells:
            try:
                live.close()
            except Exception:
                log.warning("cell %s: closing failed", live.cell.cell_id, exc_info=True)
            except BaseException as exc:
                interrupted = interrupted or exc
        for node_id, target in targets.items():
            begun = time.monotonic()
            rentals_before = len(self.nodes.rentals)
            clock = self.nodes.clocks.get(node_id)
            limit = cleanup_limit(clock)
            problem: str | None = None
            outcome: Outcome = "ok"
            try:
                problem = close_within(target, limit)
                if problem is not None:
                    outcome = "timeout"
            except Exception as exc:
                problem = plain_error(exc)
                log.warning("node %s: closing failed", node_id, exc_info=True)
            except BaseException as exc:
                problem = "interrupted"
                interrupted = interrupted or exc
            for rental in self.nodes.rentals[rentals_before:]:
                if not rental.get("session_done"):
                    problem = f"session {rental.get('session_id')} not marked done: end it by hand"
            if problem is not None and outcome == "ok":
                outcome = "failed"
            if clock is not None:
                clock.note(
                    "cleanup", outcome, time.monotonic() - begun, error=problem, timeout_s=limit
                )
        if interrupted is not None:
            raise interrupted


def cleanup_limit(clock: StageClock | None) -> float:
    """The cleanup stage's own timeout (stage_timeouts.cleanup, else DEFAULT_CLEANUP_TIMEOUT_S),
    cut to the node's budget but, where that leaves less, CLEANUP_GRACE_S (or its own timeout if
    shorter): giving a node back is worth trying even when the budget is spent."""
    if clock is None:
        return DEFAULT_CLEANUP_TIMEOUT_S
    own = clock.timeouts.get("cleanup", DEFAULT_CLEANUP_TIMEOUT_S)
    limit = clock.limit("cleanup", DEFAULT_CLEANUP_TIMEOUT_S)
    return max(own if limit is None else limit, min(own, CLEANUP_GRACE_S))


def close_within(target: Target, limit_s: float) -> str | None:
    """Close a target, waiting at most `limit_s`: None when it closed, else why it was left
    (what it started stays in the lease journal for the next run to give back). Its error, or
    an interruption while waiting, is raised here."""
    failure: list[BaseException] = []

    def close() -> None:
        try:
            target.close()
        except BaseException as exc:  # handed to the waiting thread
            failure.append(exc)

    closer = threading.Thread(target=close, name=f"gpubench-cleanup-{target.node_id}", daemon=True)
    closer.start()
    closer.join(limit_s)
    if closer.is_alive():
        return (
            f"node {target.node_id}: cleanup ran past its timeout of {limit_s:g} s; what it "
            "started stays in the lease journal (gpubench leases --release gives it back)"
        )
    if failure:
        raise failure[0]
    return None
