"""How to talk to an inference engine: the `Engine` protocol and its shared streaming parsers."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from pytest_gpubench.errors import GpubenchError
from pytest_gpubench.measure import (
    CallMeasurement,
    Line,
    StreamedResponse,
    StreamError,
    finish_timing,
    read_error_body,
    stream_post,
)

if TYPE_CHECKING:
    from pytest_gpubench.matrix import Cell


@dataclass(frozen=True)
class Health:
    ok: bool
    reason: str = ""


class Engine(Protocol):
    """One engine endpoint serving one model."""

    kind: str
    base_url: str
    model: str

    def health(self, timeout_s: float) -> Health: ...

    def describe(self, timeout_s: float) -> dict[str, Any]:
        """engine_version and model_digest (None where the engine does not say)."""
        ...

    def chat(self, prompt: str, max_tokens: int, timeout_s: float) -> CallMeasurement:
        """One streamed chat call; failures come back as a measurement with `error` set."""
        ...

    def unload(self, timeout_s: float) -> bool:
        """Force the model out of memory; False where the engine cannot (cold = process_warm)."""
        ...


def control_client(timeout_s: float, headers: dict[str, str] | None = None) -> httpx.Client:
    """An httpx client for control calls (health, version, tags); never used for timed streams."""
    return httpx.Client(timeout=timeout_s, headers=headers or {}, trust_env=False)


def get_json(
    base_url: str, path: str, timeout_s: float, headers: dict[str, str] | None = None
) -> Any:
    with control_client(timeout_s, headers) as client:
        response = client.get(base_url.rstrip("/") + path)
        response.raise_for_status()
        return response.json()


def _failed(backend: str, error: str) -> CallMeasurement:
    return CallMeasurement(backend=backend, error=error, finish_reason="error")


def measure_stream(
    backend: str,
    base_url: str,
    path: str,
    payload: dict[str, Any],
    *,
    timeout_s: float,
    headers: tuple[tuple[str, str], ...] = (),
    parse: ChunkParser,
) -> CallMeasurement:
    """Send one streamed request and turn its stamped lines into a measurement.

    Every fault after the request went out (an HTTP error, an error line, a broken or timed-out
    stream) keeps what was measured until then beside the error (measure.finish_timing).
    """
    measurement = CallMeasurement(backend=backend)
    try:
        response = stream_post(
            base_url, path, json.dumps(payload).encode(), timeout_s=timeout_s, headers=headers
        )
    except StreamError as exc:
        return _failed(backend, str(exc))
    content_arrivals: list[int] = []
    try:
        if response.status != 200:
            measurement.error = f"HTTP {response.status}: {read_error_body(response)}"
        else:
            parse(response, measurement, content_arrivals)
    except StreamError as exc:
        measurement.error = str(exc)
    if not measurement.error and measurement.finish_reason not in ("stop", "length"):
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


def llamacpp_engine_figures(timings: dict[str, Any], measurement: CallMeasurement) -> None:
    """llama-server's own rate and times from its `timings`: decode rate, prompt and total ms."""
    prompt_ms = json_number(timings.get("prompt_ms"))
    predicted_ms = json_number(timings.get("predicted_ms"))
    measurement.engine_tokens_per_sec = json_number(timings.get("predicted_per_second"))
    measurement.engine_prompt_ms = prompt_ms
    if prompt_ms is not None and predicted_ms is not None:
        measurement.engine_total_ms = round(prompt_ms + predicted_ms, 4)


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
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            measurement.error = f"stream sent a line that is not JSON: {data[:120]!r}"
            break
        if not isinstance(chunk, dict):
            measurement.error = f"stream sent JSON that is not an object: {data[:120]!r}"
            break
        if "error" in chunk:
            measurement.error = f"engine error in stream: {json.dumps(chunk['error'])[:300]}"
            break
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            # Reasoning models stream their thinking first; it is the first token all the same.
            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
            if text:
                arrivals.append(arrived_ns)
            if choice.get("finish_reason"):
                measurement.finish_reason = str(choice["finish_reason"])
        fingerprint = chunk.get("system_fingerprint")
        if isinstance(fingerprint, str) and fingerprint:
            measurement.system_fingerprint = fingerprint
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            measurement.prompt_tokens = usage.get("prompt_tokens")
            measurement.completion_tokens = usage.get("completion_tokens")
        timings = chunk.get("timings")
        if isinstance(timings, dict):
            measurement.engine_timings = timings
            llamacpp_engine_figures(timings, measurement)


# pytest_gpubench_make_engine (hookspecs.py), as pytest's hook relay calls it.
EngineHook = Callable[..., "Engine | None"]


def make_engine(
    cell: Cell,
    base_url: str,
    *,
    api_key: str | None,
    model_digest: str | None,
    plugin_hook: EngineHook | None = None,
) -> Engine:
    """The engine for a cell: a plugin's first (pytest_gpubench_make_engine), else a built-in."""
    if plugin_hook is not None:
        engine = plugin_hook(
            cell=cell, base_url=base_url, api_key=api_key, model_digest=model_digest
        )
        if engine is not None:
            return engine
    spec = cell.spec
    if spec.engine == "llamacpp":
        from pytest_gpubench.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(base_url, spec.model, api_key, model_digest)
    if spec.engine == "ollama":
        from pytest_gpubench.engines.ollama import OllamaEngine

        return OllamaEngine(base_url, spec.model)
    if spec.engine == "openai":
        from pytest_gpubench.engines.openai import OpenAIEngine

        return OpenAIEngine(base_url, spec.model, api_key)
    raise GpubenchError(
        f"cell {cell.cell_id}: engine: no plugin built an engine of kind {spec.engine}"
    )
