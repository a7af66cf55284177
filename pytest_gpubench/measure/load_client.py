"""The load client: streamed requests on asyncio with kept-alive HTTP/1.1 connections, each read
stamped with perf_counter_ns() the moment it arrives, before any parsing.

One `StreamConnection` per in-flight request: a raw asyncio Protocol (no HTTP library in the
path of the bytes), its reads kept whole with their arrival stamps; the body is decoded as it
comes only as far as needed to find its end. Once a response has ended, its stamped lines go
through the engines' own stream parser and measure.py's timing rules (engines.measure_response),
exactly as a single call's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pytest_gpubench.measure.stream import (
    Endpoint,
    Line,
    StreamedResponse,
    StreamError,
    ack_at_once,
)


@dataclass
class RawResponse:
    """What came back for one request: the status, headers, and the body as stamped pieces."""

    sent_ns: int
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    # (arrival ns of the read that brought it, decoded body bytes), in order.
    pieces: list[tuple[int, bytes]] = field(default_factory=list)
    reads: int = 0
    last_byte_ns: int = 0
    keep_alive: bool = True

    def streamed(self) -> StreamedResponse:
        """The response as measure.py's readers take it: its lines, each with the arrival time of
        its first byte."""
        return StreamedResponse(
            sent_ns=self.sent_ns,
            status=self.status,
            headers=self.headers,
            lines=iter(stamped_lines(self.pieces)),
            chunks_received=self.reads,
            last_byte_ns=self.last_byte_ns,
            connection_reused=True,
        )


def stamped_lines(pieces: Sequence[tuple[int, bytes]]) -> list[Line]:
    """Split stamped body pieces into lines, blank ones left out; a line keeps the stamp of the
    piece it began in. (bytes.split does the scanning: this runs once per token under load.)"""
    lines: list[Line] = []
    append = lines.append
    pending = b""
    pending_ns = 0
    for arrived, data in pieces:
        parts = data.split(b"\n")
        last = parts.pop()  # after the last newline: the start of a line still to come
        if parts:
            first = parts[0]
            if pending:
                first = pending + first
            else:
                pending_ns = arrived
            if first and first != b"\r":
                append(Line(pending_ns, first.rstrip(b"\r")))
            for text in parts[1:]:
                if text and text != b"\r":  # blank lines only separate events
                    append(Line(arrived, text.rstrip(b"\r")))
            pending = b""
        if last:
            if not pending:
                pending_ns = arrived
            pending += last
    if pending and pending != b"\r":
        lines.append(Line(pending_ns, pending.rstrip(b"\r")))
    return lines


class DroppedConnection(StreamError):
    """The server closed the connection without a byte of answer: on a reused connection, it
    had dropped it before the request (the request may be sent again on a new one)."""


class _ResponseReader:
    """An HTTP/1.1 response parser fed with stamped reads: head, then a chunked, sized or
    close-delimited body. `done` once the response has ended."""

    def __init__(self, response: RawResponse) -> None:
        self.response = response
        self.buffer = b""
        self.in_head = True
        self.chunked = False
        self.remaining = -1  # bytes left of a sized body or of the current chunk; -1: unknown
        self.done = False

    def feed(self, arrived: int, data: bytes) -> None:
        response = self.response
        response.reads += 1
        response.last_byte_ns = arrived
        buffer = self.buffer + data if self.buffer else data
        self.buffer = b""
        if self.in_head:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                self.buffer = buffer
                return
            self._head(buffer[:end])
            buffer = buffer[end + 4 :]
            self.in_head = False
            if self.done:
                return
        if self.chunked:
            self._chunks(arrived, buffer)
        elif self.remaining >= 0:
            piece = buffer[: self.remaining]
            self.remaining -= len(piece)
            if piece:
                response.pieces.append((arrived, piece))
            self.done = self.remaining == 0
        elif buffer:
            response.pieces.append((arrived, buffer))

    def _head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise StreamError(f"not an HTTP/1.1 response: {lines[0][:80]!r}")
        self.response.status = int(parts[1])
        headers = self.response.headers
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not self.chunked and "content-length" in headers:
            self.remaining = int(headers["content-length"])
            self.done = self.remaining == 0
        closes = headers.get("connection", "").lower() == "close"
        self.response.keep_alive = not closes and (self.chunked or self.remaining >= 0)

    def _chunks(self, arrived: int, buffer: bytes) -> None:
        """Decode the chunks of one read; their data becomes one piece with the read's stamp."""
        parts: list[bytes] = []
        try:
            self._decode(buffer, parts)
        finally:
            if parts:
                self.response.pieces.append((arrived, b"".join(parts)))

    def _decode(self, buffer: bytes, parts: list[bytes]) -> None:
        """Chunk framing off; `remaining` (kept between reads) is the data left of the current
        chunk, 0 when its closing CRLF is due, -1 when a size line is."""
        position = 0
        size = len(buffer)
        remaining = self.remaining
        append = parts.append
        find = buffer.find
        try:
            while position < size:
                if remaining > 0:
                    piece = buffer[position : position + remaining]
                    append(piece)
                    remaining -= len(piece)
                    position += len(piece)
                    continue
                if remaining == 0:  # the CRLF after a chunk's data
                    if size - position < 2:
                        break
                    position += 2
                    remaining = -1
                    continue
                line_end = find(b"\r\n", position)
                if line_end < 0:
                    break
                size_line = buffer[position:line_end]
                if b";" in size_line:  # chunk extensions (no engine sends any)
                    size_line = size_line.split(b";", 1)[0]
                chunk_size = int(size_line, 16)
                if chunk_size == 0:
                    # The last chunk: trailers (none from the engines) and the final CRLF.
                    self.done = find(b"\r\n\r\n", line_end) >= 0
                    if self.done:
                        return
                    break
                position = line_end + 2
                remaining = chunk_size
        finally:
            self.remaining = remaining
        self.buffer = buffer[position:]

    def closed(self) -> None:
        """The server closed the connection: the end of a close-delimited body, else a fault."""
        if self.done:
            return
        if not self.in_head and not self.chunked and self.remaining < 0:
            self.done = True
            self.response.keep_alive = False
            return
        if self.response.reads == 0:
            raise DroppedConnection("the server closed the connection without an answer")
        raise StreamError(
            f"stream broke after {self.response.reads} reads: the server closed the connection "
            "before the end of its response"
        )


