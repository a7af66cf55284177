"""Head-to-head A/B sessions on a noisy machine: how often a +30 % TTFT candidate is caught, how
often an unchanged one is a false alarm, and what sequential sampling saves.

Each session is one pytest run (a subprocess, in a temporary project) with two managed cells on
this machine, llama-servers on the same binary and model (the tiny one, one thread each) that the
harness starts for the session: the reference, and the candidate, reached directly ("unchanged")
or through the delaying proxy of tests/support/delay_proxy.py (its cell's `port:` is the proxy's)
holding each reply's first content back by 30 % of that call's own time to first content as the
proxy saw it ("+30 %"; each session's line prints the TTFT change the plugin measured). The prompt
is about 800 tokens of never-cached prefill (TTFT of tens of ms), 4 output tokens. While the
sessions run, busy processes load the machine:

    b  one busy process, on for 3 s and off for 3 s
    d  two busy processes, on for 20 s and off for 20 s together (whole sessions in one state)

Each session measures `--runs` pairs (a fixed N) and is judged by the plugin; its end record gives
the fixed-N verdict. The same pairs, in the order they were measured, are then judged by the
sequential rule (min_runs, at most runs: results/paired.py), which at each look sees only the pairs
before it, exactly as the harness does when a cell sets min_runs: that gives the calls a verdict
would have cost with sequential sampling on the same sessions. `--live-sequential` runs the
sessions with min_runs set instead, so that the harness itself stops them.

`--pin 1` runs both servers on CPU 1 (taskset), so that a busy process that shares a core with
one of them shares it with both.

    python benchmarks_dev/ab_runs.py [--scenarios b,d] [--repeat 20] [--runs 20] [--min-runs 6]
        [--pin CPUS] [--slower 0.30] [--kinds slower,unchanged] [--keep DIR] [--replay DIR]
        [--live-sequential]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.config.synthetic import WORDS
from pytest_gpubench.core.status import EXIT_REGRESSION, EXIT_UNSTEADY
from pytest_gpubench.engines.llamacpp_build import find_llama_server
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.results.judging_settings import JudgingSettings
from pytest_gpubench.results.paired import collect_pairs, judge_candidate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.delay_proxy import DelayProxy, delay_proxy

MAIN = "local:llamacpp:tiny@main"
PR = "local:llamacpp:tiny@pr"
PROMPT_ID = "P-PREFILL"
PROMPT_TEXT = " ".join(random.Random(22).choice(WORDS) for _ in range(800))
# The A/B thresholds of docs/ab-runs.md: drift cancels between the two sides of a pair, so TTFT and
# total are judged at 15 %; the decode rate of 4 tokens is too short to judge finer than 30 %.
THRESHOLDS = "{ttft_p50: 0.15, total_p50: 0.15, tokens_per_sec: 0.30}"
SLOWER = 0.30
# Busy processes per scenario: (how many, seconds on, seconds off).
SCENARIOS = {"a": (0, 0.0, 0.0), "b": (1, 3.0, 3.0), "c": (1, 1.0, 0.0), "d": (2, 20.0, 20.0)}


@dataclass(frozen=True)
class Session:
    """One pytest session: its exit status and what it cost; the fixed-N and sequential
    verdicts of the candidate (its worst metric), with the calls each took."""

    exit_status: int
    fixed: str
    fixed_calls: int
    ttft_change: float | None
    sequential: str
    sequential_calls: int
    wall_s: float

    def line(self) -> str:
        change = "-" if self.ttft_change is None else f"{self.ttft_change - 1.0:+.1%}"
        return (
            f"exit {self.exit_status}, TTFT {change}: fixed N {self.fixed} "
            f"({self.fixed_calls} calls), sequential {self.sequential} "
            f"({self.sequential_calls} calls), {self.wall_s:.1f} s"
        )


def cells_yaml(
    binary: str, runs: int, min_runs: int | None, proxy: DelayProxy | None, pin: str | None = None
) -> str:
    """Two managed llama-servers: the reference on a port of its own, the candidate on the port
    behind the proxy (its cell's `port:` is the proxy's, so the harness reaches it, health checks
    and all, through the proxy), or on its own port, direct. With `pin` (a CPU list) both run
    under `taskset -c pin`: on the same cores, whatever else runs there hits both alike."""
    sequential = f", min_runs: {min_runs}" if min_runs is not None else ""

    def launch(port: str) -> str:
        pinned = f"taskset, -c, '{pin}', " if pin is not None else ""
        return (
            f"[{pinned}{binary}, --model, '{{model_path}}', --alias, '{{model}}', --host, "
            f"'{{host}}', --port, '{port}', --parallel, '1', --no-webui, --threads, '1']"
        )

    reference = f"launch: {launch('{port}')}"
    if proxy is None:
        candidate = reference
    else:
        candidate = f"port: {proxy.port}, launch: {launch(str(proxy.upstream[1]))}"
    return (
        f"settings: {{runs: {runs}, telemetry: {{cpu: off}}}}\n"
        "nodes: {local: {kind: local}}\ncells:\n"
        "  - {node: local, engine: llamacpp, model: tiny, name: main, phases: [warm],"
        f" {reference}}}\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, name: pr, phases: [warm], {candidate},"
        f" reference: '{MAIN}', thresholds: {THRESHOLDS}{sequential}}}\n"
    )


def write_project(
    root: Path,
    binary: str,
    runs: int,
    min_runs: int | None,
    proxy: DelayProxy | None,
    pin: str | None = None,
) -> None:
    (root / "cells.yaml").write_text(cells_yaml(binary, runs, min_runs, proxy, pin))
    (root / "prompts.yaml").write_text(
        f"prompts:\n  {PROMPT_ID}: {{intent: long prefill, prompt: '{PROMPT_TEXT}',"
        " max_tokens: 4, request: {extra_body: {cache_prompt: false}}}\n"
    )
    (root / "test_bench.py").write_text(
        "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
    )


def worst(verdicts: Sequence[Mapping[str, Any]]) -> str:
    kinds = {verdict["verdict"] for verdict in verdicts}
    return next((k for k in ("regression", "inconclusive", "win", "ok") if k in kinds), "none")


def run_session(root: Path, replay_root: Path, keep: Path | None) -> Session:
    ledgers = set((root / "runs").glob("*.jsonl"))
    started = time.monotonic()
    finished = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--force-load", "-p", "no:cacheprovider"],
        cwd=root, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    wall_s = time.monotonic() - started
    (ledger,) = set((root / "runs").glob("*.jsonl")) - ledgers
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(ledger, keep / ledger.name)
    return judged(read_ledger(ledger), replay_root, finished.returncode, wall_s)


def judged(records: list[dict[str, Any]], replay_root: Path, status: int, wall_s: float) -> Session:
    """A session's fixed-N verdict (its end record) and the sequential one on its pairs."""
    end = records[-1]
    if end.get("type") != "end" or status not in (0, EXIT_REGRESSION, EXIT_UNSTEADY):
        raise SystemExit(f"pytest failed (exit {status}): see {records[0].get('rootdir')}")
    ab = [v for v in end.get("verdicts") or [] if v.get("reference") == MAIN]
    ttft: dict[str, Any] = next((v for v in ab if v["metric"] == "warm_ttft_p50_ms"), {})
    # The sequential rule on the same pairs, in the order measured (replay_root's cells.yaml is
    # this one with min_runs set).
    matrix = read_matrix(replay_root / "cells.yaml", replay_root / "prompts.yaml")
    candidate = JudgingSettings.of_cells(matrix.cells).cells[PR]
    calls = [r for r in records if r.get("type") == "call"]
    pairs = collect_pairs(calls, {PR: MAIN})[(PR, PROMPT_ID)]
    replayed = judge_candidate(PR, candidate, PROMPT_ID, pairs)
    return Session(
        exit_status=status,
        fixed=worst(ab),
        fixed_calls=max((int(v.get("calls") or 0) for v in ab), default=0),
        ttft_change=ttft.get("change_ratio"),
        sequential=worst([v.to_record() for v in replayed]),
        sequential_calls=max((v.calls or 0 for v in replayed), default=0),
        wall_s=wall_s,
    )


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port: int = listener.getsockname()[1]
        return port


