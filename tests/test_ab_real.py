"""Head-to-head A/B against the real llama-server: a managed reference and a candidate served by a
second llama-server on the same binary and model, its replies held back by the delaying proxy
(tests/support/delay_proxy.py) where the test wants it slower. Each session is one pytest run,
in-process; the set-ups make each outcome certain: the held-back candidate is many times slower
than the threshold, and the unchanged one is judged at a threshold (+100 %) that two identical
servers called turn about do not come near."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
from support.delay_proxy import DelayProxy, delay_proxy
from support.tiny_server import tiny_llama_server

from pytest_gpubench.config.cases import build_cases
from pytest_gpubench.config.matrix import load_matrix
from pytest_gpubench.config.synthetic import WORDS
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.reports.terminal import render_markdown

MAIN = "local:llamacpp:tiny@main"
PR = "local:llamacpp:tiny@pr"
PROMPT_ID = "P-EASY"
PROMPTS = f'prompts:\n  {PROMPT_ID}: {{intent: short, prompt: "Say hi.", max_tokens: 8}}\n'
# About 800 tokens of prefill, never cached: a TTFT of tens of ms, which the few-ms hiccups of a
# shared machine move less than they move a short prompt's few ms.
LONG_TEXT = " ".join(random.Random(22).choice(WORDS) for _ in range(800))
LONG_PROMPTS = (
    f"prompts:\n  {PROMPT_ID}: {{intent: long prefill, prompt: '{LONG_TEXT}', max_tokens: 4,"
    " request: {extra_body: {cache_prompt: false}}}\n"
)
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
RUNS = 8
# The tiny model's first token on this prompt comes within a few ms: held back this long, the
# candidate's TTFT is many times its reference's.
HELD_MS = 150.0


@pytest.fixture(scope="module")
def upstream(
    llama_server: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The candidate's llama-server (one thread, as the managed reference runs)."""
    log_dir = tmp_path_factory.mktemp("llama-server-log")
    with tiny_llama_server(llama_server, tiny_model, log_dir, PR) as managed:
        yield managed.base_url


@pytest.fixture
def proxy(upstream: str) -> Iterator[DelayProxy]:
    with delay_proxy(upstream) as running:
        yield running


def write_project(
    pytester: pytest.Pytester,
    llama_server: Path,
    endpoint: str,
    *,
    thresholds: str = "{ttft_p50: 0.5, total_p50: 0.5, tokens_per_sec: 0.5}",
    min_runs: int | None = None,
    runs: int = RUNS,
    prompts: str = PROMPTS,
) -> None:
    sequential = f", min_runs: {min_runs}" if min_runs is not None else ""
    pytester.makefile(
        ".yaml",
        prompts=prompts,
        cells=(
            f"settings: {{runs: {runs}}}\n"
            "nodes: {local: {kind: local}}\ncells:\n"
            "  - {node: local, engine: llamacpp, model: tiny, name: main, phases: [warm],"
            f" server_binary: '{llama_server}', server_args: [--threads, '1']}}\n"
            f"  - {{node: local, engine: llamacpp, model: tiny, name: pr, phases: [warm],"
            f" endpoint: '{endpoint}', reference: '{MAIN}', thresholds: {thresholds}"
            f"{sequential}}}\n"
        ),
    )
    pytester.makepyfile(test_bench=TEST_FILE)


