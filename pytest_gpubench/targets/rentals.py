"""What a rental says once it is closed or given back, in each kind's words: one line, and
whether it alarms (a session not ended, a job or a server that may still run)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_gpubench.targets.leases import SSH_SERVER_LEASE


def rental_text(rental: Mapping[str, Any]) -> tuple[str, bool]:
    """(its line, whether it alarms) for a rental of any kind (the `on_rental_closed` mapping
    or a lease given back)."""
    if rental.get("kind") == "slurm":
        return _slurm_job(rental)
    if rental.get("kind") == SSH_SERVER_LEASE:
        return _ssh_server(rental)
    return _rented_node(rental)


def _slurm_job(job: Mapping[str, Any]) -> tuple[str, bool]:
    """A Slurm job of a cell's engine: how it ended; alarming when it may still be running."""
    state = job.get("state")
    ended = isinstance(state, str) and state not in ("RUNNING", "PENDING")
    leaked = "left by a killed run, cancelled now: " if job.get("leaked") else ""
    text = (
        f"slurm node {job.get('node')}: {leaked}job {job.get('slurm_job_id')} "
        f"({job.get('job_name')}) on {job.get('compute_node')}: {state} after "
        f"{job.get('elapsed_s')} s"
    )
    if not ended:
        text += f"; cancel it by hand: scancel {job.get('slurm_job_id')}"
    return text, not ended


def _ssh_server(rental: Mapping[str, Any]) -> tuple[str, bool]:
    """A managed server a killed run left on an ssh node: stopped, or to stop by hand."""
    stopped = bool(rental.get("session_done"))
    how = rental.get("state") if stopped else "NOT stopped: stop it by hand"
    text = (
        f"ssh node {rental.get('node')}: left by a killed run: {rental.get('program')} "
        f"(pid {rental.get('pid')}): {how}"
    )
    return text, not stopped


def _rented_node(rental: Mapping[str, Any]) -> tuple[str, bool]:
    """A provider's rented node: what it cost, and whether its session was marked done."""
    done = rental.get("session_done")
    state = "marked done" if done else "NOT marked done: end it by hand"
    leaked = "left rented by a killed run, given back now: " if rental.get("leaked") else ""
    text = (
        f"rented node {rental.get('node')}: {leaked}{rental.get('gpu_name')} at "
        f"{rental.get('price_per_hour')}/h for {rental.get('elapsed_s')} s, cost "
        f"{rental.get('cost')}; session {rental.get('session_id')} {state}"
    )
    return text, not done
