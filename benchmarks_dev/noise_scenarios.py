"""False alarms and detections of the gate on a noisy machine, before issue 22 (main at bd2dd57)
and after (this branch), interleaved (issue 22's "Must show").

One llama-server (the tiny model, one thread) behind the delaying proxy of
tests/support/delay_proxy.py answers a ~1,800-token prompt (prompt cache off, so every warm call
prefills it: TTFT well over 50 ms). Scenarios: `quiet`; `flicker` (a busy process switching on and
off every 3 s); `busy` (one busy process, always on); `drift-busy` and `drift-quiet` (two busy
processes on or off for whole runs, as a 20 s on / 20 s off cycle lands them, with the baseline
taken while they were on, or off). Each gate has a project directory per scenario: before's takes
one --baseline-update (all it had); after's runs the shipped `gpubench calibrate` (5 runs, here run
by run to keep each in the scenario's state). Then rounds: in each, per scenario and per gate (the
order of the gates alternating), one unchanged run (exit 6 is a false alarm) and one with the
first content held back by 30 % of the engine's TTFT (caught, unsteady, or missed). Each pytest
run is a subprocess with PYTHONPATH at its gate's code, the shipped settings (10 warm runs).

    git worktree add /tmp/gate-before bd2dd57
    python benchmarks_dev/noise_scenarios.py [--rounds N] [--minutes M] [--branch COPY] > out.txt
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpubench.engines import Request
from pytest_gpubench.engines.llamacpp import LlamaCppEngine
from pytest_gpubench.engines.llamacpp_build import find_llama_server
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.engines.tinymodel import ensure_tiny_model
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.targets.local import LocalTarget

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.delay_proxy import DelayProxy, delay_proxy

CELL = "local:llamacpp:tiny"
PROMPT_ID = "P-LONG"
# About 1,800 tokens of the tiny model's vocabulary (its context is 2,048): its prefill on one
# thread makes TTFT well over 50 ms.
PROMPT = " ".join(f"word{index % 97} and more" for index in range(350))
MAX_TOKENS = 4
FRACTION = 0.30
SCENARIOS = ("quiet", "flicker", "busy", "drift-busy", "drift-quiet")
# "before": main before issue 22's gate (a checkout of bd2dd57); "after": this branch's.
GATES = {"before": "/tmp/gate-before", "after": str(Path(__file__).resolve().parent.parent)}
# The shipped `gpubench calibrate` runs the unchanged matrix this many times.
CALIBRATE_RUNS = 5
TTFT = "warm_ttft_p50_ms"
NO_CACHE = {"cache_prompt": False}


@dataclass(frozen=True)
class Run:
    """One pytest run: its exit status, its TTFT verdict, the machine state it ran in."""

    exit_status: int
    ttft: str
    change: float | None
    remeasure: str | None
    state: str
    # The CPU pressure's p50 over the run's warm calls (after's gate records it), and why a
    # verdict was unsteady.
    pressure: float | None = None
    why: str = ""
    # Warm calls of the first pass (a sequential run stops early).
    calls: int = 0

    def line(self) -> str:
        change = "-" if self.change is None else f"{self.change - 1:+.1%}"
        again = f" ({self.remeasure})" if self.remeasure else ""
        busy = "" if self.pressure is None else f" pressure {self.pressure:.0%}"
        why = f" - {self.why}" if self.why else ""
        return f"exit {self.exit_status} TTFT {change} {self.ttft}{again} [{self.state}{busy}]{why}"


def write_project(root: Path, endpoint: str, runs: int, min_runs: int | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    sequential = f", min_runs: {min_runs}" if min_runs is not None else ""
    (root / "cells.yaml").write_text(
        "nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{endpoint}', "
        f"runs: {runs}{sequential}, phases: [warm], "
        "request: {extra_body: {cache_prompt: false}}}\n"
    )
    (root / "prompts.yaml").write_text(
        f'prompts:\n  {PROMPT_ID}: {{intent: long, prompt: "{PROMPT}", max_tokens: {MAX_TOKENS}}}\n'
    )
    (root / "test_bench.py").write_text(
        "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
    )


def pytest_run(root: Path, gate: str, state: str, *extra: str) -> Run:
    env = {**os.environ, "PYTHONPATH": GATES[gate]}
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "--force-load",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:hypothesispytest",
    ]
    before = set((root / "runs").glob("*.jsonl"))
    finished = subprocess.run(
        [*argv, *extra], cwd=root, env=env, capture_output=True, text=True, timeout=900,
        check=False,
    )  # fmt: skip
    new = set((root / "runs").glob("*.jsonl")) - before
    records = read_ledger(new.pop()) if new else []
    end = records[-1] if records else {}
    pressures = [r["cpu_pressure"] for r in records if r.get("cpu_pressure") is not None]
    verdict: dict[str, Any] = next(
        (v for v in end.get("verdicts") or [] if v.get("metric") == TTFT),
        {"verdict": "none", "change_ratio": None},
    )
    if end.get("type") != "end":
        print(finished.stdout[-2000:], finished.stderr[-2000:], flush=True)
    why = ""
    if verdict["verdict"] == "unsteady":
        message = str(verdict.get("message", ""))
        why = message.split("not judged: ", 1)[-1][:110]
    return Run(
        finished.returncode, verdict["verdict"], verdict.get("change_ratio"),
        verdict.get("remeasure"), state,
        statistics.median(pressures) if pressures else None, why,
        sum(r.get("type") == "call" and r.get("phase") == "warm" and "pass" not in r
            for r in records),
    )  # fmt: skip


class Hogs:
    """Busy processes beside the engine, each in its own session (the kernel shares CPU time
    between sessions first)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, count: int, *, on_s: float | None = None, off_s: float | None = None) -> None:
        self.stop()
        code = (
            "while True: pass"
            if on_s is None
            else "import time\nwhile True:\n"
            f"    end = time.monotonic() + {on_s}\n    while time.monotonic() < end: pass\n"
            f"    time.sleep({off_s})\n"
        )
        self.procs = [
            subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
            for _ in range(count)
        ]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs = []


