"""Trace replay's send lag: a 200-request Mooncake-format trace (made here, Poisson-like gaps,
seeded) replayed at 1x and 4x by the load client, scheduled against actual send times, p50 / p99
/ max per speed; the schedule loop as shipped (sleep, then a busy spin to the send time, holding
the loop) and the alternative tried for issue 23 (sleep, then yield to the loop's other tasks until
the send time), alternated in one run so both see the same machine. The yield was not kept: at
1x on a shared machine its p99 was 8.5 ms against the spin's 2.4 ms (a ready callback, reading a
reply, can run for milliseconds before the loop comes back to the send).

The engine is a local stand-in by default (its own process, asyncio, keep-alive: a fixed
"prefill" then a few tokens, as llama-server streams them), or a running server given by
--base-url (llama-server: `llama-server -m tiny.gguf --port 8080 -np 4`). The send lag is the
time from a request's scheduled send to the moment its bytes are written (run/load/driver.py).

    python benchmarks_dev/trace_lag.py [--repeats 2] [--base-url http://127.0.0.1:8080]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from pytest_gpubench.config.load_profile import LoadProfile
from pytest_gpubench.results.percentiles import percentile
from pytest_gpubench.run.load import driver, make_pattern, trace_replay
from pytest_gpubench.run.load.driver import LoadRun, build_target
from pytest_gpubench.run.load.open_loop import send_on_schedule

REQUESTS = 200
SPAN_S = 10.0
PREFILL_S = 0.003
TOKENS = 4
TOKEN_GAP_S = 0.001
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4}
).encode()


def mooncake_trace(path: Path) -> None:
    """REQUESTS arrivals over SPAN_S seconds at 1x (exponential gaps, seed 23), Mooncake JSONL:
    timestamp (ms), input_length, output_length, hash_ids."""
    chooser = random.Random(23)
    at_ms, lines = 0.0, []
    for index in range(REQUESTS):
        entry = {
            "timestamp": int(at_ms),
            "input_length": chooser.randint(8, 64),
            "output_length": TOKENS,
            "hash_ids": [index],
        }
        lines.append(json.dumps(entry))
        at_ms += chooser.expovariate(REQUESTS / SPAN_S) * 1000.0
    path.write_text("\n".join(lines) + "\n")


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _serve(port_queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    events = [
        _chunk(f'data: {{"choices":[{{"index":0,"delta":{{"content":"t{i}"}}}}]}}\n\n'.encode())
        for i in range(TOKENS)
    ]
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": TOKENS}}
    finish = (
        _chunk(f"data: {json.dumps(last)}\n\n".encode())
        + _chunk(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        + b"0\r\n\r\n"
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
                for event in events:
                    writer.write(event)
                    await writer.drain()
                    await asyncio.sleep(TOKEN_GAP_S)
                writer.write(finish)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=256)
        port_queue.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


async def yield_until(
    target_ns: int, spin: int, clock: Callable[[], int] = time.perf_counter_ns
) -> None:
    """The alternative tried: sleep, then yield to the loop's other tasks until the target."""
    delay_ns = target_ns - clock() - spin
    await asyncio.sleep(max(0.0, delay_ns / 1e9))
    while clock() < target_ns:
        await asyncio.sleep(0)


WAKE_LATE_MS: list[float] = []


async def replay(base_url: str, trace: Path, speedup: float, loop: str) -> list[float]:
    """One replay at `speedup`; each request's send lag in ms (and, in WAKE_LATE_MS, how late
    each wait ended: the rest of the lag is the send task's way to its write)."""
    profile = LoadProfile(trace={"path": str(trace), "format": "mooncake", "speedup": speedup})  # type: ignore[arg-type]
    pattern = make_pattern(profile, f"trace-x{speedup:g}")
    run = LoadRun(build_target("openai", base_url, BODY, {}, 30.0), profile)
    await run.open(pattern.connections)
    chosen = driver.wait_until if loop == "busy spin (shipped)" else yield_until

    async def wait(target_ns: int, spin: int) -> None:
        await chosen(target_ns, spin)
        WAKE_LATE_MS.append((time.perf_counter_ns() - target_ns) / 1e6)

    # The shared schedule loop reads its wait through open_loop's name for it.
    from pytest_gpubench.run.load import open_loop

    names = vars(open_loop)
    previous = names["wait_until"]
    names["wait_until"] = wait
    try:
        await pattern.drive(run)
    finally:
        names["wait_until"] = previous
        await run.close()
    sent = run.sent
    assert len(sent) == REQUESTS, len(sent)
    errors = [s.measurement.error for s in sent if s.measurement.error]
    assert not errors, errors[:3]
    return [s.send_lag_ms for s in sent]


def figures(lags: Iterable[float]) -> str:
    values = list(lags)
    return (
        f"p50 {percentile(values, 50):.3f}  p99 {percentile(values, 99):.3f}  "
        f"max {max(values):.3f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="replays per speed and loop")
    parser.add_argument("--base-url", help="a running OpenAI-compatible server instead")
    parser.add_argument("--speeds", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument(
        "--spin-share",
        type=float,
        default=driver.SPIN_SHARE,
        help="the share of the mean gap the wait yields for before a send (at most "
        f"{driver.SPIN_NS / 1e6:g} ms; default {driver.SPIN_SHARE})",
    )
    args = parser.parse_args()
    driver.SPIN_SHARE = args.spin_share
    # Trace replay and the open loop share this loop: what it waits with is what is compared.
    assert vars(trace_replay)["send_on_schedule"] is send_on_schedule
    server: multiprocessing.Process | None = None
    base_url = args.base_url
    if base_url is None:
        ports: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
        server = multiprocessing.Process(target=_serve, args=(ports,), daemon=True)
        server.start()
        base_url = f"http://127.0.0.1:{ports.get(timeout=10)}"
    print(
        f"trace: {REQUESTS} requests over {SPAN_S:g} s at 1x; engine: "
        f"{'stand-in' if args.base_url is None else base_url}; cores: {os.cpu_count()}; "
        f"load average {os.getloadavg()[0]:.2f} (a shared machine)"
    )
    try:
        with tempfile.TemporaryDirectory() as scratch:
            trace = Path(scratch) / "trace.jsonl"
            mooncake_trace(trace)
            lags: dict[tuple[float, str], list[float]] = {}
            for _ in range(args.repeats):
                for speedup in args.speeds:
                    for loop in ("busy spin (shipped)", "yield (tried)"):
                        WAKE_LATE_MS.clear()
                        got = asyncio.run(replay(base_url, trace, speedup, loop))
                        lags.setdefault((speedup, loop), []).extend(got)
                        print(
                            f"  x{speedup:g} {loop:<20} {figures(got)}; the wait ended late "
                            f"{figures(WAKE_LATE_MS)}",
                            flush=True,
                        )
            print("all replays, send lag (scheduled vs actual send):")
            for (speedup, loop), values in sorted(lags.items()):
                print(f"x{speedup:g} {loop:<20} {figures(values)}  ({len(values)} requests)")
            print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        if server is not None:
            server.terminate()


if __name__ == "__main__":
    main()
