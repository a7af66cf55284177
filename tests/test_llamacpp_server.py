"""Against the real llama-server serving the project's own tiny model (no stand-ins here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.bench_files import CHECKED_TEST_FILE
from support.pacing_proxy import pacing_proxy

from pytest_gpubench.engines import Request
from pytest_gpubench.engines.llamacpp import LlamaCppEngine
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.ledger.writer import read_ledger

pytestmark = pytest.mark.engine

PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "What is the capital of France?", max_tokens: 8}
  P-MEDIUM: {intent: longer, prompt: "Explain why the sky is blue.", max_tokens: 24}
"""
TEST_FILE = CHECKED_TEST_FILE


# Which test's servers: the machine is shared (other sessions, and the other xdist worker of
# `make test-fast`, serve the same tiny model), so a server counts only if it inherited this
# test's mark in its environment, which it keeps even when orphaned.
OWNER_VARIABLE = "GPUBENCH_TEST_OWNER"


@pytest.fixture(autouse=True)
def owner_mark(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    mark = f"{os.getpid()}:{request.node.nodeid}"
    monkeypatch.setenv(OWNER_VARIABLE, mark)
    return mark


def server_pids(model: Path) -> list[int]:
    """This test's llama-server processes serving this model file, from /proc."""
    owner = f"{OWNER_VARIABLE}={os.environ[OWNER_VARIABLE]}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        zombie = "State:\tZ" in status
        if (
            not zombie
            and argv
            and argv[0].endswith(b"llama-server")
            and str(model).encode() in argv
            and owner in environment
        ):
            pids.append(int(entry.name))
    return pids


def test_health_stream_usage_timings_and_restart(server: ManagedLlamaServer) -> None:
    engine = LlamaCppEngine(server.base_url, "tiny")
    assert engine.health(5).ok
    described = engine.describe(5)
    assert described["engine_version"]  # /props build_info
    first = engine.chat(Request("What is the capital of France?", 32), 60)
    assert first.error is None and first.finish_reason == "length"
    assert first.completion_tokens == 32 == first.client_chunks  # one token per streamed chunk
    assert first.prompt_tokens and first.prompt_tokens > 0
    assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n"} <= set(
        first.engine_timings
    )
    assert first.first_delta_ms is not None and first.total_duration_ms is not None
    # A reply that arrived in one read (coalesced, on a busy machine) ends where it starts.
    assert 0 < first.first_delta_ms <= first.total_duration_ms
    assert first.coalesced or first.first_delta_ms < first.total_duration_ms
    assert len(first.inter_chunk_ms) == 31
    # A decode rate unless the 32 chunks came in one read (a late read on a busy machine).
    assert (first.tokens_per_sec is None) == first.coalesced
    assert first.e2e_tokens_per_sec and first.e2e_tokens_per_sec > 0
    assert first.engine_tokens_per_sec == first.engine_timings["predicted_per_second"]
    assert first.engine_prompt_ms == first.engine_timings["prompt_ms"]
    again = engine.chat(Request("What is the capital of France?", 32), 60)
    assert again.engine_timings["cache_n"] > 0  # warm: the prompt came from the cache
    old_url = server.base_url
    server.restart()
    assert server.starts == 2 and server.base_url != old_url
    cold = LlamaCppEngine(server.base_url, "tiny").chat(
        Request("What is the capital of France?", 32), 60
    )
    assert cold.error is None and cold.engine_timings["cache_n"] == 0  # a new process: no cache


def test_every_request_generates_exactly_max_tokens(server: ManagedLlamaServer) -> None:
    engine = LlamaCppEngine(server.base_url, "tiny")
    for max_tokens, prompt in [(1, "Hi"), (7, "Count to ten."), (100, "Write a long story.")]:
        call = engine.chat(Request(prompt, max_tokens), 60)
        assert (call.completion_tokens, call.finish_reason) == (max_tokens, "length"), prompt


def test_warm_and_cold_run_through_the_plugin(
    pytester: pytest.Pytester, llama_server: Path, tiny_model: Path
) -> None:
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells=f"nodes: {{local: {{kind: local}}}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, server_binary: '{llama_server}', server_args: [--threads, '1'], runs: 2}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert cell["model_digest"].startswith("sha256:") and cell["engine_version"]
    assert cell["gpus"] == [] and cell["node_info"]["cpu_model"]
    calls = [r for r in records if r["type"] == "call"]
    max_tokens = {"P-EASY": 8, "P-MEDIUM": 24}
    for call in calls:
        assert call["completion_tokens"] == max_tokens[call["prompt_id"]]
        assert call["finish_reason"] == "length"
        # The tiny model makes a token in ~0.1 ms: if the client was descheduled that long, a
        # short reply can arrive in one read, and then TTFT honestly equals the total.
        assert 0 < call["first_delta_ms"] <= call["total_duration_ms"]
    # That the first delta comes before the end of the reply: through a pacing proxy, below, where
    # the reply cannot arrive in one read.
    cold = [c for c in calls if c["phase"] == "cold"]
    assert [c["cold_kind"] for c in cold] == ["restart", "restart"]
    assert all(c["engine_timings"]["cache_n"] == 0 for c in cold)
    (log,) = (pytester.path / "runs" / "logs").glob("llama-server-*.log")
    # One start for the cell, then one restart per cold case.
    assert log.read_text().count("llama_server: listening on") == 3
    assert server_pids(tiny_model) == []  # nothing left behind after the session


