"""An existing host reached over SSH (paramiko): commands, background servers, port forwards.

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
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import paramiko

from pytest_gpubench.targets import CommandResult, gpu_inventory_of
from pytest_gpubench.targets.stages import SetupStep, Stage, StageError

log = logging.getLogger(__name__)

# The remote `timeout` ends a command; the client waits this much longer before it gives up on
# a connection that no longer answers at all.
CLIENT_GRACE_S = 10.0
# Seconds between SIGTERM and SIGKILL for a command that outlives its timeout.
KILL_AFTER_S = 5
# GNU timeout's statuses for "the command timed out" (SIGKILL needed: 128 + 9).
TIMEOUT_STATUSES = (124, 137)
KEEPALIVE_S = 15
POLL_S = 0.25
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
# Ports free_port() draws from when the node has no python3 to ask the kernel for one.
FALLBACK_PORT_RANGE = (20000, 60999)

# Shell functions the scripts below share. `running`: whether pid $1 runs. A zombie counts as
# gone: an orphan waits for init to reap it, which in some containers takes seconds, and kill -0
# still succeeds on it meanwhile.
_RUNNING = r"""
running() {
  if [ -d /proc/self ]; then
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
  else
    kill -0 "$1" 2>/dev/null
  fi
}

# Stops process group $1: SIGTERM, then SIGKILL when its leader still runs after $2 tenths of a
# second; the final SIGKILL also takes any member the leader left behind.
stop_group() {
  kill -TERM -"$1" 2>/dev/null || kill -TERM "$1" 2>/dev/null || return 0
  i=0
  while running "$1" && [ "$i" -lt "$2" ]; do sleep 0.1; i=$((i + 1)); done
  kill -KILL -"$1" 2>/dev/null
  return 0
}
"""

# Runs argv as a background process that outlives the SSH channel: its own session (setsid, so
# no SIGHUP from sshd and a process group stop() can kill whole), stdio on /dev/null and the log
# (so sshd does not keep the channel open waiting for the pipes), and its pid written by itself
# just before exec (so the pid is right even where setsid has to fork). A process that an
# earlier run started under the same pid file and never stopped (pytest killed with -9) is
# stopped first, if it still runs the same program and the SSH connection that started it is
# gone: on a GPU node it would hold the memory the new one needs. Each one stopped is reported
# on a `stale <pid>` line. Without /proc nothing is ever taken for stale.
_START_SCRIPT = (
    _RUNNING
    + r"""
dir=$1 log=$2 pidfile=$3
shift 3
mkdir -p "$dir" || exit 1
# The SSH connection this start comes through: the nearest sshd process above this shell.
owner=$$
while [ "$owner" -gt 1 ]; do
  case "$(cat "/proc/$owner/comm" 2>/dev/null)" in sshd*) break ;; esac
  owner=$(sed 's/.*) //' "/proc/$owner/stat" 2>/dev/null | cut -d' ' -f2)
  case "$owner" in ''|*[!0-9]*) owner=1 ;; esac
done
old=$(cat "$pidfile" 2>/dev/null)
case "$old" in ''|*[!0-9]*) old= ;; esac
old_owner=$(cat "$pidfile.owner" 2>/dev/null)
case "$old_owner" in ''|*[!0-9]*) old_owner=1 ;; esac
# Stale: still running the same program, while the connection that started it is gone (a
# server of another run that is still connected is left alone).
if [ -n "$old" ] && running "$old" && ! running "$old_owner" \
    && [ "$(tr '\000' '\n' 2>/dev/null < "/proc/$old/cmdline" | head -n 1)" = "$1" ]; then
  stop_group "$old" 50
  echo "stale $old"
