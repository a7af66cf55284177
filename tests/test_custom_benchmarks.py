"""Benchmarks users write themselves: a test that asks for `gpubench_engine` is parametrized over
the matrix, and every call it makes is measured, recorded under the test's name, baselined and
gated like the built-in prompts; its request is frozen by its hash. Against the real llama-server
(tests/conftest.py `server`), through the delaying proxy (tests/support/delay_proxy.py) for the gate.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from support.delay_proxy import DelayProxy, EngineSpeed, delay_proxy
from support.pytest_process import LEAN

from pytest_gpubench.config.cases import request_sha256
from pytest_gpubench.core.status import EXIT_UNSTEADY
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.ledger.writer import read_ledger

REPO = Path(__file__).resolve().parent.parent
PROMPTS = 'prompts:\n  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}\n'
ONE = "local:llamacpp:tiny@one"
TWO = "local:llamacpp:tiny@two"
# A test of its own: a two-message conversation; and one that runs on one cell only, 4 runs.
# Four warm runs each: fewer could never be significant against a later run of as many, and
# --baseline-update refuses such a baseline.
CUSTOM_TESTS = """
import pytest

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi."},
]


def test_greeting(gpubench_engine):
    call = gpubench_engine.chat(MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert call.error is None, call.error
    assert call["completion_tokens"] == MAX_TOKENS
    assert call.text, "no answer text"
    print("ANSWER", call["case_id"], repr(call.text))


@pytest.mark.gpubench(cells=["local:llamacpp:tiny@two"], phases=["warm"], runs=4)
def test_on_two_only(gpubench_engine):
    assert gpubench_engine.chat("hi", max_tokens=2).error is None
"""


def cells_yaml(*cells: tuple[str, str], runs: int = 2, phases: str = "[warm]") -> str:
    lines = [
        f"  - {{node: local, engine: llamacpp, model: tiny, name: {name}, endpoint: '{url}',"
        f" runs: {runs}, phases: {phases}}}\n"
        for name, url in cells
    ]
    return "nodes: {local: {kind: local}}\ncells:\n" + "".join(lines)


def custom_bench(pytester: pytest.Pytester, url: str, max_tokens: int = 4) -> None:
    pytester.makefile(
        ".yaml", prompts=PROMPTS, cells=cells_yaml(("one", url), ("two", url), runs=4)
    )
    pytester.makepyfile(test_custom=f"MAX_TOKENS = {max_tokens}\n" + CUSTOM_TESTS)


def ledger_records(pytester: pytest.Pytester) -> list[dict[str, Any]]:
    newest = max((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    return read_ledger(newest)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("--force-load", "-p", "no:cacheprovider", *args)


@pytest.mark.engine
def test_a_custom_test_is_collected_per_cell_measured_recorded_and_baselined(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    custom_bench(pytester, server.base_url)
    collected = run(pytester, "--collect-only", "-q")
    collected.stdout.fnmatch_lines(
        [
            f"test_custom.py::test_greeting[[]{ONE}-test_greeting-warm-0[]]",
            f"test_custom.py::test_greeting[[]{ONE}-test_greeting-warm-1[]]",
            f"test_custom.py::test_greeting[[]{TWO}-test_greeting-warm-0[]]",
            f"test_custom.py::test_greeting[[]{TWO}-test_greeting-warm-1[]]",
            f"test_custom.py::test_on_two_only[[]{TWO}-test_on_two_only-warm-2[]]",
        ],
        consecutive=False,
    )
    assert f"{ONE}-test_on_two_only" not in collected.stdout.str()
    assert "12 tests collected" in collected.stdout.str()

    update = run(pytester, "--baseline-update", "-s")
    assert update.ret == 0, update.stdout.str()
    update.assert_outcomes(passed=12)
    update.stdout.fnmatch_lines([f"*ANSWER {ONE}-test_greeting-warm-0 '?*'"])
    update.stdout.re_match_lines(
        [rf"{ONE}\s+test_greeting\s.*new$", rf"{TWO}\s+test_on_two_only\s"]
    )
    calls = [r for r in ledger_records(pytester) if r["type"] == "call"]
    assert len(calls) == 12
    greeting = [c for c in calls if c["test_id"] == "test_greeting"]
    assert {c["cell_id"] for c in greeting} == {ONE, TWO} and len(greeting) == 8
    sent = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    expected_sha = request_sha256(sent, 4, {"temperature": 0})
    for call in greeting:
        assert call["prompt_id"] == "test_greeting"
        assert call["prompt_sha256"] == expected_sha
        assert call["error"] is None and call["completion_tokens"] == 4
        assert "text" not in call  # the answer goes to the test, not into the ledger
    assert {c["prompt_id"] for c in calls} == {"test_greeting", "test_on_two_only"}
    # --baseline-update wrote each cell's baseline with the test under its own name.
    one = json.loads((pytester.path / "baselines" / "local_llamacpp_tiny_one.json").read_text())
    two = json.loads((pytester.path / "baselines" / "local_llamacpp_tiny_two.json").read_text())
    assert set(one["prompts"]) == {"test_greeting"}
    assert set(two["prompts"]) == {"test_greeting", "test_on_two_only"}
    assert one["prompts"]["test_greeting"]["prompt_sha256"] == expected_sha

    # The next run is judged against them: every metric of each custom test has a verdict with
    # the baseline's figure, none is `new`. (Whether the same speed passes is the gate's own
    # question, tested with the built-in cases: with four samples a side, a 2-ms TTFT that moves
    # by 40 % on a shared machine can be significant, so this run may end 0 or 6; and four
    # decode rates spread wide leave the gate blind to theirs, which is a verdict too, and one
    # that CI sees as "re-run": 10.)
    again = run(pytester)
    assert again.ret in (0, 6, EXIT_UNSTEADY), again.stdout.str()
    again.stdout.re_match_lines(
        [rf"{ONE}\s+test_greeting\s.*\s(ok|inconclusive|win|regression|blind)$"]
    )
    judged = [
        verdict
        for verdict in ledger_records(pytester)[-1]["verdicts"]
        if verdict["prompt_id"] in ("test_greeting", "test_on_two_only")
    ]
    assert {(v["cell_id"], v["prompt_id"]) for v in judged} == {
        (ONE, "test_greeting"),
        (TWO, "test_greeting"),
        (TWO, "test_on_two_only"),
    }
    # TTFT always has a baseline figure (a 2-token reply may have no decode rate: coalesced).
    ttft = [v for v in judged if v["metric"] == "warm_ttft_p50_ms"]
    assert len(ttft) == 3 and all(v["verdict"] != "new" and v["baseline"] for v in ttft), ttft


@pytest.mark.engine
def test_under_xdist_a_custom_test_is_planned_and_its_node_runs_on_one_worker(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    """The controller learns of a test's own cases from the workers' node ids alone."""
    custom_bench(pytester, server.base_url)
    # The workers are processes of their own: no control call before each warm call there.
    result = run(pytester, "-n", "2", "-p", "xdist", *LEAN)
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=12)
    records = ledger_records(pytester)
    meta = records[0]
    assert meta["cases_planned"] == 12 and meta["cells_planned"] == [ONE, TWO]
    calls = [r for r in records if r["type"] == "call"]
    assert len(calls) == 12
    # Both cells are on the node `local`: one worker runs all of its cases.
    assert len({call["worker"] for call in calls}) == 1


@pytest.mark.engine
def test_a_test_that_asks_for_the_engine_but_measures_nothing_fails(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    pytester.makefile(".yaml", prompts=PROMPTS, cells=cells_yaml(("one", server.base_url)))
    pytester.makepyfile(
        test_custom="def test_idle(gpubench_engine):\n    assert gpubench_engine.engine.health(5).ok\n"
    )
    result = run(pytester)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        ["*test_idle*asked for gpubench_engine but never called gpubench_engine.chat()*"]
    )


# -- the frozen request --------------------------------------------------------------------------


@pytest.mark.engine
def test_a_changed_request_under_the_same_name_is_refused_naming_the_test(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    custom_bench(pytester, server.base_url, max_tokens=4)
    assert run(pytester, "--baseline-update").ret == 0
    custom_bench(pytester, server.base_url, max_tokens=5)  # same name, another request
    result = run(pytester)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=8, passed=4)
    result.stdout.fnmatch_lines(
        [
            f"*test_custom.py::test_greeting[[]{ONE}-test_greeting-warm-0[]]: benchmark test "
            f"test_greeting changed its request since the baseline was measured on {ONE} "
            "(sha256 * -> *): a test's request (messages, max_tokens, options) is frozen under "
            "its name like a prompt in prompts.yaml; restore it, or measure the new request in a "
            "test with a new name"
        ]
    )
    assert "Traceback" not in result.stdout.str()
    # Refused before it was sent: nothing of it is in the ledger.
    calls = [r for r in ledger_records(pytester) if r["type"] == "call"]
    assert {c["prompt_id"] for c in calls} == {"test_on_two_only"}


@pytest.mark.engine
def test_two_requests_under_one_name_in_a_run_are_refused(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    pytester.makefile(".yaml", prompts=PROMPTS, cells=cells_yaml(("one", server.base_url)))
    pytester.makepyfile(
        test_custom="""
def test_drifting(gpubench_engine):
    gpubench_engine.chat("hi", max_tokens=2)
    gpubench_engine.chat("hello", max_tokens=2)
"""
    )
    result = run(pytester)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_drifting*: benchmark test test_drifting changed its request since its first "
            f"call in this run on {ONE} (sha256 *"
        ]
    )


# -- the marker ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        (
            'cells=["local:llamacpp:nope"]',
            "ERROR: test_custom.py::test_x: @pytest.mark.gpubench: cells: 'local:llamacpp:nope' "
            "is not a cell of *cells.yaml (cells: local:llamacpp:tiny@one)",
        ),
        (
            'phases=["hot"]',
            "ERROR: test_custom.py::test_x: @pytest.mark.gpubench: phases: 'hot' is not one of "
            "cold, warm",
        ),
        (
            "runs=0",
            "ERROR: *test_x: @pytest.mark.gpubench: runs: expected a positive integer, got 0",
        ),
        ("repeat=3", "ERROR: *test_x: @pytest.mark.gpubench: unknown keyword 'repeat' (known: *)"),
    ],
    ids=["unknown cell", "unknown phase", "zero runs", "unknown keyword"],
)
def test_a_wrong_marker_is_a_usage_error_naming_the_test(
    pytester: pytest.Pytester, marker: str, message: str
) -> None:
    pytester.makefile(".yaml", prompts=PROMPTS, cells=cells_yaml(("one", "http://127.0.0.1:9")))
    pytester.makepyfile(
        test_custom=f"import pytest\n\n@pytest.mark.gpubench({marker})\n"
        "def test_x(gpubench_engine):\n    gpubench_engine.chat('hi', max_tokens=1)\n"
    )
    result = run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_two_tests_with_one_name_are_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", prompts=PROMPTS, cells=cells_yaml(("one", "http://127.0.0.1:9")))
    body = "def test_x(gpubench_engine):\n    gpubench_engine.chat('hi', max_tokens=1)\n"
    pytester.makepyfile(test_a=body, test_b=body)
    result = run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: test_b.py::test_x: another benchmark test has the name test_x (test_a.py::test_x)*"
        ]
    )


# -- the examples in benchmarks/ -----------------------------------------------------------------

EXAMPLES = ("test_chat.py", "test_long_context.py", "test_json_answer.py")


def examples_bench(pytester: pytest.Pytester, url: str) -> None:
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{url}', runs: 2}}\n",
    )
    for name in EXAMPLES:
        shutil.copy(REPO / "benchmarks" / name, pytester.path / name)


@pytest.mark.engine
def test_the_examples_pass_against_the_real_llama_server(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    examples_bench(pytester, server.base_url)
    result = run(pytester, "-rx")
    assert result.ret == 0, result.stdout.str()
    # The chat 2 warm runs (the cell's), the prefill 1 cold and 2 warm, the JSON answer the 5
    # warm runs of its marker: the tiny model never answers JSON, which the JSON answer's
    # schema valid rate shows (a figure the gate judges, not a failed test).
    result.assert_outcomes(passed=10)
    result.stdout.fnmatch_lines(["*local:llamacpp:tiny *test_json_answer *0/5 schema valid*"])
    calls = [r for r in ledger_records(pytester) if r["type"] == "call"]
    by_test: dict[str, list[dict[str, Any]]] = {}
    for call in calls:
        by_test.setdefault(call["test_id"], []).append(call)
    assert sorted(by_test) == [
        "test_json_answer",
        "test_long_context_prefill",
        "test_three_turn_chat",
    ]
    assert all(call["error"] is None for call in calls)
    prefill = by_test["test_long_context_prefill"]
    assert [c["phase"] for c in prefill] == ["cold", "warm", "warm"]
    assert prefill[0]["cold_kind"] == "process_warm"  # an engine it did not start
    # The whole prompt was prefilled on every call: llama-server's prompt cache is off for it.
    for call in prefill:
        assert call["prompt_tokens"] >= 1536
        assert call["engine_timings"]["prompt_n"] == call["prompt_tokens"]


@pytest.mark.engine
def test_the_json_example_records_an_answer_that_does_not_parse_as_not_schema_valid(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    """What a user sees of the tiny model's noise on the JSON example: every case passes (the
    call was measured, and an answer that is no JSON is a figure, not a failed test: issue 44),
    each call is recorded as judged against the example's schema and not valid, and the terminal
    says 0/5 (`--runxfail` changes nothing: nothing is expected to fail)."""
    examples_bench(pytester, server.base_url)
    result = run(pytester, "test_json_answer.py", "--runxfail")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        ["*kind*valid*", "*local:llamacpp:tiny *test_json_answer *json_schema *0/5 schema valid*"]
    )
    # Measured all the same: a correctness failure is not a failed call.
    calls = [r for r in ledger_records(pytester) if r["type"] == "call"]
    assert len(calls) == 5 and all(call["error"] is None for call in calls)
    assert [(call["kind"], call["schema_valid"]) for call in calls] == [("json_schema", 0)] * 5


# -- the gate ------------------------------------------------------------------------------------

GATE_CELL = "local:llamacpp:tiny"
GATE_TEST = "test_capital"
GATE_FILE = f"""
def {GATE_TEST}(gpubench_engine):
    call = gpubench_engine.chat("What is the capital of France?", max_tokens=64)
    assert call.error is None, call.error
