"""Where engines run, the contract: the `Target` protocol every node kind implements, the
capabilities some kinds add, a command's result, and a load point's client `Launch`
(`targets/__init__.py` names them, beside the factories that pick a kind)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypedDict, runtime_checkable

if TYPE_CHECKING:
    pass


# The names a node's own loopback goes by (what `reach` maps to the node itself).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class BackgroundProcess(Protocol):
    """A long-running process on a node (a managed engine server)."""

    def alive(self) -> bool: ...

    def stop(self, timeout_s: float = 10.0) -> None: ...

    def log_tail(self, max_bytes: int = 4000) -> str: ...


@runtime_checkable
class ListensBeyondLoopback(Protocol):
    """A node whose managed engines must listen on another address than 127.0.0.1 (a Slurm
    job's compute node is reached from the login node)."""

    @property
    def engine_bind_host(self) -> str: ...


@runtime_checkable
class StartsEnginesInJobs(Protocol):
    """A node whose managed engines each run in a batch job of their own (a Slurm node): the
    job's node, and its GPUs, are known once the job runs, and are checked inside it (`check` is
    given a shell in the job); where its commands run (the login node) lacks what the job's
    image or modules give, so a managed engine's install is not checked there."""

    def when_job_runs(self, check: Callable[[Target], None]) -> None: ...


class Target(Protocol):
    """A machine that engines run on, seen from the machine that runs pytest."""

    node_id: str

    @property
    def work_dir(self) -> str:
        """A folder on the node for the files of managed engines (log, pid): one per login user."""
        ...

    def run(self, argv: Sequence[str], *, timeout_s: float) -> CommandResult:
        """Run a command to completion; arguments are never interpreted by a shell."""
        ...

    def start(self, argv: Sequence[str], *, log_path: str) -> BackgroundProcess:
        """Start a background process whose output goes to log_path on the node."""
        ...

    def free_port(self) -> int:
        """A TCP port that is free on the node's loopback interface."""
        ...

    def reach(self, host: str, port: int) -> tuple[str, int]:
        """An address on this machine that reaches host:port as the node sees it."""
        ...

    def gpu_inventory(self) -> list[dict[str, str]]:
        """One entry per GPU from nvidia-smi; an empty list means the node has no GPU."""
        ...

    def describe(self) -> NodeFacts:
        """Facts about the node for the ledger's cell record (host, CPU model, price, ...)."""
        ...

    def close(self) -> None: ...


# The module each client task of a load point runs (`python -m ... PLAN [TASK TASKS]`):
# run/load/client_task.py, named here and not imported (the coordinator it answers is a run's).
CLIENT_TASK_MODULE = "pytest_gpubench.run.load.client_task"
# How long a load point's client tasks may take to end once the point is over, before they are
# killed.
CLIENTS_END_TIMEOUT_S = 30.0
# How a task on a node that ended without sending its requests is named (then how it ended).
NO_REQUESTS = "ended without its requests"


class Launch(Protocol):
    """How K client tasks of a load point start, given their plan: what differs between
    processes of this machine, an `srun` step and SSH sessions. Everything else (the plan,
    barrier, offsets, merge, loss) is the one coordinator's (run/load/clients.py)."""

    # Whether the tasks read this machine's clock (no offset to measure).
    shares_clock: bool

    def address(self, coordinator: str, port: int) -> tuple[str, int]:
        """Where the tasks connect to reach this machine's listener on `port`: `coordinator`'s
        address, or (`tunnel`, on an ssh node) a port on the node's loopback carried back."""

    def start(self, plan: bytes, tasks: int) -> None:
        """Put the plan where the tasks read it, and start them."""

    def ended(self) -> str | None:
        """Why the launch ended before every task connected (its own last words), else None."""

    def how_lost(self, task: int) -> str:
        """How a task that sent nothing ended, as known: `died mid-point (killed by SIGKILL)`."""

    def close(self) -> None:
        """Wait for the tasks to end (killed past CLIENTS_END_TIMEOUT_S), remove the plan."""


# pytest_gpubench_open_target (hookspecs.py), as pytest's hook relay calls it.
TargetHook = Callable[..., Target | None]


class NodeFacts(TypedDict, total=False):
    """What a node says of itself for the ledger's cell records (`node_info`): where it is and
    its CPUs; a Slurm node its job, a rented one its offer and cost so far."""

    kind: str
    host: str | None
    hostname: str | None
    port: int
    user: str
    cpu_model: str | None
    cpu_count: int | None
    # A Slurm node: the job its cells run in, and the login node it was submitted from.
    slurm_job_id: str | None
    slurm_partition: str | None
    slurm_gres: str | None
    container: str | None
    login_host: str | None
    # A rented node: its provider's API, session and offer, and what it has cost so far.
    api: str
    session_id: str | None
    offer_id: str | int | None
    provider: str | None
    gpu_name: str | None
    vram_gb: float | None
    price_per_hour: float | None
    elapsed_s: float
    cost: float


class Rental(TypedDict, total=False):
    """A lease given back (a rented node, a Slurm job, a server a killed run left on an ssh
    node): what it was, what it cost and whether it is really given back. The terminal's
    rentals lines and `gpubench leases --release` read it; workers send theirs to the
    controller (xdist)."""

    node: str | None
    kind: str
    session_id: str | None
    session_done: bool
    # A provider's rental: its offer, price and cost.
    offer_id: str | int | None
    gpu_name: str | None
    price_per_hour: float | None
    elapsed_s: float | None
    cost: float
    # A Slurm job: how it ended, as Slurm accounts it (`state_source`: sacct or squeue).
    slurm_job_id: str | None
    job_name: str | None
    compute_node: str | None
    state: str | None
    state_source: str | None
    # A managed server a killed run left on an ssh node.
    program: str | None
    pid: str | None
    # Left by a killed run (the lease journal), given back by a later one.
    leaked: bool
    leaked_at_utc: str | None


# Told what a lease cost once it is given back.
RentalClosed = Callable[[Rental], None]


def write_plan(path: str | os.PathLike[str], plan: bytes) -> None:
    """A launch's plan, written where this machine's tasks read it: the plan holds the
    connection's key (and the cell's headers), so the file is its owner's only."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(plan)
