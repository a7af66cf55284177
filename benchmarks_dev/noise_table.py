"""The gate on a shared machine, neighbour by neighbour (issue 37's table, extended for issue 43):
false alarms, false wins, catches, `unsteady` and silent passes of an unchanged engine and of one
30 % slower, with a baseline of one update, of one update measured in three runs (`update3`:
--gpubench-baseline-runs 3), a calibrated baseline (5 updates) and head-to-head A/B sessions,
the two engines where the kernel puts them (`ab`) or both pinned to the last CPU (`ab-pinned`);
and per row the sessions that decided (exit 0 or 6), those that decided right
(unchanged: exit 0 and no win reported; +30 %: exit 6), and the median session time.

Three engines (--engines):

    managed   the harness's own: a managed llama-server (the tiny model, one thread) started
              behind a holding proxy in its own process (tests/support/paced_engine.py), so that
              the engine's own run-queue wait is read as a user's managed engine's is; "+30 %"
              holds each reply's first content back by 30 % of that call's own time to it
    endpoint  the same engine and proxy, started by this script as a plain subprocess (a session
              of its own) before each session and stopped after it, and named in cells.yaml by
              its `endpoint:` (as most users have: a server they already run); A/B: two such
              endpoints, the candidate's `reference:` the other
    remote    an engine on another machine: an OpenAI-compatible stand-in with fixed timings
              (first content 60 ms after the request, then one every 5 ms; +30 %: 78 ms) in one
              process, behind a loopback proxy in another (benchmarks_dev/remote_standin.py), so
              that what holds the endpoint's socket is a proxy with no engine under it

The prompt is ~1,800 tokens of never-cached prefill, 4 tokens out; 10 warm runs per session (20
pairs for A/B). Neighbours, around each session only:

    quiet      none (what else the machine runs is printed as its load average)
    nice19     two busy processes at nice 19, each in a session of its own
    onoff      two busy processes, on for 20 s and off for 20 s together (baseline taken in
               whichever state the clock gave)
    memstream  one process copying 512 MiB over and over

Each pytest session is a subprocess with PYTHONPATH at --code (a copy of the branch, so that
editing the tree during a long run changes nothing) and the shipped settings.

Rows: each engine's modes and scenarios; by default the managed engine's are all of them (issue
37's table), the endpoint's update, calibrate and ab in every scenario, and the remote engine's
update on the quiet machine (issue 43's goals). --engines, --scenarios and --modes pick rows: a
scenario or mode given applies to every engine picked. Each session's line ends with its wall
time; --keep DIR keeps the projects (ledgers, the endpoint engines' logs) instead of a scratch
directory.

    python benchmarks_dev/noise_table.py [--rounds 20] [--minutes 60] [--code DIR] > table.txt
    python benchmarks_dev/noise_table.py --engines endpoint --scenarios quiet \
        --modes update,calibrate,ab > table.txt
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpubench.engines.llamacpp_build import find_llama_server
from pytest_gpubench.engines.tinymodel import ensure_tiny_model
from pytest_gpubench.ledger.writer import read_ledger

REPO = Path(__file__).resolve().parent.parent
WRAPPER = REPO / "tests" / "support" / "paced_engine.py"
REMOTE = REPO / "benchmarks_dev" / "remote_standin.py"
PROMPT = " ".join(f"word{index % 97} and more" for index in range(350))
SCENARIOS = ("quiet", "nice19", "onoff", "memstream")
AB_MODES = ("ab", "ab-pinned")
MODES = ("update", "update3", "calibrate", *AB_MODES)
ENGINES = ("managed", "endpoint", "remote")
# Each engine's rows when --scenarios / --modes are not given: (scenarios, modes).
DEFAULT_ROWS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "managed": (SCENARIOS, MODES),
    "endpoint": (SCENARIOS, ("update", "calibrate", "ab")),
    "remote": (("quiet",), ("update",)),
}
CALIBRATE_RUNS = 5
TTFT = "warm_ttft_p50_ms"
# The remote stand-in's fixed timings (remote_standin.py).
REMOTE_FIRST_MS = 60.0
REMOTE_GAP_MS = 5.0
ENGINE_READY_S = 120.0
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
    # The pytest session's wall time, and whether any of its verdicts was a win.
    seconds: float = 0.0
    won: bool = False

    def line(self) -> str:
        change = "-" if self.change is None else f"{self.change - 1:+.1%}"
        return f"exit {self.exit_status} TTFT {change} {self.verdict} [{self.state}] {self.why}"

    def decided(self) -> bool:
        return self.exit_status in (0, 6)


def launch(binary: Path, hold_file: Path, pin: str | None = None) -> list[str]:
    """The engine behind its holding proxy; `pin`: both run under `taskset -c pin`."""
    return [
        *(["taskset", "-c", pin] if pin is not None else []),
        sys.executable, str(WRAPPER), "--port", "{port}", "--hold-file", str(hold_file), "--",
        str(binary), "--model", "{model_path}", "--alias", "{model}", "--threads", "1",
        "--parallel", "1",
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class Outside:
    """An engine a project's cells name by endpoint: this script starts it, never the harness."""

    name: str
    port: int
    hold_file: Path


