"""A sweep's stop at saturation: an open-loop point whose TTFT and requests in flight both rise
within it (one-sided Kendall tests, results/load_over_time.saturation_trend) over-saturated its
engine; the sweep runs no higher rate, names the rate and keeps the time. Pure for the trend and
the sweep's logic; end to end against tests/support/keepalive_server.py with a fixed capacity
(at most 2 replies at once, each at least 50 ms: a stand-in, as no engine here has a set
ceiling)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from support.keepalive_server import keepalive_server
from test_load import ledger_records, write_load_project

from pytest_gpubench.config.load_profile import LoadProfile, Sweep
from pytest_gpubench.results.load_over_time import saturation_trend
from pytest_gpubench.run.load import LoadPattern
from pytest_gpubench.run.load.sweep import run_sweep


def queue_calls(gap_ms: float, service_ms: float, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """One server serving in arrival order, `service_ms` each (with a little seeded noise),
    requests arriving every `gap_ms`: the calls a client would record."""
    noise = random.Random(seed)
    calls, free_at = [], 0.0
    for i in range(n):
        send = i * gap_ms
        start = max(send, free_at)
        service = service_ms * noise.uniform(0.9, 1.1)
        free_at = start + service
        calls.append(
            {
                "send_ms": send,
                "first_delta_ms": start - send + service * 0.2,
                "total_duration_ms": free_at - send,
                "error": None,
                "finish_reason": "length",
                "load_window": "measured",
            }
        )
    return calls


def test_a_queue_that_grows_is_saturated_and_one_that_keeps_up_is_not() -> None:
    growing = saturation_trend(queue_calls(gap_ms=10.0, service_ms=15.0, n=40))
    assert growing is not None and growing["saturated"] is True
    assert growing["ttft_p"] < 0.01 and growing["in_flight_p"] < 0.01
    assert growing["ttft_tau"] > 0.5 and growing["n"] == 38
    for seed in range(20):
        steady = saturation_trend(queue_calls(gap_ms=20.0, service_ms=15.0, n=40, seed=seed))
        assert steady is not None and steady["saturated"] is False, seed


def test_a_rising_ttft_without_a_growing_queue_is_not_saturation() -> None:
    """Each request ends before the next is sent (one in flight at every send); its TTFT rises
    all the same (an engine that slows down, not one that is behind)."""
    calls = [
        {"send_ms": 100.0 * i, "first_delta_ms": 10.0 + i, "total_duration_ms": 50.0,
         "error": None, "finish_reason": "length", "load_window": "measured"}
        for i in range(30)
    ]  # fmt: skip
    trend = saturation_trend(calls)
    assert trend is not None and trend["ttft_p"] < 0.01
    assert trend["in_flight_p"] == 1.0 and trend["saturated"] is False


def test_too_few_requests_after_the_fill_give_no_trend() -> None:
    """The sends within the first shortest E2E (15 ms: the first two) are the point filling up:
    22 calls leave 20, 21 leave 19."""
    assert saturation_trend(queue_calls(gap_ms=10.0, service_ms=15.0, n=22)) is not None
    assert saturation_trend(queue_calls(gap_ms=10.0, service_ms=15.0, n=21)) is None


def test_the_sweep_stops_rising_at_the_first_saturated_rate_and_keeps_the_rest() -> None:
    """Closed loops at 10 and 20 req/s, four rates up to 3 x 20: the second one over-saturates;
    the two above it are not run, and their time (warm-up, duration) is kept."""
    profile = LoadProfile(
        sweep=Sweep(rates=4, max_concurrency=4, up_to=3.0), duration_s=2.0, warmup_s=0.5
    )
    ran: list[str] = []

    async def run_step(point: str, pattern: LoadPattern, step: str) -> Mapping[str, Any]:
        ran.append(step)
        rate = pattern.offered_rate
        saturated = rate is not None and rate > 25.0
        return {
            "valid": True,
            "achieved_rate": {"c1": 10.0, "c4": 20.0}.get(step, min(rate or 0.0, 25.0)),
            "meets_slo": None,
            "trend": {"saturated": saturated, "ttft_p": 0.001 if saturated else 0.4,
                      "in_flight_p": 0.001 if saturated else 0.6},
        }  # fmt: skip

    sweep = asyncio.run(run_sweep(profile, run_step))
    # Rates 10 + (60 - 10) * i / 5: 20, 30, 40, 50.
    assert ran == ["c1", "c4", "s1", "s2"]
    stop = sweep["saturation_stop"]
    assert stop["load_point"] == "sweep-r30" and stop["rate"] == 30.0 and stop["sweep_step"] == "s2"
    assert stop["skipped"] == ["s3", "s4"]
    assert stop["time_kept_s"] == 2 * 2.5
    assert [row["saturated"] for row in sweep["steps"]] == [False, False, False, True]
    # The highest rate it kept up with: 20 at s1 (30 offered, 25 taken: below 90 %).
    assert sweep["saturation_rate"] == 20.0


def test_a_sweep_without_a_saturated_rate_runs_every_rate() -> None:
    profile = LoadProfile(sweep=Sweep(rates=2, max_concurrency=4), requests=10)

    async def run_step(point: str, pattern: LoadPattern, step: str) -> Mapping[str, Any]:
        return {"valid": True, "achieved_rate": 10.0, "trend": {"saturated": False}}

    sweep = asyncio.run(run_sweep(profile, run_step))
    assert len(sweep["steps"]) == 4 and sweep["saturation_stop"] is None


SLOTS, SERVICE_S = 2, 0.05
# No more than this many requests a second can be served: 2 slots, each reply at least 50 ms.
CEILING = SLOTS / SERVICE_S


def test_a_sweep_against_a_fixed_capacity_stops_above_it_and_names_the_rate(
    pytester: pytest.Pytester,
) -> None:
    """The stand-in serves at most 2 replies at once, each at least 50 ms: at most 40 req/s.
    The sweep's rates reach 10 x what its closed loop of 2 took, so its first open-loop rate is
    well above the ceiling; 40 requests sent on a constant schedule above it queue, their TTFT
    and the requests in flight rising with every send. It stops there: the second rate is not
    run. A second of warm-up first: the stand-in accepts the 100-odd connections the client
    opens ahead one thread at a time, a few ms each, and a request sent on one it has not
    accepted yet waits in the kernel (the first requests were served last without it)."""
    with keepalive_server(slots=SLOTS, prefill_s=SERVICE_S) as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {sweep: {rates: 2, max_concurrency: 2, up_to: 10}, requests: 40,"
            " warmup_s: 1, arrival: constant, max_send_lag_ms: 100}}\n",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    result.assert_outcomes(passed=1)
    records = ledger_records(pytester)
    loads = [r for r in records if r["type"] == "load"]
    (sweep,) = [r for r in loads if r["pattern"] == "sweep"]
    steps = {r["sweep_step"]: r for r in loads if r["pattern"] != "sweep"}
    assert set(steps) == {"c1", "c2", "s1"}
    first = steps["s1"]
    # The set-up: its rate is above the ceiling by a fifth at least.
    assert first["rate"] > 1.2 * CEILING
    assert first["trend"]["saturated"] is True, first["trend"]
    stop = sweep["saturation_stop"]
    assert stop["load_point"] == first["load_point"] and stop["rate"] == first["rate"]
    assert stop["skipped"] == ["s2"] and stop["time_kept_s"] > 0
    assert {c["load_point"] for c in records if c["type"] == "call"} == {
        step["load_point"] for step in steps.values()
    }
    # Over-saturated: not a rate it kept up with.
    assert sweep["saturation_rate"] is not None and sweep["saturation_rate"] <= CEILING
    result.stdout.fnmatch_lines([f"*sweep*over-saturated at {first['rate']:.2f} req/s*"])


def test_a_step_the_baseline_measured_and_the_sweep_skipped_at_saturation_holds_the_run_back() -> (
    None
):
    """A sweep that saturated earlier than its baseline's skips steps the baseline measured: each
    is `inconclusive` (the run exits 10, not 0: a CI gate never passes what it did not measure),
    naming where the sweep stopped. A step the baseline did not measure either says nothing."""
    from pytest_gpubench.results.judging import holds_back
    from pytest_gpubench.results.load_gate import judge_loads

    sweep = {
        "type": "load", "pattern": "sweep", "cell_id": "c", "prompt_id": "P",
        "load_point": "sweep", "saturation_rate": 9.0,
        "saturation_stop": {"load_point": "sweep-r8", "sweep_step": "s1", "rate": 8.0,
                            "saturated": True, "time_kept_s": 6.0, "skipped": ["s2", "s3"]},
    }  # fmt: skip
    baseline = {"P@load-sweep-s2": {"rate": 12.0, "output_tokens_per_sec": 900.0}}
    judged = judge_loads([sweep], {"c": baseline}, {})
    (verdict,) = [v for v in judged if v.prompt_id != "P@load-sweep"]  # the sweep's own: new
    assert verdict.prompt_id == "P@load-sweep-s2" and verdict.verdict == "inconclusive"
    assert holds_back(verdict)
    assert verdict.message == (
        "c P@load-sweep-s2: not measured: the sweep stopped at saturation at s1 (8.0 req/s); the "
        "baseline measured s2 (12 req/s); re-run, or ratify the lower capacity with "
        "--baseline-update"
    )
    assert [v.prompt_id for v in judge_loads([sweep], {"c": {}}, {})] == ["P@load-sweep"]


def test_ratifying_a_sweep_that_stopped_at_saturation_drops_the_steps_it_did_not_run(
    tmp_path: Path,
) -> None:
    """--baseline-update after a sweep saturated earlier: the steps it skipped leave the baseline
    (its lower capacity is what was ratified), so the next run is not held back by them."""
    from pytest_gpubench.results.load_baseline import read_load_baseline, write_load_baselines
    from pytest_gpubench.results.load_gate import judge_loads

    def step(name: str, rate: float) -> dict[str, Any]:
        return {
            "type": "load", "pattern": "open", "cell_id": "c", "prompt_id": "P", "valid": True,
            "load_point": f"sweep-r{rate:g}", "sweep_step": name, "rate": rate, "requests": 20,
            "ok": 20, "output_tokens_per_sec": 900.0, "benchmark_run_id": "r1",
        }  # fmt: skip

    write_load_baselines(tmp_path, [step("s1", 8.0), step("s2", 12.0), step("s3", 16.0)])
    assert set(read_load_baseline(tmp_path, "c")) >= {"P@load-sweep-s2", "P@load-sweep-s3"}
    sweep = {
        "type": "load", "pattern": "sweep", "cell_id": "c", "prompt_id": "P", "valid": True,
        "load_point": "sweep", "saturation_rate": 7.5, "benchmark_run_id": "r2",
        "saturation_stop": {"sweep_step": "s1", "rate": 8.0, "skipped": ["s2", "s3"]},
    }  # fmt: skip
    notes = write_load_baselines(tmp_path, [{**step("s1", 8.0), "benchmark_run_id": "r2"}, sweep])
    kept = read_load_baseline(tmp_path, "c")
    assert "P@load-sweep-s1" in kept
    assert "P@load-sweep-s2" not in kept and "P@load-sweep-s3" not in kept
    assert any("P@load-sweep-s2 removed: the sweep stopped at saturation at s1" in n for n in notes)
    held = [v for v in judge_loads([sweep], {"c": kept}, {}) if v.verdict == "inconclusive"]
    assert held == []
