"""Endpoints and requests as users have them (issue 12): TLS through a real terminator (stunnel4)
in front of the real llama-server, kept-alive connections, /v1 and gateway base URLs, and the
request keys (temperature, seed, ignore_eos, min_tokens, extra_body, headers from the env)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from support.keepalive_server import KeepAliveServer, keepalive_server
from support.standins import OllamaStandin, serving
from support.tls_terminator import make_ca, stunnel, stunnel_binary

from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.config.prompts import Prompt, RequestShape
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.engines import Request, api_root
from pytest_gpubench.engines.llamacpp import LlamaCppEngine
from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.engines.ollama import OllamaEngine
from pytest_gpubench.engines.openai import OpenAIEngine
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.measure.stream import HttpConnection, TlsSettings

needs_stunnel = pytest.mark.skipif(
    stunnel_binary() is None, reason="stunnel4 is not installed (make setup installs it)"
)


# -- base URLs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "root"),
    [
        ("http://h:8000", "http://h:8000"),
        ("http://h:8000/", "http://h:8000"),
        ("http://h:8000/v1", "http://h:8000"),
        ("http://h:8000/v1/", "http://h:8000"),
        ("https://gw.example/serving/llama/v1", "https://gw.example/serving/llama"),
        ("https://gw.example/serving/llama", "https://gw.example/serving/llama"),
        ("http://h:8000/v10", "http://h:8000/v10"),
    ],
)
def test_a_trailing_v1_is_the_api_root_and_any_other_path_a_prefix(written: str, root: str) -> None:
    assert api_root(written) == root


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/serving/llama/v1"])
def test_v1_and_gateway_base_urls_are_measured_on_the_right_path(suffix: str) -> None:
    with keepalive_server() as server:
        engine = OpenAIEngine(server.url + suffix, "m")
        call = engine.chat(Request("hi", 8), 5)
    assert call.error is None and call.first_delta_ms is not None
    prefix = suffix.rstrip("/").removesuffix("/v1")
    assert [r.path for r in server.requests] == [f"{prefix}/v1/chat/completions"]


@pytest.mark.engine
def test_v1_base_url_against_the_real_llama_server(server: ManagedLlamaServer) -> None:
    """`http://host:port/v1` as OpenAI clients write it: health, models and a measured call
    (not /v1/v1/models)."""
    url = server.base_url
    for engine in (LlamaCppEngine(f"{url}/v1/", "tiny"), OpenAIEngine(f"{url}/v1", "tiny")):
        assert engine.health(10).ok, engine.health(10).reason
        call = engine.chat(Request("What is the capital of France?", 8), 30)
        assert call.error is None and call.completion_tokens == 8


# -- kept-alive connections ----------------------------------------------------------------------


def test_warm_calls_share_one_connection_and_a_cold_call_opens_a_fresh_one() -> None:
    with keepalive_server() as server:
        engine = OpenAIEngine(server.url, "m")
        calls = [engine.chat(Request("hi", 8), 5) for _ in range(6)]
        assert server.connections_accepted == 1
        engine.close_connection()  # what the harness does before a cold call
        cold = engine.chat(Request("hi", 8), 5)
        assert server.connections_accepted == 2
    assert all(call.error is None for call in [*calls, cold])
    first, *warm = calls
    assert not first.connection_reused and first.connect_ms is not None
    assert all(call.connection_reused and call.connect_ms is None for call in warm)
    assert not any(call.reconnected for call in calls)
    assert not cold.connection_reused and cold.connect_ms is not None
    assert {r.connection for r in server.requests} == {1, 2}


def test_a_dropped_connection_is_reopened_once_before_the_clock_and_noted() -> None:
    with keepalive_server() as server:
        engine = OpenAIEngine(server.url, "m")
        before = engine.chat(Request("hi", 8), 5)
        server.drop_connections()  # an idle timeout on the server's side
        import time

        time.sleep(0.05)
        after = engine.chat(Request("hi", 8), 5)
        again = engine.chat(Request("hi", 8), 5)
        assert server.connections_accepted == 2
    assert before.error is None and after.error is None and again.error is None
    assert after.reconnected and not after.connection_reused and after.connect_ms is not None
    assert again.connection_reused and not again.reconnected


def test_a_connection_closed_on_the_request_is_reopened_once_and_the_call_measured() -> None:
    """Dropped between the check and the send: the server reads the request and hangs up."""
    with keepalive_server(hang_up_on_request=2) as server:
        engine = OpenAIEngine(server.url, "m")
        first = engine.chat(Request("hi", 8), 5)
        second = engine.chat(Request("hi", 8), 5)
        assert server.connections_accepted == 2
    assert first.error is None and second.error is None, second.error
    assert second.reconnected and second.first_delta_ms is not None
    assert len(server.requests) == 3  # the request that got no answer was sent once more


def test_a_failed_call_never_leaves_its_connection_for_the_next() -> None:
    with keepalive_server(hang_up_on_request=1) as server:
        engine = OpenAIEngine(server.url, "m")
        failed = engine.chat(Request("hi", 8), 5)
        after = engine.chat(Request("hi", 8), 5)
    assert failed.error is not None and "closed the connection before responding" in failed.error
    assert after.error is None and not after.reconnected and not after.connection_reused


def test_a_reply_left_unread_never_closes_the_connection_that_came_after_it() -> None:
    """A reply whose lines were left half read and dropped, its reader finalized later (by the
    garbage collector, at any moment): closing must touch its own socket, not the one the next
    call is reading. Seen in make test-fast: a call after three failed ones broke with `[Errno 9]
    Bad file descriptor` three chunks in."""
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    with keepalive_server() as server:
        connection = HttpConnection(server.url)
        left = connection.post_stream("/v1/chat/completions", body, timeout_s=5)
        next(left.lines)  # half read, then abandoned without release
        connection.close()  # as after a failed call: the next one opens a fresh connection
        reading = connection.post_stream("/v1/chat/completions", body, timeout_s=5)
        first = next(reading.lines)
        left.lines.close()  # type: ignore[attr-defined]  # what the collector does to it later
        rest = list(reading.lines)
        reading.release(True)
    assert first.text and any(line.text == b"data: [DONE]" for line in rest)


# -- TLS through stunnel4 ------------------------------------------------------------------------


@needs_stunnel
@pytest.mark.engine
def test_tls_in_front_of_the_real_llama_server(server: ManagedLlamaServer, tmp_path: Path) -> None:
    """Calls succeed with ca_file; an unknown CA fails in one line; no certificate check works
    only when asked; stunnel completes one handshake per connection the client opened."""
    with stunnel(server.base_url, tmp_path / "tls") as terminator:
        start = terminator.handshakes()
        tls = TlsSettings(ca_file=str(terminator.ca_file))
        engine = LlamaCppEngine(f"{terminator.url}/v1", "tiny", tls=tls)
        assert engine.health(10).ok, engine.health(10).reason  # control calls trust it too
        calls = [engine.chat(Request("What is the capital of France?", 8), 30) for _ in range(4)]
        for call in calls:
            assert call.error is None and call.completion_tokens == 8
            assert call.first_delta_ms is not None and call.tls_handshake_ms is not None
        # llama-server closes the connection after every streamed reply: each call found it
        # closed and opened a new one before its clock started.
        assert all(call.reconnected for call in calls[1:])
        # One per connection: the streams' and the health check's (httpx).
        assert terminator.handshakes() - start == engine.connection.opened + 1
        other_ca = make_ca(tmp_path / "other", "someone else's CA")[0]
        stranger = LlamaCppEngine(terminator.url, "tiny", tls=TlsSettings(ca_file=str(other_ca)))
        refused = stranger.chat(Request("hi", 8), 30)
        health = stranger.health(10)
        unchecked = LlamaCppEngine(terminator.url, "tiny", tls=TlsSettings(verify=False))
        assert unchecked.chat(Request("hi", 8), 30).error is None
    assert refused.error is not None and "\n" not in refused.error
    assert refused.error.startswith(
        f"TLS: the certificate of {terminator.url.removeprefix('https://')} is not trusted by "
        f"{other_ca}: "
    )
    assert not health.ok and "CERTIFICATE_VERIFY_FAILED" in health.reason


@needs_stunnel
def test_one_tls_handshake_for_the_warm_calls_of_a_kept_alive_connection(
    tmp_path: Path,
) -> None:
    with keepalive_server() as server, stunnel(server.url, tmp_path / "tls") as terminator:
        start = terminator.handshakes()
        engine = OpenAIEngine(terminator.url, "m", tls=TlsSettings(ca_file=str(terminator.ca_file)))
        warm = [engine.chat(Request("hi", 8), 5) for _ in range(8)]
        assert terminator.handshakes() - start == 1
        engine.close_connection()
        cold = engine.chat(Request("hi", 8), 5)
        assert terminator.handshakes() - start == 2
    assert all(call.error is None for call in [*warm, cold])
    assert warm[0].tls_handshake_ms is not None and warm[0].tls_handshake_ms > 0
    assert all(c.tls_handshake_ms is None and c.connection_reused for c in warm[1:])
    assert cold.tls_handshake_ms is not None and not cold.connection_reused


# -- request keys, per cell and per prompt -------------------------------------------------------


def test_the_default_request_keeps_the_frozen_hash_and_a_changed_one_changes_it() -> None:
    prompt = Prompt(intent="i", prompt="Say hi.", max_tokens=8)
    before_issue_12 = prompt.sha256()
    assert prompt.sha256(RequestShape()) == before_issue_12
    assert prompt.sha256(RequestShape(temperature=0)) == before_issue_12
    assert prompt.sha256(RequestShape(seed=1)) != before_issue_12
    assert prompt.sha256(RequestShape(ignore_eos=True)) != prompt.sha256(RequestShape(seed=1))


def write_files(path: Path, cells: str, prompts: str | None = None) -> tuple[Path, Path]:
    cells_path, prompts_path = path / "cells.yaml", path / "prompts.yaml"
    cells_path.write_text(textwrap.dedent(cells))
    prompts_path.write_text(
        textwrap.dedent(prompts or "prompts:\n  P: {intent: i, prompt: hi, max_tokens: 4}\n")
    )
    return cells_path, prompts_path


@pytest.mark.parametrize(
    ("cell", "prompts", "error"),
    [
        (
            "{node: l, engine: ollama, model: m, endpoint: 'http://h:1', "
            "request: {ignore_eos: true}}",
            None,
            "cells[0] (l:ollama:m): request.ignore_eos: Ollama's API has no ignore_eos",
        ),
        (
            "{node: l, engine: ollama, model: m, endpoint: 'http://h:1'}",
            "prompts:\n  P: {intent: i, prompt: hi, max_tokens: 4, request: {min_tokens: 4}}\n",
            "prompts.P: request.min_tokens: Ollama's API has no min_tokens: the output length "
            "cannot be fixed (cell l:ollama:m)",
        ),
        (
            "{node: l, engine: llamacpp, model: m, endpoint: 'http://h:1', "
            "request: {min_tokens: 4}}",
            None,
            "request.min_tokens: llama-server has no min_tokens; use ignore_eos: true",
        ),
        (
            "{node: l, engine: openai, model: m, endpoint: 'http://h:1', ca_file: ca.pem}",
            None,
            "cells[0] (l:openai:m): ca_file: only applies to an https:// endpoint",
        ),
        (
            "{node: l, engine: openai, model: m, endpoint: 'http://h:1', "
            "headers: {X-Team: plain-value}}",
            None,
            "cells[0] (l:openai:m).headers.X-Team: Input should be a valid dictionary",
        ),
    ],
)
def test_request_and_tls_keys_an_engine_cannot_take_are_one_line(
    tmp_path: Path, cell: str, prompts: str | None, error: str
) -> None:
    cells_path, prompts_path = write_files(
        tmp_path, f"nodes: {{l: {{kind: local}}}}\ncells:\n  - {cell}\n", prompts
    )
    with pytest.raises(GpubenchError) as raised:
        read_matrix(cells_path, prompts_path)
    assert error in str(raised.value) and "\n" not in str(raised.value)


BENCH = """\
def test_generate(gpubench_case):
    call = gpubench_case.run()
    assert call["error"] is None, call["error"]
