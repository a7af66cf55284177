"""A TCP proxy on 127.0.0.1 that holds back the first content of a streamed chat reply, or
batches its chunks (several per write, or the whole reply in one), or sets the reply's pace
itself: the first content released at a fixed time after the request, each later one a fixed gap
after the one before (`schedule`)."""

from __future__ import annotations

import contextlib
import re
import selectors
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise

# Only the streamed chat calls are delayed; /health, /props and the rest pass straight through.
CHAT_REQUEST = b"POST /v1/chat/completions"
# A delta with text in it (llama.cpp writes compact JSON; the role-only first chunk carries
# "content":null and does not match). Reasoning text counts: the client times it as the first token.
CONTENT = re.compile(rb'"(?:content|reasoning_content|reasoning)"\s*:\s*"[^"]')
_RECV_BYTES = 65536
# The last part of a delay is spun rather than slept (see hold_until).
SPIN_S = 0.0003
# A release due within this long is waited for on the spot rather than in select(): epoll rounds
# its timeout up to whole milliseconds, which would make a 0.5 ms delay a 1 ms one.
HOLD_INLINE_S = 0.002
# batch_chunks for a reply held whole, from its first content to its end, and sent in one write.
WHOLE_REPLY = sys.maxsize


class FirstContentSplitter:
    """Splits a response byte stream at the start of the line that carries the first content.

    The client stamps a line with the arrival time of its first byte, so the delay must fall
    before that line starts, not inside it: until the content is found, a trailing partial line is
    held back for the next read (a read normally ends on an event boundary: this rarely waits).
    After it, everything is passed on as it comes.
    """

    def __init__(self) -> None:
        self.pending = b""
        self.found = False

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]:
        """(bytes to send now, bytes to send after the delay or None while no content yet)."""
        if self.found:
            return data, None
        buffer = self.pending + data
        match = CONTENT.search(buffer)
        if match is not None:
            line_start = buffer.rfind(b"\n", 0, match.start()) + 1
            self.found, self.pending = True, b""
            return buffer[:line_start], buffer[line_start:]
        cut = buffer.rfind(b"\n") + 1
        self.pending = buffer[cut:]
        return buffer[:cut], None

    def flush(self) -> bytes:
        pending, self.pending = self.pending, b""
        return pending


def content_pieces(buffer: bytes) -> tuple[list[tuple[bool, bytes]], bytes]:
    """The whole lines of `buffer` cut before each line that carries content, each piece with
    whether it starts with such a line; and the partial last line, held for the next read."""
    cut = buffer.rfind(b"\n") + 1
    whole, rest = buffer[:cut], buffer[cut:]
    starts = {whole.rfind(b"\n", 0, match.start()) + 1 for match in CONTENT.finditer(whole)}
    bounds = sorted({0, len(whole)} | starts)
    pieces = [(start in starts, whole[start:end]) for start, end in pairwise(bounds)]
    return pieces, rest


@dataclass(frozen=True)
class Schedule:
    """A reply paced by the proxy, not the engine: its first content released `first_ms` after
    the request was passed on, each later content event `gap_ms` after the one before (content
    the engine had not sent by then goes out as it comes). With an engine well inside it, the
    client's TTFT, total and decode rate are the proxy's to set, whatever the machine is doing;
    the engine's own timings are still its own."""

    first_ms: float
    gap_ms: float


@dataclass(frozen=True)
class EngineCall:
    """One chat call as the proxy saw the engine answer it: ms from the request, before any delay.

    How fast the engine, and the machine under it, was apart from the proxy and the client.
    """

    first_content_ms: float
    last_byte_ms: float


@dataclass(frozen=True)
class EngineSpeed:
    """The engine's speed over many calls, as the proxy timed them: p50s in ms."""

    first_content_ms: float
    last_byte_ms: float

    @classmethod
    def of(cls, calls: Sequence[EngineCall]) -> EngineSpeed:
        return cls(
            statistics.median(call.first_content_ms for call in calls),
            statistics.median(call.last_byte_ms for call in calls),
        )

    def within(self, other: EngineSpeed, tolerance: float) -> bool:
        """Both p50s within `tolerance` (0.10 = 10 %) of the other's."""
        return (
            abs(self.first_content_ms / other.first_content_ms - 1.0) <= tolerance
            and abs(self.last_byte_ms / other.last_byte_ms - 1.0) <= tolerance
        )

    def __str__(self) -> str:
        return f"{self.first_content_ms:.2f}/{self.last_byte_ms:.2f} ms"


