"""The warm calls checked against the engine's own word (issue 35): token counts, the prefix
cache, the engine's counters; the checks a cell asks to fail the run, and the keys' one-line
errors.

An engine whose `usage` disagrees with what it streamed cannot be had from a real one: those runs
use the stand-in of tests/support/standins.py (FaultyOpenAIServer's MISCOUNT), which follows
OpenAI's chat completions streaming protocol field by field. The same checks against the real
llama-server are in tests/test_engine_checks_real.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.standins import FaultyOpenAIServer, serving

from pytest_gpubench.cli.main import main
from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.status import EXIT_REGRESSION
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.reports.engine_checks_table import (
    engine_check_warnings,
    render_engine_checks,
)
from pytest_gpubench.results.engine_checks import engine_checks

TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"


def bench(pytester: pytest.Pytester, url: str, prompt: str, cell_keys: str = "") -> None:
    pytester.makefile(
        ".yaml",
        prompts=f'prompts:\n  P-EASY: {{intent: short, prompt: "{prompt}", max_tokens: 4}}\n',
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: openai, model: m, endpoint: '{url}', runs: 3, "
        f"phases: [warm]{cell_keys}}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)


def warm_calls(pytester: pytest.Pytester) -> list[dict[str, Any]]:
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    return [r for r in read_ledger(ledger) if r.get("type") == "call" and r["phase"] == "warm"]


def test_usage_that_disagrees_with_the_stream_is_flagged_and_shown(
    pytester: pytest.Pytester,
) -> None:
    with serving(FaultyOpenAIServer()) as url:
        bench(pytester, url, "MISCOUNT please")
        result = pytester.runpytest("--force-load", "--gpubench-steadiness", "off")
    # token_check warns by default: the run passes, saying so.
    assert result.ret == 0
    calls = warm_calls(pytester)
    assert [(c["client_chunks"], c["completion_tokens"]) for c in calls] == [(4, 7)] * 3
    assert all(call["token_mismatch"] is True for call in calls)
    result.stdout.fnmatch_lines(
        [
            "local:openai:m * P-EASY * 3 of 3 differ *",
            "TOKEN COUNTS: local:openai:m P-EASY: 3 of 3 warm calls streamed another count of "
            "tokens than the engine's usage (4 streamed, usage 7)",
        ]
    )


def test_token_check_fail_makes_a_mismatch_fail_the_run_with_exit_6(
    pytester: pytest.Pytester,
) -> None:
    with serving(FaultyOpenAIServer()) as url:
        bench(pytester, url, "MISCOUNT please", ", token_check: fail")
        failed = pytester.runpytest("--force-load", "--gpubench-steadiness", "off")
        # `gpubench gate` judges the ledger as the session did: the same status.
        (ledger,) = (pytester.path / "runs").glob("*.jsonl")
        baselines = str(pytester.mkdir("baselines"))
        assert main(["gate", str(ledger), "--baselines", baselines]) == EXIT_REGRESSION
        bench(pytester, url, "count well", ", token_check: fail")
        for old in (pytester.path / "runs").glob("*"):
            old.unlink()
        passed = pytester.runpytest("--force-load", "--gpubench-steadiness", "off")
    assert failed.ret == EXIT_REGRESSION
    failed.stdout.fnmatch_lines(
        [
            "REGRESSION: local:openai:m P-EASY: 3 of 3 warm calls streamed another count of "
            "tokens than the engine's usage (4 streamed, usage 7) (token_check: fail)",
        ]
    )
    assert failed.outlines[-1] == (
        "gpubench: exit status 6: benchmarks ran and at least one regressed"
    )
    # The same cell whose engine counts what it streamed passes, every count checked.
    assert passed.ret == 0
    assert [call["token_mismatch"] for call in warm_calls(pytester)] == [False] * 3
    passed.stdout.fnmatch_lines(["local:openai:m * P-EASY * 3/3 agree *"])


def test_token_check_off_checks_nothing(pytester: pytest.Pytester) -> None:
    with serving(FaultyOpenAIServer()) as url:
        bench(pytester, url, "MISCOUNT please", ", token_check: off")
        result = pytester.runpytest("--force-load", "--gpubench-steadiness", "off")
    assert result.ret == 0
    assert "TOKEN COUNTS" not in result.stdout.str()


def call(**fields: Any) -> dict[str, Any]:
    return {
        "type": "call",
        "cell_id": "local:openai:m",
        "prompt_id": "P-EASY",
        "phase": "warm",
        "error": None,
        "finish_reason": "length",
        **fields,
    }


def test_calls_served_from_a_prefix_cache_asked_off_are_warned_of() -> None:
    hit = call(prefix_cache_hit=True, prefix_cache_off=True, engine_counters={"preemptions": 0})
    calls = [hit, hit, call(prefix_cache_hit=False, prefix_cache_off=True)]
    checks = engine_checks(calls)
    assert (checks[0].cache_hits, checks[0].unwanted_cache_hits, checks[0].cache_known) == (2, 2, 3)
    assert "2/3 hit ASKED OFF" in render_engine_checks(checks)
    (warning,) = engine_check_warnings(checks)
    assert warning.startswith(
        "PREFIX CACHE: local:openai:m P-EASY: 2 of 3 warm calls were served from the engine's "
        "prefix cache although the request asked for none"
    )
    # Served from the cache where the request did not ask it off: shown, not warned of.
    wanted = engine_checks([call(prefix_cache_hit=True)] * 2)
    assert "2/2 hit" in render_engine_checks(wanted) and engine_check_warnings(wanted) == []


def test_an_engine_that_fills_its_cpus_and_waits_is_warned_of_its_own_threads() -> None:
    """benchmarks_dev/engine_own_threads.py: llama-server with two threads under `taskset -c 1`
    kept its one CPU 100 % busy and waited 0.83 ms for a CPU per ms it ran on a quiet machine,
    which the gate reads as a busy one. Warned of, with what to do; a neighbour that takes the
    engine's CPUs leaves them less than full, and an engine that hardly waits is not warned of."""

    def warnings(wait: float | None, filled: float | None) -> list[str]:
        fields = {
            name: value
            for name, value in (("engine_wait_per_cpu", wait), ("engine_cpus_filled", filled))
            if value is not None
        }
        return engine_check_warnings(engine_checks([call(**fields)] * 3))

    (warning,) = warnings(0.825, 1.0)
    assert warning == (
        "OWN THREADS: local:openai:m P-EASY: the engine kept every CPU it may use 100% busy and "
        "its threads waited 0.82 ms for a CPU per ms they ran: with more compute threads than "
        "CPUs they wait for each other, which the gate reads as a busy machine; give the engine "
        "as many CPUs as threads (taskset -c, --threads) and leave one to the client "
        "(docs/gate-noise.md)"
    )
    assert warnings(0.15, 0.9) != []
    assert warnings(0.88, 0.5) == []  # beside busy neighbours: their CPU time, not its own
    assert warnings(0.08, 1.0) == []  # it hardly waited
    assert warnings(0.825, None) == warnings(None, 1.0) == warnings(None, None) == []
    # The p50 over the calls: one call that waited does not make the warning.
    calls = [call(engine_wait_per_cpu=w, engine_cpus_filled=1.0) for w in (0.9, 0.02, 0.03)]
    assert engine_check_warnings(engine_checks(calls)) == []


