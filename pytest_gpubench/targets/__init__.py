"""Where engines run: the `Target` protocol that every node kind implements, and the factory."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pytest_gpubench.config.nodes import AnyNode
    from pytest_gpubench.targets.leases import JournalEntry, RentalJournal
    from pytest_gpubench.targets.stages import Stage, StageClock


def on_this_machine(target: object) -> bool:
    """Whether a target is the machine that runs pytest (the local kind): its files, processes,
    /proc and NVML are read directly, not through the node's commands."""
    from pytest_gpubench.targets.local import LocalTarget

    return isinstance(target, LocalTarget)


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

    def describe(self) -> dict[str, Any]:
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
# Told what a rented node cost once it is given back: node, kind, session_id, offer_id,
# gpu_name, price_per_hour, elapsed_s, cost, session_done.
RentalClosed = Callable[[dict[str, Any]], None]


def open_target(
    node_id: str,
    node: AnyNode,
    *,
    plugin_hook: TargetHook | None,
    on_rental_closed: RentalClosed,
    clock: StageClock | None = None,
) -> Target:
    """A connected, set-up target for a node of cells.yaml; raises StageError naming the stage.

    A rented node calls on_rental_closed once when its session is given back, also when
    opening it fails after the session was created; a Slurm node once per job it ran. `clock`
    times the stages (ssh_connect, gpu_check, engine_install, model_pull; a rented node's
    inventory and provision first) and reports each outcome.
    """
    # Each kind is imported when a node of it is opened: the kinds import this module (the
    # protocol), and a run with local nodes only loads neither paramiko nor the provider client.
    from pytest_gpubench.config.nodes import LocalNode, PluginNode, SlurmNode, SshNode
    from pytest_gpubench.targets.bringup import bring_up
    from pytest_gpubench.targets.stages import StageClock, StageError

    clock = clock or StageClock(node_id)

    if isinstance(node, LocalNode):
        from pytest_gpubench.targets.local import LocalTarget

        return LocalTarget(node_id)
    if isinstance(node, PluginNode):
        target = plugin_hook(node_id=node_id, node=node) if plugin_hook is not None else None
        if target is None:
            raise StageError("provision", f"node {node_id}: no plugin opened its kind {node.kind}")
        return target
    if isinstance(node, SshNode):
        from pytest_gpubench.targets.ssh import SshTarget

        with clock.stage("ssh_connect", node.connect_timeout_s) as limit:
            ssh = SshTarget.of_node(
                node_id,
                node,
                connect_timeout_s=limit or node.connect_timeout_s,
                forward=node.forward,
            )
        ssh.lease_node = node  # its managed servers go into the lease journal
        try:
            bring_up(ssh, clock, node)
        except BaseException:
            with clock.stage("cleanup"):
                ssh.close()
            raise
        return ssh
    if isinstance(node, SlurmNode):
        from pytest_gpubench.targets.slurm import open_slurm_target

        return open_slurm_target(node_id, node, on_job_ended=on_rental_closed)
    from pytest_gpubench.targets.provider import ProviderTarget

    return ProviderTarget(node_id, node, on_rental_closed=on_rental_closed, clock=clock).open()


def write_plan(path: str | os.PathLike[str], plan: bytes) -> None:
    """A launch's plan, written where this machine's tasks read it: the plan holds the
    connection's key (and the cell's headers), so the file is its owner's only."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(plan)


def launch_here() -> Launch:
    """How a load point's client processes start on this machine (`processes: N`)."""
    from pytest_gpubench.targets.local import ProcessLaunch

    return ProcessLaunch()


def launch_clients(node_id: str, node: AnyNode, python: str | None) -> Launch:
    """How a load point's client tasks start on `clients:`'s node, by its kind: an srun step on
    a Slurm node (from this machine, or over SSH from its login node), SSH sessions on an ssh
    node (the kinds whose node model runs_client_tasks: config/cell_rules.py has refused any
    other). `python` runs each task there."""
    from pytest_gpubench.config.nodes import SlurmNode, SshNode

    if isinstance(node, SshNode):
        from pytest_gpubench.targets.ssh.clients import SshLaunch

        return SshLaunch(node_id, node, python)
    assert isinstance(node, SlurmNode)
    from pytest_gpubench.targets.slurm.clients import slurm_launch

    return slurm_launch(node_id, node, python)


def release_leaked(node: AnyNode, journal: RentalJournal, seen: set[str]) -> list[dict[str, Any]]:
    """Give back the leases (the journal, targets/leases.py) that runs now gone left where this
    node lives: its provider's API, its Slurm cluster, its SSH host; once per place and run
    (`seen` holds the places done). What became of each, in the shape of a rental given back."""
    from pytest_gpubench.config.nodes import ProviderNode, SlurmNode, SshNode

    if isinstance(node, ProviderNode):
        from pytest_gpubench.targets.provider.leases import api_key, release_leaked_rentals

        return _once(api_key(node), seen, lambda: release_leaked_rentals(journal, node))
    if isinstance(node, SlurmNode):
        from pytest_gpubench.targets.slurm.leases import cluster_key
        from pytest_gpubench.targets.slurm.release import release_leaked_jobs

        return _once(cluster_key(node), seen, lambda: release_leaked_jobs(journal, node))
    if isinstance(node, SshNode):
        from pytest_gpubench.targets.ssh.leases import lease_key
        from pytest_gpubench.targets.ssh.release import release_leaked_servers

        return _once(lease_key(node), seen, lambda: release_leaked_servers(journal, node))
    return []  # a local node leases nothing; a plugin's kind keeps its own


def _once(
    key: str, seen: set[str], release: Callable[[], list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    if key in seen:
        return []
    seen.add(key)
    return release()


def release_lease(entry: JournalEntry, journal: RentalJournal) -> dict[str, Any]:
    """Give back one lease of the journal (`gpubench leases --release`), by its kind."""
    if entry.kind == "slurm":
        from pytest_gpubench.targets.slurm.release import release_job

        return release_job(entry, journal)
    if entry.kind == "ssh_server":
        from pytest_gpubench.targets.ssh.release import release_server

        return release_server(entry, journal)
    from pytest_gpubench.targets.provider.leases import release_rental

    return release_rental(entry, journal)


def describe_lease(entry: JournalEntry, state: str) -> str:
    """One line on a lease of the journal and its state (`gpubench leases`), by its kind."""
    if entry.kind == "slurm":
        from pytest_gpubench.targets.slurm.leases import describe
    elif entry.kind == "ssh_server":
        from pytest_gpubench.targets.ssh.leases import describe
    else:
        from pytest_gpubench.targets.provider.leases import describe
    return describe(entry, state)


def opening_stage(node: AnyNode) -> Stage:
    """The stage a node that failed to open for a reason no target named failed in."""
    from pytest_gpubench.config.nodes import SshNode

    return "ssh_connect" if isinstance(node, SshNode) else "provision"


def records_stages(node: AnyNode) -> bool:
    """Whether the node's stages go into the ledger (a local node's are timed, not recorded)."""
    from pytest_gpubench.config.nodes import LocalNode

    return not isinstance(node, LocalNode)
