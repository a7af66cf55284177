"""Engine adapters against stand-ins: Ollama's documented API, and the faults a stream can have."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from support.standins import OLLAMA_DIGEST, FaultyOpenAIServer, OllamaStandin, serving

from pytest_gpubench.config.prompts import RequestShape
from pytest_gpubench.engines import Request, api_root, send
from pytest_gpubench.engines.ollama import OllamaEngine
from pytest_gpubench.engines.openai import OpenAIEngine
from pytest_gpubench.engines.plugin import plugin_engine
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.measure.call_measurement import CallMeasurement
from pytest_gpubench.measure.stream import Endpoint, joined_url


def test_ollama_adapter_streams_ndjson_and_keeps_engine_timings() -> None:
    """Ollama cannot run here: the stand-in follows Ollama's docs/api.md field by field."""
    with serving(OllamaStandin("qwen3.5:0.8b")) as url:
        engine = OllamaEngine(url, "qwen3.5:0.8b")
        assert engine.health(5).ok
        assert engine.describe(5) == {"engine_version": "0.12.3", "model_digest": OLLAMA_DIGEST}
        call = engine.chat(Request("Say hi.", 12), 10)
    assert call.error is None and call.finish_reason == "length"
    assert call.completion_tokens == 12 == call.client_chunks
    assert call.prompt_tokens == 12
    assert call.first_delta_ms is not None and call.total_duration_ms is not None
    assert 0 < call.first_delta_ms < call.total_duration_ms
    assert set(call.engine_timings) == {
        "total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
        "eval_count", "eval_duration",
    }  # fmt: skip
    assert call.engine_timings["load_duration"] > 0  # first call loaded the model
    assert call.tokens_per_sec and call.tpot_ms and len(call.inter_chunk_ms) == 11
    # Ollama's own rate is eval_count / eval_duration (ns); its prompt time includes the load.
    timings = call.engine_timings
    # Rates are recorded to 3 decimals, milliseconds to 4: the figures are exactly those roundings
    # (a tolerance of half the last place failed on 77.38415 ms, which rounds to 77.3842).
    assert call.engine_tokens_per_sec == round(12 / (timings["eval_duration"] / 1e9), 3)
    assert call.engine_prompt_ms == round(
        (timings["prompt_eval_duration"] + timings["load_duration"]) / 1e6, 4
    )
    assert call.engine_total_ms == round(timings["total_duration"] / 1e6, 4)
    # The stand-in sleeps 2 ms per token: the client's decode rate and the engine's agree.
    assert call.tokens_per_sec == pytest.approx(call.engine_tokens_per_sec, rel=0.5)


def test_ollama_cold_unloads_with_keep_alive_0_confirmed_by_ps() -> None:
    """Ollama cannot run here: the stand-in follows Ollama's docs/api.md (keep_alive 0, /api/ps).
    Its model loads in 1 s: a warm call descheduled beside other workers (72 ms in a local
    make test, against a 200 ms load) stays far inside the 150 ms the cold call must add."""
    server = OllamaStandin("qwen3.5:0.8b", load_s=1.0)
    with serving(server) as url:
        engine = OllamaEngine(url, "qwen3.5:0.8b")
        warm_up = engine.chat(Request("Say hi.", 4), 10)
        assert engine.loaded_models(5) == ["qwen3.5:0.8b"]
        warm = engine.chat(Request("Say hi.", 4), 10)
        assert engine.unload(5) is True
        assert engine.loaded_models(5) == []
        cold = engine.chat(Request("Say hi.", 4), 10)
    unload = [r for r in server.requests if r[1] == "/api/generate"]
    assert unload == [("POST", "/api/generate", {"model": "qwen3.5:0.8b", "keep_alive": 0})]
    assert warm.engine_timings["load_duration"] == 0
    assert cold.engine_timings["load_duration"] >= 0.2e9 and warm_up.error is None
    assert cold.first_delta_ms is not None and warm.first_delta_ms is not None
    assert cold.first_delta_ms > warm.first_delta_ms + 150


