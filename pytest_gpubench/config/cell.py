"""One cell of the matrix: its keys as cells.yaml writes them (`CellSpec`), the thresholds,
telemetry and defaults they take, its id, and the cell with its effective options (`Cell`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pytest_gpubench.config.engine_kinds import BUILT_IN, engine_kind
from pytest_gpubench.config.engine_series import COUNTER_LIMITS
from pytest_gpubench.config.load_profile import LoadProfile, LoadSetting
from pytest_gpubench.config.metrics import GATED, RESOURCE_LIMITS, VALIDITY
from pytest_gpubench.config.nodes import AnyNode, context_kinds, unknown_kind
from pytest_gpubench.config.prompts import Prompt, RequestShape

PHASES = ("cold", "warm")
ENGINE_KINDS = tuple(BUILT_IN)
TINY_MODEL = "tiny"
# A cell's optional `name` ends its id (`<node>:<engine>:<model>@<name>`), so it must stay plain
# in pytest ids, ledgers and baseline file names.
CELL_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# A share from 0 to 1 (a validity rate's floor).
UnitFloat = Annotated[float, Field(ge=0.0, le=1.0)]


class Thresholds(_Strict):
    """Regression thresholds: relative changes of the gated figures (0.30 = 30 %; one key per
    figure of config/metrics.GATED, written in below), and the minimum success rate; the optional
    `max_` limits are absolute, on the warm calls' resource telemetry."""

    success_rate: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    # Each resource figure's `max_` limit (max_peak_vram_mib, max_energy_j_per_token, ...:
    # config/metrics.RESOURCES).
    __annotations__.update({key: "PositiveFloat | None" for key in RESOURCE_LIMITS})
    locals().update({key: None for key in RESOURCE_LIMITS})
    # Each limited engine counter's `max_` key (max_preemptions: the engine's own preemptions over
    # a (cell, prompt)'s warm calls, its /metrics; config/engine_series.COUNTER_LIMITS).
    __annotations__.update({key: "Annotated[int, Field(ge=0)] | None" for key in COUNTER_LIMITS})
    locals().update({key: None for key in COUNTER_LIMITS})
    # Each gated figure's key (ttft_p50, total_p50, tokens_per_sec, first_answer_p50, ...), a
    # field like the ones above: a new gated figure is a new entry in config/metrics.py only.
    __annotations__.update({figure.threshold_key: "PositiveFloat | None" for figure in GATED})
    locals().update({figure.threshold_key: None for figure in GATED})
    # Each validity rate's floor (tool_call_valid_rate, schema_valid_rate: config/metrics.VALIDITY),
    # absolute like success_rate; without one a fall below the baseline's rate is a regression.
    __annotations__.update({rate.threshold_key: "UnitFloat | None" for rate in VALIDITY})
    locals().update({rate.threshold_key: None for rate in VALIDITY})

    if TYPE_CHECKING:
        # The keys written in above, as a type checker cannot see them.
        def __init__(self, **thresholds: float | None) -> None: ...

    def ratio(self, key: str) -> float | None:
        """A gated figure's relative threshold as cells.yaml gave it (None: not given)."""
        value = getattr(self, key)
        return None if value is None else float(value)

    def limit(self, key: str) -> float | None:
        """A resource figure's `max_` limit (config/metrics.RESOURCE_LIMITS) as cells.yaml gave
        it (None: not given)."""
        value = getattr(self, key)
        return None if value is None else float(value)


