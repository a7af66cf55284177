"""Where engines run: the factories that open a node's target, start its load clients and give
back its leases, by the node's kind; and the `Target` protocol and its parts
(`targets/protocol.py`), named here as before. The kinds' modules import those from
`targets/protocol.py`, not from this package, which imports the kinds lazily: no import circle."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pytest_gpubench.targets.protocol import (
    CLIENT_TASK_MODULE,
    CLIENTS_END_TIMEOUT_S,
    LOOPBACK_HOSTS,
    NO_REQUESTS,
    BackgroundProcess,
    CommandResult,
    Launch,
    ListensBeyondLoopback,
    Rental,
    RentalClosed,
    StartsEnginesInJobs,
    Target,
    TargetHook,
    write_plan,
)

if TYPE_CHECKING:
    from pytest_gpubench.config.nodes import AnyNode
    from pytest_gpubench.targets.leases import JournalEntry, RentalJournal
    from pytest_gpubench.targets.stages import Stage, StageClock


def on_this_machine(target: object) -> bool:
    """Whether a target is the machine that runs pytest (the local kind): its files, processes,
    /proc and NVML are read directly, not through the node's commands."""
    from pytest_gpubench.targets.local import LocalTarget

    return isinstance(target, LocalTarget)


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


def release_leaked(node: AnyNode, journal: RentalJournal, seen: set[str]) -> list[Rental]:
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


def _once(key: str, seen: set[str], release: Callable[[], list[Rental]]) -> list[Rental]:
    if key in seen:
        return []
    seen.add(key)
    return release()


def release_lease(entry: JournalEntry, journal: RentalJournal) -> Rental:
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


__all__ = [
    "CLIENTS_END_TIMEOUT_S",
    "CLIENT_TASK_MODULE",
    "LOOPBACK_HOSTS",
    "NO_REQUESTS",
    "BackgroundProcess",
    "CommandResult",
    "Launch",
    "ListensBeyondLoopback",
    "RentalClosed",
    "StartsEnginesInJobs",
    "Target",
    "TargetHook",
    "describe_lease",
    "launch_clients",
    "launch_here",
    "on_this_machine",
    "open_target",
    "opening_stage",
    "records_stages",
    "release_leaked",
    "release_lease",
    "write_plan",
]
