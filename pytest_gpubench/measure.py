"""One streamed HTTP request, timed from the moment bytes arrive, before any parsing."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11

# Why not httpx here: against a server that logs when it writes its first byte, a blocking socket
# read by h11 adds the least to TTFT (benchmarks_dev/client_overhead.py; on a loaded 2-core
# machine, median 0.06 ms against 0.15 ms for httpx sync and 0.25 ms for httpx async; the README
# keeps the figures). Control calls (health, version, tags) use httpx.
_RECV_BYTES = 65536


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


@dataclass
class CallMeasurement:
    """What one call measured, in the units of README "What it measures"."""

    first_delta_ms: float | None = None
    total_duration_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    client_chunks: int = 0
    tokens_per_sec: float | None = None
    tpot_ms: float | None = None
    inter_chunk_ms: list[float] = field(default_factory=list)
    finish_reason: str = "error"
    backend: str = ""
    error: str | None = None
    engine_timings: dict[str, Any] = field(default_factory=dict)
    # Added with the decode-rate definition of issue 11; a record that has `coalesced` carries
    # `tokens_per_sec` and `tpot_ms` under that definition (older ledgers do not).
    e2e_tokens_per_sec: float | None = None
    coalesced: bool = False
    content_reads: int = 0
    # The engine's own figures, normalised from engine_timings (None where it reports none).
    engine_tokens_per_sec: float | None = None
    engine_prompt_ms: float | None = None
    engine_total_ms: float | None = None
    # An OpenAI-compatible stream's backend configuration (its chunks' system_fingerprint).
    system_fingerprint: str | None = None

    def to_record(self) -> dict[str, Any]:
        return {
            "first_delta_ms": self.first_delta_ms,
            "total_duration_ms": self.total_duration_ms,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "client_chunks": self.client_chunks,
            "tokens_per_sec": self.tokens_per_sec,
            "tpot_ms": self.tpot_ms,
            "inter_chunk_ms": self.inter_chunk_ms,
            "finish_reason": self.finish_reason,
            "backend": self.backend,
            "error": self.error,
            "engine_timings": self.engine_timings,
            "e2e_tokens_per_sec": self.e2e_tokens_per_sec,
            "coalesced": self.coalesced,
            "content_reads": self.content_reads,
            "engine_tokens_per_sec": self.engine_tokens_per_sec,
            "engine_prompt_ms": self.engine_prompt_ms,
            "engine_total_ms": self.engine_total_ms,
            "system_fingerprint": self.system_fingerprint,
        }


def _ms(start_ns: int, end_ns: int) -> float:
    return round((end_ns - start_ns) / 1e6, 4)


@dataclass(frozen=True)
class Rates:
    """A call's rates from its content arrival times (README "What it measures")."""

    tokens_per_sec: float | None
    tpot_ms: float | None
    e2e_tokens_per_sec: float | None
    coalesced: bool
    content_reads: int


def call_rates(
    content_arrivals_ns: Sequence[int], completion_tokens: int | None, total_ms: float | None
) -> Rates:
    """Decode tokens/s: the tokens after the first read over the time from it to the last.

    (n - k) / (last content arrival - first content arrival), n the server's completion_tokens
    (the client's content chunk count where the server sent no usage), k the content chunks that
    came in the first read. With one chunk per read k = 1: n tokens, n - 1 intervals. A larger k
    (chunks held back and sent together: a proxy, a late client read) would otherwise put k - 1
    tokens that took no time of their own into the span and make the rate read high. Content
    that arrived in a single read spans no time: the call is `coalesced` and has no decode rate;
    its end-to-end rate, n / total, still stands.
    """
    arrivals = content_arrivals_ns
    tokens = len(arrivals) if completion_tokens is None else completion_tokens
    reads = len(set(arrivals))
    coalesced = reads == 1
    decode = tpot = e2e = None
    if not coalesced and arrivals:
        span_ns = arrivals[-1] - arrivals[0]
        decoded = tokens - arrivals.count(arrivals[0])
        if decoded > 0 and span_ns > 0:
            decode = round(decoded / (span_ns / 1e9), 3)
            tpot = round(span_ns / 1e6 / decoded, 6)
    if total_ms and total_ms > 0 and tokens > 0:
        e2e = round(tokens / (total_ms / 1000.0), 3)
    return Rates(decode, tpot, e2e, coalesced, reads)


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
    rates = call_rates(arrivals, measurement.completion_tokens, measurement.total_duration_ms)
    measurement.coalesced, measurement.content_reads = rates.coalesced, rates.content_reads
    if measurement.error is None:
        measurement.tokens_per_sec = rates.tokens_per_sec
        measurement.tpot_ms = rates.tpot_ms
        measurement.e2e_tokens_per_sec = rates.e2e_tokens_per_sec


