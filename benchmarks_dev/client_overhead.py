"""How much each HTTP streaming client adds to TTFT, against a timing-controlled local server.

The server (a separate process, raw sockets) stamps time.perf_counter_ns() just before it writes the
first content chunk and sends that stamp in its last chunk; the client stamps the arrival of the
first content bytes. On Linux perf_counter_ns is CLOCK_MONOTONIC, shared by both processes, so the
difference is what the client adds. Prints the median and p90 per client, side by side.

The server keeps connections alive (tests/support/keepalive_server.py); pytest-gpubench is
measured with a kept-alive connection and with a new connection per call, over plain HTTP and
over TLS through stunnel4 (tests/support/tls_terminator.py, a CA made for the run), with the
connect and TLS handshake times it records beside each call (never inside its TTFT).

    python benchmarks_dev/client_overhead.py [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from pytest_gpubench.measure.stream import (
    HttpConnection,
    StreamedResponse,
    TlsSettings,
    stream_post,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.keepalive_server import KeepAliveServer
from support.tls_terminator import stunnel


def _serve(port_queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    server = KeepAliveServer().start()
    port_queue.put(server.url)
    while True:
        time.sleep(3600)


BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})


def _server_stamp(text: str) -> int:
    for line in text.splitlines():
        if "server_first_write_ns" in line:
            return int(json.loads(line.removeprefix("data:").strip())["server_first_write_ns"])
    raise ValueError("the server sent no server_first_write_ns")


def _read(response: StreamedResponse) -> int:
    """The client's error on the first content: its arrival minus the server's first write."""
    first = 0
    text = []
    for line in response.lines:
        if not first and b'"content"' in line.text:
            first = line.arrived_ns
        text.append(line.text.decode())
    response.release(True)
    return first - _server_stamp("\n".join(text))


# Connect and TLS handshake ms of the calls that opened a connection, per client.
SETUP_MS: dict[str, list[tuple[float, float | None]]] = {}


def gpubench_new_connection(url: str, tls: TlsSettings | None = None, name: str = "") -> int:
    response = stream_post(url, "/v1/chat/completions", BODY.encode(), timeout_s=10, tls=tls)
    if name and response.connect_ms is not None:
        SETUP_MS.setdefault(name, []).append((response.connect_ms, response.tls_handshake_ms))
    return _read(response)


def gpubench_kept_alive(connection: HttpConnection, name: str) -> int:
    response = connection.post_stream("/v1/chat/completions", BODY.encode(), timeout_s=10)
    if response.connect_ms is not None:
        SETUP_MS.setdefault(name, []).append((response.connect_ms, response.tls_handshake_ms))
    return _read(response)


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


OURS = "gpubench http kept-alive"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    urls: multiprocessing.Queue[str] = multiprocessing.Queue()
    server = multiprocessing.Process(target=_serve, args=(urls,), daemon=True)
    server.start()
    url = urls.get(timeout=10)
    with tempfile.TemporaryDirectory() as tmp, stunnel(url, Path(tmp)) as terminator:
        tls = TlsSettings(ca_file=str(terminator.ca_file))
        kept_http = HttpConnection(url)
        kept_https = HttpConnection(terminator.url, tls)
        https = terminator.url
        clients: dict[str, Callable[[], int]] = {
            OURS: lambda: gpubench_kept_alive(kept_http, OURS),
            "gpubench http new connection": lambda: gpubench_new_connection(
                url, name="gpubench http new connection"
            ),
            "gpubench https kept-alive": lambda: gpubench_kept_alive(
                kept_https, "gpubench https kept-alive"
            ),
            "gpubench https new connection": lambda: gpubench_new_connection(
                https, tls, "gpubench https new connection"
            ),
            "httpx sync (http, new client)": lambda: httpx_sync_client(url),
            "httpx async (http, new client)": lambda: httpx_async_client(url),
        }
        samples: dict[str, list[float]] = {name: [] for name in clients}
        for client in clients.values():
            for _ in range(20):  # warm imports and caches
                client()
        SETUP_MS.clear()
        # Interleave the clients so that machine noise hits them alike.
        for _ in range(args.requests):
            for name, client in clients.items():
                samples[name].append(client() / 1e6)
        handshakes = terminator.handshakes()
    server.terminate()
    ours = statistics.median(samples[OURS])
    print("TTFT error: first content arrival at the client minus the server's first write (ms)")
    header = f"{'client':32} {'median':>8} {'p90':>8} {'vs ours':>8} {'opened':>7}"
    print(f"{header} {'connect p50':>12} {'TLS hs p50':>11}")
    for name, values in samples.items():
        median = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        setup = SETUP_MS.get(name, [])
        opened = str(len(setup)) if name.startswith("gpubench") else "-"
        connect = f"{statistics.median(c for c, _ in setup):.3f}" if setup else "-"
        tls_ms = [h for _, h in setup if h is not None]
        handshake = f"{statistics.median(tls_ms):.3f}" if tls_ms else "-"
        row = f"{name:32} {median:8.3f} {p90:8.3f} {median / ours:7.2f}x {opened:>7}"
        print(f"{row} {connect:>12} {handshake:>11}")
    print(
        f"({args.requests} requests per client, interleaved, one stream at a time; 'opened': "
        f"connections the client opened while measured; stunnel completed {handshakes} TLS "
        "handshakes in all, warm-up included)"
    )


if __name__ == "__main__":
    main()
