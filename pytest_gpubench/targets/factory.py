"""Opening the target a node of cells.yaml describes: local, SSH or rented."""

from __future__ import annotations

from pytest_gpubench.errors import GpubenchError
from pytest_gpubench.matrix import LocalNode, ProviderNode, SshNode
from pytest_gpubench.targets import Target
from pytest_gpubench.targets.local import LocalTarget
from pytest_gpubench.targets.provider import ProviderTarget
from pytest_gpubench.targets.ssh import SshTarget
from pytest_gpubench.targets.stages import setup_steps


def open_target(node_id: str, node: LocalNode | SshNode | ProviderNode) -> Target:
    """A connected, set-up target; raises StageError (a GpubenchError) naming the failed stage."""
    if isinstance(node, LocalNode):
        return LocalTarget(node_id)
    if isinstance(node, SshNode):
        target = SshTarget(
            node_id,
            node.host,
            node.port,
            node.user,
            key_file=node.key_file,
            known_hosts=node.known_hosts,
            trust_new_host=node.trust_new_host,
            connect_timeout_s=node.connect_timeout_s,
            command_timeout_s=node.command_timeout_s,
            forward=node.forward,
        )
        try:
            target.run_setup(setup_steps(node.setup, node.model_pull), node.setup_timeout_s)
        except BaseException:
            target.close()
            raise
        return target
    rented = ProviderTarget(node_id, node)
    try:
        return rented.open()
    except GpubenchError as exc:
        # open() has given the machine back; the time it was held is still owed.
        exc.released_target = rented  # type: ignore[attr-defined]
        raise
