"""A sweep's steps gated like load points: a step whose latency regresses fails the run with
exit 6, named by its place in the sweep (`sweep-s1`: its rate moves with the engine's speed).

The engine is the timing-controlled keep-alive server behind tests/support/reply_proxy.py, which
gives it two batch slots (so that the closed loops' rates are the proxy's to set: about 38 req/s
one at a time, about twice that with every slot busy, less on a busy machine) and, in the
regressed run, holds each request 60 ms while more arrived in the last second than halfway
between the one-at-a-time rate and the middle step's: the middle, open-loop step slows; the
one-at-a-time step does not, and the saturating step keeps its throughput (its requests wait
for a slot all the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.quiet_machine import machine_moved, wait_for_quiet
from support.reply_proxy import proxied_engine_process

from pytest_gpubench.ledger.writer import read_ledger

PROMPTS = "prompts:\n  P-EASY: {intent: short, prompt: hi, max_tokens: 8}\n"
TEST_GENERATE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"


def end_verdicts(root: Path) -> list[dict[str, Any]]:
    newest = max((root / "runs").glob("*.jsonl"), key=lambda path: path.stat().st_mtime)
    records = read_ledger(newest)
    (end,) = [r for r in records if r["type"] == "end"]
    return list(end.get("load_verdicts") or end.get("verdicts") or [])


# Sweeps measured again (a fresh baseline each time) when the machine itself moved between the
# two (the regressed run's one-at-a-time step more than MOVED slower than the baseline's), or
# held the client back during the baseline (a step not kept: baseline_then_slowed).
ATTEMPTS = 3
MOVED = 0.10


# A slower middle step's TTFT p99 told significant from a short sweep's few samples: once not
# under -n 3 (p = 0.876): alone under -n (tests/support/schedule.py).
@pytest.mark.serial
def test_a_sweep_whose_middle_step_slows_exits_6_naming_that_step(
    pytester: pytest.Pytester,
) -> None:
    # The engine and its proxy in a process of their own, so that both runs go in this one.
    with proxied_engine_process(prefill_s=0.02, slots=2, slow_ms=60.0) as proxy:
        pytester.makefile(".yaml", prompts=PROMPTS)
        pytester.makefile(
            ".yaml",
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: m, endpoint: '{proxy.url}',"
            " load: {sweep: {rates: 1, max_concurrency: 12}, arrival: constant,"
            " duration_s: 1, warmup_s: 0.2, max_send_lag_ms: 50}}\n",
        )
        pytester.makepyfile(test_bench=TEST_GENERATE)
        moved: list[str] = []
        for _ in range(ATTEMPTS):
            proxy.slow_above_rate = None
            measured = baseline_then_slowed(pytester, proxy)
            if isinstance(measured, str):
                moved.append(f"{measured}; then {wait_for_quiet()}")
                continue
            one, result = measured
            # The middle step's rate follows the one-at-a-time step's: on a machine that ran the
            # second sweep slower (a neighbour took the cores) the middle step may stay under
            # the proxy's threshold, and nothing this test controls slowed it.
            again = achieved_rate(pytester.path, "c1")
            if again >= (1 - MOVED) * one:
                break
            moved.append(f"one at a time {one:.1f} then {again:.1f} req/s; then {wait_for_quiet()}")
        else:
            machine_moved(f"the machine moved between the sweeps in every attempt: {moved}")
    text = result.stdout.str()
    print(text[-4000:])
    assert proxy.slowed > 0
    assert result.ret == 6, text[-3000:]
    result.stdout.fnmatch_lines(["REGRESSION: local:openai:m P-EASY@load-sweep-s1: TTFT p99 +*"])
    assert "load regression(s)" in text


# The subject is the sweep's gate, not the shared machine's steadiness.
ARGS = ("--force-load", "-p", "no:cacheprovider", "-m", "load", "--gpubench-steadiness", "off")


POINTS = {
    "P-EASY@load-sweep-c1",
    "P-EASY@load-sweep-c12",
    "P-EASY@load-sweep-s1",
    "P-EASY@load-sweep",
}


def baseline_then_slowed(
    pytester: pytest.Pytester, proxy: Any
) -> tuple[float, pytest.RunResult] | str:
    """A baseline sweep, then one with the proxy slowing the requests that come faster than
    halfway between its one-at-a-time rate and its middle step's; the baseline's rate one at a
    time and the second run. Or why the baseline lacks a step: a step whose client fell behind
    its schedule (a neighbour held the cores: its send lag past max_send_lag_ms) is no result,
    and the product rightly keeps no baseline of it."""
    (pytester.path / "baselines" / "load" / "local_openai_m.json").unlink(missing_ok=True)
    update = pytester.runpytest(*ARGS, "--baseline-update")
    assert update.ret == 0, update.stdout.str()[-3000:]
    stored = json.loads((pytester.path / "baselines" / "load" / "local_openai_m.json").read_text())
    missing = POINTS - set(stored["points"])
    if missing and "the client could not keep its schedule" in update.stdout.str():
        return f"the client fell behind its schedule at {sorted(missing)}"
    assert set(stored["points"]) == POINTS
    assert stored["points"]["P-EASY@load-sweep"]["saturation_rate"] > 0
    one = float(stored["points"]["P-EASY@load-sweep-c1"]["achieved_rate"])
    middle = stored["points"]["P-EASY@load-sweep-s1"]["rate"]
    assert middle > 1.15 * one, (one, middle)
    # Halfway between: the one-at-a-time step stays below it, the middle one above.
    proxy.slow_above_rate = (one + middle) / 2
    return one, pytester.runpytest(*ARGS)


def achieved_rate(root: Path, point: str) -> float:
    """The newest run's achieved rate at a sweep step (its load record's `load_point`)."""
    newest = max((root / "runs").glob("*.jsonl"), key=lambda path: path.stat().st_mtime)
    (load,) = [
        r
        for r in read_ledger(newest)
        if r["type"] == "load" and str(r.get("load_point", "")).endswith(point)
    ]
    return float(load["achieved_rate"])
