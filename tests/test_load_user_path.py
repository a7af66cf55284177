"""A load profile as a new user meets it (issue 44), through the shipped benchmarks/ file: the
warm-up request each point sends before its clock starts is counted in its load record, so the
engine's request count adds up to the ledger's; and a synthetic load prompt that no tokenizer can
make exact fails its case in one line, the cell's outcome saying why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.keepalive_server import keepalive_server
from support.standins import FaultyOpenAIServer, serving

from pytest_gpubench.ledger.writer import read_ledger

INFERENCE_TEST = (Path(__file__).parent.parent / "benchmarks" / "test_inference.py").read_text()
PROMPTS = "prompts:\n  P-EASY: {intent: short, prompt: hi, max_tokens: 8}\n"


def project(pytester: pytest.Pytester, cell: str) -> None:
    pytester.makefile(".yaml", prompts=PROMPTS)
    pytester.makefile(".yaml", cells="nodes: {local: {kind: local}}\ncells:\n" + cell)
    pytester.makepyfile(test_inference=INFERENCE_TEST)


def records(pytester: pytest.Pytester) -> list[dict[str, Any]]:
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    return read_ledger(ledger)


def test_each_point_counts_the_warm_up_it_sent_and_the_engine_count_adds_up(
    pytester: pytest.Pytester,
) -> None:
    """Two closed-loop points, 5 requests each, and nothing before them: the first point warms
    the engine up with one request no call record holds, the second follows within 60 s and
    sends none. The server saw the call records' requests plus the warm-ups the load records
    count (it had seen one more than the ledger held, and nothing said so)."""
    with keepalive_server() as server:
        project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {concurrency: [1, 2], requests: 5, max_send_lag_ms: 100}}\n",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
        seen = sum(1 for request in server.requests if request.path.endswith("/completions"))
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=2)
    written = records(pytester)
    loads = {r["load_point"]: r for r in written if r["type"] == "load"}
    calls = [r for r in written if r["type"] == "call"]
    assert {point: load["unrecorded_warmups"] for point, load in loads.items()} == {
        "c1": 1,
        "c2": 0,
    }
    assert seen == len(calls) + 1 == 11


def test_a_synthetic_load_prompt_no_tokenizer_can_count_fails_in_one_line_and_names_the_cell(
    pytester: pytest.Pytester,
) -> None:
    """An OpenAI-compatible stand-in with no /tokenize whose usage counts every prompt as 5
    tokens: no text of 64 tokens can be found. The case fails with the one line that says what
    to do (it printed a GpubenchError traceback), and the cell table says the cell failed at
    `benchmark`, with that reason, not `missing — no case of this cell ran`."""
    with serving(FaultyOpenAIServer()) as url:
        project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{url}', load: "
            "{concurrency: [1], requests: 4, synthetic: {input_tokens: 64, output_tokens: 8}}}\n",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    output = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output
    result.assert_outcomes(failed=1)
    reason = (
        "cell local:openai:m: synthetic: the engine's prompt count never read 64 tokens plus the "
        "template's 4: name a tokenizer with the cell's `tokenizer:`"
    )
    result.stdout.fnmatch_lines(
        [
            "*= FAILURES =*",
            "*test_generate*synthetic-in64-out8-load-c1*",
            reason,
            "*= gpubench =*",
            "local:openai:m *failed *0/0 *benchmark *cell local:openai:m: synthetic: *",
            reason,
        ]
    )
    assert "Traceback" not in output and "GpubenchError" not in output
    assert "no case of this cell ran" not in output
    (end,) = [r for r in records(pytester) if r["type"] == "end"]
    (outcome,) = end["cells"]
    assert (outcome["status"], outcome["stage"], outcome["reason"]) == (
        "failed",
        "benchmark",
        reason,
    )
