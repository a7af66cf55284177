"""A load point checked against the engine's own figures, on a real vLLM on CPU (conftest's
`vllm_server`): the record carries vLLM's TTFT, TPOT and E2E means over exactly that point beside
the client's and the offsets; its throughput samples count tokens (their mean is the headline);
and behind a proxy that delivers every reply whole in one write (tests/support/reply_proxy.py:
the engine is not slowed, only what the client sees of it) the point counts its coalesced
replies and warns that its client-side figures are delivery delay."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from support.reply_proxy import reply_proxy

from pytest_gpubench.ledger.writer import read_ledger

# Long enough that the point lasts well over one throughput bucket (1 s) on a quiet machine:
# with 32 tokens vLLM served the 16 requests in 0.33 s, and the point had no samples to compare.
MAX_TOKENS = 256
PROMPTS = (
    f"prompts:\n  P-LOAD: {{intent: load, prompt: 'Count to ten.', max_tokens: {MAX_TOKENS}}}\n"
)
TEST_FILE = (Path(__file__).parent.parent / "benchmarks" / "test_inference.py").read_text()


def run_point(pytester: pytest.Pytester, endpoint: str) -> tuple[dict[str, Any], str]:
    """One closed-loop point at concurrency 4 (16 measured requests); its load record and the
    terminal's output."""
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: openai, model: tiny-vllm, endpoint: '{endpoint}',"
        " timeout_s: 120, load: {concurrency: [4], requests: 16}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest_subprocess(
        "--force-load", "--allow-dirty", "-p", "no:cacheprovider", "-m", "load"
    )
    result.assert_outcomes(passed=1)
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    (load,) = [r for r in records if r["type"] == "load"]
    return load, result.stdout.str()


@pytest.mark.vllm
@pytest.mark.serial
def test_a_vllm_load_point_carries_the_engines_own_means_beside_the_clients(
    pytester: pytest.Pytester, vllm_server: Any
) -> None:
    """The client's TPOT (asserted beside vLLM's) exists only where vLLM's streams reach the client
    in more than one read: beside the other workers of a parallel run on 2 cores (another vLLM on
    an SSH node among them) all 16 replies once came whole in one read. Serial, as the sweep.
    Alone too, on two cores vLLM's API server at times takes the four streams one after another,
    each whole (reproduced outside pytest with the load client's own connections, 2026-11-29):
    then no reply has a TPOT at the client, and the point says so (every reply counted as
    coalesced, the client's TPOT empty beside vLLM's), as a proxy that delivers replies whole
    makes it say in the next test."""
    load, output = run_point(pytester, vllm_server.base_url)
    assert load["valid"], load["invalid_reason"]
    check = load["server_check"]
    print(json.dumps(check, indent=1))
    assert check is not None, load["engine_metrics_notes"]
    assert check["engine"] == "vllm"
    # The /metrics reads bracket the point: vLLM counted exactly the point's requests.
    assert check["requests"] == check["client_requests"] >= load["ok"] == 16
    every_reply_whole = load["tpot_ms_n"] == 0
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        figure = check[name]
        if name == "tpot_ms" and every_reply_whole:
            assert figure["server_mean"] > 0 and figure["client_n"] == 0, figure
            assert figure["client_mean"] is None and figure["offset_ms"] is None, figure
            continue
        assert figure["server_mean"] > 0 and figure["client_mean"] > 0, name
        assert figure["offset_ms"] == pytest.approx(
            figure["client_mean"] - figure["server_mean"], abs=1e-3
        )
    # The client sees a reply after the engine made it, never before: its E2E is the longer.
    assert check["e2e_ms"]["offset_ms"] > 0
    assert load["ttft_ms_n"] == load["ok"] and load["tpot_ms_n"] <= load["ok"]
    assert load["coalesced_calls"] == load["ok"] - load["tpot_ms_n"]
    # Throughput samples in tokens: their mean is the headline output tokens/s.
    samples = load["samples"]["output_tokens_per_sec"]
    assert samples, load["window_s"]
    assert statistics.mean(samples) == pytest.approx(load["output_tokens_per_sec"], rel=0.02)
    assert "TTFT client / engine / offset ms" in output


@pytest.mark.vllm
def test_replies_delivered_whole_are_counted_and_warned_about(
    pytester: pytest.Pytester, vllm_server: Any
) -> None:
    with reply_proxy(vllm_server.base_url, whole_replies=True) as proxy:
        load, output = run_point(pytester, proxy.url)
    assert proxy.replies >= 16
    assert load["valid"], load["invalid_reason"]
    # Every reply came in one read: counted, no TPOT from any of them, the `n` says so.
    assert load["coalesced_calls"] == load["ok"] and load["coalesced_share"] == 1.0
    assert load["tpot_ms_n"] == 0 and load["tpot_ms_p50"] is None
    warnings = load["delivery_warnings"]
    assert warnings and "came whole in one read" in warnings[0]
    # The engine's own TTFT is its first token; the client's is the reply's end.
    ttft = load["server_check"]["ttft_ms"]
    assert ttft["client_mean"] > ttft["server_mean"]
    assert "WARNING" in output and "came whole in one read" in output