def test_counters_add_up_over_the_calls_and_gauges_keep_their_peak() -> None:
    first = {"preemptions": 1.0, "kv_cache_usage_peak": 0.25, "spec_draft_tokens": 6.0}
    second = {"preemptions": 2.0, "kv_cache_usage_peak": 0.5, "spec_draft_tokens": 6.0}
    (checks,) = engine_checks(
        [
            call(engine_counters=first | {"spec_accepted_tokens": 3.0}),
            call(engine_counters=second | {"spec_accepted_tokens": 6.0}),
            call(engine_counters={"preemptions": 9.0}, phase="cold"),
            call(engine_counters={"preemptions": 9.0}, error="HTTP 500"),
        ]
    )
    assert checks.counters == {
        "preemptions": 3.0,
        "kv_cache_usage_peak": 0.5,
        "spec_draft_tokens": 12.0,
        "spec_accepted_tokens": 9.0,
    }
    assert checks.acceptance == (9.0, 12.0)
    assert "9/12 (75%)" in render_engine_checks([checks])


def test_max_preemptions_over_the_limit_is_a_regression() -> None:
    from pytest_gpubench.config.cell import Thresholds
    from pytest_gpubench.results.engine_checks import check_verdicts
    from pytest_gpubench.results.judging_settings import CellJudging, JudgingSettings

    checks = engine_checks([call(engine_counters={"preemptions": 2.0})] * 2)
    settings = JudgingSettings(
        cells={
            "local:openai:m": CellJudging(
                node="local", thresholds=Thresholds(max_preemptions=3), runs=2
            )
        }
    )
    (verdict,) = check_verdicts(checks, settings)
    assert (verdict.metric, verdict.verdict, verdict.current) == ("preemptions", "regression", 4.0)
    assert "max_preemptions: 3" in verdict.message
    generous = settings.model_copy(
        update={
            "cells": {
                "local:openai:m": CellJudging(
                    node="local", thresholds=Thresholds(max_preemptions=4), runs=2
                )
            }
        }
    )
    assert check_verdicts(checks, generous) == []