@contextlib.contextmanager
def machine_state(hogs: Hogs, scenario: str, busy: bool) -> Iterator[str]:
    """The scenario's load around one run; yields its name for the record."""
    if scenario == "flicker":
        hogs.start(1, on_s=3.0, off_s=3.0)
        state = "flicker"
    elif scenario == "busy":
        hogs.start(1)
        state = "busy"
    elif scenario.startswith("drift") and busy:
        hogs.start(2)
        state = "busy"
    else:
        hogs.stop()
        state = "quiet"
    try:
        yield state
    finally:
        hogs.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=40.0, help="stop starting rounds after")
    parser.add_argument("--runs", type=int, default=10, help="warm runs per pytest run")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument(
        "--branch", default=GATES["after"], help="a copy of this branch's code to run (so that "
        "editing the worktree during a long run changes nothing)",
    )  # fmt: skip
    args = parser.parse_args()
    GATES["after"] = args.branch
    scenarios = args.scenarios.split(",")
    binary = find_llama_server(None)
    if binary is None:
        raise SystemExit("llama-server is not installed: run `make engine`")
    hogs = Hogs()
    deadline = time.monotonic() + args.minutes * 60
    results: dict[tuple[str, str, str], list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="gpubench-noise-") as temp:
        root = Path(temp)
        try:
            with proxied_engine(root, binary) as (proxy, delay):
                print(f"machine: {os.cpu_count()} cores, shared; load {os.getloadavg()}")
                take_baselines(root, proxy, hogs, scenarios, args.runs)
                results = play_rounds(root, proxy, hogs, scenarios, args.rounds, deadline, delay)
        finally:
            hogs.stop()
    print()
    print(tally(results))


