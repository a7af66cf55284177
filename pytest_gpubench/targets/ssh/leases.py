"""Managed servers on SSH nodes in the lease journal (targets/leases.py): each written
down before it is started, struck off once it is stopped; a server a killed run left is stopped
by the next run on the same node or by `gpubench leases --release`, and recorded."""

from __future__ import annotations

import logging
from pathlib import Path

from pytest_gpubench.config.nodes import SshNode
from pytest_gpubench.targets.leases import SSH_SERVER_LEASE, JournalEntry, RentalJournal
from pytest_gpubench.targets.ssh.scripts import SHELL_FUNCTIONS

log = logging.getLogger(__name__)

KIND = SSH_SERVER_LEASE
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
    key = lease_key(node)
    return [e for e in journal.leaked_of_kind(KIND) if e.facts.get("ssh") == key]


def lease_key(node: SshNode) -> str:
    return node_key(node.host, node.port, node.user or "")


def describe(entry: JournalEntry, state: str) -> str:
    facts = entry.facts
    return (
        f"ssh node {facts.get('node')}: {facts.get('program')} (pid "
        f"{entry.session_id or 'not read back'}, since {facts.get('created_at_utc')}): {state}"
    )
