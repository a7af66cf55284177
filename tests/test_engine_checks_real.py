"""The warm calls checked against the real llama-server's own word (issue 35): its `usage`
against the tokens streamed, its prefix cache (timings.cache_n) on and off, its Prometheus
counters read around each warm call, and speculative decoding with a draft model (the tiny model
drafting for itself), in one session of three managed cells on the source-built server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpubench.ledger.writer import read_ledger

pytestmark = pytest.mark.engine

PROMPTS = (
    'prompts:\n  P-EASY: {intent: short, prompt: "What is the capital of France?", '
    "max_tokens: 24}\n"
)
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
CACHED = "local:llamacpp:tiny"
UNCACHED = "local:llamacpp:tiny@nocache"
DRAFTED = "local:llamacpp:tiny@draft"


def test_token_counts_cache_hits_counters_and_draft_acceptance_on_the_real_server(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    managed = (
        f"node: local, engine: llamacpp, model: tiny, runs: 3, phases: [warm], "
        f"server_binary: '{llama_server}', server_args: [--threads, '1'], token_check: fail"
    )
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{{managed}}}\n"
        f"  - {{{managed}, name: nocache, request: {{extra_body: {{cache_prompt: false}}}}}}\n"
        f"  - {{{managed}, name: draft, draft_model: tiny, draft_max: 4}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest("--force-load", "--gpubench-steadiness", "off")
    # token_check: fail on every cell: the real server's usage agrees with what it streamed.
    assert result.ret == 0, result.stdout.str()
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    calls: dict[str, list[dict[str, Any]]] = {}
    for record in read_ledger(ledger):
        if record.get("type") == "call" and record["phase"] == "warm":
            calls.setdefault(record["cell_id"], []).append(record)
    assert {cell: len(made) for cell, made in calls.items()} == {
        CACHED: 3,
        UNCACHED: 3,
        DRAFTED: 3,
    }
    every = [call for made in calls.values() for call in made]
    assert all(call["token_mismatch"] is False for call in every)
    assert all(call["client_chunks"] == call["completion_tokens"] for call in every)
    # The prompt cache on: each warm call repeats the one before it (the warm-up first), so
    # llama-server serves its prompt from the cache, and says so in its timings and counters.
    for call in calls[CACHED]:
        assert call["prefix_cache_hit"] is True and call["cached_prompt_tokens"] > 0
        assert "prefix_cache_off" not in call
        counters = call["engine_counters"]
        assert counters["prefix_cache_hits"] == call["cached_prompt_tokens"]
        assert counters["prefix_cache_queries"] == call["prompt_tokens"]
    # Off (cache_prompt: false): no call served from it, the request's wish recorded.
    for call in calls[UNCACHED]:
        assert call["prefix_cache_hit"] is False and call["prefix_cache_off"] is True
        assert call["engine_counters"]["prefix_cache_hits"] == 0
    # The draft model proposed tokens, and the per-call figures match the server's counters.
    for call in calls[DRAFTED]:
        assert call["draft_tokens"] > 0
        assert 0 <= call["draft_accepted_tokens"] <= call["draft_tokens"]
        assert call["engine_counters"]["spec_draft_tokens"] == call["draft_tokens"]
        assert call["engine_counters"]["spec_accepted_tokens"] == call["draft_accepted_tokens"]
    accepted = sum(call["draft_accepted_tokens"] for call in calls[DRAFTED])
    proposed = sum(call["draft_tokens"] for call in calls[DRAFTED])
    result.stdout.fnmatch_lines(
        [
            "cell * prompt * token counts * prefix cache * engine counters * draft accepted",
            f"{CACHED} * P-EASY * 3/3 agree * 3/3 hit (*/* tokens) * requests queued (peak) 0 *",
            f"{UNCACHED} * P-EASY * 3/3 agree * 0/3 hit (0/* tokens) *",
            f"{DRAFTED} * P-EASY * 3/3 agree * {accepted}/{proposed} (*%)",
        ]
    )
    # Asked off and honoured: nothing to warn of.
    assert "PREFIX CACHE" not in result.stdout.str()
    assert "TOKEN COUNTS" not in result.stdout.str()
