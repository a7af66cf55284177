"""Seconds and peak memory of `gpubench report` on a generated ledger of 1,000,000 call records,
before (a dict per record: ledger.read_ledger + report.render_markdown) and after (the columnar
reader: ledger_frame.read_ledger_frame + report.render_document), each in a fresh process: after
on the ledger alone (it writes <ledger>.columns), then again with that cache.

    python benchmarks_dev/report_1m.py [--records 1000000] [--cells 40] [--skip-before] [--html]
        [--realistic [--unpacked] [--whole-keys]]

--realistic writes the ledger from realistic_ledger.py (the plugin's own record builder, the
shipped prompts of mixed length, telemetry fields filled; a pool of 3,000 distinct records
repeated with their run_idx renumbered), its gaps packed as the plugin writes them now, or with
--unpacked as a list of ms, as it wrote them before issue 24; after the cells' records, its
call records without their cell's keys, as the plugin writes them now, or with --whole-keys with
them, as it wrote them before issue 24.

The ledger is written once (about 1.3 GB) to --ledger (default: a temporary file). Each variant
runs in its own Python process so that its peak resident memory (ru_maxrss) is its own.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from aggregate_1m import PROMPT_IDS, call_record
from realistic_ledger import cell_lines, cells_and_cases, records

from pytest_gpubench.reports.frame import cache_path

BEFORE = """
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.reports.markdown import render_markdown
text = render_markdown(read_ledger(PATH))
"""
AFTER = """
from pytest_gpubench.reports.frame import read_ledger_frame
from pytest_gpubench.reports.markdown import render_document
data = read_ledger_frame(PATH)
text = render_document(data.others, data.summaries(with_samples=False))
"""
HTML = """
from pytest_gpubench.reports.html import render_html
from pytest_gpubench.reports.frame import read_ledger_frame
text = render_html(read_ledger_frame(PATH))
"""
# Runs VARIANT on PATH and prints its wall seconds, CPU seconds (imports and the processes that
# read byte ranges included: on a shared machine the wall time also counts the waits for a core),
# its peak RSS and the largest peak RSS of those processes (KiB on Linux) as JSON.
RUNNER = """
import json, resource, sys, time
PATH = sys.argv[1]
started = time.perf_counter()
exec(sys.argv[2])
seconds = time.perf_counter() - started
usage = resource.getrusage(resource.RUSAGE_SELF)
children = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = usage.ru_utime + usage.ru_stime + children.ru_utime + children.ru_stime
print(json.dumps({"seconds": seconds, "cpu": cpu, "peak_kib": usage.ru_maxrss,
                  "child_peak_kib": children.ru_maxrss, "chars": len(text)}))
"""


def write_ledger(path: Path, count: int, cells: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    groups = [(cell, prompt_id) for cell in range(cells) for prompt_id in PROMPT_IDS]
    with path.open("w", encoding="utf-8") as ledger:
        ledger.write(json.dumps({"type": "meta", "benchmark_run_id": "generated"}) + "\n")
        for number in range(count):
            record = call_record(rng, *groups[number % len(groups)], number // len(groups))
            # The fields a call record has today beyond aggregate_1m's (about 1.3 KB a line).
            failed = record["error"] is not None
            record.update(
                case_id=f"{record['cell_id']}-{record['prompt_id']}-{record['phase']}-"
                f"{record['run_idx']}",
                coalesced=None if failed else False,
                content_reads=None if failed else 64,
                e2e_tokens_per_sec=None if failed else 64 / record["total_duration_ms"] * 1000,
                engine_tokens_per_sec=None if failed else 533.3,
                engine_prompt_ms=None if failed else 1.5,
                engine_total_ms=None if failed else 121.5,
                worker=None,
                inter_chunk_ms=[] if failed else [round(rng.random() * 3, 3) for _ in range(40)],
            )
            ledger.write(json.dumps(record, separators=(",", ":")) + "\n")
        ledger.write(json.dumps({"type": "end", "verdicts": [], "cells": []}) + "\n")


def write_realistic_ledger(
    path: Path, count: int, cells: int, *, packed: bool, compact: bool
) -> None:
    cases = len(cells_and_cases(cells))
    pool = list(records(min(count, 25 * cases), cells, packed=packed, compact=compact))
    run_idx = re.compile(r'"run_idx":\d+')
    with path.open("w", encoding="utf-8") as ledger:
        ledger.write(json.dumps({"type": "meta", "benchmark_run_id": "generated"}) + "\n")
        ledger.writelines(line + "\n" for line in cell_lines(cells))
        for number in range(count):
            line = pool[number % len(pool)]
            ledger.write(run_idx.sub(f'"run_idx":{number // cases}', line, count=1) + "\n")
        ledger.write(json.dumps({"type": "end", "verdicts": [], "cells": []}) + "\n")


def measure(path: Path, variant: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(path), variant],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--cells", type=int, default=40)
    parser.add_argument("--ledger", type=Path, help="reuse or write the ledger here")
    parser.add_argument("--skip-before", action="store_true", help="only the columnar reader")
    parser.add_argument("--html", action="store_true", help="also time `gpubench report --html`")
    parser.add_argument("--realistic", action="store_true", help="realistic_ledger.py's records")
    parser.add_argument("--unpacked", action="store_true", help="their gaps as a list of ms")
    parser.add_argument(
        "--whole-keys", action="store_true", help="their cell's keys in every call record"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        path = args.ledger or Path(directory) / "run.jsonl"
        if not path.exists():
            started = time.perf_counter()
            if args.realistic:
                write_realistic_ledger(
                    path,
                    args.records,
                    args.cells,
                    packed=not args.unpacked,
                    compact=not args.whole_keys,
                )
            else:
                write_ledger(path, args.records, args.cells)
            print(
                f"wrote {args.records:,} call records ({path.stat().st_size / 1e9:.2f} GB) "
                f"in {time.perf_counter() - started:.0f} s"
            )
        cache_path(path).unlink(missing_ok=True)
        variants = [("after", AFTER), ("after, cached", AFTER)]
        if not args.skip_before:
            variants.insert(0, ("before", BEFORE))
        if args.html:
            variants.append(("--html, cached", HTML))
        for name, variant in variants:
            result = measure(path, variant)
            print(
                f"{name:>14}: {result['seconds']:6.2f} s ({result['cpu']:6.2f} s CPU), peak RSS "
                f"{result['peak_kib'] / 2**20:5.2f} GiB, of each reading process "
                f"{result['child_peak_kib'] / 2**20:5.2f} GiB ({result['chars']:,} characters)"
            )


if __name__ == "__main__":
    main()