def test_a_check_a_cell_asks_for_that_nothing_measured_holds_the_run_back() -> None:
    """max_preemptions on an engine whose /metrics has no preemption counter (llama.cpp), or
    token_check: fail where no call carried a token count: `inconclusive` (exit 10), naming what
    was not read; never a pass of a check that was not made."""
    from pytest_gpubench.config.cell import Thresholds
    from pytest_gpubench.results.engine_checks import check_verdicts
    from pytest_gpubench.results.judging import holds_back
    from pytest_gpubench.results.judging_settings import CellJudging, JudgingSettings

    unread = engine_checks(
        [call(token_mismatch=False, engine_counters={"prefix_cache_hits": 1.0})] * 2
    )
    settings = JudgingSettings(
        cells={
            "local:openai:m": CellJudging(
                node="local", thresholds=Thresholds(max_preemptions=0), runs=2,
                token_check="fail",
            )
        }
    )  # fmt: skip
    verdicts = {v.metric: v for v in check_verdicts(unread, settings)}
    assert set(verdicts) == {"preemptions"}  # its calls' token counts were checked
    assert verdicts["preemptions"].verdict == "inconclusive" and holds_back(verdicts["preemptions"])
    assert "preemptions were not read" in verdicts["preemptions"].message
    uncounted = engine_checks([call(token_mismatch=None, engine_counters={"preemptions": 0.0})])
    (verdict,) = check_verdicts(uncounted, settings)
    assert (verdict.metric, verdict.verdict) == ("token_mismatches", "inconclusive")
    assert "no warm call's token count could be checked" in verdict.message


PROMPTS = "prompts:\n  P-EASY: {intent: short, prompt: hi, max_tokens: 4}\n"


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        (
            "{node: local, engine: llamacpp, model: tiny, token_check: always}",
            r"cells\[0\] \(local:llamacpp:tiny\)\.token_check: .*'warn', 'fail' or 'off'",
        ),
        (
            "{node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:9', "
            "draft_model: tiny}",
            r"draft_model: only a managed llamacpp cell \(no endpoint\) takes it",
        ),
        (
            "{node: local, engine: llamacpp, model: tiny, launch: [llama-server], port: 8080, "
            "lora: tiny-lora-1}",
            r"lora: the cell's launch: replaces the argv; put --lora there",
        ),
        (
            "{node: local, engine: llamacpp, model: tiny, draft_max: 4}",
            r"draft_max: needs a draft_model",
        ),
        (
            "{node: local, engine: llamacpp, model: tiny, request: {cache_salt: per_call}}",
            r"request\.cache_salt: llama-server has no cache salt",
        ),
        (
            "{node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:9', "
            "request: {cache_salt: always}}",
            r"request\.cache_salt: .*'per_call'",
        ),
        (
            "{node: local, engine: llamacpp, model: tiny, thresholds: {max_preemptions: -1}}",
            r"thresholds\.max_preemptions: .*greater than or equal to 0",
        ),
    ],
)
def test_a_bad_check_key_is_one_line_naming_it(tmp_path: Path, cell: str, message: str) -> None:
    cells = tmp_path / "cells.yaml"
    cells.write_text(f"nodes: {{local: {{kind: local}}}}\ncells:\n  - {cell}\n")
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(PROMPTS)
    with pytest.raises(GpubenchError, match=message) as raised:
        read_matrix(cells, prompts)
    assert "\n" not in str(raised.value)