def run_session(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(
        "--force-load", "-p", "no:cacheprovider", "--junitxml=junit.xml", *args
    )


def ledger(pytester: pytest.Pytester) -> list[dict[str, Any]]:
    (path,) = (pytester.path / "runs").glob("*.jsonl")
    return read_ledger(path)


def ab_verdicts(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    end = records[-1]
    assert end["type"] == "end"
    return {v["metric"]: v for v in end["verdicts"] if v.get("reference") == MAIN}


def summary(result: pytest.RunResult) -> str:
    text = result.stdout.str()
    return text[text.find("gpubench") :]


def test_a_candidate_held_back_is_a_regression_against_its_reference(
    pytester: pytest.Pytester, llama_server: Path, proxy: DelayProxy
) -> None:
    proxy.delay_ms = HELD_MS
    write_project(pytester, llama_server, proxy.url)
    result = run_session(pytester, "--gpubench-ab-seed", "11")
    assert result.ret == 6, summary(result)
    records = ledger(pytester)
    ttft = ab_verdicts(records)["warm_ttft_p50_ms"]
    assert ttft["verdict"] == "regression", ttft
    assert ttft["cell_id"] == PR and ttft["pairs"] == RUNS and ttft["calls"] == 2 * RUNS
    assert ttft["change_ratio"] > 2.0 and ttft["p_value"] < 0.05
    assert ttft["interval_low"] > 1.5 and ttft["interval_high"] >= ttft["interval_low"]
    # The ledger keeps the seed and each call's place in its pair, and the calls ran in the order
    # that seed draws (A B A B …).
    assert records[0]["ab"] == {"seed": 11, "pairs": {PR: MAIN}}
    calls = [r for r in records if r["type"] == "call"]
    assert [(c["cell_id"], c["run_idx"]) for c in calls] == [
        (case.cell_id, case.run_idx)
        for case in build_cases(
            load_matrix(pytester.path / "cells.yaml", pytester.path / "prompts.yaml"), seed=11
        )
    ]
    for call in calls:
        assert call["ab_pair"]["reference"] == MAIN
        assert call["ab_pair"]["index"] == call["run_idx"]
    assert {c["ab_pair"]["order"] for c in calls} == {0, 1}
    # The terminal, the JUnit XML and the Markdown report say it too.
    result.stdout.fnmatch_lines(
        [
            "candidate * reference * prompt * metric * ratio of medians * 95% interval * p *"
            " pairs * calls * engine s * verdict",
            f"{PR} * {MAIN} * {PROMPT_ID} * TTFT p50 ms * +* * +*… +* * 8/8 * 16 * regression",
            f"REGRESSION: {PR} {PROMPT_ID}: warm TTFT p50 +*A/B over 8 pairs (slower), Wilcoxon p"
            f" = * against {MAIN}",
            "gpubench: * A/B regression(s) of a candidate against its reference",
        ]
    )
    failures = junit_cases(pytester, "failure")
    assert f"{PR} {PROMPT_ID} warm_ttft_p50_ms" in failures
    assert failures[f"{PR} {PROMPT_ID} warm_ttft_p50_ms"].startswith("REGRESSION: ")
    assert "A/B over 8 pairs" in failures[f"{PR} {PROMPT_ID} warm_ttft_p50_ms"]
    markdown = render_markdown(records)
    assert "## Head-to-head A/B" in markdown
    assert f"| {PR} " in markdown.split("## Head-to-head A/B")[1]


def junit_cases(pytester: pytest.Pytester, kind: str) -> dict[str, str]:
    """The gate's JUnit test cases: {name: the failure message} (kind "failure"), or
    {name: the verdict property} of the passed ones (kind "verdict")."""
    tree = ElementTree.parse(pytester.path / "junit.xml")
    found: dict[str, str] = {}
    for case in tree.iter("testcase"):
        if case.get("classname") != "gpubench.gate":
            continue
        failure = case.find("failure")
        if kind == "failure" and failure is not None:
            found[str(case.get("name"))] = str(failure.get("message"))
        if kind == "verdict" and failure is None:
            for prop in case.iter("property"):
                if prop.get("name") == "gpubench.verdict":
                    found[str(case.get("name"))] = str(prop.get("value"))
    return found


def test_two_identical_servers_called_turn_about_pass(
    pytester: pytest.Pytester, llama_server: Path, upstream: str
) -> None:
    write_project(
        pytester,
        llama_server,
        upstream,
        thresholds="{ttft_p50: 1.0, total_p50: 1.0, tokens_per_sec: 0.9}",
        prompts=LONG_PROMPTS,
    )
    result = run_session(pytester)
    assert result.ret == 0, summary(result)
    verdicts = ab_verdicts(ledger(pytester))
    assert set(verdicts) == {
        "warm_ttft_p50_ms",
        "warm_total_p50_ms",
        "warm_decode_tokens_per_sec_p50",
    }
    for verdict in verdicts.values():
        assert verdict["verdict"] in ("ok", "inconclusive"), verdict
        assert verdict["calls"] == 2 * RUNS
    # A call whose reply came in one read has no decode rate: that pair is left out of it alone.
    assert verdicts["warm_ttft_p50_ms"]["pairs"] == RUNS
    passed = junit_cases(pytester, "verdict")
    assert passed[f"{PR} vs {MAIN} {PROMPT_ID} warm_ttft_p50_ms"] in ("ok", "inconclusive")
    result.stdout.fnmatch_lines([f"{PR} * {MAIN} * {PROMPT_ID} * TTFT p50 ms * 8/8 * 16 * *"])
