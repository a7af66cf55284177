"""The warm calls checked against the real engines' own word (issue 35): llama-server's `usage`
against the tokens streamed, its prefix cache (timings.cache_n) on and off, its Prometheus
counters read around each warm call, and speculative decoding with a draft model (the tiny model
drafting for itself), in one session of three managed cells on the source-built server; and
vLLM CPU's prefix cache, which ignores llama.cpp's switch (warned of) and is kept cold by a cache
salt per call."""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

import pytest
from support.vllm_server import VllmServer

from pytest_gpubench.cli.main import main
from pytest_gpubench.ledger.writer import read_ledger

PROMPTS = (
    'prompts:\n  P-EASY: {intent: short, prompt: "What is the capital of France?", '
    "max_tokens: 24}\n"
)
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
CACHED = "local:llamacpp:tiny"
UNCACHED = "local:llamacpp:tiny@nocache"
DRAFTED = "local:llamacpp:tiny@draft"


@pytest.mark.engine
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
    # The same rows in the reports read after the run: the pull request summary the session
    # wrote, and the Markdown and HTML reports of its ledger.
    (summary,) = (pytester.path / "runs").glob("*.summary.md")
    report, page = pytester.path / "report.md", pytester.path / "report.html"
    assert main(["report", str(ledger), "-o", str(report)]) == 0
    assert main(["report", str(ledger), "--html", "-o", str(page)]) == 0
    cells = r"\s*(?:\|\s*|</td><td[^>]*>)"
    for text in (
        summary.read_text(encoding="utf-8"),
        report.read_text(encoding="utf-8"),
        page.read_text(encoding="utf-8"),
    ):
        checks = text[text.index("Checks against the engine") :]
        assert re.search(
            re.escape(CACHED)
            + cells
            + "P-EASY"
            + cells
            + "3/3 agree"
            + cells
            + r"3/3 hit \(\d+/\d+ tokens\)",
            checks,
        ), checks
        assert re.search(
            re.escape(UNCACHED)
            + cells
            + "P-EASY"
            + cells
            + "3/3 agree"
            + cells
            + r"0/3 hit \(0/\d+ tokens\)",
            checks,
        ), checks
        assert re.search(
            re.escape(DRAFTED) + cells + "P-EASY" + ".*" + re.escape(f"{accepted}/{proposed} ("),
            checks,
        ), checks


# Longer than a few of vLLM's 16-token KV blocks: a prompt shorter than one is never cached.
LONG_PROMPT = " ".join(["Explain in four sentences why the sky appears blue at noon."] * 8)


# Token counts per streamed chunk: 7 streamed against a usage of 8 once under -n 3 at load 9 (taken
# for vLLM's API server falling behind and sending two tokens in one chunk): alone under -n
# (tests/support/schedule.py).
@pytest.mark.serial
@pytest.mark.vllm
def test_vllm_prefix_cache_asked_off_is_warned_and_a_salt_per_call_keeps_it_cold(
    pytester: pytest.Pytester, vllm_server: VllmServer
) -> None:
    """vLLM ignores llama.cpp's `cache_prompt: false`: its warm calls are served from its
    prefix cache all the same, which its counters show and the run warns of; a cache salt of
    each call's own (`cache_salt: per_call`) keeps every warm call a prefill."""
    cell = (
        f"node: local, engine: openai, model: {vllm_server.served_name}, "
        f"endpoint: '{vllm_server.base_url}/v1', runs: 2, phases: [warm], token_check: fail"
    )
    pytester.makefile(
        ".yaml",
        prompts=(f'prompts:\n  P-LONG: {{intent: long, prompt: "{LONG_PROMPT}", max_tokens: 8}}\n'),
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{{cell}, name: asked-off, request: {{ignore_eos: true, "
        "extra_body: {cache_prompt: false}}}\n"
        f"  - {{{cell}, name: salted, request: {{ignore_eos: true, cache_salt: per_call}}}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest("--force-load", "--gpubench-steadiness", "off")
    assert result.ret == 0, result.stdout.str()
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    calls: dict[str, list[dict[str, Any]]] = {}
    for record in read_ledger(ledger):
        if record.get("type") == "call" and record["phase"] == "warm":
            calls.setdefault(record["cell_id"].rsplit("@", 1)[1], []).append(record)
    every = calls["asked-off"] + calls["salted"]
    assert len(every) == 4
    # vLLM's usage agrees with what it streamed (token_check: fail passed the run).
    assert all(call["token_mismatch"] is False for call in every)
    for call in every:
        assert call["prefix_cache_off"] is True
        assert call["engine_counters"]["prefix_cache_queries"] >= call["prompt_tokens"]
    for call in calls["asked-off"]:
        assert call["prefix_cache_hit"] is True
        assert call["engine_counters"]["prefix_cache_hits"] > 0
    for call in calls["salted"]:
        assert call["prefix_cache_hit"] is False
        assert call["engine_counters"]["prefix_cache_hits"] == 0
    result.stdout.fnmatch_lines(
        [
            "*@asked-off * P-LONG * 2/2 agree * 2/2 hit (*/* tokens) ASKED OFF *",
            "*@salted * P-LONG * 2/2 agree * 0/2 hit (0/* tokens) *",
            "PREFIX CACHE: *@asked-off P-LONG: 2 of 2 warm calls were served from the engine's "
            "prefix cache although the request asked for none*",
        ]
    )
    assert "PREFIX CACHE: *@salted" not in result.stdout.str()


@pytest.mark.engine
def test_a_load_point_with_a_draft_model_records_its_acceptance(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    """Speculative decoding per load point: llama-server's spec_decode counters over the point
    give its acceptance rate and mean acceptance length in the load record."""
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, phases: [warm], runs: 1, "
        f"server_binary: '{llama_server}', server_args: [--threads, '1'], parallel: 2, "
        "draft_model: tiny, draft_max: 3, load: {concurrency: [2], requests: 6}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest("--force-load", "--gpubench-steadiness", "off", "-m", "load")
    assert result.ret == 0, result.stdout.str()
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    (load,) = [r for r in read_ledger(ledger) if r.get("type") == "load"]
    counters = load["engine_counters"]
    drafts = counters["llamacpp:spec_decode_num_drafts_total"]
    proposed = counters["llamacpp:spec_decode_num_draft_tokens_total"]
    accepted = counters["llamacpp:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= proposed
    assert load["spec_acceptance_rate"] == round(accepted / proposed, 4)
    assert load["spec_mean_acceptance_length"] == round(accepted / drafts + 1, 4)
    # Every request of the point streamed the tokens the engine counted.
    assert load["token_mismatches"] == 0
    # The tiny model drafting for itself: the target accepts what its own copy proposed.
    assert load["spec_acceptance_rate"] == 1.0
    # Shown per point in the load tables (terminal, Markdown report) and in the load CSV.
    length = f"{load['spec_mean_acceptance_length']:.2f}"
    result.stdout.fnmatch_lines(
        ["*point*draft accepted*", f"*P-EASY*c2*100% (mean length {length})*ok*"]
    )
    report, exported = pytester.path / "report.md", pytester.path / "load.csv"
    assert main(["report", str(ledger), "-o", str(report)]) == 0
    assert f"| 100% (mean length {length}) |" in report.read_text(encoding="utf-8")
    assert main(["export", str(ledger), "--load-csv", str(exported)]) == 0
    with exported.open(encoding="utf-8", newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    assert (row["spec_acceptance_rate"], row["token_mismatches"]) == ("1.0", "0")