def test_counter_changes_take_each_engines_series_and_gauges_peak() -> None:
    from pytest_gpubench.measure.gauges import counter_changes

    before = {
        "llamacpp:prompt_tokens_total": 10.0,
        "llamacpp:prompt_tokens_cached_total": 5.0,
        "llamacpp:requests_deferred": 2.0,
        "vllm:num_preemptions_total": 1.0,
    }
    after = {
        "llamacpp:prompt_tokens_total": 11.0,
        "llamacpp:prompt_tokens_cached_total": 30.0,
        "llamacpp:requests_deferred": 0.0,
        "vllm:num_preemptions_total": 4.0,
    }
    assert counter_changes(before, after) == {
        # llama.cpp's prompt tokens looked up: those it evaluated and those it found cached.
        "prefix_cache_queries": 26.0,
        "prefix_cache_hits": 25.0,
        "preemptions": 3.0,
        "requests_waiting_peak": 2.0,
    }
    # A series on one page only is no change: left out.
    assert counter_changes({}, after) == {}


def test_an_engine_without_metrics_is_asked_once() -> None:
    import asyncio

    from pytest_gpubench.measure.gauges import CaseCounters
    from pytest_gpubench.measure.stream import Endpoint

    server = FaultyOpenAIServer()
    with serving(server) as url:
        counters = CaseCounters(Endpoint.parse(url), ())
        assert counters.read() is None and counters.read(settled=True) is None
        asked = [path for _, path, _ in server.requests]
    assert counters.absent == "/metrics answered HTTP 404 (llama-server needs --metrics)"
    assert asked.count("/metrics") == 1

    async def inside_a_loop() -> CaseCounters:
        unread = CaseCounters(Endpoint.parse("http://127.0.0.1:9"), ())
        assert unread.read() is None
        return unread

    # Inside a running event loop (an async test) the page is not read, and the call goes on.
    unread = asyncio.run(inside_a_loop())
    assert unread.absent is not None and "running event loop" in unread.absent


