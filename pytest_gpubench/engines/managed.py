"""Engines the harness launches itself: start, health-wait, restart (a true cold start), stop.

One `ManagedServer` runs any engine from a launch template (an argv whose words may hold
`{model}`, `{port}`, `{host}` and `{model_path}`); what differs per kind (the default argv,
the health path, the model's digest) is in `managed_llamacpp.py`, `managed_ollama.py` and
`managed_openai.py`. On every node the process is its own process group with a pid file beside
its log, and a server that a killed run left behind is stopped before a new one starts
(targets: `Target.start`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath

import httpx

from pytest_gpubench.config.cell import Cell
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.files import distinct_file_name
from pytest_gpubench.engines.managed_llamacpp import llama_server_launch, llamacpp_plan
from pytest_gpubench.engines.managed_ollama import ollama_plan
from pytest_gpubench.engines.managed_openai import openai_plan
from pytest_gpubench.engines.protocol import control_client
from pytest_gpubench.targets import (
    BackgroundProcess,
    ListensBeyondLoopback,
    Target,
    on_this_machine,
)
from pytest_gpubench.targets.stages import StageError

READY_POLL_S = 0.05
DEFAULT_READY_TIMEOUT_S = 120.0
# How long `command -v` of the launch's program may take on the node (an SSH round trip).
INSTALLED_CHECK_S = 30.0
# The address a managed engine listens on (`{host}`): the node's loopback, reached through the
# node's forward (SSH) or directly (this machine), unless the node says otherwise (Slurm).
LISTEN_HOST = "127.0.0.1"
PLACEHOLDER = re.compile(r"\{(model|port|host|model_path)\}")


def render_launch(template: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """The argv of a launch template: each known `{name}` replaced by its value; any other
    brace (a JSON argument) is left as written."""
    return [PLACEHOLDER.sub(lambda match: values[match.group(1)], word) for word in template]


class ManagedServer:
    """An engine's server process on a target, started from a launch template."""

    def __init__(
        self,
        target: Target,
        *,
        cell_id: str,
        launch: Sequence[str],
        log_dir: str,
        health_path: str = "/health",
        program: str = "server",
        values: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        port: int | None = None,
        pulls_model: bool = False,
    ) -> None:
        self.target = target
        self.pulls_model = pulls_model
        # Keys the cell left out, filled with this host's paths that the node shares.
        self.shared_paths: dict[str, str] = {}
        # The engine version to record in place of the server's own (LaunchPlan's).
        self.engine_version: str | None = None
        # Why its launch cannot serve a request kind, or None (LaunchPlan's).
        self.kind_missing: Callable[[str], str | None] = lambda kind: None
        self.cell_id = cell_id
        self.launch = tuple(launch)
        self.health_path = health_path if health_path.startswith("/") else f"/{health_path}"
        self.program = program
        self.values = dict(values or {})
        self.env = dict(env or {})
        # The cell id holds the model name, which may hold anything: keep the file name plain.
        self.log_path = str(PurePosixPath(log_dir) / f"{program}-{distinct_file_name(cell_id)}.log")
        self.ready_timeout_s = ready_timeout_s
        self.fixed_port = port
        self.port: int | None = None
        self.base_url = ""
        self.starts = 0
        # A node whose engine is reached from another machine (a Slurm compute node) says where
        # the engine listens; everywhere else it is reached on the node's own loopback.
        self.bind_host = (
            target.engine_bind_host if isinstance(target, ListensBeyondLoopback) else LISTEN_HOST
        )
        self._process: BackgroundProcess | None = None

    def _rendered(self, port: str) -> tuple[list[str], list[str]]:
        """The launch's environment (`NAME=value`) and its command, placeholders filled."""
        values = {**self.values, "port": port, "host": self.bind_host}
        assignments = [f"{name}={value}" for name, value in self.env.items()]
        return render_launch(assignments, values), render_launch(self.launch, values)

    def argv(self, port: int) -> list[str]:
        """The command that starts the server on `port`; its environment goes first through
        `env NAME=value`, so that every node kind starts it the same way."""
        assignments, command = self._rendered(str(port))
        return ["env", *assignments, *command] if assignments else command

    def check_installed(self) -> None:
        """Before the server is first started on a node that runs commands where it runs: its
        program is there (on the node's PATH with the launch's environment, or at the path the
        launch names). A missing one otherwise showed only as the log tail of a process that
        exited, `env: 'ollama': No such file or directory`, cut short in a one-line reason."""
        assignments, command = self._rendered("0")
        program = command[0]
        probe = ["env", *assignments, "sh", "-c", 'command -v "$0"']
        if not self.target.run([*probe, program], timeout_s=INSTALLED_CHECK_S).ok:
            raise StageError(
                "engine_start",
                f"cell {self.cell_id}: {self.program} is not installed: install it, or give the "
                f"cell an endpoint of an engine already running (`{program}` is not on the "
                "node's PATH; a cell without `endpoint:` is managed: the harness starts its "
                "engine itself)",
            )

    def start(self) -> str:
        """Start the server and return its base URL (as reached from here) once its health
        path answers 200."""
        port = self.fixed_port if self.fixed_port is not None else self.target.free_port()
        self.port = port
        self._process = self.target.start(self.argv(port), log_path=self.log_path)
        self.starts += 1
        host, local_port = self.target.reach(LISTEN_HOST, port)
        self.base_url = f"http://{host}:{local_port}"
        self._wait_ready()
        return self.base_url

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        last = "no answer yet"
        with control_client(2.0) as client:
            while time.monotonic() < deadline:
                if self._process is not None and not self._process.alive():
                    tail = self._process.log_tail(1500)
                    raise StageError(
                        "engine_start",
                        f"cell {self.cell_id}: {self.program} exited while starting; "
                        f"log tail:\n{tail}",
                    )
                try:
                    answer = client.get(f"{self.base_url}{self.health_path}")
                    if answer.status_code == 200:
                        return
                    last = f"HTTP {answer.status_code}"
                except httpx.HTTPError as exc:
                    last = type(exc).__name__
                time.sleep(READY_POLL_S)
        tail = self._process.log_tail(800) if self._process is not None else ""
        self.stop()
        raise StageError(
            "engine_start",
            f"cell {self.cell_id}: {self.program} not healthy at {self.health_path} after "
            f"{self.ready_timeout_s:g} s ({last}); raise the cell's ready_timeout_s if it loads "
            f"slowly; log tail:\n{tail}",
            timed_out=True,
        )

    def restart(self) -> str:
        """Stop and start again: the model leaves memory with the process, a true cold start."""
        self.stop()
        return self.start()

    @property
    def pid(self) -> int | None:
        """The running server's process id on its node (telemetry reads its /proc entry)."""
        pid = getattr(self._process, "pid", None)
        return pid if isinstance(pid, int) else None

    def alive(self) -> bool:
        return self._process is not None and self._process.alive()

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None


