"""Head-to-head A/B against the real llama-server: two managed cells, each a llama-server on the
same binary and model that the session starts, the candidate's replies held back by the delaying
proxy (tests/support/delay_proxy.py) where the test wants it slower: its cell's `port:` is the
proxy's, and its `launch:` starts the server on the port behind it. Each session is one pytest
run, in-process; the set-ups make each outcome certain: the held-back candidate is many times
slower than the threshold, and the unchanged one is judged at a threshold (+100 %) that two
identical servers called turn about do not come near."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
from support.delay_proxy import DelayProxy, delay_proxy

from pytest_gpubench.config.cases import build_cases, pair_order
from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.config.synthetic import WORDS
from pytest_gpubench.core.status import EXIT_UNSTEADY
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.reports.markdown import render_markdown
from pytest_gpubench.results.ledger_judgement import judge_ledger

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


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port: int = listener.getsockname()[1]
        return port


@pytest.fixture
def proxy() -> Iterator[DelayProxy]:
    """A proxy in front of a free port, where the candidate's launch: starts its server."""
    with delay_proxy(f"http://127.0.0.1:{free_port()}") as running:
        yield running


def candidate_keys(llama_server: Path, proxy: DelayProxy | None) -> str:
    """The candidate cell's keys: managed like the reference, or behind the proxy."""
    if proxy is None:
        return f"server_binary: '{llama_server}', server_args: [--threads, '1']"
    launch = (
        f"[{llama_server}, --model, '{{model_path}}', --alias, '{{model}}', --host, '{{host}}',"
        f" --port, '{proxy.upstream[1]}', --parallel, '1', --no-webui, --threads, '1']"
    )
    return f"port: {proxy.port}, launch: {launch}"


def write_project(
    pytester: pytest.Pytester,
    llama_server: Path,
    proxy: DelayProxy | None,
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
            f"settings: {{runs: {runs}, telemetry: {{cpu: off}}}}\n"
            "nodes: {local: {kind: local}}\ncells:\n"
            "  - {node: local, engine: llamacpp, model: tiny, name: main, phases: [warm],"
            f" server_binary: '{llama_server}', server_args: [--threads, '1']}}\n"
            f"  - {{node: local, engine: llamacpp, model: tiny, name: pr, phases: [warm],"
            f" {candidate_keys(llama_server, proxy)}, reference: '{MAIN}', thresholds: {thresholds}"
            f"{sequential}}}\n"
        ),
    )
    pytester.makepyfile(test_bench=TEST_FILE)


def write_identical(pytester: pytest.Pytester, llama_server: Path, **keys: Any) -> None:
    """Two managed servers alike, judged on the long prompt at thresholds (+100 %) that two
    identical servers called turn about do not come near."""
    write_project(
        pytester,
        llama_server,
        None,
        thresholds="{ttft_p50: 1.0, total_p50: 1.0, tokens_per_sec: 0.9}",
        prompts=LONG_PROMPTS,
        **keys,
    )


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


@pytest.mark.engine
def test_a_candidate_held_back_is_a_regression_against_its_reference(
    pytester: pytest.Pytester, llama_server: Path, proxy: DelayProxy
) -> None:
    proxy.delay_ms = HELD_MS
    write_project(pytester, llama_server, proxy)
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
            read_matrix(pytester.path / "cells.yaml", pytester.path / "prompts.yaml"), seed=11
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
    # `gpubench gate` over the finished ledger finds the same A/B regression.
    judged = judge_ledger(records, pytester.path / "baselines")
    assert judged.exit_status == 6
    again = [
        v
        for v in judged.judgement.verdicts
        if v.reference == MAIN and v.metric == "warm_ttft_p50_ms"
    ]
    assert [(v.verdict, v.pairs) for v in again] == [("regression", RUNS)]
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


