"""Ollama: /api/chat NDJSON streaming, its own durations, and true cold starts via keep_alive 0."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from pytest_gpubench.engines import (
    Health,
    control_client,
    get_json,
    json_number,
    measure_stream,
)
from pytest_gpubench.measure import CallMeasurement, StreamedResponse

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


def ollama_engine_figures(done: dict[str, Any], measurement: CallMeasurement) -> None:
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
        try:
            chunk = json.loads(line.text)
        except json.JSONDecodeError:
            measurement.error = f"stream sent a line that is not JSON: {line.text[:120]!r}"
            break
        if not isinstance(chunk, dict):
            measurement.error = f"stream sent JSON that is not an object: {line.text[:120]!r}"
            break
        if "error" in chunk:
            measurement.error = f"engine error in stream: {str(chunk['error'])[:300]}"
            break
        message = chunk.get("message") or {}
        if message.get("content") or message.get("thinking"):
            arrivals.append(line.arrived_ns)
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

    def __init__(self, base_url: str, model: str, keep_alive: str = "5m") -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.keep_alive = keep_alive

    def health(self, timeout_s: float) -> Health:
        try:
            get_json(self.base_url, "/api/version", timeout_s)
            tags = get_json(self.base_url, "/api/tags", timeout_s)
        except (httpx.HTTPError, ValueError) as exc:
            return Health(False, f"{self.base_url} is unreachable: {exc}")
        names = [entry.get("name", "") for entry in tags.get("models", [])]
        if not any(_same_model(name, self.model) for name in names):
            return Health(False, f"model '{self.model}' is not pulled on {self.base_url}")
        return Health(True)

    def describe(self, timeout_s: float) -> dict[str, Any]:
        version = digest = None
        try:
            version = get_json(self.base_url, "/api/version", timeout_s).get("version")
            for entry in get_json(self.base_url, "/api/tags", timeout_s).get("models", []):
                if _same_model(entry.get("name", ""), self.model):
                    digest = entry.get("digest")
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        return {"engine_version": version, "model_digest": digest}

    def chat(self, prompt: str, max_tokens: int, timeout_s: float) -> CallMeasurement:
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "keep_alive": self.keep_alive,
            "options": {"num_predict": max_tokens, "temperature": 0},
        }
        return measure_stream(
            self.kind,
            self.base_url,
            "/api/chat",
            payload,
            timeout_s=timeout_s,
            parse=parse_ollama_ndjson,
        )

    def loaded_models(self, timeout_s: float) -> list[str]:
        return [
            entry.get("name", "")
            for entry in get_json(self.base_url, "/api/ps", timeout_s).get("models", [])
        ]

    def unload(self, timeout_s: float) -> bool:
        """keep_alive 0 asks Ollama to unload; /api/ps confirms the model is gone."""
        deadline = time.monotonic() + timeout_s
        try:
            with control_client(timeout_s) as client:
                client.post(
                    f"{self.base_url}/api/generate", json={"model": self.model, "keep_alive": 0}
                ).raise_for_status()
            while time.monotonic() < deadline:
                if not any(_same_model(name, self.model) for name in self.loaded_models(timeout_s)):
                    return True
                time.sleep(0.1)
        except (httpx.HTTPError, ValueError):
            return False
        return False
