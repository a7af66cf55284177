"""A managed server a killed run left on an SSH node (the lease journal, targets/ssh/leases.py)
stopped: by the next run on the same node or by `gpubench leases --release`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pydantic import ValidationError

from pytest_gpubench.config.nodes import SshNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.targets.leases import JournalEntry, RentalJournal, leaked_lease
from pytest_gpubench.targets.ssh import SshTarget
from pytest_gpubench.targets.ssh.leases import KIND, RELEASE_SCRIPT, leaked_servers

if TYPE_CHECKING:
    from pytest_gpubench.targets.protocol import Rental

log = logging.getLogger(__name__)


def release_leaked_servers(journal: RentalJournal, node: SshNode) -> list[Rental]:
    """Stop the managed servers on this ssh node that a killed run left; what became of each."""
    return [release_server(entry, journal) for entry in leaked_servers(journal, node)]


def release_server(entry: JournalEntry, journal: RentalJournal) -> Rental:
    """Stop a leaked server on its node (its process group, while it still runs the program);
    what became of it, in the shape of a lease given back (`leaked: true`). An entry whose
    node cannot be reached stays, to be tried again."""
    facts = entry.facts
    node_id = str(facts.get("node"))
    released = leaked_lease(
        entry, KIND, program=facts.get("program"), pid=facts.get("session_id"), state=None
    )
    try:
        node = SshNode.model_validate(facts.get("ssh_node"))
        target = SshTarget.of_node(
            node_id, node, connect_timeout_s=node.connect_timeout_s, forward=False
        )
    except (ValidationError, GpubenchError, OSError) as exc:
        log.error("ssh node %s: cannot stop leaked server: %s", node_id, exc)
        return released
    try:
        result = target.run_script(
            RELEASE_SCRIPT,
            [str(facts.get("pid_path")), str(facts.get("program"))],
            node.command_timeout_s + 10,
        )
        if result.ok:
            said = result.stdout.strip().splitlines()
            released["state"] = said[-1] if said else "gone"
            released["session_done"] = True
            journal.close(entry.path)
    finally:
        target.close()
    return released
