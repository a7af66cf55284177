"""OpenAI-compatible servers (vLLM, SGLang, TGI, hosted APIs): /v1/chat/completions."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

from pytest_gpubench.engines import (
    Health,
    api_root,
    chat_messages,
    control_client,
    measure_stream,
    merge_body,
    parse_openai_sse,
)
from pytest_gpubench.measure.stream import (
    CallMeasurement,
    HttpConnection,
    StreamError,
    TlsSettings,
    joined_url,
)

if TYPE_CHECKING:
    from pytest_gpubench.config.prompts import RequestShape


def serves_model(served: str, wanted: str) -> bool:
    """Whether a /v1/models id is the model the cell names. Ollama's OpenAI-compatible API lists
    `llama3.2:latest` and answers to `llama3.2`, so an untagged name matches its `:latest`."""
    return served == wanted or (":" not in wanted and served == f"{wanted}:latest")


class OpenAIEngine:
    kind = "openai"

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

    def payload(
        self,
        prompt: str,
        max_tokens: int,
        request: RequestShape | None = None,
        messages: list[dict[str, Any]] | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The request's JSON: the cell's and prompt's request keys, then a test's own options
        (`extra_body`, gpubench_engine.chat) merged in last."""
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": chat_messages(prompt, messages),
            "max_tokens": max_tokens,
            "temperature": request.temperature_or_default if request is not None else 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request is not None:
            # vLLM takes all three; llama-server takes seed and ignore_eos (min_tokens: matrix.py).
            for key in ("seed", "ignore_eos", "min_tokens"):
                value = getattr(request, key)
                if value is not None:
                    payload[key] = value
            if request.cache_salt == "per_call":
                # A salt of its own: no earlier call's prefix cache serves this one (vLLM).
                payload["cache_salt"] = uuid.uuid4().hex
            payload = merge_body(payload, request.extra_body)
        return merge_body(payload, extra_body)

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

    def describe(self, timeout_s: float) -> dict[str, Any]:
        """engine_version where the server says (`/version`), and what identifies the model.

        An OpenAI-compatible server gives no content digest: `model_digest` is None, never the
        name. vLLM's /v1/models entry adds `root` (what the served name was loaded from) and
        `max_model_len`; `model_identity` says which of these is known.
        """
        version = None
        entry: dict[str, Any] = {}
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

    def chat(
        self,
        prompt: str,
        max_tokens: int,
        timeout_s: float,
        request: RequestShape | None = None,
        messages: list[dict[str, Any]] | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> CallMeasurement:
        headers = tuple(self._auth().items())
        return measure_stream(
            self.kind,
            self.base_url,
            "/v1/chat/completions",
            self.payload(prompt, max_tokens, request, messages, extra_body),
            timeout_s=timeout_s,
            headers=headers,
            parse=parse_openai_sse,
            connection=self.connection,
        )

    def unload(self, timeout_s: float) -> bool:
        return False
