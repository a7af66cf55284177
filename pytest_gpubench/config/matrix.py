"""Loading and validating the cell matrix (cells.yaml) and the frozen prompts (prompts.yaml)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    ModelWrapValidatorHandler,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pytest_gpubench.config.datasets import Dataset, DatasetPrompt, dataset_sha256, sample_dataset
from pytest_gpubench.config.load_profile import LoadProfile, LoadSetting, Synthetic, merged_profile
from pytest_gpubench.config.metrics import GATED
from pytest_gpubench.config.traces import read_trace
from pytest_gpubench.config.words import seeded_words
from pytest_gpubench.config.yaml_file import parse_yaml
from pytest_gpubench.core.errors import GpubenchError, shown_key

PHASES = ("cold", "warm")
ENGINE_KINDS = ("llamacpp", "ollama", "openai")
NODE_KINDS = ("local", "ssh", "provider", "slurm")
# Engines the harness knows how to launch itself when a cell has no endpoint.
MANAGED_ENGINE_KINDS = ("llamacpp", "ollama", "openai")
TINY_MODEL = "tiny"
# The stages of bringing up a node and benchmarking on it, in order (targets/stages.py); ssh_wait
# (a rented node's sshd coming up) and results (logs read back) are older names still recorded;
# queue is a Slurm job waiting for its node.
StageName = Literal[
    "inventory",
    "provision",
    "ssh_wait",
    "ssh_connect",
    "gpu_check",
    "engine_install",
    "model_pull",
    "vram_check",
    "queue",
    "engine_start",
    "benchmark",
    "collect",
    "results",
    "cleanup",
]
# A cell's optional `name` ends its id (`<node>:<engine>:<model>@<name>`), so it must stay plain
# in pytest ids, ledgers and baseline file names.
CELL_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Thresholds(_Strict):
    """Regression thresholds: relative changes of the gated figures (0.30 = 30 %; one key per
    figure of config/metrics.GATED, written in below), and the minimum success rate; the optional
    `max_` limits are absolute, on the warm calls' resource telemetry."""

    success_rate: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    max_peak_vram_mib: PositiveFloat | None = None
    # The engine's own processes' VRAM (NVML on this machine); the whole GPU's is the one above.
    max_engine_vram_mib: PositiveFloat | None = None
    max_energy_j_per_token: PositiveFloat | None = None
    max_engine_cpu_s_per_token: PositiveFloat | None = None
    # Each gated figure's key (ttft_p50, total_p50, tokens_per_sec, first_answer_p50, ...), a
    # field like the ones above: a new gated figure is a new entry in config/metrics.py only.
    __annotations__.update({figure.threshold_key: "PositiveFloat | None" for figure in GATED})
    locals().update({figure.threshold_key: None for figure in GATED})

    if TYPE_CHECKING:
        # The keys written in above, as a type checker cannot see them.
        def __init__(self, **thresholds: float | None) -> None: ...

    def ratio(self, key: str) -> float | None:
        """A gated figure's relative threshold as cells.yaml gave it (None: not given)."""
        value = getattr(self, key)
        return None if value is None else float(value)


class LocalNode(_Strict):
    kind: Literal["local"]


class SshConnection(_Strict):
    """How to log in to a host over SSH: an ssh node, or a Slurm node's login node."""

    host: str
    port: Annotated[int, Field(ge=1, le=65535)] = 22
    user: str
    key_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    trust_new_host: bool = False
    connect_timeout_s: PositiveFloat = 15.0


class SshNode(SshConnection):
    kind: Literal["ssh"]
    command_timeout_s: PositiveFloat = 60.0
    # Shell commands run on the node before its cells, each within setup_timeout_s: `setup`
    # installs the engine (stage engine_install), `model_pull` fetches models (stage model_pull).
    setup: list[str] = []
    model_pull: list[str] = []
    setup_timeout_s: PositiveFloat = 900.0
    forward: bool = True
    # What the node's nvidia-smi must report (stage gpu_check), each stage's own timeout and
    # the whole node's budget (every stage's timeout is cut to what is left of it).
    gpu_type: str | None = None
    gpu_count: PositiveInt | None = None
    gpu_check: Literal["auto", "required", "off"] = "auto"
    stage_timeouts: dict[StageName, PositiveFloat] = {}
    budget_s: PositiveFloat | None = None


