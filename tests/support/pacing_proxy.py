"""A TCP proxy on 127.0.0.1 that paces the content of streamed replies: each event that carries
content is passed on no sooner than `gap_s` after the previous one of the same reply (0: straight
through). With a gap twice the engine's own inter-token time, every stream takes twice as long,
and a closed loop's throughput halves while the engine itself runs as fast as before."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

from support.child_process import SPAWN, serve_until_killed, server_process

CONTENT = re.compile(rb'"(?:content|reasoning_content)"\s*:\s*"[^"]')
EVENT_END = b"\n\n"


class PacingProxy:
    def __init__(self, upstream_host: str, upstream_port: int, gap_s: float = 0.0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.gap_s = gap_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._accepting: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def start(self) -> PacingProxy:
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()
        return self

    def close(self) -> None:
        """Stop listening and wait for the accepting thread: a listener closed while a thread is
        blocked in its accept() goes on accepting, and answered a later test's requests (the same
        fix as keepalive_server's)."""
        self._closed = True
        # shutdown wakes the accept() blocked in the other thread; close alone does not.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if self._accepting is not None:
            self._accepting.join(timeout=5)
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sockets.append(sock)
            threading.Thread(target=self._pass, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pace, args=(upstream, client), daemon=True).start()

    def _pass(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _pace(self, source: socket.socket, sink: socket.socket) -> None:
        """Send each event as it completes; a content event waits for its turn."""
        pending = b""
        last_content = 0.0
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                pending += data
                while (end := pending.find(EVENT_END)) >= 0:
                    event, pending = pending[: end + 2], pending[end + 2 :]
                    if self.gap_s > 0 and CONTENT.search(event):
                        due = last_content + self.gap_s
                        while (now := time.monotonic()) < due:
                            time.sleep(min(due - now, 0.001))
                        last_content = time.monotonic()
                    sink.sendall(event)
                if pending and EVENT_END not in pending and b"data:" not in pending:
                    sink.sendall(pending)  # chunk framing, the end of the reply
                    pending = b""
            if pending:
                sink.sendall(pending)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@contextmanager
def pacing_proxy(upstream_url: str) -> Iterator[PacingProxy]:
    host, port = upstream_url.removeprefix("http://").rsplit(":", 1)
    proxy = PacingProxy(host, int(port)).start()
    try:
        yield proxy
    finally:
        proxy.close()


class _SharedGap:
    """`gap_s` read from, and set in, a value shared between the parent and the proxy's process."""

    _gap: Any

    @property
    def gap_s(self) -> float:
        return float(self._gap.value)

    @gap_s.setter
    def gap_s(self, value: float) -> None:
        self._gap.value = value


class _SharedGapProxy(_SharedGap, PacingProxy):
    """A pacing proxy whose gap is read, event by event, from a value its parent process sets."""

    def __init__(self, upstream_host: str, upstream_port: int, gap: Any) -> None:
        self._gap = gap
        super().__init__(upstream_host, upstream_port)


def _serve(upstream_host: str, upstream_port: int, gap: Any, ready: Connection) -> None:
    """The proxy process: serve until killed, after sending the parent the proxy's URL."""
    serve_until_killed(_SharedGapProxy(upstream_host, upstream_port, gap).start().url, ready)


class PacingProxyProcess(_SharedGap):
    """The parent's handle on a pacing proxy running in a process of its own: its URL, and its
    gap, set here and read by the proxy for each content event."""

    def __init__(self, url: str, gap: Any) -> None:
        self.url = url
        self._gap = gap


@contextmanager
def pacing_proxy_process(upstream_url: str) -> Iterator[PacingProxyProcess]:
    """The pacing proxy in a process of its own (support.child_process): a content event is then
    held back by the proxy's gap, not by the client's turn on the interpreter lock."""
    host, port = upstream_url.removeprefix("http://").rsplit(":", 1)
    gap = SPAWN.RawValue("d", 0.0)
    with server_process(_serve, (host, int(port), gap), "the pacing proxy process") as url:
        yield PacingProxyProcess(url, gap)