fi
rm -f "$pidfile"
echo "$owner" > "$pidfile.owner"
setsid sh -c 'echo $$ > "$0"; exec "$@"' "$pidfile" "$@" </dev/null >>"$log" 2>&1 &
i=0
while [ ! -s "$pidfile" ] && [ "$i" -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
cat "$pidfile"
"""
)

_ALIVE_SCRIPT = _RUNNING + 'running "$1"\n'

_STOP_SCRIPT = _RUNNING + 'stop_group "$1" "$2"\n'

_FREE_PORT_PY = (
    "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
)


class SshCommandTimeout(StageError, subprocess.TimeoutExpired):
    """A remote command ran past its timeout (also a TimeoutExpired, like a local command's)."""

    def __init__(self, stage: Stage, message: str, argv: Sequence[str], timeout_s: float) -> None:
        # Not super().__init__: the cooperative chain would reach TimeoutExpired's signature.
        Exception.__init__(self, f"[{stage}] {message}")
        self.stage = stage
        self.message = message
        self.cmd = list(argv)
        self.timeout = timeout_s
        self.output = None
        self.stderr = None

    def __str__(self) -> str:
        # TimeoutExpired's own __str__ comes first in the MRO after StageError; keep ours.
        return str(self.args[0])

    def __reduce__(self) -> Any:
        return type(self), (self.stage, self.message, self.cmd, self.timeout)


class HostKeyError(StageError):
    """The host's key is unknown or has changed: never retried, never trusted silently."""

    def __init__(self, message: str) -> None:
        super().__init__("ssh_connect", message)

    def __reduce__(self) -> Any:
        return type(self), (self.message,)


class _UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey, known_types: Sequence[str]) -> None:
        super().__init__(hostname)
        self.hostname = hostname
        self.key = key
        self.known_types = tuple(known_types)


class _RefuseUnknownHost(paramiko.MissingHostKeyPolicy):
    """Like paramiko's RejectPolicy, but raises a type that says which key was refused."""

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        known = client.get_host_keys().lookup(hostname)
        raise _UnknownHostKey(hostname, key, list(known.keys()) if known else [])


class _TrustNewHost(paramiko.MissingHostKeyPolicy):
    """Record a host seen for the first time; a host already known under any key is refused.

    The line is appended rather than rewriting the file (paramiko's AutoAddPolicy rewrites it),
    so the user's comments, hashed names and @cert-authority lines survive. A host that has a
    known key of another type is refused: that is what a replaced host looks like too.
    """

    def __init__(self, known_hosts: Path) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        known = client.get_host_keys().lookup(hostname)
        if known:
            raise _UnknownHostKey(hostname, key, list(known.keys()))
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor = os.open(self.known_hosts, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(descriptor, "a", encoding="ascii") as known_hosts:
            known_hosts.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        log.warning(
            "trusting new host %s (%s %s), recorded in %s",
            hostname,
            key.get_name(),
            key.fingerprint,
            self.known_hosts,
        )


class SshProcess:
    """A background process on an SSH node, known by its pid (= its process group id)."""

    def __init__(self, target: SshTarget, pid: int, log_path: str) -> None:
        self._target = target
        self.pid = pid
        self.log_path = log_path
        self._stopped = False

    def alive(self) -> bool:
        if self._stopped:
            return False
        result = self._target._run_script(
            _ALIVE_SCRIPT, [str(self.pid)], self._target.command_timeout_s
        )
        return result.ok

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._stopped:
            return
        tries = max(1, round(timeout_s * 10))
        self._target._run_script(
            _STOP_SCRIPT, [str(self.pid), str(tries)], timeout_s + self._target.command_timeout_s
        )
        self._stopped = True

    def log_tail(self, max_bytes: int = 4000) -> str:
        result = self._target.run(
            ["tail", "-c", str(max_bytes), self.log_path], timeout_s=self._target.command_timeout_s
        )
        return result.stdout if result.ok else ""


class _PortForward:
    """A local listening socket whose connections are carried to host:port by direct-tcpip."""

    def __init__(
        self,
        transport: Callable[[], paramiko.Transport],
        host: str,
        port: int,
        label: str,
    ) -> None:
        # Asked for each new connection, so that a forward outlives a reconnect of its target.
        self._transport = transport
        self.host = host
        self.port = port
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(32)
        # A timeout so the accept loop notices close(); closing a socket does not wake accept().
        self._listener.settimeout(POLL_S)
        self.local_port: int = self._listener.getsockname()[1]
        threading.Thread(
            target=self._accept_loop, name=f"gpubench-forward-{label}", daemon=True
        ).start()

    def active(self) -> bool:
        return not self._closed.is_set()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                connection, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connection.settimeout(None)
            threading.Thread(target=self._serve, args=(connection, peer), daemon=True).start()

    def _serve(self, connection: socket.socket, peer: tuple[str, int]) -> None:
        with self._lock:
            self._connections.add(connection)
        try:
            try:
                channel = self._transport().open_channel(
                    "direct-tcpip", (self.host, self.port), peer, timeout=30.0
                )
            except (paramiko.SSHException, OSError, EOFError, StageError) as exc:
                # Nothing listens there yet (a server still starting): the client sees a closed
                # connection and retries, as it would against the server itself.
                log.debug("forward to %s:%s refused: %s", self.host, self.port, exc)
                return
            try:
                self._pump(connection, channel)
            finally:
                # On a connection that just dropped, even the close message cannot be sent.
                with contextlib.suppress(EOFError, OSError, paramiko.SSHException):
                    channel.close()
        finally:
            with self._lock:
                self._connections.discard(connection)
            connection.close()

    def _pump(self, connection: socket.socket, channel: paramiko.Channel) -> None:
        # Each direction ends on its own EOF (a half close), the pair when both have ended.
        client_sends = server_sends = True
        try:
            while (client_sends or server_sends) and not self._closed.is_set():
                watched: list[Any] = []
                if client_sends:
                    watched.append(connection)
                if server_sends:
                    watched.append(channel)
                readable, _, _ = select.select(watched, [], [], POLL_S)
                if connection in readable:
                    data = connection.recv(65536)
                    if data:
                        channel.sendall(data)
                    else:
                        client_sends = False
                        channel.shutdown_write()
                if channel in readable:
                    data = channel.recv(65536)
                    if data:
                        connection.sendall(data)
                    else:
                        server_sends = False
                        connection.shutdown(socket.SHUT_WR)
                if server_sends and channel.closed:
                    return
        except (OSError, paramiko.SSHException, EOFError):
            return


class SshTarget:
    """A host reached over SSH with key authentication and verified host keys (SPEC §10)."""

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
        self._processes: list[SshProcess] = []
        self._forwards: dict[tuple[str, int], _PortForward] = {}
        self._description: dict[str, Any] | None = None
        self._closed = False
        self._reconnect_lock = threading.Lock()
        self._gave_up = False
        self.reconnects = 0
        self._client = self._connect()

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def _known_hosts_name(self) -> str:
        """The host as known_hosts names it: `[host]:port` unless on port 22."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    # --- connecting -----------------------------------------------------------------------

    def _connect(self) -> paramiko.SSHClient:
        def fail(message: str) -> StageError:
            return StageError("ssh_connect", f"node {self.node_id}: {self.where}: {message}")

        def refuse(message: str) -> HostKeyError:
            return HostKeyError(f"node {self.node_id}: {self.where}: {message}")

        if self.key_file is not None and not Path(self.key_file).is_file():
            raise fail(f"key_file {self.key_file} does not exist")
        client = paramiko.SSHClient()
        if self.known_hosts.is_file():
            try:
                client.load_host_keys(str(self.known_hosts))
            except (OSError, paramiko.SSHException) as exc:
                raise fail(f"cannot read known_hosts {self.known_hosts}: {exc}") from None
        policy: paramiko.MissingHostKeyPolicy = (
            _TrustNewHost(self.known_hosts) if self.trust_new_host else _RefuseUnknownHost()
        )
        client.set_missing_host_key_policy(policy)
        try:
            client.connect(
                self.host,
                self.port,
                username=self.user,
                key_filename=self.key_file,
                timeout=self.connect_timeout_s,
                banner_timeout=self.connect_timeout_s,
                auth_timeout=self.connect_timeout_s,
                channel_timeout=self.connect_timeout_s,
                allow_agent=True,
                # Without a key_file: the agent, then ~/.ssh/id_*, as ssh itself would.
                look_for_keys=self.key_file is None,
            )
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise refuse(
                f"host key has CHANGED: the server offers {exc.key.get_name()} "
                f"{exc.key.fingerprint}, known_hosts {self.known_hosts} has "
                f"{exc.expected_key.fingerprint}. Refusing to connect: this is what a "
                "man-in-the-middle looks like. If the host was reinstalled, check the new "
                f"fingerprint and remove the old line (ssh-keygen -R '{self._known_hosts_name}' "
                f"-f {self.known_hosts})."
            ) from None
        except _UnknownHostKey as exc:
            client.close()
            if exc.known_types:
                raise refuse(
                    f"host key has CHANGED: the server offers {exc.key.get_name()} "
                    f"{exc.key.fingerprint}, known_hosts {self.known_hosts} knows this host only "
                    f"by {', '.join(exc.known_types)}. Refusing to connect (also with "
                    "trust_new_host)."
                ) from None
            raise refuse(
                f"unknown host: {exc.hostname} is not in known_hosts {self.known_hosts} (the "
                f"server offers {exc.key.get_name()} {exc.key.fingerprint}). Check the "
                "fingerprint and add the host (ssh-keyscan -p "
                f"{self.port} {self.host} >> {self.known_hosts}), or set trust_new_host: true "
                "on the node to record it on first use."
            ) from None
        except paramiko.PasswordRequiredException:
            client.close()
            raise fail(
                f"key_file {self.key_file} is encrypted; load it into ssh-agent and leave "
                "key_file unset"
            ) from None
        except paramiko.AuthenticationException:
            client.close()
            by = f"key_file {self.key_file}" if self.key_file else "the agent and ~/.ssh keys"
            raise fail(f"authentication failed with {by}") from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            client.close()
            raise fail(f"cannot connect: {str(exc) or type(exc).__name__}") from None
        transport = client.get_transport()
        if transport is not None:
            # Notices a dead connection while a long command is quiet.
            transport.set_keepalive(KEEPALIVE_S)
        return client

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

    def _run_script(self, script: str, args: Sequence[str], timeout_s: float) -> CommandResult:
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
                    step.stage, f"{what} did not finish within {timeout_s:g} s"
                ) from None
            if status != 0:
                output = (stderr or stdout).decode("utf-8", "replace").strip()[-800:]
                raise StageError(step.stage, f"{what} exited with status {status}: {output}")

    # --- background processes, ports ------------------------------------------------------

    def start(self, argv: Sequence[str], *, log_path: str) -> SshProcess:
        pid_path = f"{log_path}.pid"
        log_dir = posixpath.dirname(log_path) or "."
        result = self._run_script(
            _START_SCRIPT, [log_dir, log_path, pid_path, *argv], self.command_timeout_s
        )
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
            program = argv[0] if argv else ""
            raise StageError(
                "benchmark",
                f"node {self.node_id}: cannot start `{program}` (log {log_path}): "
                f"{result.stderr.strip()[-500:] or 'no pid written'}",
            )
        process = SshProcess(self, int(pid_text), log_path)
        self._processes.append(process)
        return process

    def free_port(self) -> int:
        result = self.run(["python3", "-c", _FREE_PORT_PY], timeout_s=self.command_timeout_s)
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
        forward = _PortForward(self._forward_transport, host, port, f"{self.node_id}-{port}")
        self._forwards[key] = forward
        return "127.0.0.1", forward.local_port

    # --- files, facts ---------------------------------------------------------------------

    def read_file(self, path: str, *, timeout_s: float) -> bytes:
        status, stdout, stderr = self._exec(["cat", path], timeout_s, "results")
        if status != 0:
            reason = stderr.decode("utf-8", "replace").strip()[-300:]
            raise StageError("results", f"node {self.node_id}: cannot read {path}: {reason}")
        return stdout

    def gpu_inventory(self) -> list[dict[str, str]]:
        return gpu_inventory_of(self)

    def describe(self) -> dict[str, Any]:
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
        return dict(self._description)

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
