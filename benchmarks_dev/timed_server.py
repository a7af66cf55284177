"""The timing-controlled local server of the client benchmarks: a separate process on raw sockets
that stamps time.perf_counter_ns() just before it writes the first content chunk and sends that
stamp in its last chunk. On Linux perf_counter_ns is CLOCK_MONOTONIC, shared by both processes,
so a client's first-content arrival minus the stamp is what the client side adds to TTFT.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import time

from pytest_gpubench.measure.stream import stream_post

CHUNKS = 8
PREFILL_S = 0.002


def serve(port_queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port_queue.put(listener.getsockname()[1])
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(65536)
        head, _, body = request.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        while len(body) < length:
            body += conn.recv(65536)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        time.sleep(PREFILL_S)  # "prefill": the client is already waiting in recv()
        first_write_ns = 0
        for index in range(CHUNKS):
            event = f'data: {{"choices":[{{"delta":{{"content":"t{index}"}}}}]}}\n\n'.encode()
            if index == 0:
                first_write_ns = time.perf_counter_ns()
            conn.sendall(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            time.sleep(0.0005)
        stamp = f"data: {json.dumps({'server_first_write_ns': first_write_ns})}\n\n".encode()
        conn.sendall(f"{len(stamp):x}\r\n".encode() + stamp + b"\r\n0\r\n\r\n")
        conn.close()


BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})


def server_stamp(text: str) -> int:
    marker = text.rindex('{"server_first_write_ns"')
    return int(json.loads(text[marker:].split("\n", 1)[0])["server_first_write_ns"])


def gpubench_client(url: str) -> int:
    response = stream_post(url, "/v1/chat/completions", BODY.encode(), timeout_s=10)
    first = 0
    text = []
    for line in response.lines:
        if not first and b'"content"' in line.text:
            first = line.arrived_ns
        text.append(line.text.decode())
    return first - server_stamp("\n".join(text))


def start_server() -> tuple[str, multiprocessing.Process]:
    """The server in its own process (terminate() it when done) and its base URL."""
    ports: multiprocessing.Queue[int] = multiprocessing.Queue()
    server = multiprocessing.Process(target=serve, args=(ports,), daemon=True)
    server.start()
    return f"http://127.0.0.1:{ports.get(timeout=10)}", server
