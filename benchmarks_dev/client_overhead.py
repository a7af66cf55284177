"""How much each HTTP streaming client adds to TTFT, against a timing-controlled local server.

The server (timed_server.py) stamps the moment it writes the first content chunk; each client
stamps the arrival of the first content bytes; the difference is what the client adds. Prints the
median and p90 per client, side by side.

    python benchmarks_dev/client_overhead.py [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import httpx
from timed_server import BODY, gpubench_client, server_stamp, start_server


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
    return first - server_stamp(text.decode())


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
        return first - server_stamp(text.decode())

    return asyncio.run(once())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    url, server = start_server()
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
