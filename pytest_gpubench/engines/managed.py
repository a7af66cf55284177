"""Engines the harness launches itself: start, health-wait, restart (a true cold start), stop."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

import httpx

from pytest_gpubench.errors import GpubenchError
from pytest_gpubench.files import distinct_file_name, file_sha256
from pytest_gpubench.matrix import TINY_MODEL, Cell
from pytest_gpubench.targets import BackgroundProcess, ListensBeyondLoopback, Target
from pytest_gpubench.targets.local import LocalTarget

READY_POLL_S = 0.05


class ManagedLlamaServer:
    """A llama-server process on a target, serving one GGUF under the cell's model name."""

    def __init__(
        self,
        target: Target,
        *,
        cell_id: str,
        binary: str,
        model_path: str,
        alias: str,
        log_dir: str,
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = 120.0,
        parallel: int = 1,
        metrics: bool = False,
    ) -> None:
        self.target = target
        self.cell_id = cell_id
        self.binary = binary
        self.model_path = model_path
        self.alias = alias
        # The cell id holds the model name, which may hold anything: keep the file name plain.
        self.log_path = str(
            PurePosixPath(log_dir) / f"llama-server-{distinct_file_name(cell_id)}.log"
        )
        self.extra_args = tuple(extra_args)
        # Slots (requests decoded at once, the cell's `parallel`), and /metrics for a load case.
        self.parallel = parallel
        self.metrics = metrics
        self.ready_timeout_s = ready_timeout_s
        self.base_url = ""
        self.starts = 0
        # A node whose engine is reached from another machine (a Slurm compute node) says where
        # the engine listens; everywhere else it is reached on the node's own loopback.
        self.bind_host = (
            target.engine_bind_host if isinstance(target, ListensBeyondLoopback) else "127.0.0.1"
        )
        self._process: BackgroundProcess | None = None

    def argv(self, port: int) -> list[str]:
        return [
            self.binary,
            "--model", self.model_path,
            "--alias", self.alias,
            "--host", self.bind_host,
            "--port", str(port),
            "--parallel", str(self.parallel),
            "--no-webui",
            *(["--metrics"] if self.metrics else []),
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> str:
        """Start the server and return its base URL once /health answers 200."""
        port = self.target.free_port()
        self._process = self.target.start(self.argv(port), log_path=self.log_path)
        self.starts += 1
        host, local_port = self.target.reach("127.0.0.1", port)
        self.base_url = f"http://{host}:{local_port}"
        self._wait_ready()
        return self.base_url

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        last = "no answer yet"
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self._process is not None and not self._process.alive():
                    tail = self._process.log_tail(1500)
                    raise GpubenchError(
                        f"cell {self.cell_id}: llama-server exited while starting; "
                        f"log tail:\n{tail}"
                    )
                try:
                    answer = client.get(f"{self.base_url}/health")
                    if answer.status_code == 200:
                        return
                    last = f"HTTP {answer.status_code}"
                except httpx.HTTPError as exc:
                    last = type(exc).__name__
                time.sleep(READY_POLL_S)
        self.stop()
        raise GpubenchError(
            f"cell {self.cell_id}: llama-server not healthy after "
            f"{self.ready_timeout_s:g} s ({last})"
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


def managed_llama_server(
    cell: Cell, target: Target, log_dir: Path
) -> tuple[ManagedLlamaServer, str]:
    """The cell's llama-server on its node, not yet started, and the sha256 of its model.

    On this machine the binary is found or built and the model is the cell's GGUF (or the tiny
    model); on a remote node both are paths there, put in place by the node's setup.
    """
    spec = cell.spec
    if isinstance(target, LocalTarget):
        from pytest_gpubench.engines.llamacpp_build import ensure_llama_server

        binary = str(ensure_llama_server(spec.server_binary))
        model = _local_model(cell)
        model_path, digest = str(model), file_sha256(model)
        work_dir = str(log_dir)
    else:
        if not (spec.server_binary and spec.model_path):
            raise GpubenchError(
                f"cell {cell.cell_id}: a managed llamacpp cell on a remote node needs "
                "server_binary and model_path (paths on the node; install them with setup)"
            )
        binary, model_path = spec.server_binary, spec.model_path
        digest_run = target.run(["sha256sum", model_path], timeout_s=120)
        if not digest_run.ok:
            raise GpubenchError(
                f"cell {cell.cell_id}: model_path: cannot read {model_path} on the node"
            )
        digest = digest_run.stdout.split()[0]
        work_dir = target.work_dir
    server = ManagedLlamaServer(
        target,
        cell_id=cell.cell_id,
        binary=binary,
        model_path=model_path,
        alias=spec.model,
        log_dir=work_dir,
        extra_args=spec.server_args,
        parallel=spec.parallel or 1,
        metrics=cell.load is not None,
    )
    return server, f"sha256:{digest}"


def _local_model(cell: Cell) -> Path:
    spec = cell.spec
    if spec.model_path:
        model = Path(spec.model_path).expanduser()
        if not model.is_file():
            raise GpubenchError(f"cell {cell.cell_id}: model_path: {model} does not exist")
        return model
    if spec.model == TINY_MODEL:
        from pytest_gpubench.tinymodel import ensure_tiny_model

        return ensure_tiny_model()
    raise GpubenchError(
        f"cell {cell.cell_id}: model_path: a managed llamacpp cell needs a GGUF "
        f"file (or model: {TINY_MODEL} for the generated tiny model)"
    )
