"""One streamed HTTP request, timed from the moment bytes arrive, before any parsing."""

from __future__ import annotations

import contextlib
import functools
import itertools
import select
import socket
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import h11

from pytest_gpubench.measure.call_measurement import CallMeasurement, call_rates, token_mismatch

# A stream that sends nothing for this long once its response began is aborted as stalled (a
# cell's stall_s, set by the harness around its calls); None: only the call's timeout applies.
STALL_LIMIT_S: ContextVar[float | None] = ContextVar("gpubench_stall_limit_s", default=None)
# How a stalled call's error starts: the harness counts them by it.
STALLED = "stalled"

# Why not httpx here: against a server that logs when it writes its first byte, a blocking socket
# read by h11 adds the least to TTFT (benchmarks_dev/client_overhead.py; on a loaded 2-core
# machine, median 0.06 ms against 0.15 ms for httpx sync and 0.25 ms for httpx async;
# docs/metrics.md keeps the figures). Control calls (health, version, tags) use httpx.
_RECV_BYTES = 65536
_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


def ack_at_once(sock: socket.socket) -> None:
    """ACK at once what arrives on `sock` (Linux's TCP_QUICKACK; elsewhere nothing): a
    kept-alive connection has left Linux's quick-ACK start, and a server that does not set
    TCP_NODELAY (Nagle) would hold its next small write until our delayed ACK, up to 40 ms,
    which TTFT would then count. Not sticky: the kernel may leave it, so callers set it again."""
    if _QUICKACK is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)


class StreamError(Exception):
    """The request could not be completed (connect, HTTP status, broken or timed-out stream)."""


@dataclass(frozen=True)
class Line:
    """One line of a streamed body, stamped with the arrival time of its first byte."""

    arrived_ns: int
    text: bytes


@dataclass
class StreamedResponse:
    sent_ns: int
    status: int
    headers: dict[str, str]
    lines: Iterator[Line]
    chunks_received: int = 0
    last_byte_ns: int = 0
    # The connection the call went on: opened for it (connect, TLS handshake ms) or kept alive.
    connect_ms: float | None = None
    tls_handshake_ms: float | None = None
    connection_reused: bool = False
    reconnected: bool = False
    # Ends the exchange: drain=True reads to the end and keeps the connection for the next call.
    release: Callable[[bool], None] = lambda drain: None


def _ms(start_ns: int, end_ns: int) -> float:
    return round((end_ns - start_ns) / 1e6, 4)


def finish_timing(
    measurement: CallMeasurement, response: StreamedResponse, content_arrivals_ns: Sequence[int]
) -> None:
    """TTFT, total, chunk count and gaps from what arrived, whole or not; rates if it succeeded.

    A failed call keeps the figures it got so far (TTFT, content chunks, send to last byte) beside
    its error, but no rates: those are results, and a failed call is never one.
    """
    arrivals = content_arrivals_ns
    if arrivals:
        measurement.first_delta_ms = _ms(response.sent_ns, arrivals[0])
    end_ns = response.last_byte_ns or (arrivals[-1] if arrivals else 0)
    if end_ns:
        measurement.total_duration_ms = _ms(response.sent_ns, end_ns)
    measurement.client_chunks = len(arrivals)
    measurement.inter_chunk_ms = [
        _ms(earlier, later) for earlier, later in itertools.pairwise(arrivals)
    ]
    reasoning_split(measurement, response.sent_ns)
    rates = call_rates(arrivals, measurement.completion_tokens, measurement.total_duration_ms)
    measurement.coalesced, measurement.content_reads = rates.coalesced, rates.content_reads
    if measurement.error is None and not measurement.tool_calls:
        # A tool call's streamed pieces are its parser's, not tokens (vLLM's parsers hold text
        # back and send it in runs): such a call's count is not checked.
        # What a stream may hold in fewer chunks than tokens: a multibyte character's tokens
        # in one chunk, and a reasoning model's end of thinking (vLLM's parsers stream nothing
        # for `</think>`).
        slack = measurement.multibyte_chunks + (1 if measurement.reasoning_chunks else 0)
        measurement.token_mismatch = token_mismatch(
            len(arrivals), measurement.completion_tokens, measurement.finish_reason, slack
        )
    if measurement.error is None:
        measurement.tokens_per_sec = rates.tokens_per_sec
        measurement.tpot_ms = rates.tpot_ms
        measurement.e2e_tokens_per_sec = rates.e2e_tokens_per_sec
        total = measurement.total_duration_ms
        if measurement.inputs is not None and total:
            measurement.inputs_per_sec = round(measurement.inputs / (total / 1000.0), 3)