def test_ollama_health_names_a_missing_model() -> None:
    with serving(OllamaStandin("qwen3.5:0.8b")) as url:
        health = OllamaEngine(url, "llama3:8b").health(5)
    assert not health.ok and "model 'llama3:8b' is not pulled" in health.reason


def test_a_gateways_query_follows_every_path_of_every_engine_kind() -> None:
    """The control calls (health, version, models, /tokenize) and the streamed request alike."""
    root = api_root("http://gw.internal/serving/llama/v1/?key=k1")
    assert root == "http://gw.internal/serving/llama?key=k1"
    assert joined_url(root, "/v1/models") == "http://gw.internal/serving/llama/v1/models?key=k1"
    assert joined_url("http://h:11434/?key=k1", "/api/tags") == "http://h:11434/api/tags?key=k1"
    assert joined_url("http://h:8080", "/health") == "http://h:8080/health"
    endpoint = Endpoint.parse(root)
    assert endpoint.target("/v1/chat/completions") == "/serving/llama/v1/chat/completions?key=k1"
    assert Endpoint.parse("http://h:8080/").target("/metrics") == "/metrics"


def test_an_ollama_endpoint_with_a_query_keeps_it_after_every_path(
    pytester: pytest.Pytester,
) -> None:
    """A gateway in front of Ollama that wants its key in the query (`?key=k1`): the paths went
    after the query (`/?key=k1/api/version`), and the stream's request dropped it (issue 37).
    Ollama cannot run here: the stand-in follows Ollama's docs/api.md."""
    server = OllamaStandin("qwen3.5:0.8b")
    server.query = "key=k1"
    with serving(server) as url:
        pytester.makefile(
            ".yaml",
            prompts='prompts:\n  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}\n',
            cells=f"cells:\n  - {{node: local, engine: ollama, model: 'qwen3.5:0.8b', "
            f"endpoint: '{url}/?key=k1', runs: 1}}\n",
        )
        pytester.makepyfile("def test_generate(gpubench_case):\n    gpubench_case.run()\n")
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    paths = {path for _, path, _ in server.requests}
    assert paths == {
        "/api/version?key=k1", "/api/tags?key=k1", "/api/generate?key=k1", "/api/ps?key=k1",
        "/api/chat?key=k1",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("prompt", "error", "chunks"),
    [
        ("BREAK", "stream broke after", 2),
        ("NOTJSON", "stream sent a line that is not JSON", 2),
        ("ERRLINE", 'engine error in stream: {"message": "slot unavailable"', 2),
        ("STALL", "no data for 1 s (read timed out)", 2),
        ("FAIL500", "HTTP 500: ", 0),
    ],
)
def test_stream_faults_keep_their_partial_figures_beside_the_error(
    prompt: str, error: str, chunks: int
) -> None:
    """Every fault kind records what arrived before it the same way: TTFT, chunks, total."""
    with serving(FaultyOpenAIServer()) as url:
        call = OpenAIEngine(url, "m").chat(Request(prompt, 6), 1)
    assert call.finish_reason == "error"
    assert call.error is not None and error in call.error
    assert call.client_chunks == chunks
    assert (call.first_delta_ms is not None) == (chunks > 0)
    assert call.total_duration_ms is not None  # send to the last byte that came
    if call.first_delta_ms is not None:
        assert 0 < call.first_delta_ms <= call.total_duration_ms
        assert len(call.inter_chunk_ms) == chunks - 1
    # What a failed call measured is kept, but it is never a result: no rate.
    assert call.tokens_per_sec is None and call.e2e_tokens_per_sec is None