class TelemetrySettings(_Strict):
    """Resource sampling while cases run: the interval, and each sampler on (`auto`: where the
    node has it) or `off`."""

    interval_ms: Annotated[int, Field(ge=20, le=60_000)] = 200
    gpu: Literal["auto", "off"] = "auto"
    cpu: Literal["auto", "off"] = "auto"

    @field_validator("gpu", "cpu", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML reads a bare `off` as false (and `on` as true).
        if value is False:
            return "off"
        return "auto" if value is True else value


class HeaderFromEnv(_Strict):
    """A request header's value, read from an environment variable (never written in a file)."""

    env: str


class CellDefaults(_Strict):
    """Matrix-wide defaults, overridable per cell."""

    runs: PositiveInt = 5
    timeout_s: PositiveFloat = 300.0
    thresholds: Thresholds = Thresholds()
    env: list[str] = []
    telemetry: TelemetrySettings = TelemetrySettings()
    # The load profile of every cell (load_profile.py); a cell's own `load:` keys win.
    load: LoadProfile | None = None


def cell_id_of(node: Any, engine: Any, model: Any, name: Any = None) -> str:
    """`<node>:<engine>:<model>`, or `<node>:<engine>:<model>@<name>` for a named cell."""
    base = f"{node}:{engine}:{model}"
    return f"{base}@{name}" if name is not None else base


def node_of(cell_id: str) -> str:
    """The node of a cell id (cell_id_of's first part)."""
    return cell_id.split(":", 1)[0]


def engine_of(cell_id: str) -> str | None:
    """The engine kind of a cell id (cell_id_of's second part), None where it has none."""
    parts = cell_id.split(":", 2)
    return parts[1] if len(parts) == 3 else None


class CellSpec(_Strict):
    node: str
    engine: str
    model: str
    # Tells apart cells with the same node, engine and model (two engine versions side by side).
    name: str | None = None
    endpoint: AnyHttpUrl | None = None
    phases: list[Literal["cold", "warm"]] = ["cold", "warm"]
    prompts: list[str] | None = None
    runs: PositiveInt | None = None
    timeout_s: PositiveFloat | None = None
    thresholds: Thresholds | None = None
    telemetry: TelemetrySettings | None = None
    skip: str | None = None
    # A tokenizer (a tokenizer.json or a model folder) counting synthetic prompts' tokens where
    # the engine has no /tokenize (engines/tokenizer.py).
    tokenizer: str | None = None
    # A cell that may go unmeasured (an engine that is not always up) without failing the run.
    optional: bool = False
    # Managed llama.cpp: the GGUF file to serve (default: the generated tiny model), the server
    # binary (default: PATH, $GPUBENCH_LLAMA_SERVER, or the cached build) and extra arguments.
    model_path: str | None = None
    server_binary: str | None = None
    server_args: list[str] = []
    api_key_env: str | None = None
    # https:// endpoints: a CA file to trust instead of the system store, or no checks at all.
    ca_file: str | None = None
    tls_verify: bool = True
    request: RequestShape | None = None
    # An engine on the cell's node, addressed by its port there (reached through the node's SSH
    # forward): already running there, or started there from `launch`.
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    # A managed engine's argv, with {model}, {port}, {host} and {model_path} filled in; its
    # environment; the path that answers 200 once it is ready, and how long it may take.
    launch: Annotated[list[str], Field(min_length=1)] | None = None
    launch_env: dict[str, str] = {}
    health_path: str | None = None
    ready_timeout_s: PositiveFloat | None = None
    # A timed warm phase: each prompt's warm case calls for `duration_s` seconds, a checkpoint
    # record every `checkpoint_s` (60 s when not set) keeping what was measured so far.
    duration_s: PositiveFloat | None = None
    checkpoint_s: PositiveFloat | None = None
    # A streamed reply with no token for this long is aborted and recorded as stalled.
    stall_s: PositiveFloat | None = None
    # How a managed engine's cold case starts cold: a restart of its process (the default), or
    # `unload` (Ollama: keep_alive 0, confirmed by /api/ps; the default for a managed ollama).
    cold: Literal["restart", "unload"] | None = None
    # The memory the model needs on the node's GPUs (stage vram_check), where its file's size
    # does not say (a model directory, quantisation overheads).
    vram_gb: PositiveFloat | None = None
    # Extra headers on every request of the cell; each value from an environment variable.
    headers: dict[str, HeaderFromEnv] = {}
    # Load cases (load_profile.py): the cell's keys over settings.load; `false` turns them off.
    load: LoadProfile | None = None
    # Managed llama.cpp: the server's slots (requests it decodes at once), its --parallel.
    parallel: PositiveInt | None = None
    # Head-to-head A/B (docs/ab-runs.md): the id of the cell this one (the candidate) is measured
    # against, call for call on the same node, and judged on the paired differences.
    reference: str | None = None
    # Sequential sampling (an A/B candidate): each prompt measures at least this many warm pairs
    # and at most `runs`, stopping as soon as its verdict is decided either way.
    min_runs: PositiveInt | None = None
    # The client's count of each call's streamed tokens against the engine's usage (issue 35):
    # `warn` (the default) counts and shows a mismatch, `fail` also fails the run (exit 6),
    # `off` checks nothing (an engine that streams several tokens a chunk).
    token_check: Literal["warn", "fail", "off"] | None = None
    # Managed llama.cpp: a draft model for speculative decoding (a GGUF path, or `tiny`: the
    # generated tiny model drafting for itself), and the most tokens it drafts at a time.
    draft_model: str | None = None
    draft_max: PositiveInt | None = None
    # LoRA adapters. One (a string): managed llama.cpp applies it to every request (a GGUF
    # path, or `tiny-lora-<seed>`: one generated for the tiny model). Several, chosen per
    # request: a mapping name -> adapter (managed llama.cpp loads them all), or a list of the
    # names an OpenAI-compatible server serves them under (vLLM's --lora-modules name=path).
    # Each prompt is then measured once per adapter (`<prompt>@<name>`), and a load case
    # chooses one per request (load: lora_choice).
    lora: str | list[str] | dict[str, str] | None = None
    # The endpoint as the user wrote it: the URL type normalises (a trailing slash, a lower-case
    # scheme and host), and the record keeps what the user wrote.
    _endpoint_text: str | None = PrivateAttr(default=None)
    # `load: off` (or false): no load cases even where settings.load gives some.
    _load_off: bool = PrivateAttr(default=False)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_endpoint_text(
        cls, data: Any, handler: ModelWrapValidatorHandler[CellSpec]
    ) -> CellSpec:
        # YAML reads a bare `off` as false.
        load_off = isinstance(data, dict) and data.get("load") in (False, "off")
        spec = handler({**data, "load": None} if load_off else data)
        spec._load_off = load_off
        written = data.get("endpoint") if isinstance(data, dict) else None
        if spec.endpoint is not None and isinstance(written, str):
            spec._endpoint_text = written.strip()
        return spec

    @field_validator("name")
    @classmethod
    def _name_is_plain(cls, value: str | None) -> str | None:
        if value is not None and not CELL_NAME_PATTERN.fullmatch(value):
            raise PydanticCustomError(
                "cell_name",
                "must be letters, digits, '.', '_' or '-', starting with a letter or digit "
                "(it ends the cell id, <node>:<engine>:<model>@<name>)",
            )
        return value

    @field_validator("lora")
    @classmethod
    def _adapters_named_plainly(
        cls, value: str | list[str] | dict[str, str] | None
    ) -> str | list[str] | dict[str, str] | None:
        if isinstance(value, str) or value is None:
            return value
        if not value:
            raise ValueError("names no adapter (give one, a list of names, or name: path)")
        names = list(value)
        for name in names:
            if not CELL_NAME_PATTERN.fullmatch(name):
                raise PydanticCustomError(
                    "adapter_name",
                    "adapter name '{name}' must be letters, digits, '.', '_' or '-', starting "
                    "with a letter or digit (it ends the prompt id, <prompt>@<adapter>)",
                    {"name": name},
                )
        if len(set(names)) != len(names):
            raise ValueError("names an adapter twice")
        return value

    @field_validator("token_check", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML reads a bare `off` as false.
        return "off" if value is False else value

    @field_validator("engine")
    @classmethod
    def _engine_is_served(cls, value: str, info: ValidationInfo) -> str:
        known = ENGINE_KINDS + context_kinds(info, "engine_kinds")
        if value not in known:
            raise unknown_kind("engine", value, known)
        return value

    @field_validator("phases")
    @classmethod
    def _phases_not_empty(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("must name at least one of cold, warm")
        return value

    @property
    def cell_id(self) -> str:
        return cell_id_of(self.node, self.engine, self.model, self.name)

    @property
    def managed(self) -> bool:
        """The harness starts the engine: no endpoint, and a launch template or no port."""
        return self.endpoint is None and (self.port is None or self.launch is not None)

    @property
    def load_setting(self) -> LoadSetting | None:
        """The cell's own `load:`: its keys, False for `off`, or None when it has none."""
        return False if self._load_off else self.load

    @property
    def endpoint_as_written(self) -> str | None:
        """The endpoint exactly as cells.yaml gives it (None for a managed cell)."""
        if self.endpoint is None:
            return None
        return self._endpoint_text if self._endpoint_text is not None else str(self.endpoint)


@dataclass(frozen=True)
class Cell:
    """One validated (node, engine, model) triple with its effective options."""

    spec: CellSpec
    node: AnyNode
    index: int
    prompt_ids: tuple[str, ...]
    runs: int
    timeout_s: float
    thresholds: Thresholds
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    # The effective load profile (settings.load with the cell's keys); None: no load cases.
    load: LoadProfile | None = None
    # The request kinds of its prompts (config/prompts.py `kind:`): a managed llama.cpp cell's
    # launch follows them (engines/managed_llamacpp.kind_args).
    kinds: tuple[str, ...] = ("chat",)

    @property
    def cell_id(self) -> str:
        return self.spec.cell_id

    @property
    def managed(self) -> bool:
        return self.spec.managed

    @property
    def reference(self) -> str | None:
        """The cell id of this cell's A/B reference, or None when it is not a candidate."""
        return self.spec.reference

    @property
    def cold_mode(self) -> Literal["restart", "unload"]:
        """How a managed engine is made cold (an external one is always asked to unload)."""
        if self.spec.cold is not None:
            return self.spec.cold
        return engine_kind(self.spec.engine).cold_mode

    @property
    def endpoint_as_written(self) -> str | None:
        """What the records carry as the endpoint: the user's text, not the normalised URL."""
        return self.spec.endpoint_as_written

    def request_for(self, prompt: Prompt) -> RequestShape:
        """The request keys of a call of `prompt` in this cell: the prompt's over the cell's."""
        return (self.spec.request or RequestShape()).merged(prompt.request)

    @property
    def adapters(self) -> tuple[str, ...]:
        """The names of the LoRA adapters chosen per request (a `lora:` list or mapping), in
        their order; () where the cell has none, or one applied to every request."""
        lora = self.spec.lora
        return () if lora is None or isinstance(lora, str) else tuple(lora)

    def adapter_body(self, adapter: str) -> dict[str, object]:
        """The request fields that choose `adapter`: llama-server's per-request `lora` scales
        (the adapter's 1, every other one's 0: the ids are the order of its --lora flags), or
        the model name an OpenAI-compatible server serves it under (vLLM)."""
        if engine_kind(self.spec.engine).server_flags:
            return {
                "lora": [
                    {"id": index, "scale": 1.0 if name == adapter else 0.0}
                    for index, name in enumerate(self.adapters)
                ]
            }
        return {"model": adapter}

    def adapter_request(self, request: RequestShape, adapter: str | None) -> RequestShape:
        """`request` choosing `adapter` (its fields over the request's extra_body)."""
        if adapter is None:
            return request
        body = {**(request.extra_body or {}), **self.adapter_body(adapter)}
        return request.model_copy(update={"extra_body": body})

    def case_prompts(self) -> list[tuple[str, str, str | None]]:
        """(the id it is judged under, its prompts.yaml id, its adapter) per prompt the cell's
        cold and warm cases measure: each prompt once per adapter (`<prompt>@<adapter>`) on a
        cell that chooses adapters per request, else the prompt itself."""
        if not self.adapters:
            return [(prompt_id, prompt_id, None) for prompt_id in self.prompt_ids]
        return [
            (adapter_prompt_id(prompt_id, adapter), prompt_id, adapter)
            for prompt_id in self.prompt_ids
            for adapter in self.adapters
        ]


def adapter_prompt_id(prompt_id: str, adapter: str) -> str:
    """The id a prompt measured on one of its cell's adapters is judged under."""
    return f"{prompt_id}@{adapter}"