def test_a_signal_inside_a_counters_read_is_an_ordinary_ctrl_c(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM (CI's cancel) while a warm call's counters are read: the read raises
    KeyboardInterrupt at once, as the run's own code would, and leaves nothing behind. Read on an
    event loop of its own (asyncio.run), a signal that landed inside a task's step left the task
    holding it, and a parallel run's `test_sigterm_ends_the_run_like_ctrl_c` ended with that
    traceback ("Task exception was never retrieved") instead of its 'interrupted' line. So a read
    starts no event loop. (A stdlib server that holds its reply: only the read is under test.)"""
    import asyncio
    import gc
    import os
    import signal
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from pytest_gpubench.core.signals import TerminateAsInterrupt
    from pytest_gpubench.measure.gauges import CaseCounters
    from pytest_gpubench.measure.stream import Endpoint

    release = threading.Event()

    class HeldMetrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            release.wait(10)
            body = b"# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total 1\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    loops: list[object] = []
    new_event_loop = asyncio.events.new_event_loop

    def counted_loop() -> asyncio.AbstractEventLoop:
        loop = new_event_loop()
        loops.append(loop)
        return loop

    monkeypatch.setattr(asyncio.events, "new_event_loop", counted_loop)
    server = ThreadingHTTPServer(("127.0.0.1", 0), HeldMetrics)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    catch = TerminateAsInterrupt()
    catch.install()
    sender = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        counters = CaseCounters(Endpoint.parse(f"http://127.0.0.1:{server.server_port}"), ())
        started = time.monotonic()
        sender.start()
        with pytest.raises(KeyboardInterrupt, match="terminated by signal"):
            counters.read(settled=True)
        assert time.monotonic() - started < 5  # at once, not after the read's 5 s timeout
    finally:
        sender.cancel()
        catch.restore()
        release.set()
        server.shutdown()
        server.server_close()
    gc.collect()
    assert loops == []
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
    # An interrupted read is no engine without /metrics.
    assert counters.absent is None


def test_a_read_that_already_counts_the_call_is_not_settled_again_and_a_lapse_is_no_absence() -> (
    None
):
    """After a warm call the page is read once: where the engine's count of generated tokens has
    already moved by the call's, that read is the call's (no 100 ms settling, no second read);
    otherwise it settles as before. A read that fails after the engine answered once is that
    read's lapse: the next call asks again. (A /metrics page in Prometheus's text format from a
    stdlib server: only the page is under test here.)"""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from pytest_gpubench.measure.gauges import CaseCounters
    from pytest_gpubench.measure.stream import Endpoint

    state = {"predicted": 15.0, "reads": 0, "fail": False}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state["reads"] += 1
            if state["fail"]:
                self.send_response(500)
                self.end_headers()
                return
            body = (
                "# TYPE llamacpp:tokens_predicted_total counter\n"
                f"llamacpp:tokens_predicted_total {state['predicted']}\n"
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        counters = CaseCounters(Endpoint.parse(f"http://127.0.0.1:{server.server_port}"), ())
        before = {"llamacpp:tokens_predicted_total": 10.0}
        page = counters.read(settled=True, since=before, generated=5)
        assert page == {"llamacpp:tokens_predicted_total": 15.0} and state["reads"] == 1
        state["reads"] = 0
        assert counters.read(settled=True, since=before, generated=8) is not None
        assert state["reads"] >= 3  # not yet counted: settled (two reads that agree)
        state["fail"] = True
        assert counters.read() is None and counters.absent is None
        state["fail"] = False
        assert counters.read() is not None
    finally:
        server.shutdown()
        server.server_close()


def test_every_counter_the_table_limits_is_a_cells_yaml_key_judged_under_its_name(
    tmp_path: Path,
) -> None:
    """config/engine_series.COUNTER_LIMITS: each limited counter's `max_` key reads from cells.yaml
    (a count: -1 is refused), its sum over the warm calls past it is a regression named by the
    counter, and not read it is `inconclusive`."""
    from pytest_gpubench.config.engine_series import COUNTER_LIMITS
    from pytest_gpubench.results.engine_checks import check_verdicts
    from pytest_gpubench.results.judging_settings import CellJudging, JudgingSettings

    (tmp_path / "prompts.yaml").write_text(
        "prompts:\n  P-EASY: {intent: short, prompt: hi, max_tokens: 4}\n"
    )
    for key, counter in COUNTER_LIMITS.items():
        cells = tmp_path / "cells.yaml"
        cells.write_text(
            "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: openai, "
            f"model: m, endpoint: 'http://127.0.0.1:9', thresholds: {{{key}: 2}}}}\n"
        )
        (cell,) = read_matrix(cells, tmp_path / "prompts.yaml").cells
        settings = JudgingSettings(
            cells={cell.cell_id: CellJudging(node="local", thresholds=cell.thresholds, runs=2)}
        )
        over = engine_checks([call(cell_id=cell.cell_id, engine_counters={counter.name: 2.0})] * 2)
        (verdict,) = check_verdicts(over, settings)
        assert (verdict.metric, verdict.verdict, verdict.current) == (
            counter.name, "regression", 4.0,
        )  # fmt: skip
        assert f"{key}: 2" in verdict.message
        unread = engine_checks([call(cell_id=cell.cell_id, engine_counters={})] * 2)
        (verdict,) = check_verdicts(unread, settings)
        assert (verdict.metric, verdict.verdict) == (counter.name, "inconclusive")
        cells.write_text(cells.read_text().replace(f"{key}: 2", f"{key}: -1"))
        with pytest.raises(GpubenchError, match=rf"thresholds\.{key}: "):
            read_matrix(cells, tmp_path / "prompts.yaml")
