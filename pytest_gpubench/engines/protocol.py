"""How to talk to an inference engine: the `Engine` protocol, the request, and the streaming and
JSON readers every engine kind shares (`engines/__init__.py` names them, beside the factory)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

import httpx

from pytest_gpubench.measure.call_measurement import CallMeasurement, note_delta
from pytest_gpubench.measure.stream import (
    HttpConnection,
    Line,
    StreamedResponse,
    StreamError,
    TlsSettings,
    finish_timing,
    joined_url,
    read_error_body,
    stream_post,
)

if TYPE_CHECKING:
    from pytest_gpubench.config.prompts import Prompt, RequestKind, RequestShape
    from pytest_gpubench.engines.tokenizer import TokenCounter
    from pytest_gpubench.measure.gauges import CaseCounters


@dataclass(frozen=True)
class Health:
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Request:
    """What one call sends, one value from the harness to the engine (as httpx passes one
    `Request` through its transports): the prompt, or a whole conversation (`messages`, sent in
    place of `prompt` as one user turn), its limit, the cell's and prompt's request keys
    (`shape`: temperature, seed, ignore_eos, min_tokens, extra_body), a test's own options
    (`extra_body`, merged into the JSON last), and its kind with the kind's own keys
    (config/prompts.Prompt.kind_keys: a tools call's tools, a json_schema call's schema, an
    embedding's further inputs, a rerank's documents and top_n)."""

    prompt: str
    max_tokens: int
    shape: RequestShape | None = None
    messages: list[dict[str, object]] | None = None
    extra_body: Mapping[str, Any] | None = None
    kind: RequestKind = "chat"
    kind_keys: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, prompt: Prompt, shape: RequestShape | None) -> Request:
        """A prompts.yaml prompt's request under `shape` (the effective request keys)."""
        return cls(
            prompt.prompt, prompt.max_tokens, shape, prompt.chat_messages(), None,
            prompt.kind, prompt.kind_keys(),
        )  # fmt: skip

    @property
    def temperature(self) -> float:
        """The request keys' temperature; 0 where they set none."""
        return 0 if self.shape is None or self.shape.temperature is None else self.shape.temperature

    def conversation(self) -> list[dict[str, object]]:
        """The turns sent: `messages` when given, else `prompt` as one user turn."""
        if self.messages is not None:
            return self.messages
        return [{"role": "user", "content": self.prompt}]

    def embedding_inputs(self) -> list[str]:
        """An embedding request's inputs: `prompt`, then the kind's further `inputs`."""
        return [self.prompt, *self.kind_keys.get("inputs", ())]

    def body(self) -> dict[str, object]:
        """What joins the request's JSON last: its kind's keys, then a test's own options."""
        return {**kind_body(self.kind, self.kind_keys), **(self.extra_body or {})}


class EngineFacts(TypedDict, total=False):
    """What an engine says of itself for the cell record (describe()): its version and what
    identifies its model, which the gate compares between runs (None where it does not say)."""

    engine_version: str | None
    model_digest: str | None
    # Which of these identify the model: "digest", "path", "name and root", "name only".
    model_identity: str | None
    # vLLM's /v1/models entry: what the served name was loaded from, and its context.
    model_root: str | None
    max_model_len: int | None
    # llama-server's /props: its model's path, its slots and its context.
    engine_props: dict[str, object]
    # Added by the harness: the prebuilt llama.cpp server's own build (`engine_version` is then
    # the package's), and which of this host's paths a node ran from (a shared filesystem).
    engine_build_info: str | None
    shared_paths: dict[str, str]


class Engine(Protocol):
    """One engine endpoint serving one model."""

    kind: str
    base_url: str
    model: str
    # The request kinds it sends (config/prompts.RequestKind): chat, tools, json_schema and
    # image through `chat`, completion, embedding and rerank through a method of their own
    # (`Completes`, `Embeds`, `Reranks`).
    kinds: tuple[str, ...]

    def health(self, timeout_s: float) -> Health: ...

    def describe(self, timeout_s: float) -> EngineFacts:
        """engine_version and model_digest (None where the engine does not say)."""
        ...

    def chat(self, request: Request, timeout_s: float) -> CallMeasurement:
        """One streamed chat call (of kind chat, tools, json_schema or image: `Request.body`
        adds the kind's keys); failures come back as a measurement with `error` set."""
        ...

    def unload(self, timeout_s: float) -> bool:
        """Force the model out of memory; False where the engine cannot (cold = process_warm)."""
        ...


