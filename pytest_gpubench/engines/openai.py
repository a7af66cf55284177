"""OpenAI-compatible servers (vLLM, SGLang, TGI, hosted APIs): /v1/chat/completions, and for the
other request kinds /v1/completions, /v1/embeddings and /v1/rerank."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import httpx

from pytest_gpubench.config.metrics import REQUEST_KINDS
from pytest_gpubench.engines.protocol import (
    ChunkParser,
    EngineFacts,
    Health,
    Request,
    api_root,
    control_client,
    measure_stream,
    merge_body,
    parse_embeddings,
    parse_openai_sse,
    parse_rerank,
)
from pytest_gpubench.engines.tokenizer import TokenCounter, VllmCounter
from pytest_gpubench.measure.call_measurement import CallMeasurement
from pytest_gpubench.measure.gauges import CaseCounters
from pytest_gpubench.measure.stream import (
    Endpoint,
    HttpConnection,
    StreamError,
    TlsSettings,
    joined_url,
)


def serves_model(served: str, wanted: str) -> bool:
    """Whether a /v1/models id is the model the cell names. Ollama's OpenAI-compatible API lists
    `llama3.2:latest` and answers to `llama3.2`, so an untagged name matches its `:latest`."""
    return served == wanted or (":" not in wanted and served == f"{wanted}:latest")


class OpenAIEngine:
    kind = "openai"
    # The request kinds it sends (config/prompts.py): chat, tools and json_schema on
    # /v1/chat/completions, completion on /v1/completions, embedding on /v1/embeddings, rerank
    # on /v1/rerank.
    kinds: tuple[str, ...] = REQUEST_KINDS

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        tls: TlsSettings | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        # `http://host:8000/v1` as OpenAI clients write it: the paths below add the /v1.
        self.base_url = api_root(base_url)
        self.model = model
        self._api_key = api_key
        self.tls = tls or TlsSettings()
        self.headers = dict(headers or {})
        # Warm calls share this connection; close_connection() makes the next call open one.
        self.connection = HttpConnection(self.base_url, self.tls)

    def _auth(self) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        return {**self.headers, **auth}

    def request_headers(self) -> dict[str, str]:
        """The headers every streamed request carries (the cell's, the API key's)."""
        return self._auth()

    def close_connection(self) -> None:
        self.connection.close()

    def token_counter(self) -> TokenCounter:
        """The server's /tokenize as vLLM serves it (a server without one says so when asked:
        engines/tokenizer.TokenizeUnavailable)."""
        return VllmCounter(self.base_url, self.model, self.request_headers(), self.tls.context())

    def case_counters(self) -> CaseCounters:
        """The reader of its /metrics around a warm call, on its endpoint with its headers."""
        tls = self.tls.context() if self.base_url.startswith("https") else None
        headers = tuple(self.request_headers().items())
        return CaseCounters(Endpoint.parse(self.base_url), headers, tls)

    def payload(self, request: Request) -> dict[str, object]:
        """A request's JSON (a completion's sends `prompt` as it is, no chat template): the cell's
        and prompt's request keys, then its kind's keys and a test's own options merged in last
        (`Request.body`)."""
        text: dict[str, object] = (
            {"prompt": request.prompt}
            if request.kind == "completion"
            else {"messages": request.conversation()}
        )
        payload: dict[str, object] = {
            "model": self.model,
            **text,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        shape = request.shape
        if shape is not None:
            # vLLM takes all three; llama-server takes seed and ignore_eos (min_tokens: matrix.py).
            for key in ("seed", "ignore_eos", "min_tokens"):
                value = getattr(shape, key)
                if value is not None:
                    payload[key] = value
            if shape.cache_salt == "per_call":
                # A salt of its own: no earlier call's prefix cache serves this one (vLLM).
                payload["cache_salt"] = uuid.uuid4().hex
            payload = merge_body(payload, shape.extra_body)
        return merge_body(payload, request.body())

    def health(self, timeout_s: float) -> Health:
        try:
            with control_client(timeout_s, self._auth(), self.tls) as client:
                health = client.get(joined_url(self.base_url, "/health"))
                if health.status_code not in (200, 404):
                    return Health(False, f"{health.url} answered {health.status_code}")
                models = client.get(joined_url(self.base_url, "/v1/models"))
                models.raise_for_status()
                ids = [entry.get("id") for entry in models.json().get("data", [])]
        except (httpx.HTTPError, ValueError, StreamError) as exc:
            return Health(False, f"{self.base_url} is unreachable: {exc}")
        if not any(serves_model(str(served), self.model) for served in ids if served):
            return Health(False, f"{self.base_url} does not serve model '{self.model}' ({ids})")
        return Health(True)

    def describe(self, timeout_s: float) -> EngineFacts:
        """engine_version where the server says (`/version`), and what identifies the model.

        An OpenAI-compatible server gives no content digest: `model_digest` is None, never the
        name. vLLM's /v1/models entry adds `root` (what the served name was loaded from) and
        `max_model_len`; `model_identity` says which of these is known.
        """
        version = None
        entry: dict[str, object] = {}
        try:
            with control_client(timeout_s, self._auth(), self.tls) as client:
                answer = client.get(joined_url(self.base_url, "/version"))
                if answer.status_code == 200:
                    version = answer.json().get("version")
                models = client.get(joined_url(self.base_url, "/v1/models"))
                if models.status_code == 200:
                    entry = next(
                        (
                            item
                            for item in models.json().get("data") or []
                            if isinstance(item, dict)
                            and serves_model(str(item.get("id")), self.model)
                        ),
                        {},
                    )
        except (httpx.HTTPError, ValueError, AttributeError, StreamError):
            pass
        root = entry.get("root")
        root = root if isinstance(root, str) and root else None
        max_model_len = entry.get("max_model_len")
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int):
            max_model_len = None
        return {
            "engine_version": version if isinstance(version, str) else None,
            "model_digest": None,
            "model_identity": "name and root" if root else "name only",
            "model_root": root,
            "max_model_len": max_model_len,
        }

    def _send(
        self,
        path: str,
        payload: dict[str, Any],
        timeout_s: float,
        parse: ChunkParser = parse_openai_sse,
        inputs: int | None = None,
    ) -> CallMeasurement:
        return measure_stream(
            self.kind,
            self.base_url,
            path,
            payload,
            timeout_s=timeout_s,
            headers=tuple(self._auth().items()),
            parse=parse,
            connection=self.connection,
            inputs=inputs,
        )

    def chat(self, request: Request, timeout_s: float) -> CallMeasurement:
        return self._send("/v1/chat/completions", self.payload(request), timeout_s)

    def complete(self, request: Request, timeout_s: float) -> CallMeasurement:
        """One streamed plain completion (/v1/completions): `prompt` as it is, no chat template."""
        return self._send("/v1/completions", self.payload(request), timeout_s)

    def embed(self, request: Request, timeout_s: float) -> CallMeasurement:
        """One embeddings request (/v1/embeddings) for the prompt and the kind's further
        `inputs`, timed to its whole answer."""
        inputs = request.embedding_inputs()
        payload = {"model": self.model, "input": inputs, "encoding_format": "float"}
        return self._send("/v1/embeddings", payload, timeout_s, parse_embeddings, len(inputs))

    def rerank(self, request: Request, timeout_s: float) -> CallMeasurement:
        """One rerank request (/v1/rerank: llama-server with --rerank, vLLM with a cross-encoder)
        ranking the kind's `documents` against the prompt (the query), timed to its whole
        answer."""
        documents = list(request.kind_keys.get("documents") or ())
        payload: dict[str, Any] = {
            "model": self.model,
            "query": request.prompt,
            "documents": documents,
        }
        if request.kind_keys.get("top_n") is not None:
            payload["top_n"] = request.kind_keys["top_n"]
        return self._send("/v1/rerank", payload, timeout_s, parse_rerank, len(documents))

    def unload(self, timeout_s: float) -> bool:
        return False
