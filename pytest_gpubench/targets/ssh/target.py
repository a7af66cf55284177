"""An existing host reached over SSH (paramiko): commands, setup, background servers, facts.

Every remote command is built from an argv with `shlex.quote` (via `shlex.join`), so the remote
login shell sees one literal word per argument; the remote side needs a POSIX `sh` and the
coreutils (or busybox) `timeout`, `setsid`, `kill`, `cat` and `tail`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import random
import select
import shlex
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import paramiko

from pytest_gpubench.targets.gpu import gpu_inventory_of
from pytest_gpubench.targets.leases import RentalJournal
from pytest_gpubench.targets.protocol import LOOPBACK_HOSTS, CommandResult, NodeFacts
from pytest_gpubench.targets.ssh.connect import open_client
from pytest_gpubench.targets.ssh.forward import POLL_S, PortForward, RemoteForward
from pytest_gpubench.targets.ssh.leases import begin_server
from pytest_gpubench.targets.ssh.scripts import (
    ALIVE_SCRIPT,
    FREE_PORT_PY,
    START_SCRIPT,
    STOP_SCRIPT,
)
from pytest_gpubench.targets.stages import SetupStep, Stage, StageError

if TYPE_CHECKING:
    from pytest_gpubench.config.nodes import SshConnection, SshNode

log = logging.getLogger(__name__)

# The remote `timeout` ends a command; the client waits this much longer before it gives up on
# a connection that no longer answers at all.
CLIENT_GRACE_S = 10.0
# Seconds between SIGTERM and SIGKILL for a command that outlives its timeout.
KILL_AFTER_S = 5
# GNU timeout's statuses for "the command timed out" (SIGKILL needed: 128 + 9).
TIMEOUT_STATUSES = (124, 137)
# Ports free_port() draws from when the node has no python3 to ask the kernel for one.
FALLBACK_PORT_RANGE = (20000, 60999)


class SshCommandTimeout(StageError, subprocess.TimeoutExpired):
    """A remote command ran past its timeout (also a TimeoutExpired, like a local command's)."""

    def __init__(self, stage: Stage, message: str, argv: Sequence[str], timeout_s: float) -> None:
        # Not super().__init__: the cooperative chain would reach TimeoutExpired's signature.
        Exception.__init__(self, f"[{stage}] {message}")
        self.stage = stage
        self.message = message
        self.cmd = list(argv)
        self.timeout = timeout_s
        self.timed_out = True
        self.output = None
        self.stderr = None

    def __str__(self) -> str:
        # TimeoutExpired's own __str__ comes first in the MRO after StageError; keep ours.
        return str(self.args[0])

    def __reduce__(self) -> Any:
        return type(self), (self.stage, self.message, self.cmd, self.timeout)


class SshProcess:
    """A background process on an SSH node, known by its pid (= its process group id)."""

    def __init__(self, target: SshTarget, pid: int, log_path: str) -> None:
        self._target = target
        self.pid = pid
        self.log_path = log_path
        self._stopped = False
        # Its entry in the lease journal (an ssh node's server), struck off once stopped.
        self.lease: Path | None = None

    def alive(self) -> bool:
        if self._stopped:
            return False
        result = self._target.run_script(
            ALIVE_SCRIPT, [str(self.pid)], self._target.command_timeout_s
        )
        return result.ok

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._stopped:
            return
        tries = max(1, round(timeout_s * 10))
        self._target.run_script(
            STOP_SCRIPT, [str(self.pid), str(tries)], timeout_s + self._target.command_timeout_s
        )
        self._stopped = True
        if self.lease is not None and self._target.journal is not None:
            self._target.journal.close(self.lease)

    def log_tail(self, max_bytes: int = 4000) -> str:
        result = self._target.run(
            ["tail", "-c", str(max_bytes), self.log_path], timeout_s=self._target.command_timeout_s
        )
        return result.stdout if result.ok else ""


class SshLineStream:
    """A long-running remote command's output (stderr merged), line by line. Closing the
    channel ends the command: its next write fails once sshd has closed the pipes."""

    def __init__(self, channel: paramiko.Channel) -> None:
        self._channel = channel
        self._file = channel.makefile("rb")

    def readline(self) -> str | None:
        try:
            line = self._file.readline()
        except (OSError, EOFError, paramiko.SSHException):
            return None
        if not line:
            return None
        text: str = line.decode("utf-8", "replace") if isinstance(line, bytes) else str(line)
        return text.rstrip("\r\n")

    def exit_status(self) -> int | None:
        """The command's exit status once it has ended (-1: ended by a signal), else None."""
        if not self._channel.exit_status_ready():
            return None
        return self._channel.recv_exit_status()

    def rest(self, max_bytes: int = 4000) -> str:
        """What an ended command wrote that has not been read yet (its last words: the end of
        it, at most max_bytes); empty while it runs (it would block)."""
        if not self._channel.exit_status_ready():
            return ""
        data = b""
        with contextlib.suppress(Exception):
            data = self._file.read()
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
        return text[-max_bytes:]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._channel.close()


class SshTarget:
    """A host reached over SSH with key authentication and verified host keys."""

    def __init__(
        self,
        node_id: str,
        host: str,
        port: int = 22,
        user: str | None = None,
        key_file: str | None = None,
        known_hosts: str = "~/.ssh/known_hosts",
        trust_new_host: bool = False,
        connect_timeout_s: float = 15.0,
        command_timeout_s: float = 60.0,
        *,
        forward: bool = True,
    ) -> None:
        self.node_id = node_id
        self.host = host
        self.port = port
        self.user = user or os.environ.get("USER") or "root"
        self.key_file = str(Path(key_file).expanduser()) if key_file else None
        self.known_hosts = Path(known_hosts).expanduser()
        self.trust_new_host = trust_new_host
        self.connect_timeout_s = connect_timeout_s
        self.command_timeout_s = command_timeout_s
        self.forward = forward
        # An ssh node of cells.yaml: its servers go into the lease journal (a rented node's
        # are given back with the rental).
        self.lease_node: SshNode | None = None
        self.journal: RentalJournal | None = None
        self._processes: list[SshProcess] = []
        self._forwards: dict[tuple[str, int], PortForward] = {}
        self._description: NodeFacts | None = None
        self._closed = False
        self._reconnect_lock = threading.Lock()
        self._gave_up = False
        self.reconnects = 0
        self._client = self._connect()

    @classmethod
    def of_node(
        cls, node_id: str, node: SshNode, *, connect_timeout_s: float, forward: bool
    ) -> SshTarget:
        """The target of an ssh node of cells.yaml, connected."""
        return cls.of_connection(
            node_id,
            node,
            connect_timeout_s=connect_timeout_s,
            command_timeout_s=node.command_timeout_s,
            forward=forward,
        )

    @classmethod
    def of_connection(
        cls,
        node_id: str,
        connection: SshConnection,
        *,
        command_timeout_s: float,
        connect_timeout_s: float | None = None,
        forward: bool = True,
    ) -> SshTarget:
        """The target of a host as cells.yaml says to log in to it (an ssh node, a Slurm
        node's login node); `connect_timeout_s` by default its own."""
        return cls(
            node_id,
            connection.host,
            connection.port,
            connection.user,
            key_file=connection.key_file,
            known_hosts=connection.known_hosts,
            trust_new_host=connection.trust_new_host,
            connect_timeout_s=connection.connect_timeout_s
            if connect_timeout_s is None
            else connect_timeout_s,
            command_timeout_s=command_timeout_s,
            forward=forward,
        )

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def work_dir(self) -> str:
        return f"/tmp/gpubench-{self.user}"

    # --- connecting -----------------------------------------------------------------------

    def _connect(self) -> paramiko.SSHClient:
        return open_client(
            self.node_id,
            self.host,
            self.port,
            self.user,
            key_file=self.key_file,
            known_hosts=self.known_hosts,
            trust_new_host=self.trust_new_host,
            timeout_s=self.connect_timeout_s,
        )

    def _transport(self, stage: Stage) -> paramiko.Transport:
        """The live connection; one that dropped (a network blip, sshd restarted) is opened
        again once, with the same host key checks. One closed on purpose stays closed."""
        if self._closed or self._gave_up:
            raise self._closed_error(stage)
        transport = self._client.get_transport()
        if transport is not None and transport.is_active():
            return transport
        with self._reconnect_lock:
            transport = self._client.get_transport()
            if transport is not None and transport.is_active():
                return transport  # another thread reconnected meanwhile
            if self._closed or self._gave_up:
                raise self._closed_error(stage)
            log.warning(
                "node %s: SSH connection to %s lost; reconnecting", self.node_id, self.where
            )
            self._client.close()
            try:
                self._client = self._connect()
            except StageError:
                # Gone for longer than a connect timeout: fail the rest at once, not each slowly.
                self._gave_up = True
                raise
            if self._closed:
                # disconnect() ran meanwhile (it takes no lock): it closed the old client, so
                # close the new one too rather than undo a deliberate disconnect.
                self._client.close()
                raise self._closed_error(stage)
            self.reconnects += 1
            transport = self._client.get_transport()
            if transport is None:
                raise StageError(stage, f"node {self.node_id}: SSH connection to {self.where} lost")
            return transport

    def _closed_error(self, stage: Stage) -> StageError:
        return StageError(stage, f"node {self.node_id}: SSH connection to {self.where} is closed")

    def _forward_transport(self) -> paramiko.Transport:
        return self._transport("benchmark")

    # --- commands -------------------------------------------------------------------------

    def _exec(
        self, argv: Sequence[str], timeout_s: float, stage: Stage
    ) -> tuple[int, bytes, bytes]:
        """Run argv under the remote `timeout`; returns (status, stdout, stderr)."""
        command = shlex.join(
            ["timeout", "-k", str(KILL_AFTER_S), f"{timeout_s:.3f}", *[str(a) for a in argv]]
        )
        transport = self._transport(stage)
        lost = f"node {self.node_id}: SSH connection to {self.where} lost"
        try:
            channel = transport.open_session(timeout=self.connect_timeout_s)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise StageError(stage, f"{lost}: {str(exc) or type(exc).__name__}") from None
        started = time.monotonic()
        deadline = started + timeout_s + CLIENT_GRACE_S
        stdout, stderr = bytearray(), bytearray()
        try:
            channel.exec_command(command)
            # stdin at EOF: a command that reads it must not wait for input that never comes.
            channel.shutdown_write()
            while True:
                while channel.recv_ready():
                    stdout += channel.recv(65536)
                while channel.recv_stderr_ready():
                    stderr += channel.recv_stderr(65536)
                if channel.exit_status_ready() and (channel.eof_received or channel.closed):
                    while channel.recv_ready():
                        stdout += channel.recv(65536)
                    while channel.recv_stderr_ready():
                        stderr += channel.recv_stderr(65536)
                    break
                if channel.closed or not transport.is_active():
                    raise StageError(stage, lost)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._timeout(stage, argv, timeout_s)
                if channel.eof_received:
                    # The output is complete; the exit status follows in the next packet.
                    channel.status_event.wait(min(remaining, POLL_S))
                else:
                    select.select([channel], [], [], min(remaining, POLL_S))
            status = channel.recv_exit_status()
            if status == -1 and not transport.is_active():
                # paramiko closes the channels of a dropped connection as if they had ended,
                # with no exit status (-1); with the connection up, -1 means a signal ended it.
                raise StageError(stage, lost)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise StageError(stage, f"{lost}: {str(exc) or type(exc).__name__}") from None
        finally:
            channel.close()
        elapsed = time.monotonic() - started
        if status in TIMEOUT_STATUSES and elapsed >= timeout_s * 0.99:
            raise self._timeout(stage, argv, timeout_s)
        return status, bytes(stdout), bytes(stderr)

    def _timeout(self, stage: Stage, argv: Sequence[str], timeout_s: float) -> SshCommandTimeout:
        program = argv[0] if argv else ""
        return SshCommandTimeout(
            stage,
            f"node {self.node_id}: `{program}` did not finish within {timeout_s:g} s "
            f"on {self.where}",
            argv,
            timeout_s,
        )

    def run(self, argv: Sequence[str], *, timeout_s: float) -> CommandResult:
        status, stdout, stderr = self._exec(argv, timeout_s, "benchmark")
        return CommandResult(
            argv=tuple(argv),
            returncode=status,
            stdout=stdout.decode("utf-8", "replace"),
            stderr=stderr.decode("utf-8", "replace"),
        )

    @contextlib.contextmanager
    def _session(self, doing: str) -> Iterator[paramiko.Channel]:
        """A new channel on the node (the benchmark stage's); an SSH failure while `doing` it is
        one StageError naming the node and what it was doing."""
        transport = self._transport("benchmark")
        try:
            yield transport.open_session(timeout=self.connect_timeout_s)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise StageError(
                "benchmark",
                f"node {self.node_id}: cannot {doing} on {self.where}: "
                f"{str(exc) or type(exc).__name__}",
            ) from None

    def stream(self, argv: Sequence[str]) -> SshLineStream:
        """Start a long-lived command (a telemetry stream) on its own channel; no timeout: it
        lasts until the stream is closed."""
        with self._session(f"start `{argv[0] if argv else ''}`") as channel:
            channel.set_combine_stderr(True)
            channel.exec_command(shlex.join([str(a) for a in argv]))
            channel.shutdown_write()
        return SshLineStream(channel)

    def write_file(self, path: str, data: bytes) -> None:
        """Write data to a new file at path on the node, readable by its owner only (mode 600:
        it may hold a key), its folder made first; through `cat` on stdin (no SFTP needed)."""
        script = 'umask 077 && mkdir -p "$(dirname "$1")" && cat > "$1"'
        command = shlex.join(["sh", "-c", script, "sh", path])
        with self._session(f"write {path}") as channel:
            try:
                channel.exec_command(command)
                channel.sendall(data)
                channel.shutdown_write()
                status = channel.recv_exit_status()
                said = channel.recv_stderr(4000).decode("utf-8", "replace").strip()
            finally:
                channel.close()
        if status != 0:
            raise StageError(
                "benchmark",
                f"node {self.node_id}: cannot write {path} on {self.where}: "
                f"status {status}: {said[-300:]}",
            )

    def run_script(self, script: str, args: Sequence[str], timeout_s: float) -> CommandResult:
        """Run a fixed sh script of ours; values reach it only as positional parameters."""
        return self.run(["sh", "-c", script, "sh", *args], timeout_s=timeout_s)

    def run_setup(self, steps: Sequence[SetupStep], timeout_s: float) -> None:
        """Run the node's setup commands in order, each within timeout_s; fail with its stage."""
        for number, step in enumerate(steps, start=1):
            what = f"node {self.node_id}: setup step {number} ({step.label()})"
            log.info("%s: running", what)
            try:
                status, stdout, stderr = self._exec(
                    ["sh", "-c", step.command], timeout_s, step.stage
                )
            except SshCommandTimeout:
                raise StageError(
                    step.stage, f"{what} did not finish within {timeout_s:g} s", timed_out=True
                ) from None
            if status != 0:
                output = (stderr or stdout).decode("utf-8", "replace").strip()[-800:]
                raise StageError(step.stage, f"{what} exited with status {status}: {output}")

    # --- background processes, ports ------------------------------------------------------

    def start(self, argv: Sequence[str], *, log_path: str) -> SshProcess:
        pid_path = f"{log_path}.pid"
        log_dir = posixpath.dirname(log_path) or "."
        lease = None
        if self.lease_node is not None:
            # Written down before it starts: a run killed with -9 leaves the server running
            # (it is detached), for the next run or `gpubench leases --release` to stop.

            self.journal = self.journal or RentalJournal()
            lease = begin_server(
                self.journal, self.node_id, self.lease_node, str(argv[0]) if argv else "", pid_path
            )
        try:
            result = self.run_script(
                START_SCRIPT, [log_dir, log_path, pid_path, *argv], self.command_timeout_s
            )
        except BaseException:
            if lease is not None and self.journal is not None:
                self.journal.close(lease)
            raise
        lines = result.stdout.strip().splitlines()
        pid_text = lines[-1].strip() if lines else ""
        for line in lines[:-1]:
            if line.startswith("stale "):
                log.warning(
                    "node %s: stopped `%s` (pid %s), left running by an earlier run under %s",
                    self.node_id,
                    argv[0],
                    line.split()[1],
                    pid_path,
                )
        if not result.ok or not pid_text.isdigit():
            if lease is not None and self.journal is not None:
                self.journal.close(lease)
            program = argv[0] if argv else ""
            raise StageError(
                "benchmark",
                f"node {self.node_id}: cannot start `{program}` (log {log_path}): "
                f"{result.stderr.strip()[-500:] or 'no pid written'}",
            )
        process = SshProcess(self, int(pid_text), log_path)
        if lease is not None and self.journal is not None:
            self.journal.update(lease, session_id=pid_text)
            process.lease = lease
        self._processes.append(process)
        return process

    def free_port(self) -> int:
        result = self.run(["python3", "-c", FREE_PORT_PY], timeout_s=self.command_timeout_s)
        if result.ok and result.stdout.strip().isdigit():
            return int(result.stdout.strip())
        # No python3 on the node: pick a port no socket uses now, from the kernel's tables.
        tables = self.run(
            ["cat", "/proc/net/tcp", "/proc/net/tcp6"], timeout_s=self.command_timeout_s
        )
        if not tables.stdout:
            raise StageError(
                "benchmark", f"node {self.node_id}: cannot find a free port (no python3, no /proc)"
            )
        used = _ports_in_use(tables.stdout)
        low, high = FALLBACK_PORT_RANGE
        candidates = [port for port in range(low, high + 1) if port not in used]
        return random.choice(candidates)

    def reach(self, host: str, port: int) -> tuple[str, int]:
        if not self.forward:
            # The node's own loopback is the node's address as seen from here.
            return (self.host if host in LOOPBACK_HOSTS else host), port
        key = (host, port)
        existing = self._forwards.get(key)
        if existing is not None and existing.active():
            return "127.0.0.1", existing.local_port
        self._transport("benchmark")
        forward = PortForward(self._forward_transport, host, port, f"{self.node_id}-{port}")
        self._forwards[key] = forward
        return "127.0.0.1", forward.local_port

    def reach_back(self, port: int) -> RemoteForward:
        """A port on the node's loopback carried back to `port` on this machine's (ssh -R)."""
        return RemoteForward(self._transport("benchmark"), port)

    # --- facts ---------------------------------------------------------------------

    def gpu_inventory(self) -> list[dict[str, str]]:
        return gpu_inventory_of(self)

    def describe(self) -> NodeFacts:
        if self._description is None:
            cpuinfo = self.run(["cat", "/proc/cpuinfo"], timeout_s=self.command_timeout_s)
            hostname = self.run(["uname", "-n"], timeout_s=self.command_timeout_s)
            cpu_model, cpu_count = _cpu_facts(cpuinfo.stdout if cpuinfo.ok else "")
            self._description = {
                "kind": "ssh",
                "host": self.host,
                "port": self.port,
                "user": self.user,
                "hostname": hostname.stdout.strip() if hostname.ok else None,
                "cpu_model": cpu_model,
                "cpu_count": cpu_count,
            }
        return self._description.copy()

    # --- teardown -------------------------------------------------------------------------

    def disconnect(self) -> None:
        """Drop the connection at once (commands in flight fail); leaves remote processes be."""
        self._closed = True
        for forward in self._forwards.values():
            forward.close()
        self._client.close()

    def close(self) -> None:
        if self._closed:
            return
        for process in self._processes:
            with contextlib.suppress(StageError):
                process.stop()
        self._processes.clear()
        self.disconnect()


def _ports_in_use(proc_net_tcp: str) -> set[int]:
    """Local ports of every socket listed in /proc/net/tcp{,6} (`0100007F:1F90` → 8080)."""
    ports: set[int] = set()
    for line in proc_net_tcp.splitlines():
        fields = line.split()
        if len(fields) > 1 and ":" in fields[1]:
            with contextlib.suppress(ValueError):
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _cpu_facts(cpuinfo: str) -> tuple[str | None, int | None]:
    model = None
    count = 0
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            count += 1
        elif key in ("model name", "Model", "cpu model") and model is None:
            model = value.strip()
    return model, (count or None)
