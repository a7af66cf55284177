"""The gate on a shared machine, neighbour by neighbour (issue 37's table): false alarms, false
wins, catches, `unsteady` and silent passes of an unchanged engine and of one 30 % slower, with a
baseline of one update, a calibrated baseline (5 updates) and head-to-head A/B sessions, the
two engines where the kernel puts them (`ab`) or both pinned to the last CPU (`ab-pinned`).

The engine is the harness's own: a managed llama-server (the tiny model, one thread) started
behind a holding proxy in its own process (tests/support/paced_engine.py), so that the engine's
own run-queue wait is read as a user's managed engine's is; "+30 %" holds each reply's first
content back by 30 % of that call's own time to it. The prompt is ~1,800 tokens of never-cached
prefill, 4 tokens out; 10 warm runs per session (20 pairs for A/B). Neighbours, around each
session only:

    quiet      none (what else the machine runs is printed as its load average)
    nice19     two busy processes at nice 19, each in a session of its own
    onoff      two busy processes, on for 20 s and off for 20 s together (baseline taken in
               whichever state the clock gave)
    memstream  one process copying 512 MiB over and over

Each pytest session is a subprocess with PYTHONPATH at --code (a copy of the branch, so that
editing the tree during a long run changes nothing) and the shipped settings.

    python benchmarks_dev/noise_table.py [--rounds 20] [--minutes 60] [--code DIR] > table.txt
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpubench.engines.llamacpp_build import find_llama_server
from pytest_gpubench.engines.tinymodel import ensure_tiny_model
from pytest_gpubench.ledger.writer import read_ledger

REPO = Path(__file__).resolve().parent.parent
WRAPPER = REPO / "tests" / "support" / "paced_engine.py"
PROMPT = " ".join(f"word{index % 97} and more" for index in range(350))
SCENARIOS = ("quiet", "nice19", "onoff", "memstream")
AB_MODES = ("ab", "ab-pinned")
MODES = ("update", "calibrate", *AB_MODES)
CALIBRATE_RUNS = 5
TTFT = "warm_ttft_p50_ms"
BUSY = "while True: pass"
ONOFF = (
    "import time\nwhile True:\n"
    "    if int(time.time() // 20) % 2 == 0:\n        pass\n    else:\n        time.sleep(0.05)\n"
)
MEMSTREAM = "b = bytearray(512 << 20)\nc = bytearray(512 << 20)\nwhile True: c[:] = b\n"


class Neighbours:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, scenario: str) -> str:
        """Starts the scenario's processes; returns the state a session ran in."""
        self.stop()
        plan = {
            "nice19": [(BUSY, 19), (BUSY, 19)],
            "onoff": [(ONOFF, 0), (ONOFF, 0)],
            "memstream": [(MEMSTREAM, 0)],
        }.get(scenario, [])
        self.procs = [
            subprocess.Popen(
                ["nice", "-n", str(nice), sys.executable, "-c", code], start_new_session=True
            )
            for code, nice in plan
        ]
        if scenario == "onoff":
            return "on" if int(time.time() // 20) % 2 == 0 else "off"
        return scenario

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs = []


@dataclass(frozen=True)
class Session:
    exit_status: int
    verdict: str
    change: float | None
    state: str
    why: str

    def line(self) -> str:
        change = "-" if self.change is None else f"{self.change - 1:+.1%}"
        return f"exit {self.exit_status} TTFT {change} {self.verdict} [{self.state}] {self.why}"


def launch(binary: Path, hold_file: Path, pin: str | None = None) -> list[str]:
    """The engine behind its holding proxy; `pin`: both run under `taskset -c pin`."""
    return [
        *(["taskset", "-c", pin] if pin is not None else []),
        sys.executable, str(WRAPPER), "--port", "{port}", "--hold-file", str(hold_file), "--",
        str(binary), "--model", "{model_path}", "--alias", "{model}", "--threads", "1",
        "--parallel", "1",
    ]  # fmt: skip


def write_project(root: Path, mode: str, binary: Path, model: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "hold").write_text("0")
    (root / "zero").write_text("0")
    common = (
        f"node: local, engine: llamacpp, model: tiny, model_path: '{model}', phases: [warm], "
        "request: {extra_body: {cache_prompt: false}}"
    )
    if mode in AB_MODES:
        # ab-pinned: both engines on the last CPU (docs/ab-runs.md: placed alike).
        pin = str(max(os.sched_getaffinity(0))) if mode == "ab-pinned" else None
        cells = (
            f"  - {{{common}, name: main, runs: 20, "
            f"launch: {json.dumps(launch(binary, root / 'zero', pin))}}}\n"
            f"  - {{{common}, name: pr, runs: 20, reference: 'local:llamacpp:tiny@main', "
            f"launch: {json.dumps(launch(binary, root / 'hold', pin))}}}\n"
        )
    else:
        cells = f"  - {{{common}, runs: 10, launch: {json.dumps(launch(binary, root / 'hold'))}}}\n"
    (root / "cells.yaml").write_text("nodes: {local: {kind: local}}\ncells:\n" + cells)
    (root / "prompts.yaml").write_text(
        f'prompts:\n  P-LONG: {{intent: long, prompt: "{PROMPT}", max_tokens: 4}}\n'
    )
    (root / "test_bench.py").write_text(
        "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
    )


def session(root: Path, code: str, state: str, *extra: str) -> Session:
    before = set((root / "runs").glob("*.jsonl"))
    argv = [sys.executable, "-m", "pytest", "-q", "--force-load", "-p", "no:cacheprovider",
            "-p", "no:hypothesispytest", *extra]  # fmt: skip
    finished = subprocess.run(
        argv, cwd=root, env={**os.environ, "PYTHONPATH": code}, capture_output=True, text=True,
        timeout=900, check=False,
    )  # fmt: skip
    new = set((root / "runs").glob("*.jsonl")) - before
    records = read_ledger(new.pop()) if new else []
    end = records[-1] if records else {}
    if end.get("type") != "end":
        print(finished.stdout[-1500:], finished.stderr[-1500:], flush=True)
    # An A/B session's is the candidate's, against its reference; the reference's own is `new`.
    ttfts = [v for v in end.get("verdicts") or [] if v.get("metric") == TTFT]
    ttft: dict[str, Any] = next(
        (v for v in sorted(ttfts, key=lambda v: v.get("reference") is None)),
        {"verdict": "none", "change_ratio": None},
    )
    why = ""
    if ttft["verdict"] in ("unsteady", "blind", "inconclusive"):
        why = str(ttft.get("message", ""))[:140]
    # A session that failed on another figure than TTFT says which, and why.
    others = [
        v for v in end.get("verdicts") or [] if v.get("verdict") == "regression" and v is not ttft
    ]
    if finished.returncode == 6 and others:
        why = "; ".join(str(v.get("message", ""))[:200] for v in others)
    return Session(finished.returncode, ttft["verdict"], ttft.get("change_ratio"), state, why)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=60.0, help="stop starting rounds after")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--code", default=str(REPO), help="the package's code to run")
    args = parser.parse_args()
    binary = find_llama_server(None)
    if binary is None:
        raise SystemExit("llama-server is not installed: run `make engine`")
    model = ensure_tiny_model()
    scenarios, modes = args.scenarios.split(","), args.modes.split(",")
    neighbours = Neighbours()
    deadline = time.monotonic() + args.minutes * 60
    results: dict[tuple[str, str, str], list[Session]] = {}
    print(f"machine: {os.cpu_count()} cores, shared; load {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpubench-noise-table-") as temp:
        try:
            for scenario in scenarios:
                for mode in modes:
                    project = Path(temp) / f"{scenario}-{mode}"
                    write_project(project, mode, binary, model)
                    if mode in AB_MODES:
                        continue
                    for _ in range(CALIBRATE_RUNS if mode == "calibrate" else 1):
                        state = neighbours.start(scenario)
                        base = session(project, args.code, state, "--baseline-update")
                        neighbours.stop()
                    print(f"baseline {scenario} {mode}: {base.line()}", flush=True)
            for round_idx in range(args.rounds):
                if time.monotonic() > deadline:
                    print(f"stopped after {round_idx} rounds (time bound)", flush=True)
                    break
                for scenario in scenarios:
                    for offset in range(len(modes)):
                        mode = modes[(round_idx + offset) % len(modes)]
                        project = Path(temp) / f"{scenario}-{mode}"
                        for kind, hold in (("unchanged", "0"), ("+30%", "0.3")):
                            (project / "hold").write_text(hold)
                            state = neighbours.start(scenario)
                            try:
                                run = session(project, args.code, state)
                            finally:
                                neighbours.stop()
                            results.setdefault((scenario, mode, kind), []).append(run)
                            print(
                                f"round {round_idx + 1} {scenario} {mode} {kind}: {run.line()} "
                                f"load {os.getloadavg()[0]:.2f}",
                                flush=True,
                            )
        finally:
            neighbours.stop()
    print()
    print(tally(results, scenarios, modes))


def tally(
    results: dict[tuple[str, str, str], list[Session]], scenarios: list[str], modes: list[str]
) -> str:
    lines = [
        "neighbour | baseline | unchanged: false alarms / false wins / could not tell (exit 10) "
        "/ ok / n | +30 %: caught (exit 6) / held back (exit 10) / silent passes (exit 0) / n"
    ]
    for scenario in scenarios:
        for mode in modes:
            same = results.get((scenario, mode, "unchanged"), [])
            slow = results.get((scenario, mode, "+30%"), [])
            if not same and not slow:
                continue
            alarms = sum(r.exit_status == 6 for r in same)
            wins = sum(r.verdict == "win" for r in same)
            untold = sum(r.exit_status == 10 for r in same)
            fine = sum(r.exit_status == 0 for r in same)
            caught = sum(r.exit_status == 6 for r in slow)
            held = sum(r.exit_status == 10 for r in slow)
            silent = sum(r.exit_status == 0 for r in slow)
            kinds = dict(Counter(r.verdict for r in slow))
            lines.append(
                f"{scenario} | {mode} | {alarms} / {wins} / {untold} / {fine} / {len(same)} | "
                f"{caught} / {held} / {silent} / {len(slow)} (TTFT verdicts {kinds})"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