"""
# The proxy holds back the first content of every call by BASE_DELAY_MS, the baseline's calls
# too: the tiny model's own TTFT (a few ms, which a shared machine can double from one run to the
# next) is then a small part of what the gate compares, and the 60 % added on top of the
# baseline's p50 (18 ms or more) stands far above anything the machine does to the engine.
BASE_DELAY_MS = 30.0
RUNS = 30


def measured_run(
    pytester: pytest.Pytester, proxy: DelayProxy, *args: str
) -> tuple[pytest.RunResult, EngineSpeed]:
    since = len(proxy.wait_until_idle())
    result = run(pytester, "--gpubench-runs", str(RUNS), *args)
    calls = proxy.wait_until_idle()[since:]
    assert len(calls) == RUNS + 1, result.stdout.str()[-3000:]  # the measured calls and the warm-up
    return result, EngineSpeed.of(calls)


@pytest.mark.engine
def test_a_custom_test_60_percent_slower_to_first_token_exits_6_naming_test_and_cell(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    with delay_proxy(server.base_url) as proxy:
        pytester.makefile(
            ".yaml",
            prompts=PROMPTS,
            cells="nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: llamacpp, "
            f"model: tiny, endpoint: '{proxy.url}', phases: [warm]}}\n",
        )
        pytester.makepyfile(test_custom=GATE_FILE)
        baseline = pytester.path / "baselines" / "local_llamacpp_tiny.json"
        proxy.delay_ms = BASE_DELAY_MS
        update, at_baseline = measured_run(pytester, proxy, "--baseline-update")
        assert update.ret == 0, update.stdout.str()[-3000:]
        stored = json.loads(baseline.read_text())["prompts"][GATE_TEST]
        proxy.delay_ms = BASE_DELAY_MS + 0.60 * float(stored["warm"]["first_delta_ms"]["p50"])
        result, speed = measured_run(pytester, proxy)
        print(f"engine {speed} against {at_baseline}")
    assert result.ret == 6, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(
        [
            f"{GATE_CELL}*{GATE_TEST}*regression",
            f"REGRESSION: {GATE_CELL} {GATE_TEST}: warm TTFT p50 +*",
            "gpubench: exit status 6: benchmarks ran and at least one regressed",
        ]
    )
    end = ledger_records(pytester)[-1]
    regressed = [v for v in end["verdicts"] if v["verdict"] == "regression"]
    assert {(v["cell_id"], v["prompt_id"]) for v in regressed} == {(GATE_CELL, GATE_TEST)}
    assert "warm_ttft_p50_ms" in {v["metric"] for v in regressed}


def test_a_case_id_names_its_cell_even_when_one_cell_id_starts_another(tmp_path: Path) -> None:
    from pytest_gpubench.config.cases import build_test_cases, own_case_of_id
    from pytest_gpubench.config.matrix import read_matrix

    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    (tmp_path / "cells.yaml").write_text(
        "nodes: {a: {kind: local}, b: {kind: local}}\ncells:\n"
        "  - {node: a, engine: openai, model: qwen3, endpoint: 'http://127.0.0.1:9'}\n"
        "  - {node: b, engine: openai, model: qwen3-0.6b, endpoint: 'http://127.0.0.1:9'}\n"
    )
    matrix = read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")
    cases = build_test_cases(matrix, "test_x", runs=2)
    assert [case.case_id for case in cases] == [
        "a:openai:qwen3-test_x-cold-0",
        "a:openai:qwen3-test_x-warm-0",
        "a:openai:qwen3-test_x-warm-1",
        "b:openai:qwen3-0.6b-test_x-cold-0",
        "b:openai:qwen3-0.6b-test_x-warm-0",
        "b:openai:qwen3-0.6b-test_x-warm-1",
    ]
    assert [own_case_of_id(matrix, case.case_id) for case in cases] == cases
    assert own_case_of_id(matrix, "a:openai:qwen3-P-EASY-warm-0") is None  # a prompts.yaml case
    assert own_case_of_id(matrix, "a:openai:qwen3-test_x-warm-0-extra") is None


def test_a_test_of_the_node_alone_runs_per_cell_and_plans_no_measurement(
    pytester: pytest.Pytester,
) -> None:
    """gpubench_target without gpubench_engine: the node, opened, and no engine started."""
    pytester.makefile(".yaml", prompts=PROMPTS, cells=cells_yaml(("one", "http://127.0.0.1:9")))
    pytester.makepyfile(
        test_node="""
