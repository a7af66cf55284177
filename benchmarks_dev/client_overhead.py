"""How much each HTTP streaming client adds to TTFT, against a timing-controlled local server.

The server (a separate process, raw sockets) stamps time.perf_counter_ns() just before it writes the
first content chunk and sends that stamp in its last chunk; the client stamps the arrival of the
first content bytes. On Linux perf_counter_ns is CLOCK_MONOTONIC, shared by both processes, so the
difference is what the client adds. Prints the median and p90 per client, side by side.

    python benchmarks_dev/client_overhead.py [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import time
from collections.abc import Callable

import httpx

from pytest_gpubench.measure import stream_post

CHUNKS = 8
PREFILL_S = 0.002


def _serve(port_queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
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


def _server_stamp(text: str) -> int:
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
    return first - _server_stamp("\n".join(text))


def httpx_sync_client(url: str) -> int:
    with (
        httpx.Client(trust_env=False) as client,
        client.stream("POST", f"{url}/v1/chat/completions", content=BODY) as response,
    ):
        first = 0
        text = b""
        for chunk in response.iter_raw():
            if not first and b'"content"' in chunk:
                first = time.perf_counter_ns()
            text += chunk
    return first - _server_stamp(text.decode())


def httpx_async_client(url: str) -> int:
    async def once() -> int:
        async with (
            httpx.AsyncClient(trust_env=False) as client,
            client.stream("POST", f"{url}/v1/chat/completions", content=BODY) as response,
        ):
            first = 0
            text = b""
            async for chunk in response.aiter_raw():
                if not first and b'"content"' in chunk:
                    first = time.perf_counter_ns()
                text += chunk
        return first - _server_stamp(text.decode())

    return asyncio.run(once())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    ports: multiprocessing.Queue[int] = multiprocessing.Queue()
    server = multiprocessing.Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{ports.get(timeout=10)}"
    clients: dict[str, Callable[[str], int]] = {
        "pytest-gpubench (h11, blocking socket)": gpubench_client,
        "httpx sync": httpx_sync_client,
        "httpx async": httpx_async_client,
    }
    samples: dict[str, list[float]] = {name: [] for name in clients}
    for client in clients.values():
        for _ in range(20):  # warm imports and caches
            client(url)
    # Interleave the clients so that machine noise hits them alike.
    for _ in range(args.requests):
        for name, client in clients.items():
            samples[name].append(client(url) / 1e6)
    server.terminate()
    ours = statistics.median(samples["pytest-gpubench (h11, blocking socket)"])
    print(f"{'client':40} {'median ms':>10} {'p90 ms':>8} {'vs ours':>8}")
    for name, values in samples.items():
        median = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        print(f"{name:40} {median:10.3f} {p90:8.3f} {median / ours:7.2f}x")
    print(f"({args.requests} requests per client, interleaved, one stream at a time)")


if __name__ == "__main__":
    main()
