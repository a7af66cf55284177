"""Port forwards of an SSH node: a local listening socket carried to host:port by direct-tcpip
(PortForward), and a port on the node's loopback carried back to one on this machine by a
remote forward (RemoteForward: `ssh -R`)."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
from collections.abc import Callable
from typing import Any

import paramiko

from pytest_gpubench.targets.stages import StageError

log = logging.getLogger(__name__)

# How often the threads look up from a blocking wait, to notice close() or a closed channel.
POLL_S = 0.25


class PortForward:
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
                pump(connection, channel, self._closed)
            finally:
                # On a connection that just dropped, even the close message cannot be sent.
                with contextlib.suppress(EOFError, OSError, paramiko.SSHException):
                    channel.close()
        finally:
            with self._lock:
                self._connections.discard(connection)
            connection.close()


def pump(connection: socket.socket, channel: paramiko.Channel, closed: threading.Event) -> None:
    """Carry bytes both ways between a socket and a channel until both directions have ended
    (each ends on its own EOF: a half close), the channel closed, or `closed` is set."""
    # Each side still sending: where its bytes go, and how that end is told it has them all.
    ends: dict[Any, tuple[Any, Callable[[], None]]] = {
        connection: (channel, channel.shutdown_write),
        channel: (connection, lambda: connection.shutdown(socket.SHUT_WR)),
    }
    try:
        while ends and not closed.is_set():
            readable, _, _ = select.select(list(ends), [], [], POLL_S)
            for source in readable:
                sink, half_close = ends[source]
                data = source.recv(65536)
                if data:
                    sink.sendall(data)
                else:
                    del ends[source]
                    half_close()
            if channel in ends and channel.closed:
                return
    except (OSError, paramiko.SSHException, EOFError):
        return


class RemoteForward:
    """A port on the node's loopback (chosen by its sshd) whose connections are carried back
    over the SSH connection to `port` on this machine's loopback: what `ssh -R 0:127.0.0.1:port`
    does, for a node that cannot reach this machine itself (a firewall, a NAT). The node's sshd
    must allow it (`AllowTcpForwarding yes` or `remote`)."""

    def __init__(self, transport: paramiko.Transport, port: int) -> None:
        self._transport = transport
        self.port = port
        self._closed = threading.Event()
        try:
            self.remote_port: int = transport.request_port_forward(
                "127.0.0.1", 0, handler=self._handle
            )
        except paramiko.SSHException as exc:
            raise StageError(
                "benchmark",
                f"the node refused a remote port forward ({exc}): its sshd needs "
                "AllowTcpForwarding yes (or remote)",
            ) from None

    def _handle(
        self, channel: paramiko.Channel, origin: tuple[str, int], server: tuple[str, int]
    ) -> None:
        # Called on the transport's own thread: the carrying goes on a thread of its own.
        threading.Thread(target=self._serve, args=(channel,), daemon=True).start()

    def _serve(self, channel: paramiko.Channel) -> None:
        try:
            connection = socket.create_connection(("127.0.0.1", self.port), timeout=10.0)
        except OSError as exc:
            log.debug("remote forward to 127.0.0.1:%s refused: %s", self.port, exc)
            with contextlib.suppress(EOFError, OSError, paramiko.SSHException):
                channel.close()
            return
        connection.settimeout(None)
        try:
            pump(connection, channel, self._closed)
        finally:
            with contextlib.suppress(EOFError, OSError, paramiko.SSHException):
                channel.close()
            connection.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(EOFError, OSError, paramiko.SSHException):
            self._transport.cancel_port_forward("127.0.0.1", self.remote_port)
