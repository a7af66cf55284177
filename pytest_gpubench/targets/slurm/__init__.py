"""A Slurm cluster as a node kind: engines run as batch jobs submitted from a login node."""

from __future__ import annotations

from pytest_gpubench.config.nodes import SlurmNode
from pytest_gpubench.targets.protocol import RentalClosed, Target
from pytest_gpubench.targets.slurm.target import SlurmJob, SlurmTarget

__all__ = ["SlurmJob", "SlurmTarget", "open_slurm_target"]


def open_slurm_target(node_id: str, node: SlurmNode, *, on_job_ended: RentalClosed) -> SlurmTarget:
    """The cluster through its login node: this machine, or an SSH host (key auth, known
    hosts verified, as an ssh node)."""
    login: Target
    if node.login is None:
        from pytest_gpubench.targets.local import LocalTarget

        login = LocalTarget(node_id)
    else:
        from pytest_gpubench.targets.ssh import SshTarget

        login = SshTarget.of_connection(
            node_id, node.login, command_timeout_s=node.command_timeout_s
        )
    return SlurmTarget(node_id, node, login, on_job_ended=on_job_ended)