def _split_url(base_url: str) -> tuple[str, int, str]:
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise StreamError(f"{base_url}: only http:// endpoints can be streamed")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


class _ClosedByPeer(Exception):
    """The server closed the connection where HTTP says it may not (before or within a reply)."""


def _read_event(conn: h11.Connection, sock: socket.socket, stamps: list[int]) -> h11.Event:
    """Next h11 event; each time bytes arrive, their arrival time is pushed onto `stamps`.

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
        raw = sock.recv(_RECV_BYTES)
        if raw:
            stamps.append(time.perf_counter_ns())
        closed = not raw
        conn.receive_data(raw)


def stream_post(
    base_url: str,
    path: str,
    body: bytes,
    *,
    timeout_s: float,
    headers: Sequence[tuple[str, str]] = (),
) -> StreamedResponse:
    """POST `body` and return the response whose body lines are stamped on arrival.

    The connection is opened before the clock starts, so TTFT measures the server, not TCP setup.
    """
    host, port, prefix = _split_url(base_url)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise StreamError(f"cannot connect to {host}:{port}: {exc}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = h11.Connection(h11.CLIENT)
    request_headers = [
        ("Host", f"{host}:{port}"),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
        ("Connection", "close"),
        *headers,
    ]
    payload = conn.send(h11.Request(method="POST", target=prefix + path, headers=request_headers))
    payload += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
    stamps: list[int] = []
    sent_ns = time.perf_counter_ns()
    try:
        sock.sendall(payload)
        event = _read_event(conn, sock, stamps)
    except _ClosedByPeer:
        sock.close()
        raise StreamError(f"{host}:{port} closed the connection before responding") from None
    except ConnectionResetError:
        sock.close()
        raise StreamError(f"{host}:{port} reset the connection before responding") from None
    except (OSError, h11.RemoteProtocolError) as exc:
        sock.close()
        raise StreamError(f"no response from {host}:{port}: {exc}") from None
    if not isinstance(event, h11.Response):
        sock.close()
        raise StreamError(f"unexpected response from {host}:{port}: {event!r}")
    response_headers = {
        name.decode("latin-1").lower(): value.decode("latin-1") for name, value in event.headers
    }
    response = StreamedResponse(
        sent_ns=sent_ns, status=event.status_code, headers=response_headers, lines=iter(())
    )
    response.lines = _lines(conn, sock, stamps, response, deadline_s=timeout_s)
    return response


def _lines(
    conn: h11.Connection,
    sock: socket.socket,
    stamps: list[int],
    response: StreamedResponse,
    *,
    deadline_s: float,
) -> Iterator[Line]:
    """Split the body into lines; each line keeps the arrival time of its first byte."""
    pending = b""
    pending_ns = 0
    deadline = time.monotonic() + deadline_s
    try:
        while True:
            if time.monotonic() > deadline:
                raise StreamError(f"stream did not finish within {deadline_s:g} s")
            try:
                event = _read_event(conn, sock, stamps)
            except TimeoutError:
                raise StreamError(f"no data for {deadline_s:g} s (read timed out)") from None
            except _ClosedByPeer:
                raise StreamError(
                    f"stream broke after {response.chunks_received} chunks: the server closed "
                    "the connection before the end of its response"
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
                if pending:
                    yield Line(pending_ns, pending.rstrip(b"\r"))
                return
    finally:
        sock.close()


def read_error_body(response: StreamedResponse, limit: int = 300) -> str:
    """The start of a non-2xx body, for the error message."""
    text = b"\n".join(line.text for line in response.lines).decode("utf-8", "replace")
    return text[:limit]