class OutsideEngines:
    """A project's endpoint engines (`endpoint`: llama-server behind paced_engine.py; `remote`:
    remote_standin.py's stand-in and its proxy, two processes), each process in a session of its
    own, started before a session (reading its hold file then) and stopped after it."""

    def __init__(
        self, engine: str, root: Path, binary: Path, model: Path, pin: str | None,
        cells: list[Outside],
    ) -> None:  # fmt: skip
        self.engine, self.root, self.binary, self.model = engine, root, binary, model
        self.taskset = ["taskset", "-c", pin] if pin is not None else []
        self.cells = cells
        self.procs: list[subprocess.Popen[bytes]] = []

    def _popen(self, argv: list[str], name: str, **kwargs: Any) -> subprocess.Popen[bytes]:
        with (self.root / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [*self.taskset, *argv], cwd=self.root, start_new_session=True,
                stdout=kwargs.pop("stdout", log), stderr=log, **kwargs,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        self.stop()
        for cell in self.cells:
            if self.engine == "endpoint":
                self._popen(
                    [sys.executable, str(WRAPPER), "--port", str(cell.port), "--hold-file",
                     str(cell.hold_file), "--", str(self.binary), "--model", str(self.model),
                     "--alias", "tiny", "--threads", "1", "--parallel", "1"],
                    cell.name,
                )  # fmt: skip
                continue
            standin = self._popen(
                [sys.executable, str(REMOTE), "standin"], f"{cell.name}-standin",
                stdout=subprocess.PIPE,
            )  # fmt: skip
            assert standin.stdout is not None
            upstream = standin.stdout.readline().decode().strip()
            if not upstream:
                raise RuntimeError(
                    f"the remote stand-in did not start: see {cell.name}-standin.log"
                )
            self._popen(
                [sys.executable, str(REMOTE), "proxy", "--port", str(cell.port),
                 "--upstream-port", upstream, "--first-ms", str(REMOTE_FIRST_MS),
                 "--gap-ms", str(REMOTE_GAP_MS), "--hold-file", str(cell.hold_file)],
                cell.name,
            )  # fmt: skip
        for cell in self.cells:
            self._wait_ready(cell)

    def _wait_ready(self, cell: Outside) -> None:
        deadline = time.monotonic() + ENGINE_READY_S
        while time.monotonic() < deadline:
            if any(proc.poll() is not None for proc in self.procs):
                raise RuntimeError(f"an outside engine exited: see {self.root}/{cell.name}.log")
            try:
                url = f"http://127.0.0.1:{cell.port}/health"
                with urllib.request.urlopen(url, timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{cell.name} on port {cell.port} not ready in {ENGINE_READY_S:.0f} s")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs = []


def write_project(
    root: Path, mode: str, binary: Path, model: Path, engine: str = "managed"
) -> OutsideEngines | None:
    """The project's files; for an endpoint engine, also the engines its cells name."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "hold").write_text("0")
    (root / "zero").write_text("0")
    # ab-pinned: both engines on the last CPU (docs/ab-runs.md: placed alike).
    pin = str(max(os.sched_getaffinity(0))) if mode == "ab-pinned" else None
    outside: OutsideEngines | None = None
    if engine == "managed":
        common = (
            f"node: local, engine: llamacpp, model: tiny, model_path: '{model}', phases: [warm], "
            "request: {extra_body: {cache_prompt: false}}"
        )
        if mode in AB_MODES:
            cells = (
                f"  - {{{common}, name: main, runs: 20, "
                f"launch: {json.dumps(launch(binary, root / 'zero', pin))}}}\n"
                f"  - {{{common}, name: pr, runs: 20, reference: 'local:llamacpp:tiny@main', "
                f"launch: {json.dumps(launch(binary, root / 'hold', pin))}}}\n"
            )
        else:
            cells = (
                f"  - {{{common}, runs: 10, launch: {json.dumps(launch(binary, root / 'hold'))}}}\n"
            )
    else:
        kind = "llamacpp" if engine == "endpoint" else "openai"
        common = (
            f"node: local, engine: {kind}, model: tiny, phases: [warm], "
            "request: {extra_body: {cache_prompt: false}}"
        )
        if mode in AB_MODES:
            main, pr = (
                Outside("main", free_port(), root / "zero"),
                Outside("pr", free_port(), root / "hold"),
            )
            cells = (
                f"  - {{{common}, name: main, runs: 20, endpoint: 'http://127.0.0.1:{main.port}'}}\n"
                f"  - {{{common}, name: pr, runs: 20, reference: 'local:{kind}:tiny@main', "
                f"endpoint: 'http://127.0.0.1:{pr.port}'}}\n"
            )
            outside = OutsideEngines(engine, root, binary, model, pin, [main, pr])
        else:
            only = Outside("engine", free_port(), root / "hold")
            cells = f"  - {{{common}, runs: 10, endpoint: 'http://127.0.0.1:{only.port}'}}\n"
            outside = OutsideEngines(engine, root, binary, model, None, [only])
    (root / "cells.yaml").write_text("nodes: {local: {kind: local}}\ncells:\n" + cells)
    (root / "prompts.yaml").write_text(
        f'prompts:\n  P-LONG: {{intent: long, prompt: "{PROMPT}", max_tokens: 4}}\n'
    )
    (root / "test_bench.py").write_text(
        "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
    )
    return outside


def session(root: Path, code: str, state: str, *extra: str) -> Session:
    before = set((root / "runs").glob("*.jsonl"))
    argv = [sys.executable, "-m", "pytest", "-q", "--force-load", "-p", "no:cacheprovider",
            "-p", "no:hypothesispytest", *extra]  # fmt: skip
    started = time.monotonic()
    finished = subprocess.run(
        argv, cwd=root, env={**os.environ, "PYTHONPATH": code}, capture_output=True, text=True,
        timeout=900, check=False,
    )  # fmt: skip
    seconds = time.monotonic() - started
    new = set((root / "runs").glob("*.jsonl")) - before
    records = read_ledger(new.pop()) if new else []
    end = records[-1] if records else {}
    if end.get("type") != "end":
        print(finished.stdout[-1500:], finished.stderr[-1500:], flush=True)
    # An A/B session's is the candidate's, against its reference; the reference's own is `new`.
    verdicts = end.get("verdicts") or []
    ttfts = [v for v in verdicts if v.get("metric") == TTFT]
    ttft: dict[str, Any] = next(
        (v for v in sorted(ttfts, key=lambda v: v.get("reference") is None)),
        {"verdict": "none", "change_ratio": None},
    )
    why = ""
    if ttft["verdict"] in ("unsteady", "blind", "inconclusive"):
        why = str(ttft.get("message", ""))[:400]
    elif ttft["verdict"] == "ok":
        # What a pass rested on: the steadiness it judged on, for a +30 % session that passed.
        why = str(ttft.get("message", ""))
    elif ttft["verdict"] in ("regression", "win"):
        # What decided it (the client's test, or the engine's own figure), for a false alarm or
        # a false win above all.
        why = str(ttft.get("message", ""))[:400]
    # A session that failed on another figure than TTFT says which, and why.
    others = [v for v in verdicts if v.get("verdict") == "regression" and v is not ttft]
    if finished.returncode == 6 and others:
        why = "; ".join(str(v.get("message", ""))[:200] for v in others)
    # So does one held back (exit 10) by another figure while its TTFT was decided.
    held = [v for v in verdicts if v.get("verdict") in ("unsteady", "blind", "inconclusive")]
    if finished.returncode == 10 and not why and held:
        why = "; ".join(str(v.get("message", ""))[:400] for v in held)
    won = any(v.get("verdict") == "win" for v in verdicts)
    return Session(
        finished.returncode, ttft["verdict"], ttft.get("change_ratio"), state, why, seconds, won
    )


Row = tuple[str, str, str]  # (engine, scenario, mode)


def pick_rows(engines: str, scenarios: str | None, modes: str | None) -> list[Row]:
    """The rows to run, scenario by scenario, then engine by engine, in the order given."""
    picked = engines.split(",")
    wanted = {
        "engine": (picked, ENGINES),
        "scenario": (scenarios.split(",") if scenarios else [], SCENARIOS),
        "mode": (modes.split(",") if modes else [], MODES),
    }
    for what, (names, known) in wanted.items():
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise SystemExit(f"unknown {what} {', '.join(unknown)}: one of {', '.join(known)}")
    order = scenarios.split(",") if scenarios else list(SCENARIOS)
    rows: list[Row] = []
    for scenario in order:
        for engine in picked:
            own_scenarios, own_modes = DEFAULT_ROWS[engine]
            if scenarios is None and scenario not in own_scenarios:
                continue
            rows.extend(
                (engine, scenario, mode) for mode in (modes.split(",") if modes else own_modes)
            )
    return rows


def label(engine: str, mode: str) -> str:
    """The row's baseline column: the mode, after the engine where it is not the managed one."""
    return mode if engine == "managed" else f"{engine} {mode}"


def project_dir(temp: str, row: Row) -> Path:
    engine, scenario, mode = row
    return Path(temp) / (f"{scenario}-{mode}" if engine == "managed" else "-".join(row))


def update_options(row: Row) -> tuple[str, ...]:
    """update3: the first update measures each (cell, prompt) in three runs; calibrate: five
    updates of one calibration, as `gpubench calibrate` runs them."""
    mode = row[2]
    if mode == "update3":
        return ("--gpubench-baseline-runs", "3")
    if mode == "calibrate":
        return ("--gpubench-calibration", f"noise-table-{'-'.join(row)}")
    return ()


def run_session(
    project: Path, outside: OutsideEngines | None, neighbours: Neighbours, scenario: str,
    code: str, *extra: str,
) -> Session:  # fmt: skip
    """One session beside the scenario's neighbours; an endpoint's engines started before the
    neighbours and stopped after them."""
    if outside is not None:
        outside.start()
    try:
        state = neighbours.start(scenario)
        try:
            return session(project, code, state, *extra)
        finally:
            neighbours.stop()
    finally:
        if outside is not None:
            outside.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=60.0, help="stop starting rounds after")
    parser.add_argument("--engines", default=",".join(ENGINES), help=", ".join(ENGINES))
    parser.add_argument("--scenarios", help=f"of {', '.join(SCENARIOS)} (default: each engine's)")
    parser.add_argument("--modes", help=f"of {', '.join(MODES)} (default: each engine's)")
    parser.add_argument("--code", default=str(REPO), help="the package's code to run")
    parser.add_argument(
        "--keep", type=Path, help="make the projects here, and keep them (ledgers, engine logs)"
    )
    args = parser.parse_args()
    rows = pick_rows(args.engines, args.scenarios, args.modes)
    # Stopped with SIGTERM, the neighbours and the endpoint engines (sessions of their own) are
    # stopped on the way out too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    binary = find_llama_server(None)
    if binary is None:
        raise SystemExit("llama-server is not installed: run `make engine`")
    model = ensure_tiny_model()
    neighbours = Neighbours()
    deadline = time.monotonic() + args.minutes * 60
    results: dict[tuple[str, str, str, str], list[Session]] = {}
    outside: dict[Row, OutsideEngines | None] = {}
    # Within a round, each (scenario, engine)'s modes take turns going first, as before.
    groups: dict[tuple[str, str], list[str]] = {}
    for engine, scenario, mode in rows:
        groups.setdefault((scenario, engine), []).append(mode)
    print(f"machine: {os.cpu_count()} cores, shared; load {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpubench-noise-table-") as scratch:
        temp = str(args.keep) if args.keep is not None else scratch
        try:
            for row in rows:
                engine, scenario, mode = row
                project = project_dir(temp, row)
                outside[row] = write_project(project, mode, binary, model, engine)
                if mode in AB_MODES:
                    continue
                # update3 and calibrate (issue 43): a managed engine started again between the
                # runs, an endpoint's spaced.
                runs = update_options(row)
                for _ in range(CALIBRATE_RUNS if mode == "calibrate" else 1):
                    base = run_session(
                        project, outside[row], neighbours, scenario, args.code, "--baseline-update",
                        *runs,
                    )  # fmt: skip
                print(f"baseline {scenario} {label(engine, mode)}: {base.line()}", flush=True)
            for round_idx in range(args.rounds):
                if time.monotonic() > deadline:
                    print(f"stopped after {round_idx} rounds (time bound)", flush=True)
                    break
                for (scenario, engine), modes in groups.items():
                    for offset in range(len(modes)):
                        mode = modes[(round_idx + offset) % len(modes)]
                        row = (engine, scenario, mode)
                        project = project_dir(temp, row)
                        for kind, hold in (("unchanged", "0"), ("+30%", "0.3")):
                            (project / "hold").write_text(hold)
                            run = run_session(
                                project, outside[row], neighbours, scenario, args.code
                            )
                            results.setdefault((engine, scenario, mode, kind), []).append(run)
                            print(
                                f"round {round_idx + 1} {scenario} {label(engine, mode)} {kind}: "
                                f"{run.line()} load {os.getloadavg()[0]:.2f} "
                                f"time {run.seconds:.1f} s",
                                flush=True,
                            )
        finally:
            neighbours.stop()
            for engines in outside.values():
                if engines is not None:
                    engines.stop()
    print()
    print(tally(results, rows))


def tally(results: dict[tuple[str, str, str, str], list[Session]], rows: list[Row]) -> str:
    lines = [
        "neighbour | baseline | unchanged: false alarms / false wins / could not tell (exit 10) "
        "/ ok / n | +30 %: caught (exit 6) / held back (exit 10) / silent passes (exit 0) / n"
        " | decisive: unchanged right (exit 0, no win) / decided (exit 0 or 6) / n, +30 % right "
        "(exit 6) / decided / n | median session time"
    ]
    for engine, scenario, mode in rows:
        same = results.get((engine, scenario, mode, "unchanged"), [])
        slow = results.get((engine, scenario, mode, "+30%"), [])
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
        right = sum(r.exit_status == 0 and not r.won for r in same)
        median = statistics.median(r.seconds for r in same + slow)
        lines.append(
            f"{scenario} | {label(engine, mode)} | {alarms} / {wins} / {untold} / {fine} / "
            f"{len(same)} | {caught} / {held} / {silent} / {len(slow)} (TTFT verdicts {kinds})"
            f" | decisive: {right} / {sum(r.decided() for r in same)} / {len(same)}, "
            f"{caught} / {sum(r.decided() for r in slow)} / {len(slow)} | {median:.1f} s"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
