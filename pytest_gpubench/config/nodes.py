"""The nodes of cells.yaml: where cells run (local, an SSH host, a rented machine, a Slurm
cluster, a kind a plugin adds), validated strictly, and the stages of bringing one up."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PositiveFloat,
    PositiveInt,
    Tag,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

NODE_KINDS = ("local", "ssh", "provider", "slurm")
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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _NodeKind:
    """What a node kind is, as cells.yaml's checks ask it (each kind's model says its own)."""

    # It runs a load point's client tasks (`load.clients.node`; targets.launch_clients).
    runs_client_tasks: ClassVar[bool] = False
    # Why its client tasks cannot reach the coordinator through a tunnel (`coordinator:
    # tunnel`), {node} its name; None where they can.
    no_client_tunnel: ClassVar[str | None] = None


class LocalNode(_Strict, _NodeKind):
    kind: Literal["local"]
    # The name a cell may give as its node without declaring it under nodes: this machine.
    implicit_name: ClassVar[str] = "local"


class SshConnection(_Strict):
    """How to log in to a host over SSH: an ssh node, or a Slurm node's login node."""

    host: str
    port: Annotated[int, Field(ge=1, le=65535)] = 22
    user: str
    key_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    trust_new_host: bool = False
    connect_timeout_s: PositiveFloat = 15.0


class SshNode(SshConnection, _NodeKind):
    kind: Literal["ssh"]
    runs_client_tasks: ClassVar[bool] = True
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


class ProviderNode(_Strict, _NodeKind):
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


class SlurmNode(_Strict, _NodeKind):
    """A Slurm cluster: each managed engine of its cells runs as a batch job (targets/slurm/)."""

    kind: Literal["slurm"]
    runs_client_tasks: ClassVar[bool] = True
    no_client_tunnel: ClassVar[str | None] = (
        "Slurm node '{node}' needs this machine's address as its compute nodes reach it"
    )
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


class PluginNode(BaseModel, _NodeKind):
    """A node of a kind another package adds (hookspecs.py); its other keys are its options."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kind: str

    @field_validator("kind")
    @classmethod
    def _kind_is_served(cls, value: str, info: ValidationInfo) -> str:
        served = context_kinds(info, "node_kinds")
        if value not in served:
            raise unknown_kind("node", value, NODE_KINDS + served)
        return value

    @property
    def options(self) -> dict[str, object]:
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


def context_kinds(info: ValidationInfo, key: str) -> tuple[str, ...]:
    context = info.context if isinstance(info.context, dict) else {}
    return tuple(context.get(key, ()))


def unknown_kind(what: str, value: str, known: tuple[str, ...]) -> PydanticCustomError:
    return PydanticCustomError(
        "unknown_kind",
        "unknown {what} kind '{value}' (known: {known}; a plugin adds more with "
        "pytest_gpubench_{what}_kinds)",
        {"what": what, "value": value, "known": ", ".join(known)},
    )