class ProviderNode(_Strict):
    kind: Literal["provider"]
    api: AnyHttpUrl
    gpu_type: str
    provider: str | None = None
    max_price: PositiveFloat
    min_vram_gb: PositiveFloat | None = None
    consumer_id: str = "pytest-gpubench"
    workload_type: str = "inference-benchmark"
    reservation_hours: PositiveFloat = 1.0
    api_token_env: str | None = None
    user: str | None = None
    provision_timeout_s: PositiveFloat = 600.0
    ssh_wait_timeout_s: PositiveFloat = 600.0
    command_timeout_s: PositiveFloat = 60.0
    setup: list[str] = []
    model_pull: list[str] = []
    setup_timeout_s: PositiveFloat = 1800.0
    connect_timeout_s: PositiveFloat = 15.0
    gpu_count: PositiveInt | None = None
    gpu_check: Literal["auto", "required", "off"] = "auto"
    stage_timeouts: dict[StageName, PositiveFloat] = {}
    budget_s: PositiveFloat | None = None


class SlurmLogin(SshConnection):
    """The login node a Slurm node's commands (sbatch, squeue, ...) run on, over SSH."""


class SlurmNode(_Strict):
    """A Slurm cluster: each managed engine of its cells runs as a batch job (targets/slurm/)."""

    kind: Literal["slurm"]
    # The job's resources, as sbatch's options of the same names (`time_limit` is --time).
    partition: str | None = None
    gres: str | None = None
    time_limit: str | None = None
    account: str | None = None
    constraint: str | None = None
    qos: str | None = None
    cpus_per_task: PositiveInt | None = None
    mem: str | None = None
    # Other sbatch options, each one whole word ("--exclusive", "--reservation=bench").
    sbatch_args: list[str] = []
    # An Apptainer/Singularity image the engine runs in (`exec --nv IMAGE argv`).
    container: str | None = None
    container_runtime: Literal["apptainer", "singularity"] = "apptainer"
    container_args: list[str] = []
    # Where sbatch and squeue run: a login node over SSH, or this machine when absent.
    login: SlurmLogin | None = None
    # The cluster's slurm.conf, when not the login node's default (SLURM_CONF for every command).
    slurm_conf: str | None = None
    # A folder that the login and compute nodes share, for job scripts and engine logs.
    work_dir: str | None = None
    # The address the engine listens on in its job: the compute node is another machine.
    bind_host: str = "0.0.0.0"
    # How long a job may wait in the queue before its cell fails (stage `queue`).
    queue_timeout_s: PositiveFloat = 600.0
    command_timeout_s: PositiveFloat = 60.0
    # What nvidia-smi must report inside each job (stage gpu_check, on the job's own node).
    gpu_type: str | None = None
    gpu_count: PositiveInt | None = None
    gpu_check: Literal["auto", "required", "off"] = "auto"