def test_a_server_that_hangs_up_before_answering_says_so() -> None:
    with serving(FaultyOpenAIServer()) as url:
        call = OpenAIEngine(url, "m").chat(Request("HANGUP", 6), 5)
    host_port = url.removeprefix("http://")
    assert call.error == f"{host_port} closed the connection before responding"
    assert "h11" not in call.error and "ConnectionClosed" not in call.error
    assert (call.first_delta_ms, call.total_duration_ms, call.client_chunks) == (None, None, 0)


def test_a_stream_cut_mid_way_names_the_close_not_the_http_librarys_words() -> None:
    with serving(FaultyOpenAIServer()) as url:
        call = OpenAIEngine(url, "m").chat(Request("BREAK", 6), 5)
    assert call.error is not None
    assert "the server closed the connection before the end of its response" in call.error
    assert "can't handle event" not in call.error


def test_unreachable_engine_is_an_error_measurement() -> None:
    call = OpenAIEngine("http://127.0.0.1:9", "m").chat(Request("hi", 4), 2)
    assert call.finish_reason == "error" and "cannot connect to 127.0.0.1:9" in (call.error or "")


def test_faults_are_recorded_and_the_run_goes_on(pytester: pytest.Pytester) -> None:
    with serving(FaultyOpenAIServer()) as url:
        pytester.makefile(
            ".yaml",
            prompts=textwrap.dedent(
                """\
                prompts:
                  P-OK: {intent: fine, prompt: "Say hi.", max_tokens: 5}
                  P-BREAK: {intent: fault, prompt: "BREAK", max_tokens: 5}
                  P-NOTJSON: {intent: fault, prompt: "NOTJSON", max_tokens: 5}
                  P-500: {intent: fault, prompt: "FAIL500", max_tokens: 5}
                  P-OK-AGAIN: {intent: fine, prompt: "Say hello.", max_tokens: 5}
                """
            ),
            cells=f"nodes: {{local: {{kind: local}}}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: m, endpoint: '{url}', phases: [warm], runs: 1}}\n",
        )
        pytester.makepyfile(
            "def test_generate(gpubench_case):\n"
            "    call = gpubench_case.run()\n"
            "    assert call['error'] is None, call['error']\n"
        )
        result = pytester.runpytest("--force-load")
    result.assert_outcomes(passed=2, failed=3)
    (ledger,) = Path(pytester.path / "runs").glob("*.jsonl")
    calls = read_ledger(ledger)
    calls = [c for c in calls if c["type"] == "call"]
    by_prompt = {c["prompt_id"]: c for c in calls}
    assert [c["prompt_id"] for c in calls] == [
        "P-OK",
        "P-BREAK",
        "P-NOTJSON",
        "P-500",
        "P-OK-AGAIN",
    ]
    assert by_prompt["P-OK"]["error"] is None and by_prompt["P-OK-AGAIN"]["error"] is None
    assert by_prompt["P-OK"]["completion_tokens"] == 5
    for prompt_id in ("P-BREAK", "P-NOTJSON", "P-500"):
        assert by_prompt[prompt_id]["finish_reason"] == "error"
        assert by_prompt[prompt_id]["error"]


class OllamaOpenAIStandin(FaultyOpenAIServer):
    """Ollama's OpenAI-compatible API (docs/openai.md): /v1/models lists the tagged name
    (`llama3.2:latest`), /v1/chat/completions answers to the untagged one too, and there is no
    /health (404). Streaming is FaultyOpenAIServer's."""

    def __init__(self, model: str = "llama3.2:latest") -> None:
        super().__init__(model)

    def get(self, handler: Any) -> None:
        if handler.path == "/v1/models":
            entry = {
                "id": self.model,
                "object": "model",
                "created": 1730000000,
                "owned_by": "library",
            }
            handler._json(200, {"object": "list", "data": [entry]})
        else:
            handler._json(404, {"error": "not found"})

    def post(self, handler: Any, body: dict[str, Any]) -> None:
        if body.get("model") not in (self.model, self.model.removesuffix(":latest")):
            message = f'model "{body.get("model")}" not found, try pulling it first'
            handler._json(404, {"error": {"message": message, "type": "api_error"}})
            return
        super().post(handler, body)