@runtime_checkable
class Completes(Protocol):
    """An engine that sends plain completions (kind completion: `prompt` as it is)."""

    def complete(self, request: Request, timeout_s: float) -> CallMeasurement: ...


@runtime_checkable
class Embeds(Protocol):
    """An engine that sends embeddings (kind embedding: the prompt and its further inputs)."""

    def embed(self, request: Request, timeout_s: float) -> CallMeasurement: ...


@runtime_checkable
class Reranks(Protocol):
    """An engine that ranks documents (kind rerank: its documents against the prompt)."""

    def rerank(self, request: Request, timeout_s: float) -> CallMeasurement: ...


def send(engine: Engine, request: Request, timeout_s: float) -> CallMeasurement:
    """One call of the request's kind, through the engine's method for it: a completion, an
    embedding and a rerank through their own, every other kind (named in the engine's `kinds`)
    a chat call."""
    if request.kind == "completion" and isinstance(engine, Completes):
        return engine.complete(request, timeout_s)
    if request.kind == "embedding" and isinstance(engine, Embeds):
        return engine.embed(request, timeout_s)
    if request.kind == "rerank" and isinstance(engine, Reranks):
        return engine.rerank(request, timeout_s)
    if request.kind in ("completion", "embedding", "rerank"):
        return _failed(engine.kind, f"engine {engine.kind} has no method for {request.kind}")
    return engine.chat(request, timeout_s)


@runtime_checkable
class ReadsCounters(Protocol):
    """An engine whose own counters (its /metrics) are read around each warm call: an
    OpenAI-compatible one's (vLLM, llama-server)."""

    def case_counters(self) -> CaseCounters: ...


@runtime_checkable
class ChatPayloads(Protocol):
    """An engine that speaks OpenAI's streamed chat completions, whose requests a load point
    sends on its own client (run/load/): each request's JSON, the headers and TLS settings."""

    tls: TlsSettings

    def payload(self, request: Request) -> dict[str, object]: ...

    def request_headers(self) -> dict[str, str]: ...


@runtime_checkable
class KeepsConnection(Protocol):
    """An engine that keeps its streaming connection alive between calls (the built-in ones).
    The harness closes it before a cold call, which then opens a fresh one."""

    def close_connection(self) -> None: ...


@runtime_checkable
class CountsTokens(Protocol):
    """An engine that counts a text's tokens itself (llama-server's /tokenize, an
    OpenAI-compatible server's: vLLM's): token-exact synthetic prompts are counted through it
    where the cell names no tokenizer (run/workloads.py)."""

    def token_counter(self) -> TokenCounter: ...


def api_root(base_url: str) -> str:
    """The endpoint with a trailing `/v1` taken off: OpenAI clients, vLLM and guidellm write
    base URLs as `http://host:8000/v1`, and the engines add `/v1/...` themselves. Any other path
    is kept as a prefix (a gateway's `/serving/llama/v1` becomes `/serving/llama`)."""
    parts = urlsplit(base_url.strip())
    path = parts.path.rstrip("/")
    if path.endswith("/v1") or path == "/v1":
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def control_client(
    timeout_s: float, headers: Mapping[str, str] | None = None, tls: TlsSettings | None = None
) -> httpx.Client:
    """An httpx client for control calls (health, version, tags); never used for timed streams.
    It trusts what the timed streams trust (ca_file, tls_verify; the system's CA store by
    default), with the process's one context for those settings (TlsSettings.context)."""
    verify = (tls or TlsSettings()).context()
    return httpx.Client(
        timeout=timeout_s, headers=dict(headers or {}), trust_env=False, verify=verify
    )


def get_json(
    base_url: str,
    path: str,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    tls: TlsSettings | None = None,
) -> Any:
    with control_client(timeout_s, headers, tls) as client:
        response = client.get(joined_url(base_url, path))
        response.raise_for_status()
        return response.json()