@contextlib.contextmanager
def proxied_engine(root: Path, binary: Path) -> Iterator[tuple[DelayProxy, float]]:
    """The managed llama-server (one thread), warmed up, behind the delaying proxy; and the
    delay that makes its TTFT 30 % slower (FRACTION of its p50, measured through the proxy)."""
    target = LocalTarget()
    server = ManagedLlamaServer(
        target, cell_id=CELL, binary=str(binary), model_path=str(ensure_tiny_model()),
        alias="tiny", log_dir=str(root / "server-log"), extra_args=("--threads", "1"),
    )  # fmt: skip
    try:
        upstream = server.start()
        engine = LlamaCppEngine(upstream, "tiny")
        for _ in range(30):
            engine.chat(Request(PROMPT, MAX_TOKENS, extra_body=NO_CACHE), 60)
        with delay_proxy(upstream) as proxy:
            client = LlamaCppEngine(proxy.url, "tiny")
            ttft = statistics.median(
                client.chat(Request(PROMPT, MAX_TOKENS, extra_body=NO_CACHE), 60).first_delta_ms
                or 0.0
                for _ in range(10)
            )
            delay = FRACTION * ttft
            print(f"engine TTFT p50 {ttft:.1f} ms (quiet); +30 % = {delay:.1f} ms held", flush=True)
            yield proxy, delay
    finally:
        server.stop()
        target.close()


def take_baselines(
    root: Path, proxy: DelayProxy, hogs: Hogs, scenarios: list[str], runs: int
) -> None:
    """Each scenario's baseline per gate, in the scenario's state: before's one ratified run,
    after's CALIBRATE_RUNS (gpubench calibrate's default, here run by run in the state)."""
    for scenario in scenarios:
        for gate in GATES:
            project = root / f"{scenario}-{gate}"
            write_project(project, proxy.url, runs)
            proxy.delay_ms = 0.0
            with machine_state(hogs, scenario, busy=scenario == "drift-busy") as state:
                for _ in range(1 if gate == "before" else CALIBRATE_RUNS):
                    base = pytest_run(project, gate, state, "--baseline-update")
            print(f"baseline {scenario} {gate}: {base.line()}", flush=True)


def play_rounds(
    root: Path, proxy: DelayProxy, hogs: Hogs, scenarios: list[str], rounds: int,
    deadline: float, delay: float,
) -> dict[tuple[str, str, str], list[Run]]:  # fmt: skip
    """Rounds until `rounds` or the deadline: per scenario and gate (the order alternating), an
    unchanged run and a +30 % run, in the same machine state (drift: busy or quiet at random)."""
    order = random.Random(22)
    results: dict[tuple[str, str, str], list[Run]] = {}
    for round_idx in range(rounds):
        if time.monotonic() > deadline:
            print(f"stopped after {round_idx} rounds (time bound)")
            break
        for scenario in scenarios:
            gates = list(GATES) if round_idx % 2 == 0 else list(GATES)[::-1]
            busy = order.random() < 0.5
            for gate in gates:
                project = root / f"{scenario}-{gate}"
                for kind, held in (("unchanged", 0.0), ("+30%", delay)):
                    proxy.delay_ms = held
                    with machine_state(hogs, scenario, busy) as state:
                        run = pytest_run(project, gate, state)
                    results.setdefault((scenario, gate, kind), []).append(run)
                    print(
                        f"round {round_idx + 1} {scenario} {gate} {kind}: {run.line()}", flush=True
                    )
    return results


def tally(results: dict[tuple[str, str, str], list[Run]]) -> str:
    lines = ["scenario | gate | unchanged: false alarms / unsteady / significant wins / n | "
             "+30 %: caught / unsteady / missed / n"]  # fmt: skip
    for scenario in SCENARIOS:
        for gate in GATES:
            same = results.get((scenario, gate, "unchanged"), [])
            slow = results.get((scenario, gate, "+30%"), [])
            if not same and not slow:
                continue
            alarms = sum(r.exit_status == 6 for r in same)
            unsteady_same = sum(r.exit_status == 10 or r.ttft == "unsteady" for r in same)
            wins = sum(r.ttft == "win" for r in same)
            caught = sum(r.exit_status == 6 for r in slow)
            unsteady = sum(r.exit_status != 6 and (r.exit_status == 10 or r.ttft == "unsteady")
                           for r in slow)  # fmt: skip
            missed = len(slow) - caught - unsteady
            kinds = Counter(r.ttft for r in slow)
            lines.append(
                f"{scenario} | {gate} | {alarms} / {unsteady_same} / {wins} / {len(same)} | "
                f"{caught} / {unsteady} / {missed} / {len(slow)} (TTFT verdicts {dict(kinds)})"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
