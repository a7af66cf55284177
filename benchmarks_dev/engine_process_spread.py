"""How much a freshly started llama-server's speed differs from one process to the next, pinned to
one CPU or where the kernel puts it: the between-process spread that a baseline measured in one
engine process cannot know (issue 43: the endpoint row's false alarms were a fresh server 40-63 %
slower than the baseline's, by its own timings).

Each round starts llama-server (the tiny model, one thread) afresh, unpinned or under `taskset -c
CPU`, sends --calls prompts of ~1,800 never-cached tokens (4 out), and prints the process's median
prompt time (llama-server's own `timings.prompt_ms`, after 3 calls of warm-up) and its spread;
then, per placement, the medians' min / median / max and how many processes ran 25 % or more
slower than the fastest. Prints the load average beside the figures.

    python benchmarks_dev/engine_process_spread.py [--processes 8] [--calls 16] [--cpu 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import time
import urllib.request

from pytest_gpubench.engines.llamacpp_build import find_llama_server
from pytest_gpubench.engines.tinymodel import ensure_tiny_model

PROMPT = " ".join(f"word{index % 97} and more" for index in range(350))
WARM_UP = 3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def one_process(argv: list[str], calls: int) -> list[float]:
    """The prompt times (ms) of `calls` calls on a fresh server, after the warm-up."""
    port = free_port()
    server = subprocess.Popen(
        [*argv, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("llama-server did not start") from None
                time.sleep(0.2)
        times: list[float] = []
        for index in range(WARM_UP + calls):
            body = json.dumps(
                {"prompt": f"{PROMPT} {index}", "n_predict": 4, "cache_prompt": False}
            ).encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=60) as reply:
                times.append(float(json.load(reply)["timings"]["prompt_ms"]))
        return times[WARM_UP:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--cpu", default=str(max(os.sched_getaffinity(0))))
    args = parser.parse_args()
    binary = find_llama_server(None)
    if binary is None:
        raise SystemExit("llama-server is not installed: run `make engine`")
    server = [str(binary), "--model", str(ensure_tiny_model()), "--threads", "1", "--parallel", "1"]
    placements = {
        "unpinned": server,
        f"pinned to CPU {args.cpu}": ["taskset", "-c", args.cpu, *server],
    }
    medians: dict[str, list[float]] = {name: [] for name in placements}
    print(f"machine: {os.cpu_count()} cores; load {os.getloadavg()}", flush=True)
    # Alternated, so that a drift of the machine falls on both placements alike.
    for index in range(args.processes):
        for name, argv in placements.items():
            times = one_process(argv, args.calls)
            medians[name].append(statistics.median(times))
            print(
                f"process {index + 1} {name}: prompt ms median {statistics.median(times):.1f} "
                f"min {min(times):.1f} max {max(times):.1f}  load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    for name, values in medians.items():
        fastest = min(values)
        slow = sum(value >= 1.25 * fastest for value in values)
        print(
            f"{name}: process medians min {fastest:.1f} median {statistics.median(values):.1f} "
            f"max {max(values):.1f} ms; {slow} of {len(values)} processes 25 % or more slower "
            "than the fastest"
        )
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