def merge_body(payload: dict[str, Any], extra: Mapping[str, Any] | None) -> dict[str, object]:
    """`extra` (a cell's or prompt's extra_body) merged into the request's JSON, mappings key by
    key (an extra `options` adds to Ollama's options rather than replacing them)."""
    merged = dict(payload)
    for key, value in (extra or {}).items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = merge_body(merged[key], value)
        else:
            merged[key] = value
    return merged


def _failed(backend: str, error: str) -> CallMeasurement:
    return CallMeasurement(backend=backend, error=error, finish_reason="error")


def measure_stream(
    backend: str,
    base_url: str,
    path: str,
    payload: dict[str, object],
    *,
    timeout_s: float,
    headers: tuple[tuple[str, str], ...] = (),
    parse: ChunkParser,
    connection: HttpConnection | None = None,
    tls: TlsSettings | None = None,
    inputs: int | None = None,
) -> CallMeasurement:
    """Send one streamed request and turn its stamped lines into a measurement.

    On `connection` (kept alive between calls; its base URL wins over `base_url`), else on a
    connection of its own. Every fault after the request went out (an HTTP error, an error line,
    a broken or timed-out stream) keeps what was measured until then beside the error
    (measure.finish_timing); the connection of a failed call is closed, never reused.
    """
    body = json.dumps(payload).encode()
    try:
        if connection is not None:
            response = connection.post_stream(path, body, timeout_s=timeout_s, headers=headers)
        else:
            response = stream_post(
                base_url, path, body, timeout_s=timeout_s, headers=headers, tls=tls
            )
    except StreamError as exc:
        return _failed(backend, str(exc))
    measurement = measure_response(backend, response, parse, inputs=inputs)
    # After the clock: the rest of a good reply is read so its connection can carry the next call.
    response.release(measurement.error is None)
    return measurement


def measure_response(
    backend: str, response: StreamedResponse, parse: ChunkParser, inputs: int | None = None
) -> CallMeasurement:
    """A measurement from a response whose lines carry their arrival stamps: the stream parser
    fills it, measure.finish_timing times it (a single call's, and each of a load case's).
    `inputs`: an embedding request's count of inputs."""
    measurement = CallMeasurement(backend=backend, inputs=inputs)
    measurement.connect_ms = response.connect_ms
    measurement.tls_handshake_ms = response.tls_handshake_ms
    measurement.connection_reused = response.connection_reused
    measurement.reconnected = response.reconnected
    content_arrivals: list[int] = []
    try:
        if response.status != 200:
            measurement.error = f"HTTP {response.status}: {read_error_body(response)}"
        else:
            parse(response, measurement, content_arrivals)
    except StreamError as exc:
        measurement.error = str(exc)
    # A tools call's stream ends with `tool_calls` (OpenAI's, vLLM's and llama.cpp's finish).
    if not measurement.error and measurement.finish_reason not in ("stop", "length", "tool_calls"):
        measurement.error = "stream ended without a finish reason"
    if measurement.error:
        measurement.finish_reason = "error"
    finish_timing(measurement, response, content_arrivals)
    return measurement


class ChunkParser(Protocol):
    def __call__(
        self, response: StreamedResponse, measurement: CallMeasurement, arrivals: list[int]
    ) -> None:
        """Fill the measurement from the stream; append each content chunk's arrival time.

        Appended as they come, so that a stream that breaks keeps the arrivals before the break.
        """
        ...


def json_number(value: Any) -> float | None:
    """A number from an engine's JSON; None for anything else (booleans included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def llamacpp_engine_figures(timings: dict[str, object], measurement: CallMeasurement) -> None:
    """llama-server's own rate and times from its `timings`: decode rate, prompt and total ms."""
    prompt_ms = json_number(timings.get("prompt_ms"))
    predicted_ms = json_number(timings.get("predicted_ms"))
    measurement.engine_tokens_per_sec = json_number(timings.get("predicted_per_second"))
    measurement.engine_prompt_ms = prompt_ms
    if prompt_ms is not None and predicted_ms is not None:
        measurement.engine_total_ms = round(prompt_ms + predicted_ms, 4)


