"""Load cases against the real llama-server serving the tiny model with 4 slots: throughput
rises with concurrency (each stream paced by a proxy, so that a request's time is certain), every
request gets max_tokens, an open loop records its Poisson schedule and its send lag against it,
the engine's own token counter agrees with the client's, and the gate fails a load point whose
throughput a pacing proxy halved (tests/support/pacing_proxy.py) while passing an unchanged one."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.pacing_proxy import PacingProxyProcess, pacing_proxy_process

from pytest_gpubench.engines import tinymodel
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.engines.tinymodel import TinyConfig
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.targets.local import LocalTarget

pytestmark = pytest.mark.engine

MAX_TOKENS = 64
PROMPTS = (
    f"prompts:\n  P-LOAD: {{intent: load, prompt: 'Count to ten.', max_tokens: {MAX_TOKENS}}}\n"
)
TEST_FILE = (Path(__file__).parent.parent / "benchmarks" / "test_inference.py").read_text()


def ledger_records(root: Path) -> list[dict[str, Any]]:
    """The newest ledger's records."""
    (ledger,) = sorted((root / "runs").glob("*.jsonl"), key=lambda path: path.stat().st_mtime)[-1:]
    return read_ledger(ledger)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """The load benchmark in this process: no proxy thread shares it (the pacing proxy runs in
    a process of its own), and a subprocess would add 2-5 s of imports to each run."""
    # The subject is the load client, not the shared machine's steadiness.
    options = ("--force-load", "--allow-dirty", "-p", "no:cacheprovider", "-m", "load",
               "--gpubench-steadiness", "off", *args)  # fmt: skip
    return pytester.runpytest(*options)


def write_project(pytester: pytest.Pytester, cells: str, max_tokens: int = MAX_TOKENS) -> None:
    """prompts.yaml (P-LOAD with max_tokens), this cells.yaml, the shipped benchmark test."""
    prompts = PROMPTS.replace(str(MAX_TOKENS), str(max_tokens))
    pytester.makefile(".yaml", prompts=prompts, cells=cells)
    pytester.makepyfile(test_bench=TEST_FILE)


def managed_cell(load: str, model: str = "tiny", model_path: Path | None = None) -> str:
    path = f" model_path: '{model_path}'," if model_path is not None else ""
    return (
        "nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: {model},{path} parallel: 4,"
        f" server_args: [--threads, '1'], load: {{{load}}}}}\n"
    )


# A model that spends its time in matrix products (about 4 ms a token on one thread here), so
# that a batch of 4 costs far less than 4 single steps: the tiny model spends its time in
# per-request overhead, which no batching shares, so its throughput hardly moves with slots.
HEAVY = TinyConfig(n_embd=512, n_layer=4, n_head=8, n_head_kv=4, n_ff=1536)
HEAVY_TOKENS = 64
# The machine is shared: a run whose neighbours took the cores during one point is measured
# again, up to this many times.
ATTEMPTS = 3
# One content event per stream every 25 ms: 16 tokens take 0.4 s whatever the engine's speed
# (the tiny model's 4 slots give 16 tokens in about 30 ms here), so 4 paced streams ask the
# engine for 160 tokens/s, a fifth of what it serves on one busy core.
PACED_GAP_S = 0.025


@pytest.fixture(scope="module")
def heavy_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's vocabulary and weights generator at a size where batching pays."""
    path = tmp_path_factory.mktemp("heavy") / "heavy.gguf"
    tinymodel.write_tiny_model(path, config=HEAVY)
    return path


