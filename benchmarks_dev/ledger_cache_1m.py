"""Writes the ledgers for the columnar cache's figures, from realistic_ledger.py's records (the
shape report_1m.py --realistic writes), into DIRECTORY:

    run.jsonl             1,000,000 call records and no cache (as main wrote it, or a copy)
    session.jsonl         the same lines, each written and handed to the ledger's observer as a
                          session writes them (ledger.writer.Ledger: one os.write a line, then
                          reports/frame_cache.ColumnCacheWriter), so session.jsonl.columns is
                          the cache a run of that length leaves
    shard-0.jsonl, shard-1.jsonl   the two halves as the ledgers of a two-task job array
                          (their meta names the shard), for `gpubench merge`

and prints the seconds spent writing each, the observer's share among them. The reports
themselves are timed outside, with /usr/bin/time -v, each in a process of its own:

    python benchmarks_dev/ledger_cache_1m.py DIRECTORY [--records 1000000] [--cells 40]
    /usr/bin/time -v gpubench report DIRECTORY/run.jsonl -o /dev/null        # no cache
    /usr/bin/time -v gpubench report DIRECTORY/session.jsonl -o /dev/null    # the run's cache
    /usr/bin/time -v gpubench merge DIRECTORY/shard-*.jsonl -o DIRECTORY/merged.jsonl
    /usr/bin/time -v gpubench report DIRECTORY/merged.jsonl -o /dev/null     # merge's cache
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from realistic_ledger import RUN_ID, cell_lines, cells_and_cases, records

from pytest_gpubench.reports.frame_cache import ColumnCacheWriter

RUN_IDX = re.compile(r'"run_idx":\d+')
GIT_SHA = "0123456789abcdef0123456789abcdef01234567"


def meta(run_id: str, **more: object) -> str:
    return json.dumps({"type": "meta", "benchmark_run_id": run_id, "git_sha": GIT_SHA, **more})


def end(run_id: str, **more: object) -> str:
    return json.dumps({"type": "end", "benchmark_run_id": run_id, "verdicts": [], **more})


def call_lines(count: int, cells: int, first: int = 0) -> list[str]:
    """`count` call record lines from a pool of distinct records, run_idx renumbered."""
    cases = len(cells_and_cases(cells))
    pool = list(records(min(count, 25 * cases), cells))
    return [
        RUN_IDX.sub(f'"run_idx":{number // cases}', pool[number % len(pool)], count=1)
        for number in range(first, first + count)
    ]


def write_plain(path: Path, lines: list[str]) -> float:
    started = time.perf_counter()
    with path.open("w", encoding="utf-8") as ledger:
        ledger.writelines(line + "\n" for line in lines)
    return time.perf_counter() - started


def write_as_a_session(path: Path, lines: list[str]) -> tuple[float, float]:
    """Each line one os.write of the whole line, then the observer (ledger.writer.Ledger's
    order); returns the seconds in all and those the observer took."""
    observer = ColumnCacheWriter(path)
    observed = 0.0
    started = time.perf_counter()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        for line in lines:
            data = (line + "\n").encode("utf-8")
            os.write(descriptor, data)
            before = time.perf_counter()
            observer.written(data)
            observed += time.perf_counter() - before
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    before = time.perf_counter()
    observer.closed()
    observed += time.perf_counter() - before
    return time.perf_counter() - started, observed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--cells", type=int, default=40)
    args = parser.parse_args()
    args.directory.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    calls = call_lines(args.records, args.cells)
    cells = cell_lines(args.cells)
    print(f"built {len(calls):,} call record lines in {time.perf_counter() - started:.0f} s")
    whole = [meta(RUN_ID), *cells, *calls, end(RUN_ID)]

    seconds = write_plain(args.directory / "run.jsonl", whole)
    size = (args.directory / "run.jsonl").stat().st_size
    print(f"run.jsonl: {size / 1e9:.2f} GB written in {seconds:.1f} s (no cache)")

    seconds, observed = write_as_a_session(args.directory / "session.jsonl", whole)
    cache = args.directory / "session.jsonl.columns"
    print(
        f"session.jsonl: written line by line in {seconds:.1f} s, of which the cache's "
        f"observer {observed:.1f} s; cache {cache.stat().st_size / 1e6:.0f} MB"
    )

    matrix = sorted({json.loads(line)["cell_id"] for line in cells})
    half = len(calls) // 2
    for index, part in enumerate((calls[:half], calls[half:])):
        shard_id = f"shard-{index}-{RUN_ID[9:]}"
        shard = {"index": index, "count": 2, "matrix_cells": matrix}
        lines = [
            meta(shard_id, shard=shard, cells_planned=matrix, started_at_utc="2026-11-25T10:00Z"),
            *cells,
            *part,
            end(shard_id, exit_status=0, cells=[], finished_at_utc="2026-11-25T12:00Z"),
        ]
        seconds = write_plain(args.directory / f"shard-{index}.jsonl", lines)
        print(f"shard-{index}.jsonl: {len(part):,} calls written in {seconds:.1f} s")


if __name__ == "__main__":
    main()
