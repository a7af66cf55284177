"""Ollama: /api/chat NDJSON streaming, its own durations, and true cold starts via keep_alive 0."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import httpx

from pytest_gpubench.engines.protocol import (
    EngineFacts,
    Health,
    Request,
    control_client,
    get_json,
    json_number,
    measure_stream,
    merge_body,
    stream_chunk,
)
from pytest_gpubench.measure.call_measurement import CallMeasurement, note_delta
from pytest_gpubench.measure.stream import (
    HttpConnection,
    StreamedResponse,
    StreamError,
    TlsSettings,
    joined_url,
)

# The engine's own timings, kept unchanged (nanoseconds, as Ollama reports them).
OLLAMA_TIMING_FIELDS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)


def _same_model(name: str, wanted: str) -> bool:
    """Ollama adds ':latest' to untagged names."""
    return name in (wanted, f"{wanted}:latest")


def ollama_engine_figures(done: dict[str, object], measurement: CallMeasurement) -> None:
    """Ollama's own rate and times from its final chunk (durations in nanoseconds).

    Decode rate eval_count / eval_duration; time to first token prompt_eval_duration +
    load_duration (a cold call loads the model first); total its total_duration.
    """
    eval_count = json_number(done.get("eval_count"))
    eval_ns = json_number(done.get("eval_duration"))
    if eval_count is not None and eval_ns:
        measurement.engine_tokens_per_sec = round(eval_count / (eval_ns / 1e9), 3)
    prompt_ns = json_number(done.get("prompt_eval_duration"))
    if prompt_ns is not None:
        load_ns = json_number(done.get("load_duration")) or 0.0
        measurement.engine_prompt_ms = round((prompt_ns + load_ns) / 1e6, 4)
    total_ns = json_number(done.get("total_duration"))
    if total_ns is not None:
        measurement.engine_total_ms = round(total_ns / 1e6, 4)


def parse_ollama_ndjson(
    response: StreamedResponse, measurement: CallMeasurement, arrivals: list[int]
) -> None:
    for line in response.lines:
        if not line.text.strip():
            continue
        chunk = stream_chunk(line.text, measurement, error=str)
        if chunk is None:
            break
        message = chunk.get("message") or {}
        if message.get("content") or message.get("thinking"):
            arrivals.append(line.arrived_ns)
            # A thinking model's `thinking` (think: true) read as vLLM's `reasoning`.
            note_delta(
                measurement,
                line.arrived_ns,
                reasoning=bool(message.get("thinking")),
                answer=bool(message.get("content")),
                text=str(message.get("content") or message.get("thinking")),
            )
        if isinstance(message.get("content"), str):
            measurement.text += message["content"]
        if chunk.get("done"):
            measurement.finish_reason = str(chunk.get("done_reason") or "stop")
            measurement.prompt_tokens = chunk.get("prompt_eval_count")
            measurement.completion_tokens = chunk.get("eval_count")
            measurement.engine_timings = {
                key: chunk[key] for key in OLLAMA_TIMING_FIELDS if key in chunk
            }
            ollama_engine_figures(chunk, measurement)
            break


class OllamaEngine:
    kind = "ollama"
    # Only chat: prompts of other request kinds are skipped on an Ollama cell
    # (docs/request-kinds.md).
    kinds: tuple[str, ...] = ("chat",)

    def __init__(
        self,
        base_url: str,
        model: str,
        keep_alive: str = "5m",
        *,
        tls: TlsSettings | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        # A path after the host is a prefix (a gateway): the /api paths go under it.
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.keep_alive = keep_alive
        self.tls = tls or TlsSettings()
        self.headers = dict(headers or {})
        self.connection = HttpConnection(self.base_url, self.tls)

    def close_connection(self) -> None:
        self.connection.close()

    def _get(self, path: str, timeout_s: float) -> Any:
        return get_json(self.base_url, path, timeout_s, self.headers, self.tls)

    def health(self, timeout_s: float) -> Health:
        try:
            self._get("/api/version", timeout_s)
            tags = self._get("/api/tags", timeout_s)
        except (httpx.HTTPError, ValueError, StreamError) as exc:
            return Health(False, f"{self.base_url} is unreachable: {exc}")
        names = [entry.get("name", "") for entry in tags.get("models", [])]
        if not any(_same_model(name, self.model) for name in names):
            return Health(False, f"model '{self.model}' is not pulled on {self.base_url}")
        return Health(True)

    def describe(self, timeout_s: float) -> EngineFacts:
        version = digest = None
        try:
            version = self._get("/api/version", timeout_s).get("version")
            for entry in self._get("/api/tags", timeout_s).get("models", []):
                if _same_model(entry.get("name", ""), self.model):
                    digest = entry.get("digest")
        except (httpx.HTTPError, ValueError, AttributeError, StreamError):
            pass
        return {"engine_version": version, "model_digest": digest}

    def payload(self, request: Request) -> dict[str, object]:
        """Ollama's request. It has no ignore_eos or min_tokens (matrix.py refuses them). The
        cell's and prompt's extra_body, then a test's own options, are merged in last; their
        `options` add to Ollama's, key by key."""
        options: dict[str, object] = {
            "num_predict": request.max_tokens,
            "temperature": request.temperature,
        }
        if request.shape is not None and request.shape.seed is not None:
            options["seed"] = request.shape.seed
        payload = {
            "model": self.model,
            "messages": request.conversation(),
            "stream": True,
            "keep_alive": self.keep_alive,
            "options": options,
        }
        payload = merge_body(
            payload, request.shape.extra_body if request.shape is not None else None
        )
        return merge_body(payload, request.body())

    def chat(self, request: Request, timeout_s: float) -> CallMeasurement:
        return measure_stream(
            self.kind,
            self.base_url,
            "/api/chat",
            self.payload(request),
            timeout_s=timeout_s,
            headers=tuple(self.headers.items()),
            parse=parse_ollama_ndjson,
            connection=self.connection,
        )

    def loaded_models(self, timeout_s: float) -> list[str]:
        models = self._get("/api/ps", timeout_s).get("models", [])
        return [entry.get("name", "") for entry in models]

    def unload(self, timeout_s: float) -> bool:
        """keep_alive 0 asks Ollama to unload; /api/ps confirms the model is gone."""
        deadline = time.monotonic() + timeout_s
        try:
            with control_client(timeout_s, self.headers, self.tls) as client:
                client.post(
                    joined_url(self.base_url, "/api/generate"),
                    json={"model": self.model, "keep_alive": 0},
                ).raise_for_status()
            while time.monotonic() < deadline:
                if not any(_same_model(name, self.model) for name in self.loaded_models(timeout_s)):
                    return True
                time.sleep(0.1)
        except (httpx.HTTPError, ValueError, StreamError):
            return False
        return False