@pytest.mark.parametrize(
    ("served", "wanted", "ok"),
    [
        ("llama3.2:latest", "llama3.2", True),
        ("llama3.2:latest", "llama3.2:latest", True),
        ("llama3.2:1b", "llama3.2", False),
        ("llama3.2:latest", "llama3", False),
        ("qwen3.5:0.8b", "qwen3.5:0.8b:latest", False),
    ],
)
def test_openai_cell_on_ollama_accepts_the_untagged_name(
    served: str, wanted: str, ok: bool
) -> None:
    with serving(OllamaOpenAIStandin(served)) as url:
        engine = OpenAIEngine(url, wanted)
        health = engine.health(5)
        call = engine.chat(Request("Say hi.", 4), 5) if ok else None
    assert health.ok is ok, health.reason
    if not ok:
        assert f"does not serve model '{wanted}'" in health.reason and served in health.reason
    else:
        assert call is not None and call.error is None and call.completion_tokens == 4


def test_two_versions_side_by_side_are_named_cells_recorded_as_written(
    pytester: pytest.Pytester,
) -> None:
    """Two Ollama builds serving llama3.2:latest, named apart; each cell uses the untagged name
    and the ledger records the endpoints as written (the URL type would add a trailing slash)."""
    old, new = OllamaOpenAIStandin(), OllamaOpenAIStandin()
    with serving(old) as old_url, serving(new) as new_url:
        pytester.makefile(
            ".yaml",
            prompts='prompts:\n  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 3}\n',
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: llama3.2, endpoint: '{old_url}',"
            " name: ollama-0.12, phases: [warm], runs: 2}\n"
            f"  - {{node: local, engine: openai, model: llama3.2, endpoint: '{new_url}',"
            " name: ollama-0.13, phases: [warm], runs: 2}\n",
        )
        pytester.makepyfile(
            "def test_generate(gpubench_case):\n"
            "    call = gpubench_case.run()\n"
            "    assert call['error'] is None, call['error']\n"
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=4)
    (ledger,) = Path(pytester.path / "runs").glob("*.jsonl")
    records = read_ledger(ledger)
    cells = {r["cell_id"]: r for r in records if r["type"] == "cell"}
    assert {cell_id: r["endpoint"] for cell_id, r in cells.items()} == {
        "local:openai:llama3.2@ollama-0.12": old_url,
        "local:openai:llama3.2@ollama-0.13": new_url,
    }
    calls = [r for r in records if r["type"] == "call"]
    assert sorted(c["case_id"] for c in calls) == [
        f"local:openai:llama3.2@ollama-0.1{v}-P-EASY-warm-{i}" for v in (2, 3) for i in (0, 1)
    ]
    for server in (old, new):
        chats = [body for method, path, body in server.requests if method == "POST"]
        assert len(chats) >= 2 and {body["model"] for body in chats} == {"llama3.2"}


def test_an_openai_compatible_server_is_described_without_calling_a_name_a_digest() -> None:
    """vLLM's /v1/models entry says what the served name was loaded from and its context; a
    server that says only the name is recorded as `name only`, its digest unknown."""

    class VllmLike(FaultyOpenAIServer):
        def get(self, handler: Any) -> None:
            if handler.path == "/v1/models":
                entry = {"id": "qwen", "object": "model", "owned_by": "vllm",
                         "root": "Qwen/Qwen3-0.6B", "max_model_len": 4096}  # fmt: skip
                handler._json(200, {"object": "list", "data": [entry]})
            else:
                super().get(handler)

    with serving(VllmLike("qwen")) as url:
        assert OpenAIEngine(url, "qwen").describe(5) == {
            "engine_version": None,
            "model_digest": None,
            "model_identity": "name and root",
            "model_root": "Qwen/Qwen3-0.6B",
            "max_model_len": 4096,
        }
    with serving(FaultyOpenAIServer("m")) as url:
        facts = OpenAIEngine(url, "m").describe(5)
    assert facts["model_digest"] is None and facts["model_identity"] == "name only"


