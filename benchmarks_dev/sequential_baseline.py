"""Sequential sampling against a baseline (issue 22's "Must show"): calls per decided verdict
against a fixed N, at equal detection, on the real llama-server of noise_scenarios.py.

One project, `runs: 20`, its baseline from the shipped `gpubench calibrate` (5 runs). Then, in
alternation, sessions with a fixed N (20 calls) and sessions with `min_runs: 5` (looks after 5,
10 and 15 calls), each with the engine unchanged or behind the proxy holding the first content
back by 30 % of its TTFT. The table gives, per setting, how many sessions were caught (exit 6),
passed, or unsteady, and the warm calls they took (first pass; a regression's re-measure is the
same for both).

    PYTHONPATH=$PWD python benchmarks_dev/sequential_baseline.py [--sessions 10] > out.txt
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from noise_scenarios import CALIBRATE_RUNS, Run, proxied_engine, pytest_run, write_project

from pytest_gpubench.engines.llamacpp_build import find_llama_server

RUNS = 20
MIN_RUNS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=10, help="per setting")
    args = parser.parse_args()
    binary = find_llama_server(None)
    if binary is None:
        raise SystemExit("llama-server is not installed: run `make engine`")
    results: dict[tuple[str, str], list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="gpubench-sequential-") as temp:
        root = Path(temp) / "project"
        with proxied_engine(Path(temp), binary) as (proxy, delay):
            write_project(root, proxy.url, RUNS)
            for _ in range(CALIBRATE_RUNS):
                pytest_run(root, "after", "quiet", "--baseline-update")
            for index in range(args.sessions):
                for mode, min_runs in (("fixed N", None), ("sequential", MIN_RUNS)):
                    write_project(root, proxy.url, RUNS, min_runs)
                    for kind, held in (("unchanged", 0.0), ("+30%", delay)):
                        proxy.delay_ms = held
                        run = pytest_run(root, "after", "quiet")
                        results.setdefault((mode, kind), []).append(run)
                        print(f"session {index + 1} {mode} {kind}: {run.line()} "
                              f"calls {run.calls}", flush=True)  # fmt: skip
    print("\nsetting | engine | caught (exit 6) / passed / unsteady | warm calls per session")
    for (mode, kind), runs in sorted(results.items()):
        caught = sum(r.exit_status == 6 for r in runs)
        unsteady = sum(r.exit_status == 10 for r in runs)
        passed = sum(r.exit_status == 0 for r in runs)
        calls = statistics.mean(r.calls for r in runs)
        print(f"{mode} | {kind} | {caught} / {passed} / {unsteady} of {len(runs)} | {calls:.1f}")


if __name__ == "__main__":
    main()