class StreamConnection(asyncio.Protocol):
    """One kept-alive connection carrying one streamed request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._reader: _ResponseReader | None = None
        self._done: asyncio.Future[RawResponse] | None = None
        self.lost = False
        self.exchanges = 0

    @classmethod
    async def open(
        cls, endpoint: Endpoint, timeout_s: float, tls: ssl.SSLContext | None = None
    ) -> StreamConnection:
        """Connect (over TLS for an https:// endpoint: `tls` is the cell's context, the one its
        single calls trust); the stamps are taken on the decrypted bytes."""
        loop = asyncio.get_running_loop()
        secure = tls if endpoint.scheme == "https" else None
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(
                    cls,
                    endpoint.host,
                    endpoint.port,
                    ssl=secure,
                    server_hostname=endpoint.host if secure is not None else None,
                ),
                timeout_s,
            )
        except ssl.SSLError as exc:
            raise StreamError(f"TLS handshake with {endpoint.address} failed: {exc}") from None
        except (OSError, TimeoutError) as exc:
            raise StreamError(f"cannot connect to {endpoint.address}: {exc}") from None
        return protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ack_at_once(sock)

    def data_received(self, data: bytes) -> None:
        arrived = time.perf_counter_ns()  # first, before anything looks at the bytes
        reader, done = self._reader, self._done
        if reader is None or done is None or done.done():
            return  # bytes on an idle connection: the next request finds it dropped
        try:
            reader.feed(arrived, data)
        except (StreamError, ValueError) as exc:
            done.set_exception(StreamError(str(exc)))
            return
        if reader.done:
            done.set_result(reader.response)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        reader, done = self._reader, self._done
        if reader is None or done is None or done.done():
            return
        try:
            reader.closed()
        except StreamError as error:
            done.set_exception(error)
            return
        done.set_result(reader.response)

    @property
    def usable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    async def exchange(self, request: bytes, timeout_s: float) -> RawResponse:
        """Send one request and wait for the end of its response (at most `timeout_s`)."""
        assert self.transport is not None
        if self.lost:
            raise DroppedConnection("the connection was closed before the request")
        self.exchanges += 1
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        response = RawResponse(sent_ns=time.perf_counter_ns())
        self._reader = _ResponseReader(response)
        self.transport.write(request)
        try:
            return await asyncio.wait_for(self._done, timeout_s)
        except TimeoutError:
            self.close()
            raise StreamError(f"stream did not finish within {timeout_s:g} s") from None
        finally:
            self._reader = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.lost = True


def request_bytes(
    endpoint: Endpoint, path: str, body: bytes, headers: Sequence[tuple[str, str]]
) -> bytes:
    """A whole HTTP/1.1 POST, built once per distinct request and sent as is."""
    head = [
        f"POST {endpoint.target(path)} HTTP/1.1",
        f"Host: {endpoint.address}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        *(f"{name}: {value}" for name, value in headers),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class ConnectionPool:
    """Idle kept-alive connections to one endpoint; a dropped one is replaced when taken."""

    def __init__(
        self,
        endpoint: Endpoint,
        connect_timeout_s: float = 10.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.connect_timeout_s = connect_timeout_s
        self.tls = tls
        self.idle: list[StreamConnection] = []
        self.opened = 0
        self.server_closes = False
        self._replacing: set[asyncio.Future[None]] = set()

    async def fill(self, count: int) -> None:
        """Open connections ahead of the first requests, so no request waits for a connect."""
        while len(self.idle) < count:
            self.idle.append(await self._open())

    async def _open(self) -> StreamConnection:
        connection = await StreamConnection.open(self.endpoint, self.connect_timeout_s, self.tls)
        self.opened += 1
        return connection

    async def take(self) -> StreamConnection:
        while self.idle:
            connection = self.idle.pop()
            if connection.usable:
                return connection
            if connection.exchanges:
                self.dropped()  # the server closed a connection after its reply
        return await self._open()

    def give_back(self, connection: StreamConnection, keep: bool) -> None:
        """A connection the server keeps goes back to the idle ones. A server that closes its
        connection after each reply (llama-server does, though it answers `Keep-Alive`) gets a
        fresh one opened now, in the background, so the next request finds one ready and its
        send is not late by a connect."""
        if keep and connection.usable and not self.server_closes:
            self.idle.append(connection)
            return
        if keep and not connection.usable:
            # It said keep-alive and closed all the same: so will the next ones. Until this was
            # noticed here, each later send waited for a connect of its own (0.5-1 ms late).
            self.server_closes = True
        connection.close()
        task = asyncio.ensure_future(self._replace())
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    def dropped(self) -> None:
        """A kept connection was found closed on reuse: from now on none is reused. The idle
        connections that never carried a request stay: they were opened ahead so that no send
        waits for a connect, and closing them made the next send late by one (1-2 ms)."""
        self.server_closes = True
        used = [idle for idle in self.idle if idle.exchanges]
        for idle in used:
            idle.close()
        self.idle = [idle for idle in self.idle if not idle.exchanges]

    async def _replace(self) -> None:
        with contextlib.suppress(StreamError):
            self.idle.append(await self._open())

    async def close(self) -> None:
        for task in list(self._replacing):
            task.cancel()
        await asyncio.gather(*self._replacing, return_exceptions=True)
        for connection in self.idle:
            connection.close()
        self.idle.clear()