# Throughput at 1, 2 and 4 streams compared: alone under -n (tests/support/schedule.py).
@pytest.mark.serial
def test_throughput_rises_with_concurrency_and_every_request_gets_max_tokens(
    pytester: pytest.Pytester, llama_server: Path, heavy_model: Path, proxy: PacingProxyProcess
) -> None:
    """Counts and gauges on the heavy model as it is; the rise of throughput with concurrency
    through the pacing proxy. Whether a real engine gives more tokens/s at 2 streams than at 1
    is a figure of the machine, not of this code (on a fresh 2-core machine it did not:
    557/463/669 tokens/s at 1, 2, 4): with each stream paced to one content event every
    PACED_GAP_S, a request's time is the proxy's, and only a closed loop that keeps 1, 2 and 4
    requests in flight gives 1, 2 and 4 times its throughput."""
    # Replies of HEAVY_TOKENS: a request spends far longer in the engine (about 0.5 s at 4
    # slots) than the client takes to send the next one, even when the client's own worker
    # waits for a CPU, so the engine's gauge of requests in progress, sampled every 200 ms,
    # reads 3 or 4 at c4. With 16 tokens (about 0.1 s) a starved client's turnaround was as
    # long, and under -n 3 every sample of a 1 s point once read 2 or less.
    write_project(
        pytester,
        managed_cell("concurrency: [1, 2, 4], duration_s: 1", "heavy", heavy_model),
        max_tokens=HEAVY_TOKENS,
    )
    result = run(pytester)
    result.assert_outcomes(passed=3)
    records = ledger_records(pytester.path)
    loads = {r["load_point"]: r for r in records if r["type"] == "load"}
    calls = [r for r in records if r["type"] == "call"]
    assert all(r["error"] is None for r in calls)
    # ignore_eos: every request generates exactly max_tokens, by the engine's count and ours.
    assert {r["completion_tokens"] for r in calls} == {HEAVY_TOKENS}
    assert {r["client_chunks"] for r in calls} == {HEAVY_TOKENS}
    for point, load in loads.items():
        assert load["valid"], load["invalid_reason"]
        # The engine's own counter (llama-server --metrics) over the point equals ours.
        counters = load["engine_counters"]
        assert counters["llamacpp:tokens_predicted_total"] == load["client_completion_tokens"]
        assert load["ok"] == load["requests"] > 0, point
    samples = [r for r in records if r["type"] == "sample" and r.get("engine")]
    assert {s["load_point"] for s in samples} == {"c1", "c2", "c4"}
    at_four = next(s for s in samples if s["load_point"] == "c4")["engine"]
    assert max(v or 0 for v in at_four["llamacpp:requests_processing"]) >= 3
    result.stdout.fnmatch_lines(["load: local:llamacpp:heavy", "*P-LOAD*c4*ok"])
    print(
        "output tokens/s of the heavy model at concurrency 1, 2, 4:",
        [loads[p]["output_tokens_per_sec"] for p in ("c1", "c2", "c4")],
    )

    proxy.gap_s = PACED_GAP_S
    write_project(
        pytester,
        "nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{proxy.url}',"
        " load: {concurrency: [1, 2, 4], duration_s: 0.5}}\n",
        max_tokens=16,
    )
    paced = run(pytester)
    paced.assert_outcomes(passed=3)
    loads = {r["load_point"]: r for r in ledger_records(pytester.path) if r["type"] == "load"}
    throughput = [loads[p]["output_tokens_per_sec"] for p in ("c1", "c2", "c4")]
    print("output tokens/s through the pacing proxy at concurrency 1, 2, 4:", throughput)
    assert throughput[0] < throughput[1] < throughput[2]


def test_a_poisson_run_records_its_schedule_and_keeps_it(
    pytester: pytest.Pytester, llama_server: Path, tiny_model: Path
) -> None:
    """The client records each request's Poisson schedule (seeded: the same 24 sends each run)
    and its send lag against it, and judges the point on that lag. How close to the schedule it
    keeps on this machine (p99 well under a millisecond, quiet) is a figure of the machine, not
    asserted here: a run during which neighbours held both cores is late by milliseconds.
    benchmarks_dev/trace_lag.py measures it for the same schedule loop (send_on_schedule)
    against the real llama-server, and this test prints it."""
    write_project(
        pytester, managed_cell("rate: [16], arrival: poisson, requests: 24"), max_tokens=16
    )
    result = run(pytester)
    records = ledger_records(pytester.path)
    (load,) = [r for r in records if r["type"] == "load"]
    lags = (load["send_lag_ms_p50"], load["send_lag_ms_p99"], load["send_lag_ms_max"])
    print("send lag p50/p99/max ms:", lags, "load average:", os.getloadavg()[0])
    if load["valid"]:
        result.assert_outcomes(passed=1)
    else:
        # Neighbours held both cores past the point's own limit (max_send_lag_ms): the point
        # fails as it should, for that reason alone.
        assert "send lag" in (load["invalid_reason"] or ""), load["invalid_reason"]
        assert load["send_lag_ms_p99"] > load["max_send_lag_ms"]
        result.assert_outcomes(failed=1)
    calls = [r for r in records if r["type"] == "call"]
    assert load["pattern"] == "open" and load["arrival"] == "poisson" and load["rate"] == 16
    assert len(calls) == load["requests"] == 24
    for call in calls:
        assert call["scheduled_send_ms"] <= call["send_ms"]
        lag = call["send_ms"] - call["scheduled_send_ms"]
        assert call["send_lag_ms"] == pytest.approx(lag, abs=1e-3)
    scheduled = [c["scheduled_send_ms"] for c in sorted(calls, key=lambda c: c["request_idx"])]
    gaps = [b - a for a, b in itertools.pairwise(scheduled)]
    assert len({round(g, 1) for g in gaps}) > len(gaps) // 2  # Poisson, not constant
    assert load["send_lag_ms_p50"] <= load["send_lag_ms_p99"] <= load["send_lag_ms_max"]


