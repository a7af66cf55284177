"""How often the gate cries wolf on an unchanged real llama-server, and how often it catches +60 %.

Starts llama-server (the tiny model, one thread) behind the delaying proxy of
tests/support/delay_proxy.py, writes one baseline through the proxy with no delay, then repeats full
pytest runs (each a subprocess, in a temporary directory) and counts exit statuses and verdicts:
exit 6 with no delay is a false alarm. With --detect, the same again with the first content held
back by 60 % of the baseline's warm TTFT p50 counts detections. Each run also shows llama-server's
own speed during it, as the proxy timed it (time to first content / last byte, p50) against the
baseline run's, and the tally repeats the counts for the runs where that speed stayed within 10 %.

    python benchmarks_dev/false_alarms.py [--repeat 20] [--runs N] [--detect] [--hog N]

The noise scenarios of issue 22 (quiet, a busy process flickering, always on, a slow drift with
the baseline in either state), main's gate against this one's interleaved, are in
benchmarks_dev/noise_scenarios.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_gpubench.core.status import EXIT_REGRESSION
from pytest_gpubench.engines import Request
from pytest_gpubench.engines.llamacpp import LlamaCppEngine
from pytest_gpubench.engines.llamacpp_build import find_llama_server
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.engines.tinymodel import ensure_tiny_model
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.targets.local import LocalTarget

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.delay_proxy import DelayProxy, EngineSpeed, delay_proxy

CELL = "local:llamacpp:tiny"
PROMPT_ID = "P-EASY"
PROMPT = "What is the capital of France?"
MAX_TOKENS = 64  # as in tests/test_gate_real.py
STEADY = 0.10
# A fresh llama-server answers its first calls slower (first touch of its buffers): without these
# the baseline alone would be slow, and every later run would look faster.
WARM_UP_CALLS = 200
GATED = {
    "warm_ttft_p50_ms": "TTFT",
    "warm_total_p50_ms": "total",
    "warm_decode_tokens_per_sec_p50": "decode tok/s",
}


@dataclass(frozen=True)
class Outcome:
    """One pytest run: its exit status, the gate's verdict per metric, the engine's speed."""

    exit_status: int
    verdicts: dict[str, tuple[str, float | None, str | None]]
    speed: EngineSpeed

    @property
    def inconclusive(self) -> bool:
        return any(kind == "inconclusive" for kind, _, _ in self.verdicts.values())

    def line(self, baseline: EngineSpeed) -> str:
        parts = []
        for metric, label in GATED.items():
            kind, ratio, attribution = self.verdicts.get(metric, ("-", None, None))
            change = "-" if ratio is None else f"{ratio - 1.0:+.1%}"
            side = f" [{attribution}]" if attribution else ""
            parts.append(f"{label} {change} {kind}{side}")
        steady = "steady" if self.speed.within(baseline, STEADY) else "UNSTEADY"
        return (
            f"exit {self.exit_status}: {', '.join(parts)}; "
            f"engine {self.speed} against {baseline} ({steady})"
        )


def write_project(root: Path, endpoint: str) -> None:
    # No runs: in the cell, so that the matrix's default N applies unless --runs is given.
    (root / "cells.yaml").write_text(
        "nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{endpoint}', "
        "phases: [warm]}\n"
    )
    (root / "prompts.yaml").write_text(
        f'prompts:\n  {PROMPT_ID}: {{intent: short, prompt: "{PROMPT}", '
        f"max_tokens: {MAX_TOKENS}}}\n"
    )
    (root / "test_bench.py").write_text(
        "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
    )


def run_pytest(root: Path, proxy: DelayProxy, runs: int | None, *extra: str) -> Outcome:
    argv = [sys.executable, "-m", "pytest", "-q", "--force-load", "-p", "no:cacheprovider"]
    if runs is not None:
        argv += ["--gpubench-runs", str(runs)]
    ledgers = set((root / "runs").glob("*.jsonl"))
    since = len(proxy.wait_until_idle())
    finished = subprocess.run(
        [*argv, *extra], cwd=root, capture_output=True, text=True, timeout=600, check=False
    )
    calls = proxy.wait_until_idle()[since:]
    (ledger,) = set((root / "runs").glob("*.jsonl")) - ledgers
    end = read_ledger(ledger)[-1]
    if end.get("type") != "end" or finished.returncode not in (0, EXIT_REGRESSION) or not calls:
        raise SystemExit(f"pytest failed (exit {finished.returncode}):\n{finished.stdout[-3000:]}")
    return Outcome(finished.returncode, _verdicts(end), EngineSpeed.of(calls))


def _verdicts(end: dict[str, Any]) -> dict[str, tuple[str, float | None, str | None]]:
    return {
        verdict["metric"]: (verdict["verdict"], verdict["change_ratio"], verdict.get("attribution"))
        for verdict in end.get("verdicts") or []
        if verdict["cell_id"] == CELL and verdict["prompt_id"] == PROMPT_ID
    }


def warm_up(upstream: str) -> None:
    engine = LlamaCppEngine(upstream, "tiny")
    for _ in range(WARM_UP_CALLS):
        engine.chat(Request(PROMPT, MAX_TOKENS), 30)


def baseline_ttft_p50(root: Path) -> float:
    stored = json.loads((root / "baselines" / "local_llamacpp_tiny.json").read_text())
    return float(stored["prompts"][PROMPT_ID]["warm"]["first_delta_ms"]["p50"])


def repeat(
    label: str, root: Path, proxy: DelayProxy, baseline: Outcome, delay_ms: float, count: int,
    runs: int | None,
) -> list[Outcome]:  # fmt: skip
    proxy.delay_ms = delay_ms
    print(f"\n{label}: {count} runs, first content held {delay_ms:.3f} ms", flush=True)
    outcomes = []
    for index in range(count):
        outcome = run_pytest(root, proxy, runs)
        print(f"  {index + 1:2d}  {outcome.line(baseline.speed)}", flush=True)
        outcomes.append(outcome)
    return outcomes


def tally(label: str, outcomes: Sequence[Outcome], baseline: Outcome) -> str:
    def counts(chosen: Sequence[Outcome]) -> str:
        exits = sum(outcome.exit_status == EXIT_REGRESSION for outcome in chosen)
        inconclusive = sum(outcome.inconclusive for outcome in chosen)
        return (
            f"exit {EXIT_REGRESSION} in {exits} of {len(chosen)}, "
            f"inconclusive verdicts in {inconclusive}"
        )

    steady = [o for o in outcomes if o.speed.within(baseline.speed, STEADY)]
    return f"{label}: {counts(outcomes)}; runs with a steady engine: {counts(steady)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="runs per setting (default 20)")
    parser.add_argument("--runs", type=int, help="warm runs per pytest run (default: the matrix's)")
    parser.add_argument("--detect", action="store_true", help="also repeat the +60 %% runs")
    parser.add_argument("--fraction", type=float, default=0.6, help="delay for --detect, × TTFT")
    parser.add_argument(
        "--hog",
        type=int,
        default=0,
        metavar="N",
        help="N busy processes beside the engine for the whole session (a loaded machine)",
    )
    args = parser.parse_args()
    with cpu_hogs(args.hog):
        measure(args)


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """`count` processes spinning on the CPU, each in its own session (the kernel shares CPU time
    between sessions first, so a hog in this session would mostly slow this script)."""
    hogs = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]
    if hogs:
        print(f"{count} CPU hog(s) running beside the engine", flush=True)
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def measure(args: argparse.Namespace) -> None:
    binary = find_llama_server(None)
    if binary is None:
        raise SystemExit("llama-server is not installed: run `make engine`")
    target = LocalTarget()
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpubench-false-alarms-") as temp:
        root = Path(temp)
        server = ManagedLlamaServer(
            target,
            cell_id=CELL,
            binary=str(binary),
            model_path=str(ensure_tiny_model()),
            alias="tiny",
            log_dir=str(root / "server-log"),
            extra_args=("--threads", "1"),
        )
        try:
            upstream = server.start()
            warm_up(upstream)
            with delay_proxy(upstream) as proxy:
                write_project(root, proxy.url)
                baseline = run_pytest(root, proxy, args.runs, "--baseline-update")
                ttft_p50 = baseline_ttft_p50(root)
                print(f"baseline: warm TTFT p50 {ttft_p50:.3f} ms, engine {baseline.speed}")
                same = repeat("no delay", root, proxy, baseline, 0.0, args.repeat, args.runs)
                lines.append(tally("no delay", same, baseline))
                if args.detect:
                    label = f"+{args.fraction:.0%}"
                    held = args.fraction * ttft_p50
                    slower = repeat(label, root, proxy, baseline, held, args.repeat, args.runs)
                    lines.append(tally(label, slower, baseline))
        finally:
            server.stop()
            target.close()
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