def reasoning_split(measurement: CallMeasurement, sent_ns: int) -> None:
    """Time to the first answer token and the reasoning/answer token counts, from what the
    stream parser saw: the same figures whichever engine's format the reasoning came in."""
    if measurement.first_answer_ns:
        measurement.first_answer_ms = _ms(sent_ns, measurement.first_answer_ns)
    if measurement.reasoning_tokens is None:
        measurement.reasoning_tokens = measurement.reasoning_chunks
    completion = measurement.completion_tokens
    if isinstance(completion, int) and completion >= measurement.reasoning_tokens:
        measurement.answer_tokens = completion - measurement.reasoning_tokens
    else:
        measurement.answer_tokens = measurement.answer_chunks


@dataclass(frozen=True)
class TlsSettings:
    """How an https:// endpoint is trusted: the system store, a CA file, or (loudly) not at all."""

    verify: bool = True
    ca_file: str | None = None
    # The CA file's own text, where the settings travel to another process or node (a load
    # point's `processes:` or `clients:`): an ssl.SSLContext cannot be pickled, and the file's
    # path may not exist on the node a client task runs on.
    ca_pem: str | None = None

    def context(self) -> ssl.SSLContext:
        """The client context for both the timed streams and the control calls (httpx): one per
        setting in a process, since reading the system's CA store costs about 50 ms of CPU."""
        return _client_context(self.verify, self.ca_file, self.ca_pem)

    def portable(self) -> TlsSettings:
        """The same trust with the CA file's text carried in place of its path."""
        if self.ca_file is None:
            return self
        try:
            pem = Path(self.ca_file).read_text(encoding="ascii")
        except (OSError, UnicodeError) as exc:
            raise StreamError(f"ca_file {self.ca_file}: cannot be read as PEM: {exc}") from None
        return TlsSettings(self.verify, self.ca_file, pem)


@functools.lru_cache(maxsize=16)
def _client_context(verify: bool, ca_file: str | None, ca_pem: str | None) -> ssl.SSLContext:
    try:
        if ca_pem is not None:
            context = ssl.create_default_context(cadata=ca_pem)
        else:
            context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise StreamError(f"ca_file {ca_file}: cannot be read as PEM: {exc}") from None
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def joined_url(base_url: str, path: str) -> str:
    """`path` under the base URL's own path, with the base URL's query after it (a gateway's
    key, a proxy's route): `http://h:11434/?key=k` and `/api/tags` give
    `http://h:11434/api/tags?key=k`, where pasting them together put the query before `/api`."""
    parts = urlsplit(base_url)
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + path, parts.query, ""))


@dataclass(frozen=True)
class Endpoint:
    """Where a stream goes: scheme, host, port, the path prefix every request path follows and
    the query that follows every path (an endpoint's own `?key=...`)."""

    scheme: str
    host: str
    port: int
    prefix: str
    query: str = ""

    @classmethod
    def parse(cls, base_url: str) -> Endpoint:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StreamError(f"{base_url}: only http:// and https:// endpoints can be streamed")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"), parts.query)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def target(self, path: str) -> str:
        """The request target of `path`: under the prefix, the endpoint's query after it."""
        return f"{self.prefix}{path}?{self.query}" if self.query else f"{self.prefix}{path}"


class _ClosedByPeer(Exception):
    """The server closed the connection where HTTP says it may not (before or within a reply)."""


def _read_event(conn: h11.Connection, sock: socket.socket, stamps: list[int]) -> h11.Event:
    """Next h11 event; each time bytes arrive, their arrival time is pushed onto `stamps`.

    Over TLS `sock` is the ssl socket: the stamp is when decrypted content bytes came out of it.
    h11 reports a close in the wrong place in its own words ("can't handle event type
    ConnectionClosed when role=SERVER…"); it becomes _ClosedByPeer, for a message a user can read.
    """
    closed = False
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            if closed:
                raise _ClosedByPeer from None
            raise
        if event is not h11.NEED_DATA:
            return event  # type: ignore[return-value]
        # Before every read, before the wait, so its microsecond is not after the arrival.
        ack_at_once(sock)
        raw = sock.recv(_RECV_BYTES)
        if raw:
            stamps.append(time.perf_counter_ns())
        closed = not raw
        conn.receive_data(raw)


class _NoAnswer(StreamError):
    """The request went out and nothing came back before the connection ended."""


