"""The machine that runs pytest, as a benchmark node."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import os
import platform
import secrets
import signal
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pytest_gpubench.targets.gpu import gpu_inventory_of
from pytest_gpubench.targets.protocol import (
    CLIENT_TASK_MODULE,
    CommandResult,
    NodeFacts,
    write_plan,
)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: get SIGKILL when pytest dies, even by kill -9, so no server is left behind."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class LocalProcess:
    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self._popen = popen
        self._log_path = log_path

    @property
    def pid(self) -> int:
        return self._popen.pid

    def alive(self) -> bool:
        return self._popen.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._popen.pid, signal.SIGTERM)
        try:
            self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._popen.pid, signal.SIGKILL)
            self._popen.wait(timeout=timeout_s)

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            with self._log_path.open("rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - max_bytes))
                return log.read().decode("utf-8", "replace")
        except OSError:
            return ""


class LocalLineStream:
    """A long-running command's output (stderr merged), line by line; close() ends it."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen

    def readline(self) -> str | None:
        assert self._popen.stdout is not None
        line = self._popen.stdout.readline()
        if not line:
            return None
        return line.decode("utf-8", "replace").rstrip("\r\n")

    def close(self) -> None:
        if self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._popen.pid, signal.SIGTERM)
            try:
                self._popen.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._popen.pid, signal.SIGKILL)
                self._popen.wait(timeout=5.0)
        if self._popen.stdout is not None:
            self._popen.stdout.close()


class LocalTarget:
    def __init__(self, node_id: str = "local") -> None:
        self.node_id = node_id
        self._processes: list[LocalProcess] = []

    @property
    def work_dir(self) -> str:
        user = os.environ.get("USER") or str(os.getuid())
        return str(Path(tempfile.gettempdir()) / f"gpubench-{user}")

    def run(self, argv: Sequence[str], *, timeout_s: float) -> CommandResult:
        completed = subprocess.run(
            list(argv),
            capture_output=True,
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        return CommandResult(
            argv=tuple(argv),
            returncode=completed.returncode,
            stdout=completed.stdout.decode("utf-8", "replace"),
            stderr=completed.stderr.decode("utf-8", "replace"),
        )

    def start(self, argv: Sequence[str], *, log_path: str) -> LocalProcess:
        path = Path(log_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as log:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - needed for PDEATHSIG
            )
        process = LocalProcess(popen, path)
        self._processes.append(process)
        return process

    def stream(self, argv: Sequence[str]) -> LocalLineStream:
        """Start a long-lived command (a telemetry stream) whose output is read as it comes."""
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - needed for PDEATHSIG
        )
        return LocalLineStream(popen)

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
            return port

    def reach(self, host: str, port: int) -> tuple[str, int]:
        return host, port

    def gpu_inventory(self) -> list[dict[str, str]]:
        return gpu_inventory_of(self)

    def describe(self) -> NodeFacts:
        return {"host": platform.node(), "cpu_model": _cpu_model(), "cpu_count": os.cpu_count()}

    def close(self) -> None:
        for process in self._processes:
            process.stop()
        self._processes.clear()


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


class ProcessLaunch:
    """`processes: N`: a load point's client tasks as processes of this machine (spawned, each
    with its own event loop and connections), the plan in a file of its own (mode 600). They
    share this machine's clock: no offset is measured."""

    shares_clock = True

    def __init__(self) -> None:
        self.plan = Path(tempfile.gettempdir()) / f"gpubench-load-plan-{secrets.token_hex(6)}.pkl"
        self.processes: list[multiprocessing.process.BaseProcess] = []

    def address(self, coordinator: str, port: int) -> tuple[str, int]:
        return coordinator, port

    def start(self, plan: bytes, tasks: int) -> None:
        write_plan(self.plan, plan)
        context = multiprocessing.get_context("spawn")
        for task in range(tasks):
            process = context.Process(
                target=run_client_task,
                args=(CLIENT_TASK_MODULE, str(self.plan), str(task), str(tasks)),
                daemon=True,
            )
            process.start()
            self.processes.append(process)

    def ended(self) -> str | None:
        for task, process in enumerate(self.processes):
            if process.exitcode is not None:
                return f"client process {task} ended ({_how_ended(process.exitcode)})"
        return None

    def how_lost(self, task: int) -> str:
        process = self.processes[task]
        process.join(timeout=5)
        return f"died mid-point ({_how_ended(process.exitcode)})"

    def close(self) -> None:
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
        self.plan.unlink(missing_ok=True)


def run_client_task(module: str, *argv: str) -> None:
    """In a spawned process: the client task's module's `task_main` (named, not imported here:
    it is a run's)."""
    importlib.import_module(module).task_main(*argv)


def _how_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"
