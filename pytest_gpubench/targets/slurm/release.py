"""A Slurm job a killed run left (the lease journal, targets/slurm/leases.py) cancelled: by the
next run on the same cluster or by `gpubench leases --release`."""

from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from pytest_gpubench.config.nodes import SlurmNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.targets.leases import JournalEntry, RentalJournal, leaked_lease
from pytest_gpubench.targets.slurm import open_slurm_target
from pytest_gpubench.targets.slurm.leases import KIND, leaked_jobs

if TYPE_CHECKING:
    from pytest_gpubench.targets.protocol import Rental

log = logging.getLogger(__name__)

# How long a cancelled job may take to leave the queue (Slurm's KillWait is 30 s by default).
CANCEL_WAIT_S = 40.0
POLL_S = 0.5


def release_leaked_jobs(journal: RentalJournal, node: SlurmNode) -> list[Rental]:
    """Cancel the jobs on this node's cluster that a killed run left; how each ended."""
    return [release_job(entry, journal) for entry in leaked_jobs(journal, node)]


def release_job(entry: JournalEntry, journal: RentalJournal) -> Rental:
    """Cancel a leaked job (scancel; by its name when its id was never read back), wait until
    it has left the queue, and return how it ended, in the shape of a job given back
    (SlurmTarget.job_ended) plus `leaked: true`. An entry whose jobs could not be cancelled
    stays, to be tried again."""
    facts = entry.facts
    node_id = str(facts.get("node"))
    ended = leaked_lease(
        entry,
        KIND,
        slurm_job_id=entry.session_id,
        job_name=facts.get("job_name"),
        compute_node=None,
        state=None,
        elapsed_s=None,
        state_source=None,
    )
    try:
        node = SlurmNode.model_validate(facts.get("slurm_node"))
        if node.login is None and facts.get("host") != socket.gethostname():
            raise GpubenchError(f"its jobs were submitted on {facts.get('host')}, not here")
        target = open_slurm_target(node_id, node, on_job_ended=lambda _: None)
    except (ValidationError, GpubenchError) as exc:
        log.error("slurm node %s: cannot cancel leaked job %s: %s", node_id, entry.session_id, exc)
        return ended
    try:
        job_ids = [entry.session_id] if entry.session_id else _jobs_named(target, facts)
        for job_id in job_ids:
            ended.update(_cancel(target, job_id))
        ended["session_done"] = all(
            not _active(target, job_id) for job_id in job_ids
        )  # none left in the queue
    except GpubenchError as exc:
        log.error("slurm node %s: cancelling leaked job failed: %s", node_id, exc)
    finally:
        target.login.close()
    if ended["session_done"]:
        journal.close(entry.path)
    return ended


def _jobs_named(target: Any, facts: dict[str, Any]) -> list[str]:
    name = facts.get("job_name")
    if not isinstance(name, str) or not name:
        return []
    listed = target.client.run(["squeue", "-h", "-n", name, "-o", "%i"])
    return listed.stdout.split() if listed.ok else []


def _active(target: Any, job_id: str) -> bool:
    state = target.client.queue_state(job_id)
    return state is not None and state.active


def _cancel(target: Any, job_id: str) -> Rental:
    client = target.client
    queued = client.queue_state(job_id)
    client.cancel(job_id)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline and _active(target, job_id):
        time.sleep(POLL_S)
    final = client.final_state(job_id)
    log.warning(
        "slurm node %s: job %s was left by a run that was killed; cancelled it (%s)",
        target.node_id,
        job_id,
        final.state if final is not None else "gone",
    )
    return {
        "session_id": job_id,
        "slurm_job_id": job_id,
        "compute_node": queued.node_list if queued is not None else None,
        "state": final.state if final is not None else None,
        "elapsed_s": final.elapsed_s if final is not None else None,
        "state_source": final.source if final is not None else None,
    }
