"""A live cell: its node, its engine (started, pulled, checked), warm state, cold restarts, and
its engine log fetched at the end."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from pytest_gpubench.config.cell import Cell
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.files import distinct_file_name
from pytest_gpubench.core.secrets import secret_from_env
from pytest_gpubench.engines import (
    Engine,
    EngineHook,
    KeepsConnection,
    ReadsCounters,
    Request,
    make_engine,
    send,
)
from pytest_gpubench.engines.managed import ManagedServer, managed_server, model_size
from pytest_gpubench.engines.managed_ollama import pull_model, pulled_model_bytes
from pytest_gpubench.engines.protocol import EngineFacts
from pytest_gpubench.ledger.records import tls_warning
from pytest_gpubench.ledger.schema import CellFacts
from pytest_gpubench.measure.call_measurement import CallMeasurement
from pytest_gpubench.measure.engine_wait import EngineWait
from pytest_gpubench.measure.gauges import CaseCounters
from pytest_gpubench.measure.listener import EngineProcess, endpoint_process
from pytest_gpubench.measure.stream import STALL_LIMIT_S, StreamError, TlsSettings
from pytest_gpubench.run.nodes import plain_error
from pytest_gpubench.targets import StartsEnginesInJobs, Target, on_this_machine, records_stages
from pytest_gpubench.targets.bringup import check_gpus, check_vram
from pytest_gpubench.targets.gpu import gpu_summary
from pytest_gpubench.targets.stages import Stage, StageClock, StageError

log = logging.getLogger(__name__)

# A call is warm when the same model answered a call less than this long ago.
WARM_WINDOW_S = 60.0
HEALTH_TIMEOUT_S = 10.0
# How long an engine may take to pull its own model where the node has no setup_timeout_s.
PULL_TIMEOUT_S = 1800.0
LOG_FETCH_TIMEOUT_S = 60.0
# The log on the node grows across runs (it is appended to): its tail holds this run.
LOG_FETCH_MAX_BYTES = 4 << 20


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
    # The LoRA adapters a request has named since the engine was last made cold: an adapter's
    # first request may load it (vLLM's LoRA slots), so each gets a warm-up of its own.
    warmed_adapters: set[str] = field(default_factory=set)
    # The cell record's facts (engine version, model digest, GPUs), once healthy.
    facts: CellFacts | None = None
    # When the cell became ready (its benchmark stage runs from there until it is closed).
    ready_at: float | None = None
    # A Slurm cell's gpu_check ran in its first job (not again in each restarted one).
    job_node_checked: bool = False
    # Why its benchmark stage was stopped (its timeout or the node's budget spent), if it was.
    benchmark_stopped: str | None = None
    # Token-exact synthetic texts counted on this cell, by (size, seed) (run/workloads.py).
    exact_texts: dict[tuple[int, int], Any] = field(default_factory=dict)
    # The engine's /metrics read around each warm call (None until first asked, or where the
    # engine speaks no OpenAI-compatible HTTP: Ollama, a plugin's engine).
    counters: CaseCounters | None = None
    # The process serving an engine the harness did not start, found from its endpoint on this
    # machine (or why it was not): None for a managed engine, or one on another node.
    engine_process: EngineProcess | None = None

    def engine_pid(self) -> int | None:
        """The engine's process: a managed engine's, or the one found serving the endpoint of an
        engine started outside the harness on this machine; None elsewhere."""
        if self.server is not None:
            return self.server.pid
        return self.engine_process.pid if self.engine_process is not None else None

    def engine_wait(self) -> EngineWait | None:
        """The reader of the engine's own waiting: an engine process on this machine."""
        if not on_this_machine(self.target):
            return None
        pid = self.engine_pid()
        return EngineWait(pid) if pid is not None else None

    def engine_counters(self) -> CaseCounters | None:
        """The reader of the engine's own counters around a warm call (engines.ReadsCounters);
        None where it exposes no /metrics (asked once: CaseCounters.absent says why)."""
        if not isinstance(self.engine, ReadsCounters):
            return None
        if self.counters is None:
            self.counters = self.engine.case_counters()
        return None if self.counters.absent is not None else self.counters

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
            # A copy (a plugin's engine may hand out its own), to add to below.
            engine_facts = EngineFacts(**self.engine.describe(HEALTH_TIMEOUT_S))
            if engine_facts.get("model_digest") is None and self.model_digest is not None:
                # A managed engine's model file, hashed on its node (the engine may not say).
                engine_facts["model_digest"] = self.model_digest
            if self.server is not None and self.server.engine_version is not None:
                # The prebuilt llama.cpp server's own build reads `b0-unknown`: the package and
                # its llama.cpp build are recorded instead, its own kept beside them.
                own_build = engine_facts.get("engine_version")
                engine_facts["engine_version"] = self.server.engine_version
                engine_facts["engine_build_info"] = own_build
            if self.server is not None and self.server.shared_paths:
                # Which of this host's paths the node ran from (a shared filesystem).
                engine_facts["shared_paths"] = self.server.shared_paths
            self.facts = {
                "engine_facts": engine_facts,
                "gpus": gpus,
                "gpu_summary": gpu_summary(gpus),
                "node_info": self.target.describe(),
                "engine_url": base_url,
            }
            if self.server is None and on_this_machine(self.target):
                self.engine_process = self._find_engine_process(base_url)
                self.facts["engine_process"] = self.engine_process.facts()
            self.ready_at = time.monotonic()
        except GpubenchError as exc:
            self._unavailable(exc)
        except Exception as exc:  # an OSError, a plugin's engine or target: still one clear line
            self._unavailable(GpubenchError(f"cell {self.cell.cell_id}: {plain_error(exc)}"))
        except BaseException:
            # Ctrl-C while preparing: no later case may find a half-built cell.
            self.unavailable = "interrupted while the cell was being prepared"
            raise

    def _find_engine_process(self, base_url: str) -> EngineProcess:
        """The process serving an engine the user started, whose own CPU wait each warm call
        reads (measure/listener.py); where none is found, why, said once here and in the cell
        record, and the machine's CPU pressure stands in."""
        found = endpoint_process(base_url)
        if found.pid is not None:
            log.info(
                "cell %s: the engine at %s is process %d (%s)",
                self.cell.cell_id, base_url, found.pid, found.comm,
            )  # fmt: skip
        else:
            log.info("cell %s: %s", self.cell.cell_id, found.missing)
        return found

    def _start_server(self, server: ManagedServer, target: Target) -> str:
        """Stages vram_check (where the model's size is known) and engine_start (within the
        cell's ready_timeout_s, cut to what is left of the node's budget)."""
        clock = self.node_clock(self.cell)
        cell_id = self.cell.cell_id
        if isinstance(target, StartsEnginesInJobs):
            # A job: its node (and GPUs) are known once it runs; checked inside it.
            target.when_job_runs(lambda shell: self._check_job_node(shell, server, clock))
        elif not server.pulls_model:
            size, where = model_size(self.cell, server, target)
            check_vram(target, clock, cell_id=cell_id, model_bytes=size, where=where)
        with clock.stage("engine_start", server.ready_timeout_s, cell_id=cell_id) as limit:
            if limit is not None:
                server.ready_timeout_s = limit
            # Not for a job: the login node that runs commands lacks what its image or modules
            # give the compute node.
            if not isinstance(target, StartsEnginesInJobs) and server.starts == 0:
                server.check_installed()
            base_url = server.start()
        if server.pulls_model:
            self._pull(base_url, clock)
            size, where = model_size(self.cell, server, target)
            if size is None:
                size, where = pulled_model_bytes(base_url, self.cell.spec.model), "/api/tags"
            check_vram(target, clock, cell_id=cell_id, model_bytes=size, where=where)
        return base_url

    def _check_job_node(self, shell: Target, server: ManagedServer, clock: StageClock) -> None:
        """Stages gpu_check (once per cell) and vram_check on the job's own node, through a
        step of the job (the login node's GPUs, if any, are not the job's)."""
        node = self.cell.node
        if not self.job_node_checked:
            self.job_node_checked = True
            check_gpus(
                shell,
                clock,
                gpu_type=getattr(node, "gpu_type", None),
                gpu_count=getattr(node, "gpu_count", None),
                mode=getattr(node, "gpu_check", "auto"),
            )
        if not server.pulls_model:
            size, where = model_size(self.cell, server, shell)
            check_vram(shell, clock, cell_id=self.cell.cell_id, model_bytes=size, where=where)

    def _pull(self, base_url: str, clock: StageClock) -> None:
        """Stage model_pull of an engine that fetches its own model (Ollama), within the node's
        model_pull timeout (setup_timeout_s by default); its progress goes with the outcome."""
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
        self.unavailable_stage = failed_stage(self.cell, exc)

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
        self.warmed_adapters.clear()
        if self.server is not None and self.cell.cold_mode == "restart":
            self.engine = self._engine(self.server.restart())
            return "restart"
        if self.engine.unload(timeout_s=30.0):
            return "unload"
        return "process_warm"

    def start_again(self) -> bool:
        """Stop the managed engine and start it again, so that the next calls are a new run of
        it (run/history_runs.py), warmed up again before the first; False for an engine this
        cell does not start (an endpoint)."""
        if self.server is None or self.engine is None:
            return False
        self.close_connection()
        self.warmed_adapters.clear()
        self.engine = self._engine(self.server.restart())
        self.last_call_end = None
        return True

    def kind_missing(self, kind: str) -> str | None:
        """Why the cell's engine cannot send a request of `kind` (one line), or None: an engine
        says which kinds it sends (`kinds`), a managed one's launch what it serves."""
        assert self.engine is not None
        kinds = self.engine.kinds
        if kind not in kinds:
            return (
                f"cell {self.cell.cell_id}: engine {self.engine.kind} does not send {kind} "
                f"requests (it sends {', '.join(kinds)})"
            )
        why = self.server.kind_missing(kind) if self.server is not None else None
        return f"cell {self.cell.cell_id}: {why}" if why is not None else None

    def request(self, request: Request) -> CallMeasurement:
        """One call of the request's kind on the cell's engine (engines.send). A tools or
        json_schema answer is checked (measure/validity.py)."""
        assert self.engine is not None
        stall = STALL_LIMIT_S.set(self.cell.spec.stall_s)
        try:
            measurement = send(self.engine, request, self.cell.timeout_s)
        finally:
            STALL_LIMIT_S.reset(stall)
        if request.kind != "chat":
            from pytest_gpubench.measure.validity import judge_answer

            measurement.kind = request.kind
            judge_answer(measurement, request.kind_keys)
        return measurement

    def benchmark_left(self) -> float | None:
        """Seconds the cell's benchmark stage may still run (stage_timeouts.benchmark, cut to
        the node's budget); None: no limit."""
        if self.ready_at is None:
            return None
        return self.node_clock(self.cell).left("benchmark", self.ready_at)

    def check_benchmark_time(self) -> None:
        """Before a case: a benchmark stage past its timeout (or the node's budget) ends, and
        the cell's remaining cases are skipped with the reason, stage `benchmark`."""
        if self.ready_at is None or self.unavailable is not None:
            return
        overrun = self.node_clock(self.cell).overrun("benchmark", self.ready_at)
        if overrun is not None:
            self.benchmark_stopped = overrun
            self.unavailable = overrun
            self.unavailable_stage = "benchmark"

    def warm_up(self, request: Request, adapter: str | None = None) -> bool:
        """An unrecorded call, so that the measured call follows one within the warm window (and
        on a connection already open). It sends the measured request itself, so that it primes
        what the measured call will find (a prompt cache) on every run alike. A request naming
        a LoRA adapter (`adapter`) no request has named since the engine was made cold is
        always preceded by one. Whether it sent one."""
        recent = self.last_call_end is not None and (
            time.monotonic() - self.last_call_end < WARM_WINDOW_S
        )
        if recent and (adapter is None or adapter in self.warmed_adapters):
            return False
        if adapter is not None:
            self.warmed_adapters.add(adapter)
        self.request(request)
        self.last_call_end = time.monotonic()
        return True

    def close(self) -> None:
        """Stop the cell's managed engine; the node itself is closed by the harness.

        A remote engine's log is read back (stage `results`) into the local log folder first:
        a rented node, and everything on it, is gone once it is given back.
        """
        self.close_connection()
        clock = self.node_clock(self.cell)
        if self.ready_at is not None:
            elapsed = time.monotonic() - self.ready_at
            timeout = clock.timeouts.get("benchmark")
            if self.benchmark_stopped is not None:
                clock.note(
                    "benchmark", "timeout", elapsed, error=self.benchmark_stopped,
                    cell_id=self.cell.cell_id, timeout_s=timeout,
                )  # fmt: skip
            else:
                clock.note("benchmark", "ok", elapsed, cell_id=self.cell.cell_id, timeout_s=timeout)
            self.ready_at = None
        if self.server is None:
            return
        with contextlib.suppress(Exception):
            self.server.stop()
        started = self.server.starts > 0
        if started and self.target is not None and not on_this_machine(self.target):
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


def failed_stage(cell: Cell, exc: Exception) -> Stage | None:
    """The stage a remote cell failed in; local cells have no stages."""
    if isinstance(exc, StageError):
        return exc.stage
    return "benchmark" if records_stages(cell.node) else None
