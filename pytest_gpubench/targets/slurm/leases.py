"""Slurm jobs in the lease journal (targets/leases.py): each job written down before
sbatch, struck off once it has ended; a job a killed run left is cancelled by the next run on the
same cluster or by `gpubench leases --release`, and what became of it is recorded."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from pytest_gpubench.config.nodes import SlurmNode
from pytest_gpubench.targets.leases import JournalEntry, RentalJournal

log = logging.getLogger(__name__)

KIND = "slurm"


def cluster_key(node: SlurmNode) -> str:
    """Which cluster a job ran on, as the journal tells clusters apart: its login node (this
    machine's name when the commands run here) and its slurm.conf."""
    login = f"{node.login.user}@{node.login.host}:{node.login.port}" if node.login else "local"
    host = socket.gethostname() if node.login is None else ""
    return f"{login}/{host}/{node.slurm_conf or ''}"


def begin_job(journal: RentalJournal, node_id: str, node: SlurmNode, job_name: str) -> Path:
    """Written before sbatch: the job's name (so that a job whose id was never read back is
    still found) and how to reach the cluster again (the node's settings, no secret)."""
    return journal.begin_lease(
        KIND,
        node_id,
        {
            "job_name": job_name,
            "cluster": cluster_key(node),
            "slurm_node": node.model_dump(mode="json"),
        },
    )


def job_submitted(journal: RentalJournal, path: Path, job_id: str) -> None:
    journal.update(path, session_id=job_id, slurm_job_id=job_id)


def leaked_jobs(journal: RentalJournal, node: SlurmNode) -> list[JournalEntry]:
    """Jobs on this node's cluster that a run now gone left behind."""
    key = cluster_key(node)
    return [entry for entry in journal.leaked_of_kind(KIND) if entry.facts.get("cluster") == key]


def describe(entry: JournalEntry, state: str) -> str:
    facts = entry.facts
    return (
        f"slurm node {facts.get('node')}: job {entry.session_id or '(id not read back)'} "
        f"({facts.get('job_name')}, since {facts.get('created_at_utc')}): {state}"
    )
