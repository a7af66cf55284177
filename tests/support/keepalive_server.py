"""A timing-controlled OpenAI-style streaming server on 127.0.0.1 that keeps connections alive
(HTTP/1.1, as vLLM's and SGLang's uvicorn do; llama-server closes after every streamed reply).

It counts the connections it accepted, keeps each request (path, headers, JSON body), stamps
time.perf_counter_ns() just before it writes the first content chunk and sends that stamp in its
last event (`server_first_write_ns`): on Linux perf_counter_ns is CLOCK_MONOTONIC, shared by all
processes, so a client's first-content arrival minus the stamp is what the client adds.
"""

from __future__ import annotations

import collections
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

CHUNKS = 8
PREFILL_S = 0.002


@dataclass
class SeenRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, object]
    connection: int


class FifoSlots:
    """A semaphore that hands its slots out in the order they were asked for (threading's lets
    a newcomer take a slot ahead of a thread already waiting: last come, first served)."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._lock = threading.Lock()
        self._waiting: collections.deque[threading.Event] = collections.deque()

    def __enter__(self) -> None:
        with self._lock:
            if self._free > 0 and not self._waiting:
                self._free -= 1
                return
            turn = threading.Event()
            self._waiting.append(turn)
        turn.wait()

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            if self._waiting:
                self._waiting.popleft().set()  # the slot passes straight to the next in line
            else:
                self._free += 1


@dataclass
class KeepAliveServer:
    chunks: int = CHUNKS
    prefill_s: float = PREFILL_S
    # Close the connection on reading request number N (1-based, over all connections), without
    # a byte of answer: a kept-alive connection dropped just as the client reuses it.
    hang_up_on_request: int | None = None
    # From POST number N on (1-based, warm-up included), each reply waits `then_prefill_s`
    # before its first chunk instead of `prefill_s`: an engine that slows down (or speeds up)
    # partway.
    from_request: int | None = None
    then_prefill_s: float = 0.0
    # At most this many replies at once (an engine's slots), the others waiting their turn in
    # arrival order (first come, first served, as vLLM's and llama-server's schedulers) before
    # their first byte: a fixed capacity of slots / service time.
    slots: int | None = None
    # Called with each POST's number (1-based) as it is read, before it is answered.
    on_request: Callable[[int], None] | None = None
    connections_accepted: int = 0
    requests: list[SeenRequest] = field(default_factory=list)
    _listener: socket.socket = field(init=False)
    _open: list[socket.socket] = field(default_factory=list)
    _closed: bool = False
    _slots: FifoSlots | None = None

    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> KeepAliveServer:
        self._slots = FifoSlots(self.slots) if self.slots is not None else None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._spawn(self._accept_loop)
        return self

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def drop_connections(self) -> None:
        """Close every open connection, as a server's idle timeout or a restart would."""
        for conn in list(self._open):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def close(self) -> None:
        """Stop listening and serving, and wait for every thread: nothing of this server may go
        on answering on a port (or a file descriptor) that a later server gets."""
        self._closed = True
        # shutdown wakes the accept() blocked in the other thread; close alone does not.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.drop_connections()
        for thread in self._threads:
            thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections_accepted += 1
            self._open.append(conn)
            number = self.connections_accepted
            self._spawn(self._serve, conn, number)

    def _serve(self, conn: socket.socket, number: int) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {
                    name.strip().lower(): value.strip()
                    for name, _, value in (line.partition(":") for line in lines[1:])
                }
                length = int(headers.get("content-length", "0"))
                while len(buffer) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                body, buffer = buffer[:length], buffer[length:]
                method, path = lines[0].split(" ")[:2]
                if method != "POST":
                    self._answer_get(conn, path)
                    continue
                self.requests.append(
                    SeenRequest(lines[0].split(" ")[1], headers, json.loads(body or b"{}"), number)
                )
                if self.on_request is not None:
                    self.on_request(len(self.requests))
                if self.hang_up_on_request == len(self.requests):
                    return
                close = headers.get("connection", "").lower() == "close"
                later = self.from_request is not None and len(self.requests) >= self.from_request
                self._reply(conn, close, self.then_prefill_s if later else self.prefill_s)
                if close:
                    return
        except OSError:
            return
        finally:
            with contextlib.suppress(ValueError):
                self._open.remove(conn)
            conn.close()

    def _answer_get(self, conn: socket.socket, path: str) -> None:
        """Control calls: /v1/models lists model `m`; anything else is 404."""
        if path.endswith("/v1/models"):
            status, body = b"200 OK", json.dumps({"data": [{"id": "m"}]}).encode()
        else:
            status, body = b"404 Not Found", b"{}"
        conn.sendall(
            b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )

    def _reply(self, conn: socket.socket, close: bool, prefill_s: float) -> None:
        if self._slots is None:
            self._reply_now(conn, close, prefill_s)
            return
        with self._slots:
            self._reply_now(conn, close, prefill_s)

    def _reply_now(self, conn: socket.socket, close: bool, prefill_s: float) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n"
            + (b"Connection: close\r\n" if close else b"")
            + b"\r\n"
        )
        time.sleep(prefill_s)  # "prefill": the client is already waiting in recv()
        first_write_ns = 0
        for index in range(self.chunks):
            finish = "length" if index == self.chunks - 1 else None
            delta = {"choices": [{"delta": {"content": f"t{index}"}, "finish_reason": finish}]}
            event = f"data: {json.dumps(delta)}\n\n".encode()
            if index == 0:
                first_write_ns = time.perf_counter_ns()
            conn.sendall(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            time.sleep(0.0005)
        usage = {
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": self.chunks},
            "server_first_write_ns": first_write_ns,
        }
        tail = f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()
        conn.sendall(f"{len(tail):x}\r\n".encode() + tail + b"\r\n0\r\n\r\n")


@contextmanager
def keepalive_server(**options: object) -> Iterator[KeepAliveServer]:
    server = KeepAliveServer(**options).start()  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.close()