class PluginNode(BaseModel):
    """A node of a kind another package adds (hookspecs.py); its other keys are its options."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kind: str

    @field_validator("kind")
    @classmethod
    def _kind_is_served(cls, value: str, info: ValidationInfo) -> str:
        served = _context_kinds(info, "node_kinds")
        if value not in served:
            raise _unknown_kind("node", value, NODE_KINDS + served)
        return value

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


def _node_tag(value: Any) -> str | None:
    if isinstance(value, BaseModel):
        value = {"kind": getattr(value, "kind", None)}
    if not isinstance(value, dict):
        return None  # not a mapping: the discriminator's own error says what a node is
    return value.get("kind") if value.get("kind") in NODE_KINDS else "plugin"


Node = Annotated[
    Annotated[LocalNode, Tag("local")]
    | Annotated[SshNode, Tag("ssh")]
    | Annotated[ProviderNode, Tag("provider")]
    | Annotated[SlurmNode, Tag("slurm")]
    | Annotated[PluginNode, Tag("plugin")],
    Discriminator(
        _node_tag,
        custom_error_type="node_not_mapping",
        custom_error_message=(
            "a node is a mapping with a 'kind' key (local, ssh, provider, slurm, ...)"
        ),
    ),
]
AnyNode = LocalNode | SshNode | ProviderNode | SlurmNode | PluginNode


def _context_kinds(info: ValidationInfo, key: str) -> tuple[str, ...]:
    context = info.context if isinstance(info.context, dict) else {}
    return tuple(context.get(key, ()))


def _unknown_kind(what: str, value: str, known: tuple[str, ...]) -> PydanticCustomError:
    return PydanticCustomError(
        "unknown_kind",
        "unknown {what} kind '{value}' (known: {known}; a plugin adds more with "
        "pytest_gpubench_{what}_kinds)",
        {"what": what, "value": value, "known": ", ".join(known)},
    )


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


class RequestShape(_Strict):
    """What a chat request asks for beyond the prompt (a cell's `request`, a prompt's
    `request`; the prompt's keys win). Unset keys are left out of the request, except
    temperature, which is 0 unless set."""

    temperature: Annotated[float, Field(ge=0.0)] | None = None
    seed: int | None = None
    # A fixed output length: keep generating past the end-of-sequence token, or at least this many.
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    # Merged into the request's JSON body last (engine-specific fields).
    extra_body: dict[str, Any] | None = None

    def merged(self, over: RequestShape | None) -> RequestShape:
        """These keys with `over`'s set keys on top."""
        if over is None:
            return self
        return RequestShape(
            **{**self.model_dump(exclude_none=True), **over.model_dump(exclude_none=True)}
        )

    @property
    def temperature_or_default(self) -> float:
        return 0.0 if self.temperature is None else self.temperature

    def changed_keys(self) -> dict[str, Any]:
        """The keys that change the request from the default one (temperature 0, nothing else):
        what the frozen prompt hash covers, so that a baseline measured before these keys
        existed keeps its hash."""
        keys = self.model_dump(exclude_none=True)
        if keys.get("temperature") == 0:
            del keys["temperature"]
        return keys


# What each engine kind cannot send, and why: one line in the error.
UNSUPPORTED_REQUEST_KEYS = {
    "ollama": {
        "ignore_eos": "Ollama's API has no ignore_eos: the output length cannot be fixed",
        "min_tokens": "Ollama's API has no min_tokens: the output length cannot be fixed",
    },
    "llamacpp": {
        "min_tokens": "llama-server has no min_tokens; use ignore_eos: true for a fixed length",
    },
}


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

    @field_validator("engine")
    @classmethod
    def _engine_is_served(cls, value: str, info: ValidationInfo) -> str:
        known = ENGINE_KINDS + _context_kinds(info, "engine_kinds")
        if value not in known:
            raise _unknown_kind("engine", value, known)
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


class ChatTurn(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class Prompt(_Strict):
    intent: str
    prompt: Annotated[str, Field(min_length=1)]
    max_tokens: PositiveInt
    request: RequestShape | None = None
    # A whole conversation sent in place of `prompt` alone (a dataset's entry with a system
    # turn); `prompt` is then its last user turn.
    messages: tuple[ChatTurn, ...] | None = None
    # A token-exact synthetic prompt of one size: `prompt` holds word text until the live cell
    # counts the exact text through the engine (run/workloads.py); frozen at that point.
    synthetic: Synthetic | None = None

    def chat_messages(self) -> list[dict[str, Any]] | None:
        """The conversation to send, or None where `prompt` is sent as one user turn."""
        if self.messages is None:
            return None
        return [turn.model_dump() for turn in self.messages]

    def sha256(self, request: RequestShape | None = None) -> str:
        """The frozen hash: the text and max_tokens, plus the request keys that change what is
        measured (`request`, the effective one) only where some are set: a prompt measured
        with the default request keeps the hash it had before request keys existed. A
        conversation's turns join the hash only where there are some, for the same reason."""
        frozen: dict[str, Any] = {"prompt": self.prompt, "max_tokens": self.max_tokens}
        if self.messages is not None:
            frozen["messages"] = self.chat_messages()
        changed = request.changed_keys() if request is not None else {}
        if changed:
            frozen["request"] = changed
        canonical = json.dumps(frozen, sort_keys=True).encode()
        return hashlib.sha256(canonical).hexdigest()


class _CellsFile(_Strict):
    settings: CellDefaults = CellDefaults()
    # `local` (this machine) needs no entry: a local-only file may leave out `nodes:`.
    nodes: dict[str, Node] = {}
    cells: list[CellSpec]


class _PromptsFile(_Strict):
    prompts: dict[str, Prompt]


class DatasetEntry(_Strict):
    """A prompts.yaml entry that names a dataset: it stands for `count` prompts, one case each,
    with ids `<id>#<entry>` (the entry's line or position in the file)."""

    intent: str = ""
    dataset: Dataset
    request: RequestShape | None = None


class _DatasetPromptsFile(_Strict):
    prompts: dict[str, DatasetEntry]


class SyntheticEntry(_Strict):
    """A prompts.yaml entry of token-exact synthetic prompts: one prompt per input size, with
    ids `<id>#in<N>`."""

    intent: str = ""
    synthetic: Synthetic


class _SyntheticPromptsFile(_Strict):
    prompts: dict[str, SyntheticEntry]


def synthetic_entry_prompt(key: str, intent: str, synthetic: Synthetic, size: int) -> Prompt:
    """One size of a synthetic entry, its text still words (made exact on the live cell)."""
    one = synthetic.model_copy(update={"input_tokens": size, "spread": None})
    return Prompt(
        intent=f"{intent or key}: {size} input tokens, {synthetic.output_tokens} output",
        prompt=seeded_words(synthetic.seed, size, size),
        max_tokens=synthetic.output_tokens,
        request=RequestShape(ignore_eos=True),
        synthetic=one,
    )


def dataset_prompt(
    group: str, entry: DatasetEntry | None, item: DatasetPrompt, dataset: Dataset
) -> Prompt:
    """One sampled entry of a dataset as a frozen prompt."""
    intent = entry.intent if entry is not None and entry.intent else f"dataset {group}"
    turns = tuple(ChatTurn(role=role, content=content) for role, content in item.messages)  # type: ignore[arg-type]
    return Prompt(
        intent=f"{intent} ({Path(dataset.path).name} entry {item.index})",
        prompt=item.prompt,
        max_tokens=item.max_tokens,
        request=entry.request if entry is not None else None,
        messages=turns if len(turns) > 1 else None,
    )


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
        return "unload" if self.spec.engine == "ollama" else "restart"

    @property
    def endpoint_as_written(self) -> str | None:
        """What the records carry as the endpoint: the user's text, not the normalised URL."""
        return self.spec.endpoint_as_written

    def request_for(self, prompt: Prompt) -> RequestShape:
        """The request keys of a call of `prompt` in this cell: the prompt's over the cell's."""
        return (self.spec.request or RequestShape()).merged(prompt.request)


@dataclass(frozen=True)
class Matrix:
    cells_path: Path
    prompts_path: Path
    settings: CellDefaults
    nodes: dict[str, AnyNode]
    cells: tuple[Cell, ...]
    prompts: dict[str, Prompt]
    # {dataset entry id: the ids of the prompts sampled from it}
    prompt_groups: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def cell(self, cell_id: str) -> Cell:
        for cell in self.cells:
            if cell.cell_id == cell_id:
                return cell
        raise KeyError(cell_id)


def _read_yaml(path: Path, expected: str) -> Any:
    """The parsed document; `expected` says what the file holds, for an empty file's error."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise GpubenchError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise GpubenchError(f"{path}: is a directory, not a file") from None
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise GpubenchError(
            f"{path}: line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}); save the file as UTF-8"
        ) from None
    loaded = parse_yaml(text, path)
    if loaded is None:
        raise GpubenchError(f"{path}: the file is empty (expected {expected})")
    if not isinstance(loaded, dict):
        raise GpubenchError(f"{path}: expected {expected}, got {type(loaded).__name__}")
    return loaded


def _describe_location(loc: tuple[int | str, ...], raw: Any) -> str:
    """Turn a pydantic error location into `cells[1] (local:llamacpp:tiny) key 'foo'`."""
    parts: list[str] = []
    for i, item in enumerate(loc):
        if isinstance(item, int):
            if not parts:
                parts.append(f"[{item}]")  # a key that is a number, at the top level
                continue
            parts[-1] = f"{parts[-1]}[{item}]"
            if loc[:i] == ("cells",) and isinstance(raw, dict):
                cells = raw.get("cells")
                if isinstance(cells, list) and item < len(cells) and isinstance(cells[item], dict):
                    entry = cells[item]
                    name = cell_id_of(*(entry.get(k) for k in ("node", "engine", "model", "name")))
                    parts[-1] += f" ({name})"
        elif i == 2 and loc[0] == "nodes" and item in (*NODE_KINDS, "plugin"):
            continue  # pydantic's union tag after nodes.<name>, not a key the user wrote
        else:
            parts.append(shown_key(str(item)))
    return ".".join(parts)


def _first_error(path: Path, exc: ValidationError, raw: Any) -> GpubenchError:
    lines = []
    for error in exc.errors():
        where = _describe_location(tuple(error["loc"]), raw)
        if error["type"] == "extra_forbidden":
            lines.append(f"{path}: {where}: unknown key (remove it or check its spelling)")
        elif error["type"] == "missing":
            lines.append(f"{path}: {where}: required key is missing")
        else:
            value = error.get("input")
            plain = not isinstance(value, dict | list) and error["type"] != "unknown_kind"
            shown = f" (got {value!r})" if plain else ""
            lines.append(f"{path}: {where}: {error['msg']}{shown}")
    return GpubenchError("\n".join(lines))


def read_prompts(path: Path) -> dict[str, Prompt]:
    return read_prompt_file(path)[0]


def read_prompt_file(path: Path) -> tuple[dict[str, Prompt], dict[str, tuple[str, ...]]]:
    """The prompts of prompts.yaml, a dataset entry's sampled ones in its place, and
    {dataset entry id: its prompts' ids}."""
    raw = _read_yaml(path, "a mapping with a 'prompts' key")
    if raw.get("prompts") is None and "prompts" in raw:
        raise GpubenchError(f"{path}: prompts: no prompts defined")
    entries = raw.get("prompts")
    named = entries if isinstance(entries, dict) else {}
    from_datasets = {
        key: value for key, value in named.items() if isinstance(value, dict) and "dataset" in value
    }
    generated = {
        key: value
        for key, value in named.items()
        if isinstance(value, dict) and "synthetic" in value and key not in from_datasets
    }
    plain = {
        **raw,
        "prompts": {
            k: v for k, v in named.items() if k not in from_datasets and k not in generated
        },
    }
    if not isinstance(entries, dict):
        plain = raw
    try:
        parsed = _PromptsFile.model_validate(plain)
        sampled = _DatasetPromptsFile.model_validate({"prompts": from_datasets})
        synthetic = _SyntheticPromptsFile.model_validate({"prompts": generated})
    except ValidationError as exc:
        raise _first_error(path, exc, raw) from None
    if not parsed.prompts and not sampled.prompts and not synthetic.prompts:
        raise GpubenchError(f"{path}: prompts: no prompts defined")
    prompts: dict[str, Prompt] = {}
    groups: dict[str, tuple[str, ...]] = {}
    for key in named:
        if key in parsed.prompts:
            prompts[key] = parsed.prompts[key]
            continue
        if key in synthetic.prompts:
            made = synthetic.prompts[key]
            if made.synthetic.prefix is not None:
                raise GpubenchError(
                    f"{path}: prompts.{key}.synthetic.prefix: a shared prefix is measured under "
                    "load (a cell's load: synthetic: with prefix:), where requests share it"
                )
            sizes = tuple(dict.fromkeys(made.synthetic.sizes))
            for size in sizes:
                prompts[f"{key}#in{size}"] = synthetic_entry_prompt(
                    key, made.intent, made.synthetic, size
                )
            groups[key] = tuple(f"{key}#in{size}" for size in sizes)
            continue
        entry = sampled.prompts[key]
        dataset = entry.dataset.resolved(path.parent)
        ids = []
        for item in sample_dataset(dataset, f"{path}: prompts.{key}.dataset"):
            prompt_id = f"{key}#{item.index}"
            if prompt_id in named:
                raise GpubenchError(
                    f"{path}: prompts.{prompt_id}: the id is taken by dataset entry {key}'s "
                    "sampled prompts; rename it"
                )
            prompts[prompt_id] = dataset_prompt(key, entry, item, dataset)
            ids.append(prompt_id)
        groups[key] = tuple(ids)
    return prompts, groups


def read_matrix(
    cells_path: Path,
    prompts_path: Path,
    *,
    engine_kinds: Sequence[str] = (),
    node_kinds: Sequence[str] = (),
) -> Matrix:
    """Read both files and check everything that can be checked without touching the network.

    `engine_kinds` and `node_kinds` are the kinds plugins add (hookspecs.py).
    """
    raw = _read_yaml(cells_path, "a mapping with 'nodes' and 'cells' keys")
    prompts, groups = read_prompt_file(prompts_path)
    if raw.get("cells") is None and "cells" in raw:
        raw = {**raw, "cells": []}  # `cells:` with nothing under it: said below, after the nodes
    if raw.get("nodes") is None and "nodes" in raw:
        raw = {**raw, "nodes": {}}  # `nodes:` with nothing under it: `local` only
    context = {"engine_kinds": tuple(engine_kinds), "node_kinds": tuple(node_kinds)}
    try:
        parsed = _CellsFile.model_validate(raw, context=context)
    except ValidationError as exc:
        raise _first_error(cells_path, exc, raw) from None
    if not parsed.cells:
        raise GpubenchError(
            f"{cells_path}: cells: no cells defined (add at least one "
            "{node, engine, model} under cells)"
        )

    nodes: dict[str, AnyNode] = dict(parsed.nodes)
    if "local" not in nodes and any(spec.node == "local" for spec in parsed.cells):
        nodes["local"] = LocalNode(kind="local")
    cells: list[Cell] = []
    seen: dict[str, int] = {}
    for index, spec in enumerate(parsed.cells):
        where = f"{cells_path}: cells[{index}] ({spec.cell_id})"
        if spec.cell_id in seen:
            hint = (
                ""
                if spec.name is not None
                else " (two cells with the same node, engine and model on different endpoints: "
                "give each a `name:`, which makes the id <node>:<engine>:<model>@<name>)"
            )
            raise GpubenchError(
                f"{where}: duplicate cell id, already defined at cells[{seen[spec.cell_id]}]{hint}"
            )
        seen[spec.cell_id] = index
        if spec.node not in nodes:
            known = ", ".join(sorted(nodes)) or "none"
            raise GpubenchError(
                f"{where}: node: '{spec.node}' is not defined under nodes (defined: {known})"
            )
        _check_endpoint_keys(where, spec)
        prompt_ids = tuple(spec.prompts) if spec.prompts is not None else tuple(prompts)
        # A dataset entry's id stands for the prompts sampled from it.
        prompt_ids = tuple(p for pid in prompt_ids for p in groups.get(pid, (pid,)))
        for prompt_id in prompt_ids:
            if prompt_id not in prompts:
                raise GpubenchError(
                    f"{where}: prompts: '{prompt_id}' is not defined in {prompts_path}"
                )
        _check_request_keys(where, spec, prompts, prompt_ids, prompts_path)
        load = merged_profile(parsed.settings.load, spec.load_setting)
        load = _resolved_load(where, load, cells_path.parent)
        _check_load(where, spec, load, prompts, prompts_path)
        merged = parsed.settings.thresholds.model_dump(exclude_none=True)
        if spec.thresholds is not None:
            merged.update(spec.thresholds.model_dump(exclude_none=True))
        cells.append(
            Cell(
                spec=spec,
                node=nodes[spec.node],
                index=index,
                prompt_ids=prompt_ids,
                runs=spec.runs or parsed.settings.runs,
                timeout_s=spec.timeout_s or parsed.settings.timeout_s,
                thresholds=Thresholds(**merged),
                telemetry=parsed.settings.telemetry.model_copy(
                    update=spec.telemetry.model_dump(exclude_unset=True) if spec.telemetry else {}
                ),
                load=load,
            )
        )
    _check_references(cells_path, cells)
    return Matrix(
        cells_path=cells_path,
        prompts_path=prompts_path,
        settings=parsed.settings,
        nodes=nodes,
        cells=tuple(cells),
        prompts=prompts,
        prompt_groups=groups,
    )


def _resolved_load(where: str, load: LoadProfile | None, base: Path) -> LoadProfile | None:
    """The profile with its files' paths made absolute against cells.yaml's folder, each read
    once here so that a bad file stops the run before it starts."""
    if load is None:
        return None
    if load.dataset is not None:
        dataset = load.dataset.resolved(base)
        sample_dataset(dataset, f"{where}: load.dataset")
        load = load.model_copy(update={"dataset": dataset})
    if load.trace is not None:
        trace = load.trace.resolved(base)
        read_trace(trace, f"{where}: load.trace")
        load = load.model_copy(update={"trace": trace})
    return load


def load_dataset_sha256(profile: LoadProfile, request: RequestShape) -> str:
    """What a dataset load case is frozen by: its sampled prompts in order, and the request
    keys that change what is measured."""
    assert profile.dataset is not None
    items = sample_dataset(profile.dataset, "load.dataset")
    changed = request.changed_keys()
    digest = dataset_sha256(items)
    if not changed:
        return digest
    canonical = json.dumps({"dataset": digest, "request": changed}, sort_keys=True).encode()
    return hashlib.sha256(canonical).hexdigest()


def _check_references(cells_path: Path, cells: Sequence[Cell]) -> None:
    """An A/B candidate's `reference:` names another cell, on the same node, that is measured
    the same way (warm, the same runs, the candidate's prompts) and is no candidate itself."""
    by_id = {cell.cell_id: cell for cell in cells}
    for cell in cells:
        spec = cell.spec
        where = f"{cells_path}: cells[{cell.index}] ({cell.cell_id})"
        if spec.reference is None:
            if spec.min_runs is not None and spec.min_runs > cell.runs:
                raise GpubenchError(
                    f"{where}: min_runs: {spec.min_runs} is more than runs ({cell.runs})"
                )
            continue
        reference = by_id.get(spec.reference)
        if reference is None:
            raise GpubenchError(
                f"{where}: reference: '{spec.reference}' is not a cell of this file "
                f"(cells: {', '.join(by_id)})"
            )
        if reference is cell:
            raise GpubenchError(f"{where}: reference: a cell cannot be its own reference")
        if reference.reference is not None:
            raise GpubenchError(
                f"{where}: reference: '{reference.cell_id}' has a reference of its own "
                f"('{reference.reference}'); chains are not supported: name "
                f"'{reference.reference}' here"
            )
        _check_pair(where, cell, reference)


def _check_pair(where: str, cell: Cell, reference: Cell) -> None:
    """What makes an A/B pair's calls comparable one for one, each broken rule in one line."""
    ref = f"its reference '{reference.cell_id}'"
    if reference.spec.node != cell.spec.node:
        raise GpubenchError(
            f"{where}: reference: {ref} runs on node '{reference.spec.node}', this cell on "
            f"'{cell.spec.node}'; an A/B pair shares one node, so that the machine's drift "
            "hits both sides"
        )
    for side, other in ((cell, "this cell"), (reference, ref)):
        if "warm" not in side.spec.phases:
            raise GpubenchError(f"{where}: reference: {other} has no warm phase to pair")
        if side.spec.duration_s is not None:
            raise GpubenchError(
                f"{where}: reference: {other} has a timed warm phase (duration_s); an A/B pair "
                "counts its calls in runs"
            )
        if side.spec.skip or side.spec.optional:
            key = "skip" if side.spec.skip else "optional"
            raise GpubenchError(
                f"{where}: reference: {other} is {key}: an A/B verdict needs both sides measured"
            )
    if reference.runs != cell.runs:
        raise GpubenchError(
            f"{where}: runs: {cell.runs}, but {ref} has {reference.runs}; a pair measures both "
            "sides the same number of times"
        )
    for prompt_id in cell.prompt_ids:
        if prompt_id not in reference.prompt_ids:
            raise GpubenchError(f"{where}: prompts: '{prompt_id}' is not measured by {ref}")
    if cell.spec.min_runs is not None and cell.spec.min_runs > cell.runs:
        raise GpubenchError(
            f"{where}: min_runs: {cell.spec.min_runs} is more than runs ({cell.runs})"
        )


def _check_endpoint_keys(where: str, spec: CellSpec) -> None:
    """One way to reach the engine: an endpoint, a port on the node, or a launch; and a managed
    engine of a kind the harness can start."""
    if spec.endpoint is not None:
        for key in ("port", "launch", "launch_env", "health_path", "ready_timeout_s", "cold"):
            if getattr(spec, key):
                raise GpubenchError(
                    f"{where}: {key}: only for an engine on the node (port:) or one the "
                    "harness launches; this cell has an endpoint"
                )
    if not spec.managed:
        for key in ("launch_env", "health_path", "ready_timeout_s", "cold"):
            if getattr(spec, key):
                raise GpubenchError(
                    f"{where}: {key}: only for a managed engine (give the cell a launch:)"
                )
        return
    if spec.engine not in MANAGED_ENGINE_KINDS:
        raise GpubenchError(
            f"{where}: endpoint: required for engine '{spec.engine}' "
            f"(the harness can only launch {', '.join(MANAGED_ENGINE_KINDS)} itself)"
        )
    if spec.engine == "openai" and spec.launch is None:
        raise GpubenchError(
            f"{where}: launch: a managed openai cell needs a launch template (e.g. "
            '[vllm, serve, "{model}", --host, "{host}", --port, "{port}"]), '
            "or an endpoint or port of an engine already running"
        )


def _check_request_keys(
    where: str,
    spec: CellSpec,
    prompts: dict[str, Prompt],
    prompt_ids: Sequence[str],
    prompts_path: Path,
) -> None:
    """Request keys the cell's engine cannot send, and TLS keys on a plain endpoint: one line."""
    unsupported = UNSUPPORTED_REQUEST_KEYS.get(spec.engine, {})
    sources: list[tuple[str, RequestShape | None]] = [(where, spec.request)]
    sources += [(f"{prompts_path}: prompts.{pid}", prompts[pid].request) for pid in prompt_ids]
    for source, shape in sources:
        for key in shape.model_dump(exclude_none=True) if shape is not None else {}:
            if key in unsupported:
                suffix = f" (cell {spec.cell_id})" if source != where else ""
                raise GpubenchError(f"{source}: request.{key}: {unsupported[key]}{suffix}")
    plain = spec.endpoint is None or spec.endpoint.scheme != "https"
    if plain and (spec.ca_file is not None or not spec.tls_verify):
        key = "ca_file" if spec.ca_file is not None else "tls_verify"
        raise GpubenchError(f"{where}: {key}: only applies to an https:// endpoint")


# The engine kinds a load case can drive: those that speak OpenAI's streamed chat completions.
LOAD_ENGINE_KINDS = ("llamacpp", "openai")


def _check_load(
    where: str,
    spec: CellSpec,
    load: LoadProfile | None,
    prompts: dict[str, Prompt],
    prompts_path: Path,
) -> None:
    """A load profile that cannot run, and `parallel` where no managed server takes it: one line."""
    if spec.parallel is not None and not (spec.managed and spec.engine == "llamacpp"):
        raise GpubenchError(
            f"{where}: parallel: only a managed llamacpp cell (no endpoint) takes it; an "
            "external server's slots are set where it is started"
        )
    if spec.parallel is not None and spec.launch is not None:
        raise GpubenchError(
            f"{where}: parallel: the cell's launch: replaces the argv; put --parallel there"
        )
    if load is None:
        return
    if spec.engine not in LOAD_ENGINE_KINDS:
        raise GpubenchError(
            f"{where}: load: engine '{spec.engine}' cannot be load-tested yet (load cases drive "
            f"{', '.join(LOAD_ENGINE_KINDS)})"
        )
    if not load.bounded:
        raise GpubenchError(
            f"{where}: load: needs duration_s or requests (or both) to bound each load point"
        )
    for prompt_id in load.prompts or ():
        if prompt_id not in prompts:
            raise GpubenchError(
                f"{where}: load.prompts: '{prompt_id}' is not defined in {prompts_path}"
            )
    sources = [key for key in ("prompts", "synthetic", "dataset", "trace") if getattr(load, key)]
    if len(sources) > 1:
        raise GpubenchError(
            f"{where}: load: give one of prompts, synthetic, dataset (got {', '.join(sources)})"
        )


def frozen_prompt_error(
    prompt_id: str,
    cell_id: str,
    *,
    baseline_sha256: str | None,
    current_sha256: str | None,
    source: Path | None = None,
) -> GpubenchError | None:
    """The error for a prompt changed under an id a baseline was measured with, or None.

    Prompts are frozen once shipped: numbers of two different prompts compare nothing.
    """
    if baseline_sha256 is None or current_sha256 is None or baseline_sha256 == current_sha256:
        return None
    where = f"{source}: " if source is not None else ""
    return GpubenchError(
        f"{where}prompt {prompt_id} changed since the baseline of {cell_id} was measured "
        f"(sha256 {baseline_sha256[:12]} -> {current_sha256[:12]}): shipped prompts are frozen; "
        f"restore '{prompt_id}' and add the new text under a new id"
    )