def stream_chunk(
    text: str | bytes, measurement: CallMeasurement, error: Callable[[Any], str] = json.dumps
) -> dict[str, Any] | None:
    """One line of a stream (an SSE event's data, an NDJSON line) as a JSON object; None, with the
    call's error set, where it is not JSON, not an object, or the engine's error (written by
    `error`: OpenAI-compatible servers send an object, Ollama a string)."""
    try:
        chunk = json.loads(text)
    except json.JSONDecodeError:
        measurement.error = f"stream sent a line that is not JSON: {text[:120]!r}"
        return None
    if not isinstance(chunk, dict):
        measurement.error = f"stream sent JSON that is not an object: {text[:120]!r}"
        return None
    if "error" in chunk:
        measurement.error = f"engine error in stream: {error(chunk['error'])[:300]}"
        return None
    return chunk


def _sse_events(lines: Iterator[Line]) -> Iterator[tuple[int, str]]:
    for line in lines:
        text = line.text.decode("utf-8", "replace")
        if text.startswith("data:"):
            yield line.arrived_ns, text[5:].strip()
        elif text.startswith("error:"):
            yield line.arrived_ns, text


def parse_openai_sse(
    response: StreamedResponse, measurement: CallMeasurement, arrivals: list[int]
) -> None:
    """Server-sent events of /v1/chat/completions (OpenAI, vLLM, SGLang, TGI, llama.cpp).

    Only llama.cpp adds its own timings to the stream; vLLM's stream carries none per request,
    so an OpenAI-compatible engine other than llama.cpp has no engine-side figures.
    """
    for arrived_ns, data in _sse_events(response.lines):
        if data == "[DONE]":
            break
        chunk = stream_chunk(data, measurement)
        if chunk is None:
            break
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if isinstance(choice.get("text"), str) and not delta:
                # /v1/completions streams `text` where a chat stream has a delta's content.
                delta = {"content": choice["text"]}
            called = note_tool_calls(delta.get("tool_calls"), measurement)
            # Reasoning models stream their thinking first; it is the first token all the same.
            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
            if called and not text:
                # A tool call's streamed name and arguments are the answer's tokens.
                arrivals.append(arrived_ns)
                note_delta(measurement, arrived_ns, reasoning=False, answer=True)
            if text:
                arrivals.append(arrived_ns)
                # vLLM streams `reasoning` (`reasoning_content` before 0.10), llama.cpp
                # `reasoning_content` (--reasoning-format deepseek).
                thought = delta.get("reasoning_content") or delta.get("reasoning")
                note_delta(
                    measurement,
                    arrived_ns,
                    reasoning=bool(thought),
                    answer=bool(delta.get("content")),
                    text=str(text),
                )
            if isinstance(delta.get("content"), str):
                measurement.text += delta["content"]
            if choice.get("finish_reason"):
                measurement.finish_reason = str(choice["finish_reason"])
        fingerprint = chunk.get("system_fingerprint")
        if isinstance(fingerprint, str) and fingerprint:
            measurement.system_fingerprint = fingerprint
        note_usage_and_timings(chunk, measurement)


def note_usage_and_timings(chunk: Mapping[str, Any], measurement: CallMeasurement) -> None:
    """A chunk's `usage` (OpenAI's, vLLM's token counts) and `timings` (llama.cpp's own)."""
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        measurement.prompt_tokens = usage.get("prompt_tokens")
        measurement.completion_tokens = usage.get("completion_tokens")
        details = usage.get("completion_tokens_details")
        # OpenAI's and vLLM's (with a reasoning parser) count of the reasoning tokens.
        if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
            measurement.reasoning_tokens = details["reasoning_tokens"]
        cached = usage.get("prompt_tokens_details")
        if isinstance(cached, dict) and isinstance(cached.get("cached_tokens"), int):
            measurement.cached_prompt_tokens = cached["cached_tokens"]
    timings = chunk.get("timings")
    if isinstance(timings, dict):
        measurement.engine_timings = timings
        llamacpp_engine_figures(timings, measurement)
        if isinstance(timings.get("cache_n"), int):
            measurement.cached_prompt_tokens = timings["cache_n"]
        # Speculative decoding (a draft model): what it proposed, what was accepted.
        if isinstance(timings.get("draft_n"), int):
            measurement.draft_tokens = timings["draft_n"]
        if isinstance(timings.get("draft_n_accepted"), int):
            measurement.draft_accepted_tokens = timings["draft_n_accepted"]


