"""A TCP proxy on 127.0.0.1 that understands HTTP/1.1 replies, kept-alive connections included
(vLLM's): it can hold each reply back and deliver it whole in one write at its end, or slow the
requests that arrive while the offered rate is above a threshold (an engine that degrades only
under load), and let at most `slots` requests at a time through to the upstream (an engine with
that many batch slots: above them, throughput is the engine's, whatever else waits). One thread
per client connection: the tests drive a few streams at a time."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

from support.child_process import SPAWN, serve_until_killed, server_process

_RECV_BYTES = 65536
# The end of a chunked body (no engine sends trailers).
LAST_CHUNK = b"\r\n0\r\n\r\n"


class ReplyProxy:
    """Forwards 127.0.0.1:<port> to an upstream HTTP server.

    `whole_replies`: each chat reply is gathered until its end and sent in one write (the
    engine is not slowed; the client sees every reply arrive in one read, as a client that was
    not scheduled while the bytes queued would). `slow_above_rate` req/s: a chat request that
    arrives when more than that many arrived in the last `rate_window_s` is held `slow_ms` before
    it goes upstream. `slots`: at most that many chat requests upstream at a time, the others
    wait their turn (after any hold).
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        whole_replies: bool = False,
        slow_above_rate: float | None = None,
        slow_ms: float = 0.0,
        rate_window_s: float = 1.0,
        slots: int | None = None,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._slots = threading.BoundedSemaphore(slots) if slots else None
        self.whole_replies = whole_replies
        self.slow_above_rate = slow_above_rate
        self.slow_ms = slow_ms
        self.rate_window_s = rate_window_s
        self.slowed = 0
        self.replies = 0
        self._arrivals: deque[float] = deque()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        self._sockets: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ReplyProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._sockets.update((client, upstream))
        try:
            pending = b""
            while True:
                request, pending = _read_request(client, pending)
                if request is None:
                    return
                chat = request.startswith(b"POST") and b"/chat/completions" in request[:200]
                if chat:
                    self._pace()
                slot = self._slots if chat else None
                if slot is not None:
                    slot.acquire()
                try:
                    upstream.sendall(request)
                    kept = self._relay(upstream, client, hold=chat and self.whole_replies)
                finally:
                    if slot is not None:
                        slot.release()
                if not kept:
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._sockets.difference_update((client, upstream))
            client.close()
            upstream.close()

    def _pace(self) -> None:
        if self.slow_above_rate is None:
            return
        now = time.monotonic()
        with self._lock:
            self._arrivals.append(now)
            while self._arrivals and self._arrivals[0] < now - self.rate_window_s:
                self._arrivals.popleft()
            rate = len(self._arrivals) / self.rate_window_s
            slow = rate > self.slow_above_rate
            self.slowed += slow
        if slow:
            time.sleep(self.slow_ms / 1000.0)

    def _relay(self, upstream: socket.socket, client: socket.socket, *, hold: bool) -> bool:
        """One reply from upstream to the client (whole, in one write, when `hold`); False when
        the upstream closed the connection after it."""
        received = b""
        head_end = -1
        length: int | None = None
        chunked = False
        while True:
            data = upstream.recv(_RECV_BYTES)
            if not data:
                if hold and received:
                    client.sendall(received)
                self.replies += 1
                return False
            received += data
            if not hold:
                client.sendall(data)
            if head_end < 0:
                head_end = received.find(b"\r\n\r\n")
                if head_end >= 0:
                    head = received[:head_end].decode("latin-1").lower()
                    chunked = "transfer-encoding: chunked" in head
                    for line in head.split("\r\n"):
                        if line.startswith("content-length:"):
                            length = int(line.split(":", 1)[1])
            if head_end < 0:
                continue
            body = len(received) - head_end - 4
            ended = (chunked and received.endswith(LAST_CHUNK)) or (
                length is not None and body >= length
            )
            if ended:
                if hold:
                    client.sendall(received)
                self.replies += 1
                return True


