"""How long stats.summarize takes on a generated ledger of 1,000,000 call records.

Records carry every field a real call record has (inter-chunk gaps and engine timings included),
about 2 % are failures, and they are spread over cells x prompts with 1 cold call per 20 warm ones.
Prints the time to build the records in memory (not measured), to parse them from JSONL with the
ledger reader, and to aggregate them, best of --repeat.

    python benchmarks_dev/aggregate_1m.py [--records 1000000] [--cells 40] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.results.stats import summarize

PROMPT_IDS = ("P-EASY", "P-MEDIUM", "P-HARD")


def call_record(rng: random.Random, cell: int, prompt_id: str, index: int) -> dict[str, Any]:
    phase = "cold" if index % 21 == 0 else "warm"
    failed = rng.random() < 0.02
    ttft = None if failed else rng.lognormvariate(3.0, 0.3)
    total = None if failed else (ttft or 0.0) + rng.lognormvariate(5.0, 0.2)
    tokens = None if failed else 64
    return {
        "type": "call",
        "benchmark_run_id": "00000000-0000-4000-8000-000000000000",
        "cell_id": f"node{cell}:llamacpp:tiny",
        "node": f"node{cell}",
        "engine": "llamacpp",
        "model": "tiny",
        "prompt_id": prompt_id,
        "prompt_sha256": "ab" * 32,
        "phase": phase,
        "run_idx": index,
        "cold_kind": "restart" if phase == "cold" else None,
        "started_at_utc": "2025-01-01T00:00:00.000Z",
        "first_delta_ms": ttft,
        "total_duration_ms": total,
        "prompt_tokens": None if failed else 12,
        "completion_tokens": tokens,
        "client_chunks": 0 if failed else 64,
        "tokens_per_sec": None if failed else 64 / (((total or 0) - (ttft or 0)) / 1000),
        "tpot_ms": None if failed else ((total or 0) - (ttft or 0)) / 63,
        "inter_chunk_ms": [] if failed else [round(rng.random() * 3, 3) for _ in range(8)],
        "finish_reason": "error" if failed else "length",
        "backend": "llamacpp",
        "error": "connection reset" if failed else None,
        "engine_timings": {} if failed else {"prompt_ms": 1.5, "predicted_ms": 120.0, "cache_n": 0},
    }


def generate(count: int, cells: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    groups = [(cell, prompt_id) for cell in range(cells) for prompt_id in PROMPT_IDS]
    return [
        call_record(rng, *groups[number % len(groups)], number // len(groups))
        for number in range(count)
    ]


def best_of(repeat: int, action: Any) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        result = action()
        best = min(best, time.perf_counter() - started)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--cells", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-parse", action="store_true", help="time the aggregation only")
    args = parser.parse_args()

    started = time.perf_counter()
    records = generate(args.records, args.cells)
    print(f"generated {len(records):,} call records in {time.perf_counter() - started:.2f} s")

    seconds, summaries = best_of(args.repeat, lambda: summarize(records))
    print(f"summarize: {seconds:.2f} s for {len(summaries)} (cell, prompt) summaries")

    if not args.skip_parse:
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "run.jsonl"
            with path.open("w", encoding="utf-8") as ledger:
                for record in records:
                    ledger.write(json.dumps(record, separators=(",", ":")) + "\n")
            del records
            seconds, parsed = best_of(1, lambda: read_ledger(path))
            print(f"read_ledger: {seconds:.2f} s for {path.stat().st_size / 1e6:.0f} MB")
            seconds, _ = best_of(1, lambda: summarize(parsed))
            print(f"summarize after parsing: {seconds:.2f} s")


if __name__ == "__main__":
    main()
