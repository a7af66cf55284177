"""Workloads against a real vLLM on CPU (conftest's `vllm_server`): token-exact synthetic
prompts of three sizes counted through vLLM's /tokenize, single-call and under load, and the same
through the model's tokenizer.json named by the cell (`tokenizer:`); `prompt_tokens` from
vLLM's usage is the size asked plus the chat template's overhead reported beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.workload_runs import (
    DATASET,
    SHAREGPT_PROMPTS,
    copy_sharegpt_sample,
    edit_every_question,
    ledger_records,
)
from support.workload_runs import run_workload as run

pytest.importorskip(
    "support.vllm_server", reason="the shared vLLM set-up (tests/support/vllm_server.py) is missing"
)

TEST_FILE = (Path(__file__).parent.parent / "benchmarks" / "test_inference.py").read_text()
SIZES = (16, 100, 400)


@pytest.mark.parametrize("tokenizer", [None, "model folder"])
@pytest.mark.vllm
def test_token_exact_synthetic_prompts_on_vllm(
    pytester: pytest.Pytester, vllm_server: Any, tokenizer: str | None
) -> None:
    from support.vllm_server import VLLM_MODEL_DIR

    named = f" tokenizer: '{VLLM_MODEL_DIR}'," if tokenizer else ""
    sizes = list(SIZES)
    pytester.makefile(
        ".yaml",
        prompts="prompts:\n"
        f"  syn: {{intent: sizes, synthetic: {{input_tokens: {sizes}, output_tokens: 4}}}}\n",
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: openai, model: tiny-vllm, endpoint: '{vllm_server.base_url}',"
        f"{named} timeout_s: 120, runs: 2, phases: [warm], prompts: [syn],"
        f" load: {{concurrency: [2], requests: 6,"
        f" synthetic: {{input_tokens: {sizes}, output_tokens: 4}}}}}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = run(pytester)
    assert result.ret == 0, result.stdout.str()
    calls = [r for r in ledger_records(pytester.path) if r["type"] == "call"]
    assert {r["input_tokens_requested"] for r in calls} == set(SIZES)
    assert {r["prompt_id"] for r in calls if r.get("load_point") is None} == {
        f"syn#in{size}" for size in SIZES
    }
    counted_by = f"tokenizer {VLLM_MODEL_DIR / 'tokenizer.json'}" if tokenizer else None
    for call in calls:
        assert call["error"] is None
        assert call["tokens_counted_by"] == (counted_by or "engine /tokenize")
        assert call["template_tokens"] is not None and call["template_tokens"] > 0
        assert call["prompt_tokens"] == call["input_tokens_requested"] + call["template_tokens"]


@pytest.mark.vllm
def test_a_shared_prefix_shows_in_vllm_prefix_cache_counters(
    pytester: pytest.Pytester, vllm_server: Any
) -> None:
    """Prompts sharing a 1536-token prefix (2 groups) against unique prompts of the same length:
    vLLM's own prefix-cache counters over each point, in its load record."""
    cell = (
        f"node: local, engine: openai, model: tiny-vllm, endpoint: '{vllm_server.base_url}',"
        " timeout_s: 120"
    )
    shared = (
        "load: {concurrency: [2], requests: 12, synthetic: {input_tokens: 32, output_tokens: 4,"
        " count: 6}, prefix: {tokens: 1536, groups: 2}}"
    )
    unique = (
        "load: {concurrency: [2], requests: 12,"
        " synthetic: {input_tokens: 1568, output_tokens: 4, count: 13}}"
    )
    pytester.makefile(
        ".yaml",
        prompts="prompts:\n  P: {intent: p, prompt: hi, max_tokens: 4}\n",
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{{cell}, name: prefix, {shared}}}\n  - {{{cell}, name: unique, {unique}}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = run(pytester, "-m", "load")
    assert result.ret == 0, result.stdout.str()
    loads = {
        r["cell_id"].rsplit("@", 1)[1]: r
        for r in ledger_records(pytester.path)
        if r["type"] == "load"
    }
    shared_load, unique_load = loads["prefix"], loads["unique"]
    # TTFT is printed, not asserted: the tiny model reads 1568 tokens in a few ms on vLLM's CPU
    # back end, less than what a busy shared machine adds to a request's wait (on llama.cpp,
    # with a model whose prompt reading takes time, test_workloads_real asserts it).
    print(
        "vLLM prefix cache hit rate with / without a shared prefix:",
        shared_load["prefix_cache_hit_rate"], unique_load["prefix_cache_hit_rate"],
        "TTFT p50 ms:", shared_load["ttft_ms_p50"], unique_load["ttft_ms_p50"],
    )  # fmt: skip
    assert shared_load["prefix_cache_source"] == unique_load["prefix_cache_source"] == "vllm"
    assert shared_load["prefix_cache_hit_rate"] > 0.5
    assert unique_load["prefix_cache_hit_rate"] < 0.1


@pytest.mark.vllm
def test_a_sharegpt_sample_on_vllm_single_call_and_under_load_frozen(
    pytester: pytest.Pytester, vllm_server: Any
) -> None:
    sample = copy_sharegpt_sample(pytester.path)
    pytester.makefile(
        ".yaml",
        prompts=SHAREGPT_PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: openai, model: tiny-vllm, endpoint: '{vllm_server.base_url}',"
        " timeout_s: 120, runs: 5, phases: [warm], prompts: [chat],"
        f" load: {{concurrency: [2], requests: 6, dataset: {DATASET}}}}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    first = run(pytester, "--baseline-update")
    assert first.ret == 0, first.stdout.str()
    records = ledger_records(pytester.path)
    calls = [r for r in records if r["type"] == "call"]
    single = {r["prompt_id"] for r in calls if r.get("load_point") is None}
    assert len(single) == 3 and all(p.startswith("chat#") for p in single)
    (load,) = [r for r in records if r["type"] == "load"]
    assert load["prompt_id"] == "dataset-chat" and load["valid"] and load["ok"] == 6
    assert all(r["error"] is None for r in calls)

    edit_every_question(sample)
    stopped = run(pytester)
    assert stopped.ret == pytest.ExitCode.USAGE_ERROR
    stopped.stderr.fnmatch_lines(["*changed since the baseline of local:openai:tiny-vllm*"])