class ManagedLlamaServer(ManagedServer):
    """A llama-server process on a target, serving one GGUF under the cell's model name
    (`binary`: its path, or the argv before its flags, as the prebuilt server's launcher)."""

    def __init__(
        self,
        target: Target,
        *,
        cell_id: str,
        binary: str | Sequence[str],
        model_path: str,
        alias: str,
        log_dir: str,
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        parallel: int = 1,
        metrics: bool = False,
    ) -> None:
        super().__init__(
            target,
            cell_id=cell_id,
            launch=llama_server_launch(binary, extra_args, parallel=parallel, metrics=metrics),
            log_dir=log_dir,
            program="llama-server",
            values={"model": alias, "model_path": model_path},
            ready_timeout_s=ready_timeout_s,
        )
        self.binary = binary
        self.model_path = model_path
        self.alias = alias
        self.extra_args = tuple(extra_args)


def managed_server(cell: Cell, target: Target, log_dir: Path) -> tuple[ManagedServer, str | None]:
    """The cell's engine server on its node, not yet started, and its model's digest.

    The engine kind says what runs by default; a cell's `launch:` replaces that argv, its
    `launch_env:`, `health_path:`, `ready_timeout_s:` and `port:` apply to every kind.
    """
    spec = cell.spec
    if spec.engine == "llamacpp":
        plan = llamacpp_plan(cell, target, log_dir)
    elif spec.engine == "ollama":
        plan = ollama_plan(cell, target)
    elif spec.engine == "openai":
        plan = openai_plan(cell, target)
    else:
        raise GpubenchError(
            f"cell {cell.cell_id}: endpoint: required for engine '{spec.engine}' (the harness "
            "launches llamacpp, ollama and openai itself)"
        )
    work_dir = str(log_dir) if on_this_machine(target) else target.work_dir
    server = ManagedServer(
        target,
        cell_id=cell.cell_id,
        launch=plan.launch,
        log_dir=work_dir,
        health_path=spec.health_path or plan.health_path,
        program=plan.program,
        values=plan.values,
        env={**plan.env, **spec.launch_env},
        ready_timeout_s=spec.ready_timeout_s or DEFAULT_READY_TIMEOUT_S,
        port=spec.port,
        pulls_model=plan.pulls_model,
    )
    server.shared_paths = dict(plan.shared_paths)
    server.engine_version = plan.engine_version
    server.kind_missing = plan.kind_missing
    return server, plan.model_digest


GIB = 1 << 30


def model_size(cell: Cell, server: ManagedServer, target: Target) -> tuple[float | None, str]:
    """The bytes the model needs in VRAM and where that figure comes from: the cell's
    `vram_gb`, else the size of its model file on the node (a GGUF), else unknown (None)."""
    if cell.spec.vram_gb is not None:
        return cell.spec.vram_gb * GIB, "vram_gb"
    path = server.values.get("model_path")
    if not path or path == cell.spec.model:
        return None, ""
    if on_this_machine(target):
        local = Path(path).expanduser()
        return (float(local.stat().st_size), f"size of {path}") if local.is_file() else (None, "")
    result = target.run(["sh", "-c", 'test -f "$1" && stat -c %s "$1"', "sh", path], timeout_s=60)
    text = result.stdout.strip()
    return (float(text), f"size of {path}") if result.ok and text.isdigit() else (None, "")
