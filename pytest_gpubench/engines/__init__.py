"""How to talk to an inference engine: the factory that makes a cell's engine, and the `Engine`
protocol, the request and the shared streaming parsers (`engines/protocol.py`), named here as
before. The engine kinds' modules import those from `engines/protocol.py`, not from this package,
which imports the kinds lazily: no import circle."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.engines.ollama import OllamaEngine
from pytest_gpubench.engines.plugin import plugin_engine
from pytest_gpubench.engines.protocol import (
    ChatPayloads,
    ChunkParser,
    Completes,
    CountsTokens,
    Embeds,
    Engine,
    Health,
    KeepsConnection,
    ReadsCounters,
    Request,
    Reranks,
    api_root,
    control_client,
    get_json,
    json_number,
    kind_body,
    llamacpp_engine_figures,
    measure_response,
    measure_stream,
    merge_body,
    note_tool_calls,
    note_usage_and_timings,
    parse_embeddings,
    parse_openai_sse,
    parse_rerank,
    send,
)
from pytest_gpubench.measure.stream import TlsSettings

if TYPE_CHECKING:
    from pytest_gpubench.config.cell import Cell

__all__ = [
    "ChatPayloads",
    "ChunkParser",
    "Completes",
    "CountsTokens",
    "Embeds",
    "Engine",
    "EngineHook",
    "Health",
    "KeepsConnection",
    "ReadsCounters",
    "Request",
    "Reranks",
    "api_root",
    "control_client",
    "get_json",
    "json_number",
    "kind_body",
    "llamacpp_engine_figures",
    "make_engine",
    "measure_response",
    "measure_stream",
    "merge_body",
    "note_tool_calls",
    "note_usage_and_timings",
    "parse_embeddings",
    "parse_openai_sse",
    "parse_rerank",
    "send",
]


# pytest_gpubench_make_engine (hookspecs.py), as pytest's hook relay calls it.
EngineHook = Callable[..., "Engine | None"]


def make_engine(
    cell: Cell,
    base_url: str,
    *,
    api_key: str | None,
    model_digest: str | None,
    plugin_hook: EngineHook | None = None,
    headers: Mapping[str, str] | None = None,
) -> Engine:
    """The engine for a cell: a plugin's first (pytest_gpubench_make_engine), else a built-in.

    `headers`: the cell's extra request headers, their values already read from the environment.
    """
    if plugin_hook is not None:
        engine = plugin_hook(
            cell=cell, base_url=base_url, api_key=api_key, model_digest=model_digest
        )
        if engine is not None:
            return plugin_engine(engine)
    spec = cell.spec
    tls = TlsSettings(verify=spec.tls_verify, ca_file=spec.ca_file)
    if spec.engine == "llamacpp":
        from pytest_gpubench.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(base_url, spec.model, api_key, model_digest, tls=tls, headers=headers)
    if spec.engine == "ollama":
        return OllamaEngine(base_url, spec.model, tls=tls, headers=headers)
    if spec.engine == "openai":
        from pytest_gpubench.engines.openai import OpenAIEngine

        return OpenAIEngine(base_url, spec.model, api_key, tls=tls, headers=headers)
    raise GpubenchError(
        f"cell {cell.cell_id}: engine: no plugin built an engine of kind {spec.engine}"
    )
