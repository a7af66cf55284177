"""One client process against two (`processes: N`) at the stand-in's ceiling: throughput and send
lag side by side.

The stand-in is benchmarks_dev/load_client.py's asyncio server (its own process; kept-alive
connections; `--tokens` SSE events a reply after a 2 ms "prefill"). Each configuration runs
through run/load/clients.run_clients (processes on this machine), so one process and two are
spawned the same way:

- closed loop at `--streams`: output tokens/s (content chunks the clients read over the
  window) and the send lag (from a stream's last reply to its next send);
- open loop at `--rate` req/s (constant): requests/s achieved and the send lag p50/p99/max
  against the schedule.

On a machine of 2 cores the server, the clients and anything else running share them: the
figures say what one more client process buys there, not on a real client host. Prints the
load average before and after.

    python benchmarks_dev/load_processes.py [--seconds 3] [--streams 64] [--rate 400]
    python benchmarks_dev/load_processes.py --url http://127.0.0.1:8080 --streams 4 --rate 20
        (a server already running instead of the stand-in: a llama-server with 4 slots)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

from pytest_gpubench.config.load_profile import LoadProfile
from pytest_gpubench.run.load import LoadPattern
from pytest_gpubench.run.load.clients import run_clients
from pytest_gpubench.run.load.closed_loop import ClosedLoop
from pytest_gpubench.run.load.driver import Sent, build_target
from pytest_gpubench.run.load.open_loop import OpenLoop
from pytest_gpubench.targets import launch_here

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_client import BODY, _serve


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round((len(ordered) - 1) * q))] if ordered else 0.0


def measure(
    url: str, body: bytes, pattern: LoadPattern, processes: int, seconds: float
) -> dict[str, float]:
    """One point through run_clients: its throughput and send lag."""
    target = build_target("openai", url, body, {}, 60.0)
    profile = LoadProfile(duration_s=seconds, processes=processes)
    result = run_clients(target, profile, pattern, launch_here())
    started_ns, sent, lost = result.started_ns, result.sent, result.lost
    assert not lost, lost
    measured: list[Sent] = [item for item in sent if item.window == "measured"]
    assert all(item.measurement.error is None for item in measured)
    ends = [
        item.sent_ns + int((item.measurement.total_duration_ms or 0.0) * 1e6) for item in measured
    ]
    window_s = (max(ends) - started_ns) / 1e9
    lags = [item.send_lag_ms for item in measured]
    return {
        "requests": len(measured),
        "req_per_s": len(measured) / window_s,
        "tokens_per_s": sum(item.measurement.client_chunks for item in measured) / window_s,
        "lag_p50": statistics.median(lags),
        "lag_p99": _percentile(lags, 0.99),
        "lag_max": max(lags),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per reply")
    parser.add_argument("--seconds", type=float, default=3.0, help="per point")
    parser.add_argument("--streams", type=int, default=64, help="closed loop's concurrency")
    parser.add_argument("--rate", type=float, default=400.0, help="open loop's req/s")
    parser.add_argument("--url", help="a running OpenAI-style server instead of the stand-in")
    parser.add_argument("--max-tokens", type=int, default=32, help="per request, with --url")
    args = parser.parse_args()
    server = None
    if args.url:
        url, body = args.url, json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "Count to ten."}],
             "stream": True, "max_tokens": args.max_tokens, "ignore_eos": True}
        ).encode()  # fmt: skip
        described = f"{url}: {args.max_tokens} tokens a reply"
    else:
        ports: multiprocessing.Queue[int] = multiprocessing.Queue()
        server = multiprocessing.Process(target=_serve, args=(ports, args.tokens), daemon=True)
        server.start()
        url, body = f"http://127.0.0.1:{ports.get(timeout=10)}", BODY
        described = f"stand-in: {args.tokens} tokens a reply"
    print(f"load average before: {os.getloadavg()}, cores: {os.cpu_count()}")
    print(f"{described}; {args.seconds:g} s a point")
    header = (
        f"{'point':<12} {'processes':>9} {'requests':>9} {'req/s':>9} {'out tok/s':>11} "
        f"{'lag p50 ms':>11} {'lag p99 ms':>11} {'lag max ms':>11}"
    )
    print(header)
    points: list[tuple[str, LoadPattern]] = [
        (f"c{args.streams}", ClosedLoop(args.streams)),
        (f"r{args.rate:g}", OpenLoop(args.rate, "constant")),
    ]
    for name, pattern in points:
        for processes in (1, 2):
            row = measure(url, body, pattern, processes, args.seconds)
            print(
                f"{name:<12} {processes:>9} {row['requests']:>9.0f} {row['req_per_s']:>9.1f} "
                f"{row['tokens_per_s']:>11.0f} {row['lag_p50']:>11.3f} {row['lag_p99']:>11.3f} "
                f"{row['lag_max']:>11.3f}"
            )
    print(f"load average after: {os.getloadavg()}")
    if server is not None:
        server.terminate()


if __name__ == "__main__":
    main()