@pytest.fixture(scope="module")
def four_slot_server(
    llama_server: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    target = LocalTarget()
    managed = ManagedLlamaServer(
        target,
        cell_id="local:llamacpp:tiny",
        binary=str(llama_server),
        model_path=str(tiny_model),
        alias="tiny",
        log_dir=str(tmp_path_factory.mktemp("llama-log")),
        extra_args=("--threads", "1"),
        parallel=4,
        metrics=True,
    )
    try:
        yield managed.start()
    finally:
        managed.stop()
        target.close()


@pytest.fixture
def proxy(four_slot_server: str) -> Iterator[PacingProxyProcess]:
    with pacing_proxy_process(four_slot_server) as running:
        yield running


def test_a_halved_throughput_at_concurrency_4_fails_the_gate_and_an_unchanged_one_passes(
    pytester: pytest.Pytester, proxy: PacingProxyProcess
) -> None:
    write_project(
        pytester,
        "nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{proxy.url}',"
        " load: {concurrency: [4], duration_s: 6, thresholds: {ttft_p99: 5, tpot_p99: 5}}}\n",
        max_tokens=16,
    )
    # The throughput is the proxy's, not the shared machine's: one content event every
    # PACED_GAP_S for the baseline and the unchanged run, every twice that for the halved one.
    # A reply of 16 tokens takes 0.4 s (0.8 s halved): 6 s give 6 one-second throughput samples
    # or more a run, enough for the gate's test to be significant even with one baseline second
    # stalled by a neighbour (6 against 6: p = 1/924 at best; 4 against 4 would not survive it).
    proxy.gap_s = PACED_GAP_S
    baseline = run(pytester, "--baseline-update")
    assert baseline.ret == 0, baseline.stdout.str()[-3000:]
    assert (pytester.path / "baselines" / "load" / "local_llamacpp_tiny.json").exists()
    (measured,) = [r for r in ledger_records(pytester.path) if r["type"] == "load"]

    # Unchanged: the same speed passes. Throughput alone is judged at 30 % here (the p99
    # latencies at 500 %): on this shared 2-core machine a neighbour's burst moves a p99 by 3x
    # between runs; and a run during which one took the cores is measured again.
    unchanged = [run(pytester) for _ in range(1)]
    while unchanged[-1].ret != 0 and len(unchanged) < ATTEMPTS:
        unchanged.append(run(pytester))
    assert unchanged[-1].ret == 0, unchanged[-1].stdout.str()[-3000:]

    # Each content event waits for its turn, one every twice the gap: every stream takes about
    # twice as long, while the engine runs as fast as before.
    proxy.gap_s = 2 * PACED_GAP_S
    halved = run(pytester)
    text = halved.stdout.str()
    assert halved.ret == 6, text[-3000:]
    (load,) = [r for r in ledger_records(pytester.path) if r["type"] == "load"]
    assert load["output_tokens_per_sec"] < 0.7 * measured["output_tokens_per_sec"]
    halved.stdout.fnmatch_lines(
        [
            "REGRESSION: local:llamacpp:tiny P-LOAD@load-c4: output tokens/s -*",
            "*load regression(s)*",
        ]
    )