# Each content event of a reply passed on no sooner than this after the one before it.
PACING_GAP_S = 0.005


def test_the_first_delta_is_stamped_at_the_first_token_not_at_the_end(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    """Through the pacing proxy (tests/support/pacing_proxy.py), a reply of 8 or 24 tokens takes at
    least 7 or 23 gaps of 5 ms after its first token: it cannot arrive in one read, however late
    the client is scheduled, so its first delta must come before its end."""
    with pacing_proxy(server.base_url) as paced:
        paced.gap_s = PACING_GAP_S
        pytester.makefile(
            ".yaml",
            prompts=PROMPTS,
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{paced.url}', runs: 2,"
            " phases: [warm]}\n",
        )
        pytester.makepyfile(test_bench=TEST_FILE)
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    calls = [r for r in read_ledger(ledger) if r["type"] == "call"]
    max_tokens = {"P-EASY": 8, "P-MEDIUM": 24}
    assert sorted(c["prompt_id"] for c in calls) == ["P-EASY", "P-EASY", "P-MEDIUM", "P-MEDIUM"]
    for call in calls:
        assert call["completion_tokens"] == max_tokens[call["prompt_id"]]
        assert 0 < call["first_delta_ms"] < call["total_duration_ms"]
    # Moved here from test_warm_and_cold_run_through_the_plugin, where an unpaced reply of the
    # tiny model (0.1 ms a token) could come in one read when the client was descheduled.
    for prompt_id in max_tokens:
        assert any(
            c["first_delta_ms"] < c["total_duration_ms"]
            for c in calls
            if c["prompt_id"] == prompt_id
        )


def test_xdist_writes_one_ledger_with_one_call_per_case(
    pytester: pytest.Pytester, llama_server: Path
) -> None:
    pytest.importorskip("xdist")
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells=f"nodes: {{local: {{kind: local}}}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, server_binary: '{llama_server}', server_args: [--threads, '1'], runs: 2, phases: [warm]}}\n"
        f"  - {{node: local, engine: llamacpp, model: tiny-b, model_path: '{_tiny_path()}', server_binary: '{llama_server}', server_args: [--threads, '1'], runs: 2, phases: [warm]}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    result = pytester.runpytest("-n", "2", "-p", "xdist", "--force-load")
    result.assert_outcomes(passed=8)
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    calls = [r for r in records if r["type"] == "call"]
    assert sorted(c["case_id"] for c in calls) == sorted(
        f"local:llamacpp:{model}-{prompt}-warm-{run}"
        for model in ("tiny", "tiny-b")
        for prompt in ("P-EASY", "P-MEDIUM")
        for run in (0, 1)
    )
    assert len({r["benchmark_run_id"] for r in records}) == 1
    assert records[0]["type"] == "meta" and records[-1]["type"] == "end"
    # Both cells share the node `local`, so one worker ran them one after the other: side by
    # side on one machine they would have measured each other.
    assert len({call["worker"] for call in calls}) == 1
    assert [c["cell_id"] for c in calls] == sorted(c["cell_id"] for c in calls)


def _tiny_path() -> Path:
    from pytest_gpubench.engines.tinymodel import ensure_tiny_model

    return ensure_tiny_model()


def start_long_run(
    pytester: pytest.Pytester, llama_server: Path, tiny_model: Path
) -> subprocess.Popen[bytes]:
    """A pytest subprocess measuring a thousand warm cases (seconds of work left when the test
    signals it: a call takes 10-50 ms); returns once 10 calls are in. Steadiness checks off (a
    control call before each call) and no hypothesis plugin (a second to import): the subject is
    what a signal does to the run, not the machine's speed."""
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells=f"nodes: {{local: {{kind: local}}}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, server_binary: '{llama_server}', server_args: [--threads, '1'], runs: 500, phases: [warm]}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "pytest", "-q", "--force-load", "-p", "no:cacheprovider"),
            *("-p", "no:hypothesispytest", "--gpubench-steadiness", "off"),
        ],
        cwd=pytester.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ledgers = list((pytester.path / "runs").glob("*.jsonl"))
        if ledgers and ledgers[0].read_text().count('"type":"call"') >= 10:
            break
        time.sleep(0.02)
    assert server_pids(tiny_model), "the managed server never started"
    return process


def wait_until_gone(model: Path, timeout_s: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server_pids(model):
        time.sleep(0.05)
    return server_pids(model)


def test_kill_9_of_pytest_leaves_no_server(
    pytester: pytest.Pytester, llama_server: Path, tiny_model: Path
) -> None:
    process = start_long_run(pytester, llama_server, tiny_model)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    assert wait_until_gone(tiny_model) == []
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    complete = ledger.read_text().split("\n")[:-1]
    kinds = [json.loads(line)["type"] for line in complete]
    assert kinds[:2] == ["meta", "cell"] and set(kinds[2:]) <= {"call", "sample"}, kinds
    assert "call" in kinds, kinds


def test_ctrl_c_stops_the_server_and_closes_the_ledger(
    pytester: pytest.Pytester, llama_server: Path, tiny_model: Path
) -> None:
    process = start_long_run(pytester, llama_server, tiny_model)
    os.kill(process.pid, signal.SIGINT)
    assert process.wait(timeout=30) == pytest.ExitCode.INTERRUPTED
    assert server_pids(tiny_model) == []  # stopped by the session's own teardown, not by a signal
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    assert records[-1]["type"] == "end" and records[-1]["pytest_exitstatus"] == 2