def _read_request(client: socket.socket, pending: bytes) -> tuple[bytes | None, bytes]:
    """One whole request (head and Content-Length body) and what followed it; None at the end."""
    data = pending
    while b"\r\n\r\n" not in data:
        more = client.recv(_RECV_BYTES)
        if not more:
            return None, b""
        data += more
    head_end = data.index(b"\r\n\r\n") + 4
    length = 0
    for line in data[:head_end].decode("latin-1").lower().split("\r\n"):
        if line.startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    while len(data) < head_end + length:
        more = client.recv(_RECV_BYTES)
        if not more:
            return None, b""
        data += more
    return data[: head_end + length], data[head_end + length :]


@contextmanager
def reply_proxy(
    upstream_url: str,
    *,
    whole_replies: bool = False,
    slow_above_rate: float | None = None,
    slow_ms: float = 0.0,
    rate_window_s: float = 1.0,
    slots: int | None = None,
) -> Iterator[ReplyProxy]:
    """A running ReplyProxy in front of `upstream_url` (http://host:port), closed on exit."""
    host_port = upstream_url.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    proxy = ReplyProxy(
        host,
        int(port),
        whole_replies=whole_replies,
        slow_above_rate=slow_above_rate,
        slow_ms=slow_ms,
        rate_window_s=rate_window_s,
        slots=slots,
    ).start()
    try:
        yield proxy
    finally:
        proxy.close()


class _SharedSlowdown:
    """`slow_above_rate` (NaN: none) and `slowed`, read from and set in values shared between the
    parent and the proxy's process."""

    _rate: Any
    _slowed: Any

    @property
    def slow_above_rate(self) -> float | None:
        rate = float(self._rate.value)
        return None if math.isnan(rate) else rate

    @slow_above_rate.setter
    def slow_above_rate(self, value: float | None) -> None:
        self._rate.value = math.nan if value is None else value

    @property
    def slowed(self) -> int:
        return int(self._slowed.value)

    @slowed.setter
    def slowed(self, value: int) -> None:
        self._slowed.value = value


class _SharedProxy(_SharedSlowdown, ReplyProxy):
    """A reply proxy whose `slow_above_rate` and `slowed` live in values shared with the parent."""

    def __init__(self, host: str, port: int, shared: tuple[Any, Any], **options: Any) -> None:
        self._rate, self._slowed = shared
        super().__init__(host, port, **options)


def _serve_engine(
    prefill_s: float, shared: tuple[Any, Any], options: dict[str, Any], ready: Connection
) -> None:
    """The engine process: the keep-alive server and the proxy in front of it, until killed."""
    from support.keepalive_server import keepalive_server

    with keepalive_server(prefill_s=prefill_s) as server:
        host, port = server.url.split("://", 1)[-1].rstrip("/").rsplit(":", 1)
        serve_until_killed(_SharedProxy(host, int(port), shared, **options).start().url, ready)


class ProxiedEngine(_SharedSlowdown):
    """The parent's handle on a proxied keep-alive engine in a process of its own: its URL, the
    proxy's `slow_above_rate` (set here, read by the proxy at each request) and `slowed`."""

    def __init__(self, url: str, shared: tuple[Any, Any]) -> None:
        self.url = url
        self._rate, self._slowed = shared


@contextmanager
def proxied_engine_process(*, prefill_s: float, **options: Any) -> Iterator[ProxiedEngine]:
    """tests/support/keepalive_server.py behind a ReplyProxy (`options`: its keywords but
    slow_above_rate, which the handle sets), both in a process of their own
    (support.child_process): their timing is theirs alone."""
    shared = (SPAWN.RawValue("d", math.nan), SPAWN.RawValue("q", 0))
    args = (prefill_s, shared, options)
    with server_process(_serve_engine, args, "the proxied engine process") as url:
        yield ProxiedEngine(url, shared)
