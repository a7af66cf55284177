"""What each built-in engine kind is, as cells.yaml and the verdicts see it: its facts, declared
once per kind, that the matrix's checks, a cell's defaults and the messages ask instead of the
kind's name.

The kind's behaviour lives in engines/; its facts sit here, in config/, because the matrix reader
checks a cell against them and config/ is below engines/ (whose package loads httpx and
measure/): config/ cannot import them from there. A kind a plugin adds has the facts of
`EngineKind(name)`: no managed launch, no load case, nothing refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal


@dataclass(frozen=True)
class EngineKind:
    """One engine kind's facts."""

    name: str
    # The harness can launch it itself (a managed cell: no endpoint).
    managed: bool = False
    # Why a managed cell of this kind needs a `launch:` template (one line), or None.
    launch_required: str | None = None
    # The request keys it cannot send, each with why (one line in the error).
    refused_request_keys: Mapping[str, str] = field(default_factory=dict)
    # It speaks OpenAI's streamed chat completions: load cases can drive it.
    drives_load: bool = False
    # How a managed engine of this kind is made cold when the cell does not say (cold:).
    cold_mode: Literal["restart", "unload"] = "restart"
    # The plugin writes a managed cell's argv with llama-server's flags: draft_model
    # (--model-draft), LoRA adapter files (--lora, lora: {name: path}) and parallel (--parallel);
    # a request then chooses its adapter by the per-request `lora` scales.
    server_flags: bool = False
    # `lora:` lists the names the server serves its adapters under (vLLM's --lora-modules); a
    # request chooses its adapter by the model name.
    adapters_by_name: bool = False
    # How the verdicts name its server.
    server_name: str = "the engine"


LLAMACPP = EngineKind(
    name="llamacpp",
    managed=True,
    refused_request_keys=MappingProxyType(
        {
            "min_tokens": "llama-server has no min_tokens; use ignore_eos: true for a fixed length",
            "cache_salt": "llama-server has no cache salt; use extra_body: {cache_prompt: false}",
        }
    ),
    drives_load=True,
    server_flags=True,
    server_name="llama-server",
)
OLLAMA = EngineKind(
    name="ollama",
    managed=True,
    refused_request_keys=MappingProxyType(
        {
            "ignore_eos": "Ollama's API has no ignore_eos: the output length cannot be fixed",
            "min_tokens": "Ollama's API has no min_tokens: the output length cannot be fixed",
            "cache_salt": "Ollama's API has no cache salt",
        }
    ),
    # Ollama unloads a model on request (keep_alive: 0); its server stays up.
    cold_mode="unload",
    server_name="Ollama",
)
OPENAI = EngineKind(
    name="openai",
    managed=True,
    launch_required=(
        "a managed openai cell needs a launch template (e.g. "
        '[vllm, serve, "{model}", --host, "{host}", --port, "{port}"]), '
        "or an endpoint or port of an engine already running"
    ),
    drives_load=True,
    adapters_by_name=True,
)

# The built-in kinds, in the order the messages list them.
BUILT_IN: Mapping[str, EngineKind] = MappingProxyType(
    {kind.name: kind for kind in (LLAMACPP, OLLAMA, OPENAI)}
)


def engine_kind(name: str) -> EngineKind:
    """The facts of the engine kind `name`; a kind a plugin adds (or none) has the defaults."""
    return BUILT_IN.get(name) or EngineKind(name)