def kind_body(kind: str, keys: Mapping[str, Any]) -> dict[str, Any]:
    """What a chat request of `kind` adds to its JSON (config/prompts.Prompt.kind_keys): a `tools`
    call its tools and tool_choice (a tool's name as OpenAI names one), a `json_schema` call its
    response_format; nothing for the other kinds."""
    if kind == "tools":
        choice = keys.get("tool_choice") or "required"
        if choice not in ("auto", "required", "none"):
            choice = {"type": "function", "function": {"name": choice}}
        return {"tools": list(keys.get("tools") or ()), "tool_choice": choice}
    if kind == "json_schema":
        return {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "answer",
                    "schema": keys.get("json_schema"),
                    "strict": True,
                },
            }
        }
    return {}


def note_tool_calls(deltas: Any, measurement: CallMeasurement) -> bool:
    """A streamed delta's `tool_calls` (OpenAI's shape: each an index, then the function's name
    once and its arguments in pieces) joined into the measurement's tool calls; whether it
    carried any."""
    if not isinstance(deltas, list):
        return False
    seen = False
    for delta in deltas:
        if not isinstance(delta, dict):
            continue
        index = delta.get("index")
        index = index if isinstance(index, int) and 0 <= index < 64 else 0
        while len(measurement.tool_calls) <= index:
            measurement.tool_calls.append({"name": "", "arguments": ""})
        function = delta.get("function")
        function = function if isinstance(function, dict) else {}
        call = measurement.tool_calls[index]
        if isinstance(function.get("name"), str):
            call["name"] += function["name"]
        if isinstance(function.get("arguments"), str):
            call["arguments"] += function["arguments"]
        seen = True
    return seen


def _json_answer(
    response: StreamedResponse, measurement: CallMeasurement, what: str
) -> dict[str, Any] | None:
    """A one-JSON answer (embeddings, rerank) as an object; None, with the call's error set,
    where it is not JSON, not an object, or the engine's error."""
    body = b"".join(line.text for line in response.lines)
    try:
        answer = json.loads(body)
    except json.JSONDecodeError:
        measurement.error = f"{what} answer is not JSON: {body[:120]!r}"
        return None
    if not isinstance(answer, dict) or "error" in answer:
        detail = answer.get("error") if isinstance(answer, dict) else answer
        measurement.error = f"engine error: {json.dumps(detail)[:300]}"
        return None
    return answer


def _answered(answer: Mapping[str, Any], measurement: CallMeasurement) -> None:
    """A whole one-JSON answer (embeddings, rerank): its prompt tokens (its usage's), and its
    end: it stopped."""
    usage = answer.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        measurement.prompt_tokens = usage["prompt_tokens"]
    measurement.finish_reason = "stop"


def parse_embeddings(
    response: StreamedResponse, measurement: CallMeasurement, arrivals: list[int]
) -> None:
    """/v1/embeddings' one JSON answer (not streamed): how many vectors came back, and the
    prompt tokens of its usage. Its arrivals stay empty: an embedding has no first token."""
    answer = _json_answer(response, measurement, "embeddings")
    if answer is None:
        return
    data = answer.get("data")
    vectors = [item for item in data if isinstance(item, dict)] if isinstance(data, list) else []
    if measurement.inputs is not None and len(vectors) != measurement.inputs:
        measurement.error = f"{len(vectors)} embeddings came back for {measurement.inputs} inputs"
        return
    _answered(answer, measurement)


def parse_rerank(
    response: StreamedResponse, measurement: CallMeasurement, arrivals: list[int]
) -> None:
    """/v1/rerank's one JSON answer (llama.cpp's, vLLM's and Jina's shape: `results`, each an
    `index` and a `relevance_score`): as many results as asked for, each a document's index.
    Its arrivals stay empty: a rerank has no first token."""
    answer = _json_answer(response, measurement, "rerank")
    if answer is None:
        return
    results = answer.get("results")
    ranked = [r for r in results if isinstance(r, dict)] if isinstance(results, list) else []
    wanted = measurement.inputs
    if not ranked or (wanted is not None and any(
        not isinstance(r.get("index"), int) or not 0 <= r["index"] < wanted for r in ranked
    )):  # fmt: skip
        measurement.error = f"rerank answer ranks no document of the {wanted} sent"
        return
    _answered(answer, measurement)
