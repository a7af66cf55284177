"""An engine waiting for its own threads: the real llama-server's wait for a CPU per ms it ran
(`engine_wait_per_cpu`, measure/engine_wait.py) with as many compute threads as the CPUs it may
use, and with more. The kernel's run-queue delay does not say whose thread held the CPU, so an
engine with more threads than CPUs reads as a busy machine (docs/gate-noise.md, "The engine's
own waiting"). Run it on a quiet machine: the load average is printed beside the figures.

Each launch is one pytest session of `--calls` warm calls on the tiny model (a ~1,800-token
never-cached prefill, 4 tokens out), the harness's managed engine as a user's would be; the
table gives how busy the engine kept its CPUs (`engine_cpus_filled`) and whether the session
warned of the engine's own threads (`OWN THREADS:`, results/engine_checks.py).

    python benchmarks_dev/engine_own_threads.py [--calls 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pytest_gpubench.engines.llamacpp_build import find_llama_server
from pytest_gpubench.engines.tinymodel import ensure_tiny_model
from pytest_gpubench.ledger.writer import read_ledger

PROMPT = " ".join(f"word{index % 97} and more" for index in range(350))


def launches() -> list[tuple[str, list[str], int]]:
    """(what, the taskset prefix, --threads): one thread and two, pinned to one CPU and not."""
    cpus = sorted(os.sched_getaffinity(0))
    last, every = str(cpus[-1]), ",".join(str(cpu) for cpu in cpus)
    many = len(cpus)
    return [
        ("--threads 1, unpinned", [], 1),
        (f"--threads 1 under taskset -c {last}", ["taskset", "-c", last], 1),
        (f"--threads 2 under taskset -c {last}", ["taskset", "-c", last], 2),
        (f"--threads {many} under taskset -c {every}", ["taskset", "-c", every], many),
    ]


def measure(
    root: Path, binary: Path, model: Path, pin: list[str], threads: int, calls: int
) -> tuple[list[dict[str, Any]], bool]:
    """The session's warm call records, and whether it warned of the engine's own threads."""
    root.mkdir(parents=True)
    launch = [*pin, str(binary), "--model", "{model_path}", "--alias", "{model}",
              "--port", "{port}", "--threads", str(threads), "--parallel", "1"]  # fmt: skip
    (root / "cells.yaml").write_text(
        "nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, model_path: '{model}', "
        f"phases: [warm], runs: {calls}, request: {{extra_body: {{cache_prompt: false}}}}, "
        f"launch: {json.dumps(launch)}}}\n"
    )
    (root / "prompts.yaml").write_text(
        f'prompts:\n  P-LONG: {{intent: long, prompt: "{PROMPT}", max_tokens: 4}}\n'
    )
    (root / "test_bench.py").write_text(
        "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
    )
    finished = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=root, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    records = [r for ledger in (root / "runs").glob("*.jsonl") for r in read_ledger(ledger)]
    warm = [r for r in records if r.get("type") == "call" and r.get("phase") == "warm"]
    return warm, "OWN THREADS:" in finished.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    binary = find_llama_server(None)
    if binary is None:
        raise SystemExit("llama-server is not installed: run `make engine`")
    model = ensure_tiny_model()
    print(f"machine: {os.cpu_count()} cores; load {os.getloadavg()}", flush=True)
    print("| launch | wait per CPU ms p50 (min-max) | CPUs filled p50 | TTFT p50 ms | warned |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="gpubench-own-threads-") as temp:
        for index, (what, pin, threads) in enumerate(launches()):
            calls, warned = measure(
                Path(temp) / str(index), binary, model, pin, threads, args.calls
            )
            waits = [c["engine_wait_per_cpu"] for c in calls if c.get("engine_wait_per_cpu")]
            filled = [c["engine_cpus_filled"] for c in calls if c.get("engine_cpus_filled")]
            ttft = [c["first_delta_ms"] for c in calls if c.get("first_delta_ms")]
            if not waits or not filled or not ttft:
                print(f"| {what} | not measured ({len(calls)} calls) | - | - | - |", flush=True)
                continue
            print(
                f"| {what} | {statistics.median(waits):.3f} ({min(waits):.2f}-{max(waits):.2f}) "
                f"| {statistics.median(filled):.2f} | {statistics.median(ttft):.1f} "
                f"| {'OWN THREADS' if warned else '-'} |",
                flush=True,
            )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