class HttpConnection:
    """One HTTP/1.1 connection to an endpoint, kept alive between calls (h11 start_next_cycle).

    Opening it (TCP connect, TLS handshake) happens before a call's clock starts and is timed on
    its own. A kept-alive connection the server has dropped is found before the call (or when the
    server closes it on the request without a byte of answer) and reopened once, outside the
    timed span; the response says so (`reconnected`). With `keep_alive` False every call opens
    its own connection and asks the server to close it.
    """

    def __init__(
        self, base_url: str, tls: TlsSettings | None = None, *, keep_alive: bool = True
    ) -> None:
        self.endpoint = Endpoint.parse(base_url)
        self.tls = tls or TlsSettings()
        self.keep_alive = keep_alive
        self._sock: socket.socket | None = None
        self._conn: h11.Connection | None = None
        self._context: ssl.SSLContext | None = None
        # How many connections this object opened (tests and benchmarks count them).
        self.opened = 0

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = self._conn = None

    def _open(self, timeout_s: float) -> tuple[float, float | None]:
        """Connect (and shake hands): (connect_ms, tls_handshake_ms or None over plain TCP)."""
        self.close()
        endpoint = self.endpoint
        started = time.perf_counter_ns()
        try:
            sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s)
        except OSError as exc:
            raise StreamError(f"cannot connect to {endpoint.address}: {exc}") from None
        connected = time.perf_counter_ns()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handshake_ms = None
        if endpoint.scheme == "https":
            if self._context is None:
                self._context = self.tls.context()
            try:
                sock = self._context.wrap_socket(sock, server_hostname=endpoint.host)
            except ssl.SSLCertVerificationError as exc:
                sock.close()
                hint = "set ca_file to the CA that signed it" if not self.tls.ca_file else ""
                where = f" by {self.tls.ca_file}" if self.tls.ca_file else ""
                raise StreamError(
                    f"TLS: the certificate of {endpoint.address} is not trusted{where}: "
                    f"{exc.verify_message}{'; ' + hint if hint else ''}"
                ) from None
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                raise StreamError(f"TLS handshake with {endpoint.address} failed: {exc}") from None
            handshake_ms = _ms(connected, time.perf_counter_ns())
        self._sock, self._conn = sock, h11.Connection(h11.CLIENT)
        self.opened += 1
        return _ms(started, connected), handshake_ms

    def _idle_and_open(self) -> bool:
        """Whether the kept connection can carry a request: nothing may arrive on an idle
        connection, so anything readable (the server's FIN or TLS close_notify) means dropped."""
        if self._sock is None or self._conn is None:
            return False
        if self._conn.our_state is not h11.IDLE or self._conn.their_state is not h11.IDLE:
            return False
        if isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            return False
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):
            return False
        if not readable:
            return True
        if not isinstance(self._sock, ssl.SSLSocket):
            return False
        # TLS records that carry no data (a TLS 1.3 session ticket) leave the connection usable.
        self._sock.setblocking(False)
        try:
            self._sock.recv(1)
        except ssl.SSLWantReadError:
            return True
        except OSError:
            return False
        return False  # the end (b"") or bytes nobody asked for: not a connection to reuse

    def post_stream(
        self,
        path: str,
        body: bytes,
        *,
        timeout_s: float,
        headers: Sequence[tuple[str, str]] = (),
    ) -> StreamedResponse:
        """POST `body` and return the response whose body lines are stamped on arrival.

        The connection is ready before the clock starts, so TTFT measures the server, not TCP or
        TLS set-up. The caller reads the lines, then calls `response.release`.
        """
        reused = self._idle_and_open()
        reconnected = self._sock is not None and not reused and self._reusable_before()
        connect_ms = handshake_ms = None
        if not reused:
            connect_ms, handshake_ms = self._open(timeout_s)
        try:
            response = self._send(path, body, timeout_s, headers)
        except _NoAnswer:
            if not reused:
                raise
            # Dropped between the check and the send: reopened once, and the clock restarts.
            reconnected, reused = True, False
            connect_ms, handshake_ms = self._open(timeout_s)
            response = self._send(path, body, timeout_s, headers)
        response.connect_ms, response.tls_handshake_ms = connect_ms, handshake_ms
        response.connection_reused, response.reconnected = reused, reconnected
        return response

    def _reusable_before(self) -> bool:
        """The kept connection had finished its last exchange cleanly (so losing it is a drop)."""
        return (
            self.keep_alive
            and self._conn is not None
            and self._conn.our_state is h11.IDLE
            and self._conn.their_state is h11.IDLE
        )

    def _send(
        self, path: str, body: bytes, timeout_s: float, headers: Sequence[tuple[str, str]]
    ) -> StreamedResponse:
        sock, conn, endpoint = self._sock, self._conn, self.endpoint
        assert sock is not None and conn is not None
        sock.settimeout(timeout_s)
        request_headers = [
            ("Host", endpoint.address),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            *([] if self.keep_alive else [("Connection", "close")]),
            *headers,
        ]
        target = endpoint.target(path)
        payload = conn.send(h11.Request(method="POST", target=target, headers=request_headers))
        payload += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        stamps: list[int] = []
        sent_ns = time.perf_counter_ns()
        try:
            sock.sendall(payload)
            event = _read_event(conn, sock, stamps)
        except (_ClosedByPeer, ssl.SSLEOFError):
            self.close()
            raise _NoAnswer(f"{endpoint.address} closed the connection before responding") from None
        except (ConnectionResetError, BrokenPipeError):
            self.close()
            raise _NoAnswer(f"{endpoint.address} reset the connection before responding") from None
        except (OSError, h11.RemoteProtocolError) as exc:
            self.close()
            raise StreamError(f"no response from {endpoint.address}: {exc}") from None
        if not isinstance(event, h11.Response):
            self.close()
            raise StreamError(f"unexpected response from {endpoint.address}: {event!r}")
        response_headers = {
            name.decode("latin-1").lower(): value.decode("latin-1") for name, value in event.headers
        }
        response = StreamedResponse(
            sent_ns=sent_ns, status=event.status_code, headers=response_headers, lines=iter(())
        )
        stall_s = STALL_LIMIT_S.get()
        if stall_s is not None and stall_s < timeout_s:
            sock.settimeout(stall_s)
        response.lines = self._lines(
            sock, conn, stamps, response, deadline_s=timeout_s, stall_s=stall_s
        )
        response.release = self._release_for(response)
        return response

    def _release_for(self, response: StreamedResponse) -> Callable[[bool], None]:
        own = self._conn

        def release(drain: bool) -> None:
            """Read the response to its end (its connection then carries the next call) when
            `drain`; else, or when that fails, close the connection. A connection opened since
            is another call's: left alone."""
            if drain:
                with contextlib.suppress(StreamError):
                    for _ in response.lines:
                        pass
            conn = self._conn
            if conn is not own:
                return
            if conn is None or conn.their_state is not h11.DONE or conn.our_state is not h11.DONE:
                self.close()
                return
            if not self.keep_alive:
                self.close()
                return
            conn.start_next_cycle()

        return release

    def _lines(
        self,
        sock: socket.socket,
        conn: h11.Connection,
        stamps: list[int],
        response: StreamedResponse,
        *,
        deadline_s: float,
        stall_s: float | None = None,
    ) -> Iterator[Line]:
        """Split the body into lines; each line keeps the arrival time of its first byte."""
        pending = b""
        pending_ns = 0
        deadline = time.monotonic() + deadline_s
        clean = False
        try:
            while True:
                if time.monotonic() > deadline:
                    raise StreamError(f"stream did not finish within {deadline_s:g} s")
                try:
                    event = _read_event(conn, sock, stamps)
                except TimeoutError:
                    if stall_s is not None and stall_s < deadline_s:
                        raise StreamError(
                            f"{STALLED}: no token for {stall_s:g} s after "
                            f"{response.chunks_received} chunks (stall_s)"
                        ) from None
                    raise StreamError(f"no data for {deadline_s:g} s (read timed out)") from None
                except _ClosedByPeer:
                    raise StreamError(
                        f"stream broke after {response.chunks_received} chunks: the server "
                        "closed the connection before the end of its response"
                    ) from None
                except (OSError, h11.RemoteProtocolError) as exc:
                    raise StreamError(
                        f"stream broke after {response.chunks_received} chunks: {exc}"
                    ) from None
                if isinstance(event, h11.Data):
                    arrived = stamps[-1]
                    response.chunks_received += 1
                    response.last_byte_ns = arrived
                    data = bytes(event.data)
                    while data:
                        if not pending:
                            pending_ns = arrived
                        newline = data.find(b"\n")
                        if newline < 0:
                            pending += data
                            break
                        pending += data[:newline]
                        data = data[newline + 1 :]
                        yield Line(pending_ns, pending.rstrip(b"\r"))
                        pending = b""
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    clean = isinstance(event, h11.EndOfMessage)
                    if pending:
                        yield Line(pending_ns, pending.rstrip(b"\r"))
                    return
        finally:
            # Only its own connection: a reply left unread is finalized when the collector gets
            # to it, by which time another call may be reading on a connection opened since.
            if (not clean or not self.keep_alive) and self._sock is sock:
                self.close()


def stream_post(
    base_url: str,
    path: str,
    body: bytes,
    *,
    timeout_s: float,
    headers: Sequence[tuple[str, str]] = (),
    tls: TlsSettings | None = None,
) -> StreamedResponse:
    """One call on a connection of its own (`Connection: close`), closed once it is read."""
    connection = HttpConnection(base_url, tls, keep_alive=False)
    return connection.post_stream(path, body, timeout_s=timeout_s, headers=headers)


def read_error_body(response: StreamedResponse, limit: int = 300) -> str:
    """The start of a non-2xx body, for the error message."""
    text = b"\n".join(line.text for line in response.lines).decode("utf-8", "replace")
    return text[:limit]