@contextlib.contextmanager
def busy(scenario: str) -> Iterator[None]:
    """The scenario's busy processes, each in its own session (the kernel shares CPU time between
    sessions first), switching on and off together on the wall clock."""
    count, on_s, off_s = SCENARIOS[scenario]
    program = (
        "import time\n"
        f"on, off = {on_s}, {off_s}\n"
        "while True:\n"
        "    if off <= 0 or time.time() % (on + off) < on:\n"
        "        end = time.time() + 0.05\n"
        "        while time.time() < end: pass\n"
        "    else:\n"
        "        time.sleep(0.05)\n"
    )
    hogs = [
        subprocess.Popen([sys.executable, "-c", program], start_new_session=True)
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def tally(label: str, sessions: list[Session], *, slower: bool) -> str:
    fixed = sum(s.fixed == "regression" for s in sessions)
    sequential = sum(s.sequential == "regression" for s in sessions)
    word = "caught" if slower else "false alarms"
    return (
        f"{label}: {len(sessions)} sessions; fixed N: {word} {fixed}/{len(sessions)}, "
        f"{statistics.mean(s.fixed_calls for s in sessions):.1f} calls per verdict; "
        f"sequential: {word} {sequential}/{len(sessions)}, "
        f"{statistics.mean(s.sequential_calls for s in sessions):.1f} calls per verdict; "
        f"exit 6 in {sum(s.exit_status == EXIT_REGRESSION for s in sessions)}; "
        f"{statistics.mean(s.wall_s for s in sessions):.1f} s per session"
    )


def replay_kept(args: argparse.Namespace) -> None:
    """The tallies again from kept ledgers (the sequential rule as it is now)."""
    binary = str(find_llama_server(None))
    lines = []
    with tempfile.TemporaryDirectory(prefix="gpubench-ab-replay-") as temp:
        root = Path(temp)
        write_project(root, binary, args.runs, args.min_runs, None)
        for folder in sorted(path for path in args.replay.iterdir() if path.is_dir()):
            scenario, _, kind = folder.name.partition("-")
            sessions = []
            for ledger in sorted(folder.glob("*.jsonl"), key=lambda path: path.stat().st_mtime):
                records = read_ledger(ledger)
                sessions.append(judged(records, root, int(records[-1]["exit_status"]), 0.0))
            label = f"({scenario}) {'+30 %' if kind == 'slower' else 'unchanged'}"
            lines.append(tally(label, sessions, slower=kind == "slower"))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="b,d", help="of a,b,c,d (default b,d)")
    parser.add_argument("--repeat", type=int, default=20, help="sessions per setting")
    parser.add_argument("--runs", type=int, default=20, help="pairs per session (the fixed N)")
    parser.add_argument("--min-runs", type=int, default=6, help="the sequential minimum")
    parser.add_argument(
        "--live-sequential", action="store_true", help="sessions with min_runs set (live stops)"
    )
    parser.add_argument(
        "--slower",
        type=float,
        default=SLOWER,
        help="the share of each call's own time to first content the proxy holds back (0.30)",
    )
    parser.add_argument("--kinds", default="slower,unchanged", help="of slower,unchanged")
    parser.add_argument(
        "--pin", metavar="CPUS", help="run both servers under taskset -c CPUS (e.g. 1)"
    )
    parser.add_argument("--keep", type=Path, help="copy each session's ledger under this folder")
    parser.add_argument(
        "--replay", type=Path, help="judge the ledgers kept under this folder again, run nothing"
    )
    args = parser.parse_args()
    # A kill ends the script through its `finally`s: the busy processes and servers stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.replay is not None:
        replay_kept(args)
        return
    binary = find_llama_server(None)
    if binary is None:
        raise SystemExit("llama-server is not installed: run `make engine`")
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpubench-ab-") as temp:
        root = Path(temp)
        with delay_proxy(f"http://127.0.0.1:{free_port()}") as proxy:
            proxy.delay_fraction = args.slower
            for scenario in args.scenarios.split(","):
                for slower in [kind == "slower" for kind in args.kinds.split(",")]:
                    label = f"({scenario}) {'+30 %' if slower else 'unchanged'}"
                    behind = proxy if slower else None
                    project, replay = root / "project", root / "replay"
                    for folder in (project, replay):
                        folder.mkdir(exist_ok=True)
                    live = args.min_runs if args.live_sequential else None
                    write_project(project, str(binary), args.runs, live, behind, args.pin)
                    write_project(replay, str(binary), args.runs, args.min_runs, behind, args.pin)
                    print(f"\n{label}: {args.repeat} sessions", flush=True)
                    sessions = []
                    keep = (
                        args.keep / f"{scenario}-{'slower' if slower else 'unchanged'}"
                        if args.keep
                        else None
                    )
                    with busy(scenario):
                        for index in range(args.repeat):
                            session = run_session(project, replay, keep)
                            print(f"  {index + 1:2d}  {session.line()}", flush=True)
                            sessions.append(session)
                    lines.append(tally(label, sessions, slower=slower))
                    print(lines[-1], flush=True)
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