"""


def ledger_of(pytester: pytest.Pytester) -> tuple[list[dict[str, Any]], str]:
    (path,) = (pytester.path / "runs").glob("*.jsonl")
    return read_ledger(path), path.read_text()


def test_request_keys_and_env_headers_reach_the_engine_and_the_records_not_the_secret(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "team-s3cr3t-4f9a"
    monkeypatch.setenv("GPUBENCH_TEST_TEAM", secret)
    with keepalive_server() as server:
        pytester.makefile(
            ".yaml",
            prompts=textwrap.dedent(
                """\
                prompts:
                  P-PLAIN: {intent: i, prompt: "Say hi.", max_tokens: 8}
                  P-SEEDED: {intent: i, prompt: "Say hello.", max_tokens: 8,
                             request: {seed: 9, temperature: 0.2}}
                """
            ),
            cells=textwrap.dedent(
                f"""\
                nodes: {{local: {{kind: local}}}}
                cells:
                  - node: local
                    engine: openai
                    model: m
                    endpoint: '{server.url}/v1/'
                    phases: [cold, warm]
                    runs: 3
                    request: {{temperature: 0.5, seed: 7, ignore_eos: true, min_tokens: 8,
                              extra_body: {{top_k: 3, chat_template_kwargs: {{a: 1}}}}}}
                    headers: {{X-Team: {{env: GPUBENCH_TEST_TEAM}}}}
                """
            ),
        )
        pytester.makepyfile(BENCH)
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
        result.assert_outcomes(passed=8)  # per prompt: 1 cold, 3 warm
        requests = list(server.requests)
    bodies = {r.body["messages"][0]["content"]: r.body for r in requests}  # type: ignore[index]
    plain, seeded = bodies["Say hi."], bodies["Say hello."]
    assert (plain["temperature"], plain["seed"], plain["ignore_eos"], plain["min_tokens"]) == (
        0.5, 7, True, 8,
    )  # fmt: skip
    assert plain["top_k"] == 3 and plain["chat_template_kwargs"] == {"a": 1}
    assert (seeded["temperature"], seeded["seed"]) == (0.2, 9)
    assert all(r.headers["x-team"] == secret for r in requests)
    assert all(r.path == "/v1/chat/completions" for r in requests)
    records, text = ledger_of(pytester)
    assert secret not in text
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert cell["request_headers"] == {"X-Team": "$GPUBENCH_TEST_TEAM"}
    assert cell["request"] == {
        "temperature": 0.5, "seed": 7, "ignore_eos": True, "min_tokens": 8,
        "extra_body": {"top_k": 3, "chat_template_kwargs": {"a": 1}},
    }  # fmt: skip
    assert cell["request_by_prompt"]["P-SEEDED"]["seed"] == 9
    assert cell["tls_verify"] is None  # a plain http:// endpoint
    calls = [r for r in records if r["type"] == "call"]
    cold = [c for c in calls if c["phase"] == "cold"]
    warm = [c for c in calls if c["phase"] == "warm"]
    # Every cold call opened a fresh connection; a warm call follows a call on the same one.
    assert all(not c["connection_reused"] and c["connect_ms"] is not None for c in cold)
    assert all(c["connection_reused"] and c["connect_ms"] is None for c in warm)
    # The streams' connections (the control calls, on httpx, have their own): one per cold call,
    # and the warm-up's when a warm case came first.
    assert len({r.connection for r in requests}) <= len(cold) + 1
    # The request keys are part of what was measured: the frozen hash covers them.
    shas = {c["prompt_id"]: c["prompt_sha256"] for c in calls}
    assert shas["P-PLAIN"] != Prompt(intent="i", prompt="Say hi.", max_tokens=8).sha256()


@needs_stunnel
@pytest.mark.engine
def test_https_cells_with_ca_file_v1_and_a_gateway_prefix_through_the_plugin(
    pytester: pytest.Pytester, server: ManagedLlamaServer, tmp_path: Path
) -> None:
    """The real llama-server behind stunnel: a /v1 cell and a cell with tls_verify off, both
    measured; the unchecked one is recorded loudly."""
    with stunnel(server.base_url, tmp_path / "tls") as terminator:
        pytester.makefile(
            ".yaml",
            prompts="prompts:\n  P: {intent: i, prompt: 'Say hi.', max_tokens: 8}\n",
            cells=textwrap.dedent(
                f"""\
                nodes: {{local: {{kind: local}}}}
                cells:
                  - {{node: local, engine: llamacpp, model: tiny, name: tls,
                      endpoint: '{terminator.url}/v1', ca_file: '{terminator.ca_file}',
                      phases: [warm], runs: 2}}
                  - {{node: local, engine: openai, model: tiny, name: unchecked,
                      endpoint: '{terminator.url}/v1/', tls_verify: false,
                      phases: [warm], runs: 2}}
                """
            ),
        )
        pytester.makepyfile(BENCH)
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*TLS certificate checks are OFF (tls_verify: false)*"])
    records, _ = ledger_of(pytester)
    cells = {r["cell_id"]: r for r in records if r["type"] == "cell"}
    checked, unchecked = cells["local:llamacpp:tiny@tls"], cells["local:openai:tiny@unchecked"]
    assert checked["tls_verify"] is True and checked["ca_file"] == str(terminator.ca_file)
    assert "tls_warning" not in checked
    assert unchecked["tls_verify"] is False and "OFF" in unchecked["tls_warning"]
    calls = [r for r in records if r["type"] == "call"]
    assert len(calls) == 4 and all(c["error"] is None for c in calls)
    assert all(c["tls_handshake_ms"] is not None for c in calls)  # llama-server closes each


def test_a_gateway_prefix_through_the_plugin(pytester: pytest.Pytester) -> None:
    with keepalive_server() as server:
        pytester.makefile(
            ".yaml",
            prompts="prompts:\n  P: {intent: i, prompt: 'Say hi.', max_tokens: 8}\n",
            cells=f"nodes: {{local: {{kind: local}}}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: m, "
            f"endpoint: '{server.url}/serving/llama/v1', phases: [warm], runs: 2}}\n",
        )
        pytester.makepyfile(BENCH)
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
        paths = {r.path for r in server.requests}
    result.assert_outcomes(passed=2)
    assert paths == {"/serving/llama/v1/chat/completions"}


def test_keepalive_server_stands_in_for_a_keep_alive_engine() -> None:
    """The stand-in answers HTTP/1.1 requests on one connection, as uvicorn (vLLM) does."""
    server = KeepAliveServer().start()
    try:
        engine = OpenAIEngine(server.url, "m")
        assert [engine.chat(Request("hi", 8), 5).completion_tokens for _ in range(3)] == [8, 8, 8]
        assert server.connections_accepted == 1
        assert json.dumps(server.requests[0].body["stream"]) == "true"
    finally:
        server.close()


def test_a_header_whose_variable_is_unset_names_the_cell_the_header_and_the_variable(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUBENCH_TEST_UNSET", raising=False)
    with keepalive_server() as server:
        pytester.makefile(
            ".yaml",
            prompts="prompts:\n  P: {intent: i, prompt: 'Say hi.', max_tokens: 8}\n",
            cells=f"nodes: {{local: {{kind: local}}}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}', "
            f"phases: [warm], runs: 1, headers: {{X-Team: {{env: GPUBENCH_TEST_UNSET}}}}}}\n",
        )
        pytester.makepyfile(BENCH)
        pytester.runpytest("--force-load", "-p", "no:cacheprovider")
        posted = list(server.requests)
    records, _ = ledger_of(pytester)
    (skipped,) = [r for r in records if r["type"] == "skipped"]
    assert skipped["reason"] == (
        "cell local:openai:m: headers.X-Team: $GPUBENCH_TEST_UNSET is not set"
    )
    assert posted == []


def test_a_kept_alive_connection_does_not_hold_back_a_nagle_servers_writes() -> None:
    """The Ollama stand-in (http.server) does not set TCP_NODELAY: once a kept-alive connection
    has left Linux's quick-ACK start, a delayed ACK would hold its first content back 40 ms.
    The client ACKs at once (TCP_QUICKACK before each read): TTFT stays the server's."""
    with serving(OllamaStandin(token_s=0.003)) as url:
        engine = OllamaEngine(url, "qwen3.5:0.8b")
        calls = [engine.chat(Request("hi", 6), 5) for _ in range(12)]
    assert all(call.error is None for call in calls)
    assert sum(call.connection_reused for call in calls) >= 10
    warm = sorted(call.first_delta_ms or 0.0 for call in calls[2:])
    assert warm[len(warm) // 2] < 20.0, warm  # 40+ ms each without the quick ACKs
