"""The benchmark session at run time: per-cell engines and servers, cold/warm, and call records."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from pytest_gpubench.cases import Case
from pytest_gpubench.engines import Engine
from pytest_gpubench.engines.llamacpp import LlamaCppEngine
from pytest_gpubench.engines.managed import ManagedLlamaServer, plain_file_name
from pytest_gpubench.engines.ollama import OllamaEngine
from pytest_gpubench.engines.openai import OpenAIEngine
from pytest_gpubench.errors import GpubenchError
from pytest_gpubench.ledger import SecretScrubber, scrub_record
from pytest_gpubench.matrix import TINY_MODEL, Cell, LocalNode, Matrix, SshNode
from pytest_gpubench.measure import CallMeasurement
from pytest_gpubench.provenance import secret_values, utc_now
from pytest_gpubench.targets import Target, open_target
from pytest_gpubench.targets.gpu import gpu_summary
from pytest_gpubench.targets.local import LocalTarget
from pytest_gpubench.targets.stages import Stage, StageError

log = logging.getLogger(__name__)

# SPEC §5: a call is warm when the same model answered a call less than this long ago.
WARM_WINDOW_S = 60.0
HEALTH_TIMEOUT_S = 10.0
LOG_FETCH_TIMEOUT_S = 60.0
# The log on the node grows across runs (it is appended to): its tail holds this run.
LOG_FETCH_MAX_BYTES = 4 << 20


# pytest_gpubench_make_engine (hookspecs.py), as pytest calls it.
EngineHook = Callable[..., Engine | None]


def open_cell_node(cell: Cell) -> Target:
    """The cell's node opened outside a BenchSession: no plugin node kinds, no rental record."""
    return open_target(cell.spec.node, cell.node, plugin_hook=None, on_rental_closed=lambda _: None)


