"""The harness: the node pool, the live cells on it, and measuring one case."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from pytest_gpubench.cases import Case
from pytest_gpubench.engines import Engine, EngineHook, KeepsConnection, make_engine
from pytest_gpubench.engines.managed import ManagedServer, managed_server, model_size
from pytest_gpubench.errors import GpubenchError
from pytest_gpubench.files import distinct_file_name
from pytest_gpubench.matrix import (
    Cell,
    LocalNode,
    Matrix,
    Prompt,
    ProviderNode,
    RequestShape,
    SshNode,
)
from pytest_gpubench.measure import STALL_LIMIT_S, CallMeasurement, StreamError, TlsSettings
from pytest_gpubench.provenance import utc_now
from pytest_gpubench.records import (
    call_record,
    cell_record,
    checkpoint_record,
    sample_record,
    skipped_record,
    stage_record,
    tls_warning,
)
from pytest_gpubench.secrets import SecretScrubber, secret_from_env
from pytest_gpubench.targets import Target, TargetHook, open_target
from pytest_gpubench.targets.bringup import check_vram
from pytest_gpubench.targets.gpu import gpu_summary
from pytest_gpubench.targets.local import LocalTarget
from pytest_gpubench.targets.stages import Stage, StageClock, StageError, StageOutcome
from pytest_gpubench.telemetry import CaseSamples, NodeTelemetry, node_telemetry
from pytest_gpubench.telemetry.aggregate import case_aggregates, sample_columns

log = logging.getLogger(__name__)

# A call is warm when the same model answered a call less than this long ago.
WARM_WINDOW_S = 60.0
HEALTH_TIMEOUT_S = 10.0
# A timed run's checkpoint interval when its cell sets none.
DEFAULT_CHECKPOINT_S = 60.0
# How long an engine may take to pull its own model where the node has no setup_timeout_s.
PULL_TIMEOUT_S = 1800.0
LOG_FETCH_TIMEOUT_S = 60.0
# The log on the node grows across runs (it is appended to): its tail holds this run.
LOG_FETCH_MAX_BYTES = 4 << 20


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
        # The provider APIs whose leaked sessions (rental journal) this run has given back.
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
            try:
                self.targets[node_id] = open_target(
                    node_id,
                    cell.node,
                    plugin_hook=self.target_hook,
                    on_rental_closed=self._rental_closed,
                    clock=self.clock(cell),
                )
            except Exception as exc:
                failure = exc if isinstance(exc, GpubenchError) else _opening_error(cell, exc)
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
        from pytest_gpubench.targets.provider.journal import RentalJournal, release

        journal = RentalJournal()
        for entry in journal.leaked(api):
            log.warning(
                "node %s: session %s was left rented by a run that was killed; giving it back",
                entry.facts.get("node"),
                entry.session_id,
            )
            self._rental_closed(release(entry, journal))

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


@dataclass
class LiveCell:
    """One cell while its cases run: its node, its engine (and managed server), warm state.
    Created and made ready on the cell's first case."""

    cell: Cell
    log_dir: Path
    # How the cell gets its node: the harness shares one target between a node's cells.
    node_target: Callable[[Cell], Target]
    # The node's stage clock (stage timeouts, budget, outcomes recorded).
    node_clock: Callable[[Cell], StageClock] = lambda cell: StageClock(cell.spec.node)
    engine_hook: EngineHook | None = None
    # Cuts secrets out of text the cell writes (the engine log it fetches from a node).
    scrub: Callable[[str], str] = str
    # Tells the scrubber a secret read at run time (a header's value).
    learn_secret: Callable[[str], None] = lambda secret: None
    target: Target | None = None
    server: ManagedServer | None = None
    engine: Engine | None = None
    model_digest: str | None = None
    unavailable: str | None = None
    unavailable_stage: Stage | None = None
    last_call_end: float | None = None
    # The cell record's facts (engine version, model digest, GPUs), once healthy.
    facts: dict[str, Any] = field(default_factory=dict)
    # When the cell became ready (its benchmark stage runs from there until it is closed).
    ready_at: float | None = None

    def prepare(self) -> None:
        """Open the node, launch a managed engine, health-check; on failure mark it unavailable."""
        spec = self.cell.spec
        if spec.skip:
            self.unavailable = f"skip: {spec.skip}"
            return
        try:
            self.target = self.node_target(self.cell)
            if self.cell.managed:
                self.server, self.model_digest = managed_server(
                    self.cell, self.target, self.log_dir
                )
                base_url = self._start_server(self.server, self.target)
            elif spec.port is not None:
                # An engine already running on the node, addressed by its port there.
                host, port = self.target.reach("127.0.0.1", spec.port)
                base_url = f"http://{host}:{port}"
            else:
                base_url = str(spec.endpoint).rstrip("/")
                self._check_tls()
            self.engine = self._engine(base_url)
            health = self.engine.health(HEALTH_TIMEOUT_S)
            if not health.ok:
                self._unavailable(GpubenchError(f"health check failed: {health.reason}"))
                return
            gpus = self.target.gpu_inventory()
            engine_facts = self.engine.describe(HEALTH_TIMEOUT_S)
            if engine_facts.get("model_digest") is None and self.model_digest is not None:
                # A managed engine's model file, hashed on its node (the engine may not say).
                engine_facts = {**engine_facts, "model_digest": self.model_digest}
            self.facts = {
                "engine_facts": engine_facts,
                "gpus": gpus,
                "gpu_summary": gpu_summary(gpus),
                "node_info": self.target.describe(),
                "engine_url": base_url,
            }
            self.ready_at = time.monotonic()
        except GpubenchError as exc:
            self._unavailable(exc)
        except Exception as exc:  # an OSError, a plugin's engine or target: still one clear line
            self._unavailable(GpubenchError(f"cell {self.cell.cell_id}: {_plain(exc)}"))
        except BaseException:
            # Ctrl-C while preparing: no later case may find a half-built cell.
            self.unavailable = "interrupted while the cell was being prepared"
            raise

    def _start_server(self, server: ManagedServer, target: Target) -> str:
        """Stages vram_check (where the model's size is known) and engine_start (within the
        cell's ready_timeout_s, cut to what is left of the node's budget)."""
        clock = self.node_clock(self.cell)
        cell_id = self.cell.cell_id
        if not server.pulls_model:
            size, where = model_size(self.cell, server, target)
            check_vram(target, clock, cell_id=cell_id, model_bytes=size, where=where)
        with clock.stage("engine_start", server.ready_timeout_s, cell_id=cell_id) as limit:
            if limit is not None:
                server.ready_timeout_s = limit
            base_url = server.start()
        if server.pulls_model:
            self._pull(base_url, clock)
            size, where = model_size(self.cell, server, target)
            if size is None:
                from pytest_gpubench.engines.managed_ollama import pulled_model_bytes

                size, where = pulled_model_bytes(base_url, self.cell.spec.model), "/api/tags"
            check_vram(target, clock, cell_id=cell_id, model_bytes=size, where=where)
        return base_url

    def _pull(self, base_url: str, clock: StageClock) -> None:
        """Stage model_pull of an engine that fetches its own model (Ollama), within the node's
        model_pull timeout (setup_timeout_s by default); its progress goes with the outcome."""
        from pytest_gpubench.engines.managed_ollama import pull_model

        cell_id = self.cell.cell_id
        default = getattr(self.cell.node, "setup_timeout_s", PULL_TIMEOUT_S)
        with clock.stage("model_pull", default, cell_id=cell_id) as limit:
            progress = pull_model(base_url, self.cell.spec.model, limit or default)
            clock.detail("model_pull", progress, cell_id)

    def _check_tls(self) -> None:
        """A CA file that cannot be read is one line now, not a failed call per case; a cell
        that checks no certificate says so (and its cell record says so too)."""
        spec = self.cell.spec
        if spec.endpoint is None or spec.endpoint.scheme != "https":
            return
        try:
            TlsSettings(verify=spec.tls_verify, ca_file=spec.ca_file).context()
        except StreamError as exc:
            raise GpubenchError(f"cell {self.cell.cell_id}: {exc}") from None
        warning = tls_warning(self.cell)
        if warning is not None:
            log.warning("%s", warning)
            warnings.warn(warning, UserWarning, stacklevel=1)

    def _unavailable(self, exc: GpubenchError) -> None:
        self.unavailable = str(exc)
        self.unavailable_stage = _failed_stage(self.cell, exc)

    def _engine(self, base_url: str) -> Engine:
        name = self.cell.spec.api_key_env
        api_key = (
            secret_from_env(name, owner=f"cell {self.cell.cell_id}", key="api_key_env")
            if name is not None
            else None
        )
        headers = {}
        for header, source in self.cell.spec.headers.items():
            value = secret_from_env(
                source.env, owner=f"cell {self.cell.cell_id}", key=f"headers.{header}"
            )
            self.learn_secret(value)
            headers[header] = value
        return make_engine(
            self.cell,
            base_url,
            api_key=api_key,
            model_digest=self.model_digest,
            plugin_hook=self.engine_hook,
            headers=headers,
        )

    def close_connection(self) -> None:
        """Close the engine's kept-alive connection: the next call opens a fresh one."""
        if isinstance(self.engine, KeepsConnection):
            self.engine.close_connection()

    def make_cold(self) -> str:
        """Force the model out of memory; returns the cold_kind recorded with the call.
        A cold call also opens a fresh connection."""
        assert self.engine is not None
        self.close_connection()
        if self.server is not None and self.cell.cold_mode == "restart":
            self.engine = self._engine(self.server.restart())
            return "restart"
        if self.engine.unload(timeout_s=30.0):
            return "unload"
        return "process_warm"

    def chat(
        self, prompt: str, max_tokens: int, request: RequestShape, **own: Any
    ) -> CallMeasurement:
        """One call on the cell's engine: the cell's and prompt's request keys (`request`) and a
        test's own request (`own`: messages, extra_body). Each is passed only when set: a plugin's
        engine may not take them."""
        assert self.engine is not None
        keywords = dict(own)
        if request.model_dump(exclude_none=True):
            keywords["request"] = request
        chat: Callable[..., CallMeasurement] = self.engine.chat
        stall = STALL_LIMIT_S.set(self.cell.spec.stall_s)
        try:
            return chat(prompt, max_tokens, self.cell.timeout_s, **keywords)
        finally:
            STALL_LIMIT_S.reset(stall)

    def warm_up(self, prompt: str, max_tokens: int, request: RequestShape, **own: Any) -> None:
        """An unrecorded call, so that the measured call follows one within the warm window (and
        on a connection already open). It sends the measured request itself, so that it primes
        what the measured call will find (a prompt cache) on every run alike."""
        recent = self.last_call_end is not None and (
            time.monotonic() - self.last_call_end < WARM_WINDOW_S
        )
        if recent:
            return
        self.chat(prompt, max_tokens, request, **own)
        self.last_call_end = time.monotonic()

    def close(self) -> None:
        """Stop the cell's managed engine; the node itself is closed by the harness.

        A remote engine's log is read back (stage `results`) into the local log folder first:
        a rented node, and everything on it, is gone once it is given back.
        """
        self.close_connection()
        clock = self.node_clock(self.cell)
        if self.ready_at is not None:
            elapsed = time.monotonic() - self.ready_at
            clock.note("benchmark", "ok", elapsed, cell_id=self.cell.cell_id)
            self.ready_at = None
        if self.server is None:
            return
        with contextlib.suppress(Exception):
            self.server.stop()
        started = self.server.starts > 0
        if started and self.target is not None and not isinstance(self.target, LocalTarget):
            begun = time.monotonic()
            limit = clock.limit("collect", LOG_FETCH_TIMEOUT_S) or LOG_FETCH_TIMEOUT_S
            fetched = self.fetch_log(self.target, self.server.log_path, max(limit, 1.0))
            clock.note(
                "collect",
                "ok" if fetched is not None else "failed",
                time.monotonic() - begun,
                error=None if fetched is not None else "engine log not read back",
                cell_id=self.cell.cell_id,
            )

    def fetch_log(
        self, target: Target, remote_path: str, timeout_s: float = LOG_FETCH_TIMEOUT_S
    ) -> Path | None:
        """The last LOG_FETCH_MAX_BYTES of a remote engine log, copied here; None on failure."""
        node = self.cell.spec.node
        name = f"{distinct_file_name(node)}-{PurePosixPath(remote_path).name}"
        local = self.log_dir / name
        tail = ["tail", "-c", str(LOG_FETCH_MAX_BYTES), remote_path]
        try:
            result = target.run(tail, timeout_s=timeout_s)
            if not result.ok:
                raise GpubenchError(result.stderr.strip()[-300:] or f"status {result.returncode}")
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(self.scrub(result.stdout), encoding="utf-8")
        except Exception as exc:  # a log is a nicety: never worth losing the run's records
            log.warning(
                "cell %s: engine log %s not read back: %s", self.cell.cell_id, remote_path, exc
            )
            return None
        return local


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
    ) -> None:
        self.matrix = matrix
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
            telemetry = node_telemetry(node_id, live.target, settings, live.facts.get("gpus", []))
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
        records: list[dict[str, Any]] = self.stage_records()
        if fresh and live.facts:
            records.append(
                self.scrub.record(
                    cell_record(
                        run_id=self.run_id,
                        cell=live.cell,
                        prompts=self.matrix.prompts,
                        **live.facts,
                    )
                )
            )
        if live.unavailable is not None:
            reason = self.scrub(live.unavailable)
            records.append(
                skipped_record(
                    run_id=self.run_id,
                    cell=live.cell,
                    case=case,
                    reason=reason,
                    stage=live.unavailable_stage,
                )
            )
            return reason, records
        return None, records

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
            stage = _failed_stage(cell, exc)
            skipped = skipped_record(
                run_id=self.run_id, cell=cell, case=case, reason=reason, stage=stage
            )
            return reason, [*self.stage_records(), skipped], None
        return None, self.stage_records(), target

    def stage_records(self) -> list[dict[str, Any]]:
        """The `stage` records of the stages that ended since the last call."""
        return [
            self.scrub.record(stage_record(run_id=self.run_id, facts=outcome.to_facts()))
            for outcome in self.nodes.take_stage_outcomes()
        ]

    def run_case(self, case: Case) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Measure one case of a prompts.yaml prompt: its call record (with the case's resource
        figures) and the other records it produced (its `sample` record when its node is
        sampled)."""
        if case.load_point is not None:
            return self.run_load_case(case)
        prompt = self.matrix.prompts[case.prompt_id]
        cell = self.matrix.cell(case.cell_id)
        request = cell.request_for(prompt)
        if cell.spec.duration_s is not None and case.phase == "warm":
            return self.run_timed(case, prompt, request)
        record, others, _ = self.measure(
            case, prompt.prompt, prompt.max_tokens, sha256=prompt.sha256(request), request=request
        )
        return record, others

    def run_load_case(self, case: Case) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Measure one load case (load/runner.py): its `load` record, and the call records of
        its requests (and a sweep's per-step load records)."""
        from pytest_gpubench.load.runner import run_load_case

        live = self.cells[case.cell_id]
        window = self._begin_sampling(live)
        outcome = run_load_case(live, self.matrix, case, self.run_id)
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
        started = time.monotonic()
        end = started + spec.duration_s
        pending: list[dict[str, Any]] = []
        window: list[dict[str, Any]] = []
        calls = 0
        checkpoints = 0
        last: dict[str, Any] | None = None
        while last is None or time.monotonic() < end:
            record, others, _ = self.measure(
                case, prompt.prompt, prompt.max_tokens, sha256=prompt.sha256(request),
                request=request,
            )  # fmt: skip
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
        return record

    def measure(
        self,
        case: Case,
        prompt: str,
        max_tokens: int,
        *,
        sha256: str,
        request: RequestShape | None = None,
        messages: list[dict[str, Any]] | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
        """One measured call of the case, made cold or warm for its phase first: its call record
        (under the case's prompt_id, with `sha256`), the other records it produced (its `sample`
        record) and the answer's text (not recorded).

        `request` is the cell's (and prompt's) request keys, the cell's own when not given;
        `messages` and `extra_body` go to the engine only when given (a test's own request), so
        an engine that does not take them still measures the prompts of prompts.yaml."""
        live = self.cells[case.cell_id]
        shape = request if request is not None else (live.cell.spec.request or RequestShape())
        own: dict[str, Any] = {}
        if messages is not None:
            own["messages"] = messages
        if extra_body:
            own["extra_body"] = extra_body
        cold_kind = None
        if case.phase == "cold":
            cold_kind = live.make_cold()
        else:
            live.warm_up(prompt, max_tokens, shape, **own)
        assert live.engine is not None
        window = self._begin_sampling(live)
        started = utc_now()
        measurement = live.chat(prompt, max_tokens, shape, **own)
        live.last_call_end = time.monotonic()
        samples = self._end_sampling(live, window)
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
        others = self._sample_records(live, case, samples)
        # An engine may echo a credential in an error message: cut it out before anyone sees it.
        scrubbed_others = [self.scrub.record(other) for other in others]
        return self.scrub.record(record), scrubbed_others, measurement.text

    def _begin_sampling(self, live: LiveCell) -> tuple[NodeTelemetry, float] | None:
        """Point the node's samplers at the cell's engine; None when the cell is not sampled."""
        settings = live.cell.telemetry
        telemetry = self.telemetry.get(live.cell.spec.node)
        if telemetry is None or (settings.gpu == "off" and settings.cpu == "off"):
            return None
        pid = live.server.pid if live.server is not None else None
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
        return [
            sample_record(
                run_id=self.run_id,
                cell=live.cell,
                case=case,
                interval_ms=samples.interval_ms,
                gpu_source=samples.gpu_source,
                cpu_source=samples.cpu_source,
                columns=sample_columns(samples),
                notes=samples.notes,
            )
        ]

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
            problem: str | None = None
            try:
                target.close()
            except Exception as exc:
                problem = _plain(exc)
                log.warning("node %s: closing failed", node_id, exc_info=True)
            except BaseException as exc:
                problem = "interrupted"
                interrupted = interrupted or exc
            for rental in self.nodes.rentals[rentals_before:]:
                if not rental.get("session_done"):
                    problem = f"session {rental.get('session_id')} not marked done: end it by hand"
            clock = self.nodes.clocks.get(node_id)
            if clock is not None:
                clock.note(
                    "cleanup",
                    "ok" if problem is None else "failed",
                    time.monotonic() - begun,
                    error=problem,
                )
        if interrupted is not None:
            raise interrupted


def _failed_stage(cell: Cell, exc: Exception) -> Stage | None:
    """The stage a remote cell failed in; local cells have no stages."""
    if isinstance(exc, StageError):
        return exc.stage
    return None if isinstance(cell.node, LocalNode) else "benchmark"


def _plain(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _opening_error(cell: Cell, exc: Exception) -> StageError:
    """A node that could not be opened for a reason no target named: still a failed stage."""
    stage: Stage = "ssh_connect" if isinstance(cell.node, SshNode) else "provision"
    return StageError(stage, f"node {cell.spec.node}: {_plain(exc)}")
