"""Seconds a report spends on the checks against the engine (issue 35) of a generated ledger of
warm calls that all carry them (token_mismatch, prefix_cache_hit, three engine counters): the
ledger read into columns (reports/frame.py, no cache), the summaries, and the checks counted on
those columns (results/engine_checks.engine_checks_frame), each variant in a fresh process.

    python benchmarks_dev/engine_checks_report.py [--records 200000] [--repeat 2]

Run it from two checkouts (PYTHONPATH) to compare a change; the wall time of a shared machine
counts its waits for a core, so give the load average with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

RUNNER = """
import json, sys, time
from pytest_gpubench.reports.frame import read_ledger_frame
started = time.perf_counter()
data = read_ledger_frame(sys.argv[1])
read = time.perf_counter() - started
started = time.perf_counter()
data.summaries(with_samples=False)
summaries = time.perf_counter() - started
started = time.perf_counter()
checks = data.engine_checks() if hasattr(data, "engine_checks") else []
counted = time.perf_counter() - started
print(json.dumps({"read": read, "summaries": summaries, "checks": counted,
                  "groups": len(checks), "columns": len(data.calls.columns)}))
"""


def write_ledger(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as ledger:
        ledger.write(json.dumps({"type": "meta", "benchmark_run_id": "generated"}) + "\n")
        for number in range(count):
            record = {
                "type": "call",
                "cell_id": f"local:llamacpp:m{number % 40}",
                "prompt_id": f"P-{number % 3}",
                "prompt_sha256": "sha",
                "phase": "warm",
                "run_idx": number // 120,
                "first_delta_ms": rng.random() * 5,
                "total_duration_ms": 20 + rng.random(),
                "tokens_per_sec": 300.0,
                "finish_reason": "length",
                "error": None,
                "coalesced": False,
                "client_chunks": 8,
                "completion_tokens": 8,
                "token_mismatch": rng.random() < 0.01,
                "prefix_cache_hit": True,
                "engine_counters": {
                    "prefix_cache_hits": 37.0,
                    "prefix_cache_queries": 38.0,
                    "requests_waiting_peak": 0.0,
                },
                "inter_chunk_ms": [0.5] * 30,
            }
            ledger.write(json.dumps(record, separators=(",", ":")) + "\n")
        ledger.write(json.dumps({"type": "end", "verdicts": [], "cells": []}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ledger.jsonl"
        write_ledger(path, args.records)
        print(f"{args.records} warm calls, {path.stat().st_size / 1e6:.0f} MB")
        for _ in range(args.repeat):
            Path(str(path) + ".columns").unlink(missing_ok=True)
            done = subprocess.run(
                [sys.executable, "-c", RUNNER, str(path)],
                check=True,
                capture_output=True,
                text=True,
                cwd=folder,  # `-c` puts the current directory first: not a checkout's
            )
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"read {figures['read']:.2f} s, summaries {figures['summaries']:.2f} s, "
                f"checks {figures['checks']:.2f} s ({figures['groups']} (cell, prompt)), "
                f"{figures['columns']} columns; load average {os.getloadavg()[0]:.2f}"
            )


if __name__ == "__main__":
    main()