def test_node(gpubench_target):
    result = gpubench_target.run(["echo", "on the node"], timeout_s=10)
    assert result.ok and result.stdout.strip() == "on the node"
"""
    )
    result = run(pytester, "-v")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines([f"*test_node[[]{ONE}-test_node-warm-0[]] PASSED*"])
    result.assert_outcomes(passed=2)


# -- an answer judged against a schema ----------------------------------------------------------

SCHEMA_TEST = """
def test_judged(gpubench_engine):
    call = gpubench_engine.chat("hi", max_tokens=3, answer_schema=SCHEMA)
    assert call.error is None, call.error
"""


def test_a_bad_answer_schema_fails_the_test_in_one_line_and_a_changed_one_is_a_changed_request(
    pytester: pytest.Pytester,
) -> None:
    """`answer_schema` is checked before anything is sent (one line, no traceback), and it is
    part of the test's frozen request: a baseline judged against another schema refuses it."""
    from support.standins import FaultyOpenAIServer, serving

    with serving(FaultyOpenAIServer()) as url:
        pytester.makefile(
            ".yaml",
            prompts=PROMPTS,
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: m, endpoint: '{url}', runs: 4, "
            "phases: [warm]}\n",
        )
        pytester.makepyfile(test_own="SCHEMA = {'type': 12}\n" + SCHEMA_TEST)
        bad = run(pytester, "test_own.py")
        assert bad.ret == pytest.ExitCode.TESTS_FAILED, bad.stdout.str()
        bad.stdout.fnmatch_lines(
            ["*test_own.py::test_judged*: answer_schema: not a valid JSON Schema: 12 is not *"]
        )
        assert "Traceback" not in bad.stdout.str() and "SchemaError" not in bad.stdout.str()

        pytester.makepyfile(test_own="SCHEMA = {'type': 'object'}\n" + SCHEMA_TEST)
        first = run(pytester, "test_own.py", "--baseline-update", "--allow-dirty")
        assert first.ret == pytest.ExitCode.OK, first.stdout.str()
        # The stand-in streams `t0t1t2`: no JSON, judged not valid.
        first.stdout.fnmatch_lines(["*local:openai:m *test_judged *json_schema *0/4 schema valid*"])
        pytester.makepyfile(test_own="SCHEMA = {'type': 'array'}\n" + SCHEMA_TEST)
        changed = run(pytester, "test_own.py", "--allow-dirty")
    assert changed.ret == pytest.ExitCode.TESTS_FAILED, changed.stdout.str()
    changed.stdout.fnmatch_lines(["*benchmark test test_judged changed its request since the*"])