class _Connection:
    """One client connection and its own connection to the engine."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.is_chat: bool | None = None  # known from the first bytes of the request
        self.request = b""  # the request's first bytes (its head and body), for extra_delay
        self.request_sent_s = 0.0
        self.first_content_s: float | None = None
        self.last_byte_s = 0.0
        self.splitter = FirstContentSplitter()
        # The reply from its first content on, while it is held back: pieces, each with when to
        # let it go (one piece, or with a schedule one per content event), in order.
        self.holding = False
        self.first_content_held = False  # the first held piece, the first content, not yet out
        self.held: deque[tuple[float, bytearray]] = deque()
        self.gap_s = 0.0
        self.next_release_s = 0.0
        self.partial = b""  # a partial line, while a schedule cuts the reply at its lines
        self.upstream_done = False
        # The reply from its first content on, while chunks are being gathered into one write.
        self.batch: bytearray | None = None

    def engine_call(self) -> EngineCall | None:
        if not self.is_chat or self.first_content_s is None:
            return None
        return EngineCall(
            first_content_ms=(self.first_content_s - self.request_sent_s) * 1000.0,
            last_byte_ms=(self.last_byte_s - self.request_sent_s) * 1000.0,
        )


class DelayProxy:
    """Forwards 127.0.0.1:<port> to an upstream server, all connections on one thread.

    One thread and a selector, not threads per connection: with two threads started per call,
    after the client's clock has started, the proxy added 0.6-0.9 ms to a TTFT of 1.6 ms here, as
    much as the delays under test; like this it adds 0.2-0.4 ms. `delay_ms` may be changed between
    calls; a call reads it when its first content arrives.

    With `batch_chunks` N > 0 (and no delay), the reply from its first content on is gathered
    and sent N content chunks to a write, the rest at its end; WHOLE_REPLY sends it all in one
    write at the end. The engine is not slowed, only what the client sees of its pace.

    With a `schedule` (may be changed between calls too), the first content is released at the
    schedule's time after the request plus `delay_ms`, and each later content event the
    schedule's gap after the one before it.

    With `extra_delay` (a regex over the request's bytes and ms; may be changed between calls),
    the chat calls whose request matches it are held back that much more: one LoRA adapter's
    requests, named by their `model`, slower than another's on the same engine.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        delay_ms: float = 0.0,
        batch_chunks: int = 0,
        delay_fraction: float = 0.0,
        listen_port: int = 0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.delay_ms = delay_ms
        # Also held back: this fraction of the call's own time to first content (0.3: the call
        # takes 30 % longer to its first content than the engine took), a slowdown that follows
        # the machine's state as a slower engine's would.
        self.delay_fraction = delay_fraction
        self.batch_chunks = batch_chunks
        self.schedule: Schedule | None = None
        self.extra_delay: tuple[re.Pattern[bytes], float] | None = None
        # The chat calls answered so far, in the order their streams ended.
        self.engine_calls: list[EngineCall] = []
        # Where it listens: a free port unless told (a managed engine's, support/paced_engine.py).
        self._listener = socket.create_server(("127.0.0.1", listen_port))
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._closed = False
        self._connections: set[_Connection] = set()
        self._thread = threading.Thread(target=self._loop, name="delay-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_until_idle(self, timeout_s: float = 5.0) -> list[EngineCall]:
        """The engine calls so far, once no connection is open (or `timeout_s` has passed).

        A call is recorded when the engine closes the connection, which may be just after the
        client has read the end of the reply and moved on.
        """
        deadline = time.monotonic() + timeout_s
        while self._connections and time.monotonic() < deadline:
            time.sleep(0.005)
        return list(self.engine_calls)

    def start(self) -> DelayProxy:
        self._selector.register(self._listener, selectors.EVENT_READ, self._accept)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, None)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        self._wake_writer.send(b"x")
        self._thread.join(timeout=5)
        for connection in list(self._connections):
            self._drop(connection)
        self._selector.close()
        for sock in (self._listener, self._wake_reader, self._wake_writer):
            sock.close()

    # -- the loop, on the proxy's own thread -----------------------------------------------------

    def _loop(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select(self._select_timeout()):
                handler: Callable[[], None] | None = key.data
                if handler is not None:
                    handler()
            self._release_due()

    def _select_timeout(self) -> float | None:
        due = [self._wake_s(c) for c in self._connections if c.held]
        if not due:
            return None
        return max(0.0, min(due) - time.perf_counter())

    @staticmethod
    def _wake_s(connection: _Connection) -> float:
        """When to wake for the connection's next held piece: the first content a little early,
        to spin the rest (see hold_until); a later piece of a schedule when it is due (spinning
        every gap would hold the GIL the client's thread needs to read them)."""
        release_s = connection.held[0][0]
        return release_s - HOLD_INLINE_S if connection.first_content_held else release_s

    def _release_due(self) -> None:
        for connection in list(self._connections):
            while connection.held and self._wake_s(connection) <= time.perf_counter():
                release_s, piece = connection.held.popleft()
                if connection.first_content_held:
                    # Blocks the other connections for at most HOLD_INLINE_S; the harness makes
                    # one call at a time, and the control calls (health, props) come before or
                    # after it.
                    hold_until(release_s)
                    connection.first_content_held = False
                self._to_client(connection, bytes(piece))
            if connection not in self._connections:
                continue  # broken meanwhile, and dropped
            if connection.holding and not connection.held and connection.upstream_done:
                self._to_client(connection, connection.partial)
                self._finish(connection)

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        for sock in (client, upstream):
            # Every forwarded piece goes out at once, as the engine's own writes do.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = _Connection(client, upstream)
        self._connections.add(connection)
        self._selector.register(client, selectors.EVENT_READ, lambda: self._from_client(connection))
        self._selector.register(
            upstream, selectors.EVENT_READ, lambda: self._from_upstream(connection)
        )

    def _from_client(self, connection: _Connection) -> None:
        data = self._recv(connection, connection.client)
        if data is None:
            return
        if not data:
            self._selector.unregister(connection.client)
            with contextlib.suppress(OSError):
                connection.upstream.shutdown(socket.SHUT_WR)
            return
        if connection.is_chat is None:
            connection.is_chat = data.startswith(CHAT_REQUEST)
        if len(connection.request) < _RECV_BYTES:
            connection.request += data
        # Stamped before the write: the engine may answer before this thread runs again.
        connection.request_sent_s = time.perf_counter()
        self._send(connection, connection.upstream, data)

    def _from_upstream(self, connection: _Connection) -> None:
        data = self._recv(connection, connection.upstream)
        if data is None:
            return
        if not data:
            connection.upstream_done = True
            self._selector.unregister(connection.upstream)
            if connection.holding:
                if connection.held:  # the end goes with the last held piece
                    partial, connection.partial = connection.partial, b""
                    connection.held[-1][1].extend(partial)
                return  # finished when the last held piece is released
            batch, connection.batch = connection.batch or b"", None
            self._to_client(connection, bytes(batch) + connection.splitter.flush())
            self._finish(connection)
            return
        connection.last_byte_s = time.perf_counter()
        if not connection.is_chat:
            self._to_client(connection, data)
        elif connection.holding:
            self._hold(connection, data)  # behind the held first content, in order
        elif connection.batch is not None:
            self._gather(connection, data)
        else:
            now, later = connection.splitter.feed(data)
            self._to_client(connection, now)
            if later is not None:
                connection.first_content_s = connection.last_byte_s
                if self.batch_chunks > 0:
                    connection.batch = bytearray()
                    self._gather(connection, later)
                    return
                engine_s = connection.first_content_s - connection.request_sent_s
                schedule = self.schedule
                if schedule is None:
                    connection.next_release_s = (
                        connection.first_content_s
                        + (self.delay_ms + self._extra_ms(connection)) / 1000.0
                        + self.delay_fraction * max(0.0, engine_s)
                    )
                else:
                    connection.gap_s = schedule.gap_ms / 1000.0
                    connection.next_release_s = (
                        connection.request_sent_s + (schedule.first_ms + self.delay_ms) / 1000.0
                    )
                connection.holding = connection.first_content_held = True
                self._hold(connection, later)

    def _extra_ms(self, connection: _Connection) -> float:
        """extra_delay's ms where its pattern matches the call's request, else 0."""
        if self.extra_delay is None:
            return 0.0
        pattern, extra_ms = self.extra_delay
        return extra_ms if pattern.search(connection.request) is not None else 0.0

    def _hold(self, connection: _Connection, data: bytes) -> None:
        """Hold back the reply from its first content on: in one piece, or with a schedule cut
        before each content event, each piece due the gap after the one before it. What comes
        after the last held piece has gone out goes straight on."""
        if connection.gap_s > 0:
            pieces, connection.partial = content_pieces(connection.partial + data)
        else:
            pieces = [(not connection.held and connection.first_content_held, data)]
        for starts_content, piece in pieces:
            if starts_content:
                connection.held.append((connection.next_release_s, bytearray(piece)))
                connection.next_release_s += connection.gap_s
            elif connection.held:
                connection.held[-1][1].extend(piece)
            else:
                self._to_client(connection, piece)

    def _gather(self, connection: _Connection, data: bytes) -> None:
        """Add to the batch; send it in one write once it holds batch_chunks content chunks."""
        assert connection.batch is not None
        connection.batch += data
        if len(CONTENT.findall(connection.batch)) >= self.batch_chunks:
            batch, connection.batch = bytes(connection.batch), bytearray()
            self._to_client(connection, batch)

    def _to_client(self, connection: _Connection, data: bytes) -> None:
        if data:
            self._send(connection, connection.client, data)

    def _finish(self, connection: _Connection) -> None:
        call = connection.engine_call()
        if call is not None and connection in self._connections:  # each connection once
            self.engine_calls.append(call)
        self._drop(connection)

    # -- sockets ---------------------------------------------------------------------------------

    def _recv(self, connection: _Connection, sock: socket.socket) -> bytes | None:
        """What arrived (b"" at the end), or None when the connection broke and was dropped."""
        try:
            return sock.recv(_RECV_BYTES)
        except OSError:
            self._broken(connection)
            return None

    def _send(self, connection: _Connection, sock: socket.socket, data: bytes) -> None:
        # Blocking: a few kilobytes on loopback never fill the peer's buffer.
        try:
            sock.sendall(data)
        except OSError:
            self._broken(connection)

    def _broken(self, connection: _Connection) -> None:
        """A socket error: a client that closes as soon as it has read the reply's end can reset
        the connection before the engine's own end arrives; the engine's call still counts."""
        self._finish(connection)

    def _drop(self, connection: _Connection) -> None:
        if connection not in self._connections:
            return
        self._connections.discard(connection)
        for sock in (connection.client, connection.upstream):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()


def hold_until(deadline: float) -> None:
    """Wait until `deadline` (perf_counter seconds); at once when it has passed.

    A sleep overshoots by the timer slack and the wake-up, 0.1-0.2 ms here: as much as the
    smallest delay asked for. So sleep only up to SPIN_S before the deadline and spin the rest.
    """
    remaining = deadline - time.perf_counter()
    if remaining > SPIN_S:
        time.sleep(remaining - SPIN_S)
    while time.perf_counter() < deadline:
        pass


@contextmanager
def delay_proxy(
    upstream_url: str, delay_ms: float = 0.0, batch_chunks: int = 0
) -> Iterator[DelayProxy]:
    """A running proxy in front of `upstream_url` (http://host:port), closed on exit."""
    host_port = upstream_url.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    proxy = DelayProxy(host, int(port), delay_ms, batch_chunks).start()
    try:
        yield proxy
    finally:
        proxy.close()
