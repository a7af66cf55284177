"""The examples in benchmarks/ on cells other than the embedded default's, against the real
llama-server (tests/conftest.py `server`: the tiny model, served as `tiny`): an `openai` cell in
front of it prefills the long prompt whole on every call (its prompt cache turned off through the
OpenAI-compatible API too), and the JSON example judges every cell's answers alike.
(tests/test_custom_benchmarks.py runs them on the embedded default's `llamacpp` cell.)
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.vllm_server import VllmServer

from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.ledger.writer import read_ledger

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = ("test_chat.py", "test_long_context.py", "test_json_answer.py")
PROMPTS = 'prompts:\n  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}\n'
# benchmarks/test_long_context.py's prompt: PROMPT_TOKENS tokens of " the".
PROMPT_TOKENS = 1536
LONG_PROMPT = "Count the words that follow." + " the" * PROMPT_TOKENS


def examples(pytester: pytest.Pytester, cells: str) -> None:
    pytester.makefile(
        ".yaml", prompts=PROMPTS, cells="nodes: {local: {kind: local}}\ncells:\n" + cells
    )
    for name in EXAMPLES:
        shutil.copy(REPO / "benchmarks" / name, pytester.path / name)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("--force-load", "-p", "no:cacheprovider", *args)


def calls_by_test(pytester: pytest.Pytester) -> dict[str, list[dict[str, Any]]]:
    newest = max((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    by_test: dict[str, list[dict[str, Any]]] = {}
    for record in read_ledger(newest):
        if record["type"] == "call":
            by_test.setdefault(record["test_id"], []).append(record)
    return by_test


def prompt_evaluated(base_url: str) -> int:
    """Send the long prompt on llama-server's OpenAI-compatible API as a client would (its prompt
    cache left on), and return how many prompt tokens the server says it evaluated."""
    answer = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": LONG_PROMPT}],
            "max_tokens": 16,
        },
        timeout=120,
    )
    answer.raise_for_status()
    return int(answer.json()["timings"]["prompt_n"])


@pytest.mark.engine
def test_on_an_openai_cell_in_front_of_llama_server_every_long_context_call_is_a_whole_prefill(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    url = server.base_url
    examples(
        pytester, f"  - {{node: local, engine: openai, model: tiny, endpoint: '{url}', runs: 2}}\n"
    )
    result = run(pytester, "-rx")
    assert result.ret == 0, result.stdout.str()
    # The chat 2 warm runs, the prefill 1 cold and 2 warm, the JSON answer 5 warm runs: judged
    # on the tiny model under this cell's id too, and never valid.
    result.assert_outcomes(passed=10)
    result.stdout.fnmatch_lines(["*local:openai:tiny *test_json_answer *0/5 schema valid*"])
    prefill = calls_by_test(pytester)["test_long_context_prefill"]
    assert [call["phase"] for call in prefill] == ["cold", "warm", "warm"]
    for call in prefill:
        assert call["error"] is None and call["cell_id"] == "local:openai:tiny"
        assert call["prompt_tokens"] >= PROMPT_TOKENS
        # llama-server's own count of what it prefilled: all of it, on the warm calls too.
        assert call["engine_timings"]["prompt_n"] == call["prompt_tokens"], call["engine_timings"]
    warm_ttft = statistics.median(c["first_delta_ms"] for c in prefill if c["phase"] == "warm")

    # The control: the same prompt with the cache left on, twice. The second is served from the
    # cache, which is what the example's warm calls measured before it turned the cache off here.
    prompt_evaluated(url)
    cached = prompt_evaluated(url)
    assert cached < PROMPT_TOKENS
    print(f"warm TTFT {warm_ttft:.1f} ms, whole prefill; cache on: {cached} tokens evaluated")


@pytest.mark.engine
def test_the_json_example_judges_every_cell_alike_whatever_its_model_or_kind(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    """Three cells on the same llama-server: the tiny model under another engine kind, under
    another cell name, and a cell naming another model. The example expects nothing of a model
    (issue 44: it had expected failure of `tiny` alone, and failed every other model that does
    not answer JSON): each cell's five cases pass, each answer judged not schema valid."""
    url = server.base_url
    examples(
        pytester,
        f"  - {{node: local, engine: openai, model: tiny, endpoint: '{url}'}}\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, name: copy, endpoint: '{url}'}}\n"
        f"  - {{node: local, engine: llamacpp, model: other, endpoint: '{url}'}}\n",
    )
    result = run(pytester, "test_json_answer.py", "-rxf")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.assert_outcomes(passed=15)
    for cell in ("local:openai:tiny", "local:llamacpp:tiny@copy", "local:llamacpp:other"):
        result.stdout.fnmatch_lines([f"*{cell} *test_json_answer *0/5 schema valid*"])
    # Measured all the same, on every cell.
    calls = calls_by_test(pytester)["test_json_answer"]
    assert len(calls) == 15 and all(call["error"] is None for call in calls)
    assert {call["schema_valid"] for call in calls} == {0}


@pytest.mark.vllm
def test_the_examples_run_on_a_real_vllm_that_ignores_the_cache_switch(
    pytester: pytest.Pytester, vllm_server: VllmServer
) -> None:
    """vLLM (tests/support/vllm_server.py: a tiny random-weight model, served as `tiny-vllm`)
    takes the long-context request with `cache_prompt` in it (a key it does not have) and counts
    the whole prompt; its prefix cache is the server's setting, which these calls leave as it is.
    The JSON example is judged on this model too: its noise is never schema valid, a figure,
    not a failed test."""
    examples(
        pytester,
        f"  - {{node: local, engine: openai, model: {vllm_server.served_name}, "
        f"endpoint: '{vllm_server.base_url}/v1', runs: 2}}\n",
    )
    result = run(pytester, "-rxf")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.assert_outcomes(passed=10)
    result.stdout.fnmatch_lines(["*local:openai:tiny-vllm *test_json_answer *0/5 schema valid*"])
    by_test = calls_by_test(pytester)
    prefill = by_test["test_long_context_prefill"]
    assert [call["phase"] for call in prefill] == ["cold", "warm", "warm"]
    for call in prefill:
        assert call["error"] is None and call["prompt_tokens"] >= PROMPT_TOKENS
        assert not call["engine_timings"]  # vLLM sends no per-request timings in its stream
    assert all(call["error"] is None for calls in by_test.values() for call in calls)
