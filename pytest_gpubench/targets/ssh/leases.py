"""Managed servers on SSH nodes in the lease journal (targets/provider/journal.py): each written
down before it is started, struck off once it is stopped; a server a killed run left is stopped
by the next run on the same node or by `gpubench leases --release`, and recorded."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pytest_gpubench.config.matrix import SshNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.targets.provider.journal import JournalEntry, RentalJournal
from pytest_gpubench.targets.ssh.scripts import SHELL_FUNCTIONS

log = logging.getLogger(__name__)

KIND = "ssh_server"
# Stops the process group of the pid in its pid file, only while it still runs the program the
# run started (a pid reused by another program is left alone).
RELEASE_SCRIPT = (
    SHELL_FUNCTIONS
    + r"""
pidfile=$1 program=$2
pid=$(cat "$pidfile" 2>/dev/null)
case "$pid" in ''|*[!0-9]*) echo gone; exit 0 ;; esac
first=$(tr '\000' '\n' 2>/dev/null < "/proc/$pid/cmdline" | head -n 1)
if running "$pid" && [ "$first" = "$program" ]; then
  stop_group "$pid" 50
  echo "stopped $pid"
else
  echo gone
fi
"""
)


def node_key(host: str, port: int, user: str) -> str:
    return f"{user}@{host}:{port}"


def begin_server(
    journal: RentalJournal, node_id: str, node: SshNode, program: str, pid_path: str
) -> Path:
    """Written before the server is started: how to reach the node again (its settings, no
    secret) and the pid file the server's pid goes to."""
    return journal.begin_lease(
        KIND,
        node_id,
        {
            "program": program,
            "pid_path": pid_path,
            "ssh_node": node.model_dump(mode="json"),
            "ssh": node_key(node.host, node.port, node.user or ""),
        },
    )


def leaked_servers(journal: RentalJournal, node: SshNode) -> list[JournalEntry]:
    key = node_key(node.host, node.port, node.user or "")
    return [e for e in journal.leaked_of_kind(KIND) if e.facts.get("ssh") == key]


def release_server(entry: JournalEntry, journal: RentalJournal) -> dict[str, Any]:
    """Stop a leaked server on its node (its process group, while it still runs the program);
    what became of it, in the shape of a lease given back (`leaked: true`). An entry whose
    node cannot be reached stays, to be tried again."""
    from pytest_gpubench.targets.ssh import SshTarget

    facts = entry.facts
    node_id = str(facts.get("node"))
    released: dict[str, Any] = {
        "node": node_id,
        "kind": KIND,
        "session_id": entry.session_id,
        "program": facts.get("program"),
        "pid": facts.get("session_id"),
        "state": None,
        "leaked": True,
        "leaked_at_utc": facts.get("created_at_utc"),
        "session_done": False,
    }
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