@pytest.mark.engine
def test_two_identical_servers_called_turn_about_pass(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    write_identical(pytester, llama_server)
    # The planned pairs alone (a figure they leave undecided is sampled on past them by default:
    # test_pairs_left_undecided_are_sampled_on_in_pairs_until_decided).
    result = run_session(pytester, "--gpubench-sample-on-runs", "0")
    verdicts = ab_verdicts(ledger(pytester))
    assert set(verdicts) == {
        "warm_ttft_p50_ms",
        "warm_total_p50_ms",
        "warm_decode_tokens_per_sec_p50",
    }
    for verdict in verdicts.values():
        assert verdict["verdict"] in ("ok", "inconclusive", "blind", "ungated"), verdict
        assert verdict["calls"] == 2 * RUNS
    # Never a regression. A figure whose pairs cannot rule out a change of the threshold's size
    # says so (blind: a decode rate of the few pairs whose replies came in more than one read,
    # or, on a busy machine, an interval that reaches past it), and the run says "re-run"
    # (exit 10, issue 37); it passes (0) only where every figure is ok.
    # A decode rate of replies too short to time is declared not gated (`ungated`, issue 43).
    all_ok = all(verdict["verdict"] in ("ok", "ungated") for verdict in verdicts.values())
    assert result.ret == (0 if all_ok else EXIT_UNSTEADY), summary(result)
    # A call whose reply came in one read has no decode rate: that pair is left out of it alone.
    assert verdicts["warm_ttft_p50_ms"]["pairs"] == RUNS
    passed = junit_cases(pytester, "verdict")
    # A passed gate case with its verdict where it passed; one the run could not tell is a
    # skipped case (it holds the run back).
    ttft = verdicts["warm_ttft_p50_ms"]["verdict"]
    assert passed.get(f"{PR} vs {MAIN} {PROMPT_ID} warm_ttft_p50_ms") == (
        ttft if ttft == "ok" else None
    )
    result.stdout.fnmatch_lines([f"{PR} * {MAIN} * {PROMPT_ID} * TTFT p50 ms * 8/8 * 16 * *"])


@pytest.mark.engine
def test_pairs_left_undecided_are_sampled_on_in_pairs_until_decided(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    """Issue 43, item 2, for A/B, through a real session: two identical servers and two planned
    pairs, too few for a 95 % interval, so the candidate's TTFT is `blind` (exit 10 before). The
    session samples on in pairs at its end: the candidate's call and its reference's of one
    run_idx, each marked `sampled_on` with its place in the pair, in the order the session's A/B
    seed draws (counterbalanced as the planned pairs are), until decided at a look (+100 %
    thresholds, which two identical servers called turn about do not come near): `ok`, exit 0,
    saying after how many pairs; `gpubench gate` over the ledger agrees."""
    write_identical(pytester, llama_server, runs=2)
    result = run_session(pytester, "--gpubench-sample-on-runs", "10")
    records = ledger(pytester)
    ttft = ab_verdicts(records)["warm_ttft_p50_ms"]
    assert (result.ret, ttft["verdict"]) == (0, "ok"), summary(result)
    by_pair: dict[int, list[dict[str, Any]]] = {}
    for call in records:
        if call["type"] == "call" and call.get("sampled_on"):
            by_pair.setdefault(call["run_idx"], []).append(call)
    assert sorted(by_pair) == list(range(2, 2 + len(by_pair))) and len(by_pair) <= 10
    seed = records[0]["ab"]["seed"]
    for index, pair in by_pair.items():
        assert [c["cell_id"] for c in pair] == pair_order(seed, MAIN, PROMPT_ID, index, [MAIN, PR])
        assert [c["ab_pair"] for c in pair] == [
            {"reference": MAIN, "index": index, "order": order} for order in (0, 1)
        ]
    assert ttft["pairs"] == 2 + len(by_pair) and ttft["calls"] == 2 * ttft["pairs"]
    assert ttft["message"].endswith(
        f"; decided with {len(by_pair)} more pairs sampled on after the planned 2"
    )
    assert judge_ledger(records, pytester.path / "baselines").exit_status == 0


# -- sequential sampling --------------------------------------------------------------------------


def skipped_reasons(records: list[dict[str, Any]]) -> list[str]:
    return [str(r["reason"]) for r in records if r["type"] == "skipped"]


@pytest.mark.engine
def test_a_huge_slowdown_stops_at_the_minimum_and_skips_the_rest_with_a_reason(
    pytester: pytest.Pytester, llama_server: Path, proxy: DelayProxy
) -> None:
    # 400 ms held back: no hiccup of a busy machine makes the reference that slow, so each of
    # the first 7 pairs is slower on the candidate's side, and 7 pairs all one way are
    # significant at the first look's share of alpha (p = 1/128 < 0.05 / 4).
    proxy.delay_ms = 400.0
    write_project(pytester, llama_server, proxy, min_runs=7, runs=16)
    result = run_session(pytester, "-rs")
    assert result.ret == 6, summary(result)
    result.assert_outcomes(passed=14, skipped=18)
    records = ledger(pytester)
    ttft = ab_verdicts(records)["warm_ttft_p50_ms"]
    assert ttft["verdict"] == "regression"
    assert (ttft["pairs"], ttft["max_pairs"], ttft["calls"]) == (7, 16, 14)
    assert "decided after 7 of 16 pairs" in ttft["message"]
    reasons = skipped_reasons(records)
    assert len(reasons) == 18
    assert set(reasons) == {
        f"sequential sampling: {PR} {PROMPT_ID} decided (regression) after 7 of 16 pairs "
        f"against {MAIN}"
    }
    assert len([r for r in records if r["type"] == "call"]) == 14
    # The A/B table shows the pairs judged of the most; pytest says why each case was skipped.
    result.stdout.fnmatch_lines([f"{PR} * {MAIN} * {PROMPT_ID} * TTFT p50 ms * 7/16 * 14 * *"])
    result.stdout.fnmatch_lines(["SKIPPED * sequential sampling: * decided (regression) after *"])


@pytest.mark.engine
def test_identical_sides_stop_as_unchanged_or_run_to_the_maximum(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    write_identical(pytester, llama_server, min_runs=7, runs=12)
    # The planned pairs alone, as above.
    result = run_session(pytester, "--gpubench-sample-on-runs", "0")
    records = ledger(pytester)
    verdicts = ab_verdicts(records)
    # Never a regression; a pass (0) where every figure is ok, else "re-run" (10: a figure whose
    # pairs cannot rule out a change of the threshold's size, issue 37).
    # A decode rate of replies too short to time is declared not gated (`ungated`, issue 43).
    all_ok = all(verdict["verdict"] in ("ok", "ungated") for verdict in verdicts.values())
    assert result.ret == (0 if all_ok else EXIT_UNSTEADY), summary(result)
    ttft = verdicts["warm_ttft_p50_ms"]
    calls = len([r for r in records if r["type"] == "call"])
    assert ttft["calls"] == calls
    reasons = skipped_reasons(records)
    print(f"identical sides: {ttft['pairs']} of 12 pairs; {ttft['message']}")
    if ttft["pairs"] < 12:
        # Stopped early: as unchanged, never as a regression, and every verdict says ok.
        assert reasons and all("decided (unchanged)" in reason for reason in reasons), reasons
        assert {v["verdict"] for v in verdicts.values()} - {"ungated"} == {"ok"}
        assert calls + len(reasons) == 24
    else:
        assert calls == 24 and not reasons
        # Never a regression; a figure whose pairs cannot rule out a change is blind (a decode
        # rate of the few replies that came in more than one read), which was `ok` before.
        assert {v["verdict"] for v in verdicts.values()} <= {
            "ok",
            "inconclusive",
            "blind",
            "ungated",
        }