def test_each_engine_kind_says_how_it_counts_tokens() -> None:
    """run/workloads.py asks the engine (engines.CountsTokens), never its kind: llama-server's
    /tokenize, an OpenAI-compatible server's as vLLM serves it (for the cell's model), and none
    for Ollama (synthetic prompts then count by the prompt count it reports)."""
    from pytest_gpubench.engines import CountsTokens
    from pytest_gpubench.engines.llamacpp import LlamaCppEngine
    from pytest_gpubench.engines.tokenizer import LlamaCppCounter, VllmCounter

    headers = {"X-Team": "bench"}
    llama = LlamaCppEngine("http://127.0.0.1:1/v1", "tiny", "key", headers=headers)
    openai = OpenAIEngine("http://127.0.0.1:1", "org/model", headers=headers)
    ollama = OllamaEngine("http://127.0.0.1:1", "llama3.2")
    assert isinstance(llama, CountsTokens) and isinstance(openai, CountsTokens)
    assert not isinstance(ollama, CountsTokens)
    counted = llama.token_counter()
    assert type(counted) is LlamaCppCounter
    assert counted.base_url == "http://127.0.0.1:1"
    assert counted.client.headers["X-Team"] == "bench"
    assert counted.client.headers["Authorization"] == "Bearer key"
    vllm = openai.token_counter()
    assert type(vllm) is VllmCounter
    assert vllm.model == "org/model"
    assert vllm.client.headers["X-Team"] == "bench"


class PromptChatEngine:
    """A plugin's engine as docs/extending.md described it before the request object (issue 45):
    chat(prompt, max_tokens, timeout_s) taking `request=` only, and no `kinds`."""

    kind = "lab"
    base_url = "http://127.0.0.1:9"
    model = "m"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def chat(
        self, prompt: str, max_tokens: int, timeout_s: float, request: Any = None
    ) -> CallMeasurement:
        self.calls.append((prompt, max_tokens, timeout_s, request))
        return CallMeasurement(backend="lab", completion_tokens=max_tokens)


def test_a_plugin_engine_written_before_the_request_object_is_called_as_it_was() -> None:
    """A user's plugin engine of the old protocol keeps running: its chat gets the prompt, the
    limit and the timeout, the request keys only where set, and it sends chat requests only; a
    conversation it cannot take is a failed call that says so, not a TypeError."""
    old = PromptChatEngine()
    engine = plugin_engine(old)
    assert engine.kinds == ("chat",) and engine.model == "m"
    assert send(engine, Request("hi", 8, shape=RequestShape()), 2.0).completion_tokens == 8
    shape = RequestShape(temperature=0.5)
    send(engine, Request("hi", 4, shape=shape), 2.0)
    assert old.calls == [("hi", 8, 2.0, None), ("hi", 4, 2.0, shape)]
    refused = send(engine, Request("hi", 8, messages=[{"role": "user", "content": "x"}]), 2.0)
    assert refused.error == "engine lab's chat takes no messages"
    assert len(old.calls) == 2


def test_a_plugin_engine_of_the_request_protocol_is_used_as_it_is() -> None:
    """An engine that follows the protocol (a chat taking a Request, its kinds) is not wrapped;
    one without `kinds` sends chat requests only."""
    built = OpenAIEngine("http://127.0.0.1:9", "m", None)
    assert plugin_engine(built) is built

    class NoKinds:
        kind = "lab"

        def chat(self, request: Request, timeout_s: float) -> CallMeasurement:
            return CallMeasurement(backend="lab", completion_tokens=request.max_tokens)

    engine = plugin_engine(NoKinds())
    assert engine.kinds == ("chat",)
    assert send(engine, Request("hi", 3), 1.0).completion_tokens == 3
