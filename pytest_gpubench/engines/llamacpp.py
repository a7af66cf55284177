"""llama.cpp's llama-server: OpenAI-style streaming plus its own `timings`, /health and /props."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from pytest_gpubench.engines.openai import OpenAIEngine
from pytest_gpubench.engines.protocol import EngineFacts, Health, Request, control_client
from pytest_gpubench.engines.tokenizer import LlamaCppCounter, TokenCounter
from pytest_gpubench.measure.stream import StreamError, TlsSettings, joined_url


class LlamaCppEngine(OpenAIEngine):
    kind = "llamacpp"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        model_digest: str | None = None,
        *,
        tls: TlsSettings | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(base_url, model, api_key, tls=tls, headers=headers)
        self._model_digest = model_digest

    def token_counter(self) -> TokenCounter:
        """llama-server's own /tokenize."""
        return LlamaCppCounter(self.base_url, self.request_headers(), self.tls.context())

    def payload(self, request: Request) -> dict[str, object]:
        payload = super().payload(request)
        payload.setdefault("timings_per_token", False)
        return payload

    def health(self, timeout_s: float) -> Health:
        url = joined_url(self.base_url, "/health")
        try:
            with control_client(timeout_s, self._auth(), self.tls) as client:
                answer = client.get(url)
        except (httpx.HTTPError, StreamError) as exc:
            return Health(False, f"{url} is unreachable: {exc}")
        if answer.status_code != 200:
            return Health(False, f"{url} answered {answer.status_code}")
        return Health(True)

    def describe(self, timeout_s: float) -> EngineFacts:
        props: dict[str, Any] = {}
        try:
            with control_client(timeout_s, self._auth(), self.tls) as client:
                answer = client.get(joined_url(self.base_url, "/props"))
                if answer.status_code == 200:
                    props = answer.json()
        except (httpx.HTTPError, ValueError, StreamError):
            pass
        # A managed server's GGUF has its sha256; an external one says only its file's path,
        # which is recorded as a path, never as a digest.
        return {
            "engine_version": props.get("build_info"),
            "model_digest": self._model_digest,
            "model_identity": "digest"
            if self._model_digest
            else ("path" if props.get("model_path") else None),
            "engine_props": {
                key: props[key] for key in ("model_path", "total_slots", "n_ctx") if key in props
            },
        }