def _failed_stage(cell: Cell, exc: Exception) -> Stage | None:
    """The SPEC §10 stage a remote cell failed in; local cells have no stages."""
    if isinstance(exc, StageError):
        return exc.stage
    return None if isinstance(cell.node, LocalNode) else "benchmark"


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as model:
        for block in iter(lambda: model.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def _api_key(cell: Cell) -> str | None:
    name = cell.spec.api_key_env
    if name is None:
        return None
    value = os.environ.get(name)
    if not value:
        raise GpubenchError(f"cell {cell.cell_id}: api_key_env: ${name} is not set")
    return value


@dataclass
class CellRuntime:
    """Everything one cell needs while its cases run; created on the cell's first case."""

    cell: Cell
    log_dir: Path
    # How the runtime gets its node: BenchSession shares one target between a node's cells.
    node_target: Callable[[Cell], Target] = open_cell_node
    engine_hook: EngineHook | None = None
    # Cuts secrets out of text the runtime writes (the engine log it fetches from a node).
    scrub: Callable[[str], str] = str
    target: Target | None = None
    server: ManagedLlamaServer | None = None
    engine: Engine | None = None
    unavailable: str | None = None
    unavailable_stage: Stage | None = None
    last_call_end: float | None = None
    cell_record: dict[str, Any] = field(default_factory=dict)

    def prepare(self) -> None:
        """Open the node, launch a managed engine, health-check; on failure mark it unavailable."""
        spec = self.cell.spec
        if spec.skip:
            self.unavailable = f"skip: {spec.skip}"
            return
        try:
            self.target = self.node_target(self.cell)
            model_digest = None
            if self.cell.managed:
                self.server, model_digest = self._managed_server(self.target)
                base_url = self.server.start()
            else:
                base_url = str(spec.endpoint).rstrip("/")
            self.engine = self._engine(base_url, model_digest)
            health = self.engine.health(HEALTH_TIMEOUT_S)
            if not health.ok:
                self._unavailable(GpubenchError(f"health check failed: {health.reason}"))
                return
            self.cell_record = self._describe(self.engine, self.target)
        except GpubenchError as exc:
            self._unavailable(exc)
        except Exception as exc:  # an OSError, a plugin's engine or target: still one clear line
            self._unavailable(GpubenchError(f"cell {self.cell.cell_id}: {_plain(exc)}"))
        except BaseException:
            # Ctrl-C while preparing: no later case may find a half-built runtime.
            self.unavailable = "interrupted while the cell was being prepared"
            raise

    def _unavailable(self, exc: GpubenchError) -> None:
        self.unavailable = str(exc)
        self.unavailable_stage = _failed_stage(self.cell, exc)

    def _managed_server(self, target: Target) -> tuple[ManagedLlamaServer, str]:
        spec = self.cell.spec
        if isinstance(target, LocalTarget):
            from pytest_gpubench.engines.llamacpp_build import ensure_llama_server

            binary = str(ensure_llama_server(spec.server_binary))
            if spec.model_path:
                model = Path(spec.model_path).expanduser()
                if not model.is_file():
                    raise GpubenchError(
                        f"cell {self.cell.cell_id}: model_path: {model} does not exist"
                    )
            elif spec.model == TINY_MODEL:
                from pytest_gpubench.tinymodel import ensure_tiny_model

                model = ensure_tiny_model()
            else:
                raise GpubenchError(
                    f"cell {self.cell.cell_id}: model_path: a managed llamacpp cell needs a GGUF "
                    f"file (or model: {TINY_MODEL} for the generated tiny model)"
                )
            model_path, digest = str(model), _file_sha256(model)
        else:
            if not (spec.server_binary and spec.model_path):
                raise GpubenchError(
                    f"cell {self.cell.cell_id}: a managed llamacpp cell on a remote node needs "
                    "server_binary and model_path (paths on the node; install them with setup)"
                )
            binary, model_path = spec.server_binary, spec.model_path
            digest_run = target.run(["sha256sum", model_path], timeout_s=120)
            if not digest_run.ok:
                raise GpubenchError(
                    f"cell {self.cell.cell_id}: model_path: cannot read {model_path} on the node"
                )
            digest = f"sha256:{digest_run.stdout.split()[0]}"
        server = ManagedLlamaServer(
            target,
            cell_id=self.cell.cell_id,
            binary=binary,
            model_path=model_path,
            alias=spec.model,
            log_dir=str(self.log_dir) if isinstance(target, LocalTarget) else target.work_dir,
            extra_args=spec.server_args,
        )
        return server, digest

    def _engine(self, base_url: str, model_digest: str | None) -> Engine:
        spec = self.cell.spec
        api_key = _api_key(self.cell)
        if self.engine_hook is not None:
            engine = self.engine_hook(
                cell=self.cell, base_url=base_url, api_key=api_key, model_digest=model_digest
            )
            if engine is not None:
                return engine
        if spec.engine == "llamacpp":
            return LlamaCppEngine(base_url, spec.model, api_key, model_digest)
        if spec.engine == "ollama":
            return OllamaEngine(base_url, spec.model)
        if spec.engine == "openai":
            return OpenAIEngine(base_url, spec.model, api_key)
        raise GpubenchError(
            f"cell {self.cell.cell_id}: engine: no plugin built an engine of kind {spec.engine}"
        )

    def _describe(self, engine: Engine, target: Target) -> dict[str, Any]:
        spec = self.cell.spec
        gpus = target.gpu_inventory()
        return {
            "type": "cell",
            "cell_id": self.cell.cell_id,
            "node": spec.node,
            "node_kind": self.cell.node.kind,
            "engine": spec.engine,
            "model": spec.model,
            "managed": self.cell.managed,
            "endpoint": None if self.cell.managed else str(spec.endpoint),
            **engine.describe(HEALTH_TIMEOUT_S),
            "gpus": gpus,
            "gpu_summary": gpu_summary(gpus),
            "node_info": target.describe(),
            "at_utc": utc_now(),
        }

    def make_cold(self) -> str:
        """Force the model out of memory; returns the cold_kind recorded with the call."""
        assert self.engine is not None
        if self.server is not None:
            base_url = self.server.restart()
            self.engine = self._engine(base_url, getattr(self.engine, "_model_digest", None))
            return "restart"
        if self.engine.unload(timeout_s=30.0):
            return "unload"
        return "process_warm"

    def warm_up(self, prompt: str, max_tokens: int) -> None:
        """An unrecorded call, so that the measured call follows one within the warm window."""
        recent = self.last_call_end is not None and (
            time.monotonic() - self.last_call_end < WARM_WINDOW_S
        )
        if recent:
            return
        assert self.engine is not None
        self.engine.chat(prompt, max_tokens, self.cell.timeout_s)
        self.last_call_end = time.monotonic()

    def close(self) -> None:
        """Stop the cell's managed engine; the node itself is closed by its BenchSession.

        A remote engine's log is read back (stage `results`) into the local log folder first:
        a rented node, and everything on it, is gone once it is given back.
        """
        if self.server is None:
            return
        with contextlib.suppress(Exception):
            self.server.stop()
        if self.target is not None and not isinstance(self.target, LocalTarget):
            self.fetch_log(self.target, self.server.log_path)

    def fetch_log(self, target: Target, remote_path: str) -> Path | None:
        """The last LOG_FETCH_MAX_BYTES of a remote engine log, copied here; None on failure."""
        node = self.cell.spec.node
        local = self.log_dir / f"{plain_file_name(node)}-{PurePosixPath(remote_path).name}"
        tail = ["tail", "-c", str(LOG_FETCH_MAX_BYTES), remote_path]
        try:
            result = target.run(tail, timeout_s=LOG_FETCH_TIMEOUT_S)
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


@dataclass
class BenchSession:
    """Run-wide state, kept in config.stash; the ledger exists only in the writing process."""

    matrix: Matrix
    run_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    log_dir: Path = Path("runs")
    runtimes: dict[str, CellRuntime] = field(default_factory=dict)
    scrub: SecretScrubber = field(default_factory=lambda: SecretScrubber(secret_values()))
    # One target per node, opened by its first cell and shared by the others (one SSH
    # connection, one rented machine); a node that failed fails its other cells the same way.
    targets: dict[str, Target] = field(default_factory=dict)
    node_failures: dict[str, GpubenchError] = field(default_factory=dict)
    # What each rented node cost, known only once it is given back (SPEC §10).
    closed_nodes: list[dict[str, Any]] = field(default_factory=list)
    # pytest's hook relay, for engine and node kinds that plugins add (hookspecs.py).
    hooks: Any = None

    def runtime(self, cell_id: str) -> tuple[CellRuntime, bool]:
        """The cell's runtime, prepared on first use; the flag says it was prepared just now."""
        if cell_id in self.runtimes:
            return self.runtimes[cell_id], False
        engine_hook = self.hooks.pytest_gpubench_make_engine if self.hooks is not None else None
        runtime = CellRuntime(
            self.matrix.cell(cell_id),
            self.log_dir,
            self.node_target,
            engine_hook=engine_hook,
            scrub=self.scrub,
        )
        self.runtimes[cell_id] = runtime
        runtime.prepare()
        return runtime, True

    def node_target(self, cell: Cell) -> Target:
        """The cell's node, opened once; a node that failed to open fails again at once."""
        node_id = cell.spec.node
        failure = self.node_failures.get(node_id)
        if failure is not None:
            raise failure
        if node_id not in self.targets:
            target_hook = self.hooks.pytest_gpubench_open_target if self.hooks is not None else None
            try:
                self.targets[node_id] = open_target(
                    node_id,
                    cell.node,
                    plugin_hook=target_hook,
                    on_rental_closed=self._rental_closed,
                )
            except Exception as exc:
                failure = exc if isinstance(exc, GpubenchError) else _opening_error(cell, exc)
                self.node_failures[node_id] = failure
                raise failure from None
        return self.targets[node_id]

    def _rental_closed(self, facts: dict[str, Any]) -> None:
        """Keep what a rented node cost, told by the node once it is given back."""
        self.closed_nodes.append(scrub_record(facts, self.scrub))

    def run_case(self, case: Case) -> dict[str, Any]:
        """Measure one case and return its call record."""
        runtime = self.runtimes[case.cell_id]
        prompt = self.matrix.prompts[case.prompt_id]
        cold_kind = None
        if case.phase == "cold":
            cold_kind = runtime.make_cold()
        else:
            runtime.warm_up(prompt.prompt, prompt.max_tokens)
        assert runtime.engine is not None
        started = utc_now()
        measurement = runtime.engine.chat(prompt.prompt, prompt.max_tokens, runtime.cell.timeout_s)
        runtime.last_call_end = time.monotonic()
        record = call_record(
            self.run_id, runtime.cell, case, prompt.sha256(), cold_kind, started, measurement
        )
        # An engine may echo a credential in an error message: cut it out before anyone sees it.
        return scrub_record(record, self.scrub)

    def skipped_record(
        self, case: Case | None, cell_id: str, reason: str, stage: Stage | None = None
    ) -> dict[str, Any]:
        return {
            "type": "skipped",
            "benchmark_run_id": self.run_id,
            "cell_id": cell_id,
            "case_id": case.case_id if case else None,
            "prompt_id": case.prompt_id if case else None,
            "phase": case.phase if case else None,
            "run_idx": case.run_idx if case else None,
            "reason": self.scrub(reason),
            "at_utc": utc_now(),
            "node": self.matrix.cell(cell_id).spec.node,
            "stage": stage,
        }

    def release_node(self, node_id: str) -> None:
        """After a node's last case: stop its cells' engines and give the node back now, so a
        rented machine is not paid for while other nodes run. A later case would reopen it."""
        cells = [cell_id for cell_id, rt in self.runtimes.items() if rt.cell.spec.node == node_id]
        runtimes = [self.runtimes.pop(cell_id) for cell_id in cells]
        target = self.targets.pop(node_id, None)
        self._close(runtimes, {node_id: target} if target is not None else {})

    def close(self) -> None:
        """Stop every managed engine, then give back every node (a rented one is marked done)."""
        runtimes, self.runtimes = list(self.runtimes.values()), {}
        targets, self.targets = self.targets, {}
        self._close(runtimes, targets)

    def _close(self, runtimes: list[CellRuntime], targets: dict[str, Target]) -> None:
        """Each step runs even when an earlier one is interrupted (a second Ctrl-C during a slow
        teardown): a rented node left running costs money. The first interruption is raised
        once everything has been tried."""
        interrupted: BaseException | None = None
        for runtime in runtimes:
            try:
                runtime.close()
            except Exception:
                log.warning("cell %s: closing failed", runtime.cell.cell_id, exc_info=True)
            except BaseException as exc:
                interrupted = interrupted or exc
        for node_id, target in targets.items():
            try:
                target.close()
            except Exception:
                log.warning("node %s: closing failed", node_id, exc_info=True)
            except BaseException as exc:
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted


def _plain(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _opening_error(cell: Cell, exc: Exception) -> StageError:
    """A node that could not be opened for a reason no target named: still a failed stage."""
    stage: Stage = "ssh_connect" if isinstance(cell.node, SshNode) else "provision"
    return StageError(stage, f"node {cell.spec.node}: {_plain(exc)}")


def call_record(
    run_id: str,
    cell: Cell,
    case: Case,
    prompt_sha256: str,
    cold_kind: str | None,
    started_at_utc: str,
    measurement: CallMeasurement,
) -> dict[str, Any]:
    spec = cell.spec
    return {
        "type": "call",
        "benchmark_run_id": run_id,
        "cell_id": cell.cell_id,
        "node": spec.node,
        "engine": spec.engine,
        "model": spec.model,
        "prompt_id": case.prompt_id,
        "prompt_sha256": prompt_sha256,
        "phase": case.phase,
        "run_idx": case.run_idx,
        "case_id": case.case_id,
        "cold_kind": cold_kind,
        "started_at_utc": started_at_utc,
        **measurement.to_record(),
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
    }
