"""Slurm's own commands, run on the login node: sbatch, squeue, scancel, sacct, scontrol."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from pytest_gpubench.targets.protocol import CommandResult, Target
from pytest_gpubench.targets.stages import StageError

# The states in which a job still holds (or waits for) its resources.
ACTIVE_STATES = frozenset(
    {
        "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING",
        "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SIGNALING", "STAGE_OUT",
        "STOPPED",
    }
)  # fmt: skip
SQUEUE_FORMAT = "%T|%r|%N"
ELAPSED_PATTERN = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)(?:\.\d+)?$")


@dataclass(frozen=True)
class QueueState:
    """A job as squeue lists it: its state, why it is pending, the node it runs on."""

    state: str
    reason: str
    node_list: str

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


@dataclass(frozen=True)
class FinalState:
    """How a job ended and how long it ran, from sacct (or scontrol where there is no sacct)."""

    state: str
    elapsed_s: int | None
    source: str


def parse_job_id(output: str) -> str | None:
    """`sbatch --parsable` prints `ID` or `ID;CLUSTER`."""
    first = output.strip().splitlines()[0] if output.strip() else ""
    job_id = first.split(";", 1)[0].strip()
    return job_id if job_id.isdigit() else None


def parse_queue_line(output: str) -> QueueState | None:
    """squeue's `%T|%r|%N` line; None when squeue no longer lists the job."""
    for line in output.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[0]:
            state, reason, node_list = parts
            return QueueState(state, reason, node_list)
    return None


def parse_fields(output: str) -> dict[str, str]:
    """`scontrol show ... -o`'s KEY=VALUE words (values without spaces are all we read)."""
    fields: dict[str, str] = {}
    for word in output.split():
        key, sign, value = word.partition("=")
        if sign and key not in fields:
            fields[key] = value
    return fields


def elapsed_seconds(text: str) -> int | None:
    """Slurm's `[D-][HH:]MM:SS` as seconds."""
    match = ELAPSED_PATTERN.match(text.strip())
    if match is None:
        return None
    days, hours, minutes, seconds = (int(group) if group else 0 for group in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def parse_sacct(output: str) -> FinalState | None:
    """`sacct -n -P -X -o State,ElapsedRaw`: `CANCELLED by 0|42`; None when it has no line."""
    for line in output.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 2 and parts[0]:
            state = parts[0].split()[0]
            elapsed = int(parts[1]) if parts[1].isdigit() else None
            return FinalState(state, elapsed, "sacct")
    return None


class SlurmClient:
    """Slurm's commands for one node of cells.yaml, run on its login node (argv, no shell)."""

    def __init__(
        self, node_id: str, login: Target, *, slurm_conf: str | None, timeout_s: float
    ) -> None:
        self.node_id = node_id
        self.login = login
        self.slurm_conf = slurm_conf
        self.timeout_s = timeout_s

    def run(self, argv: Sequence[str]) -> CommandResult:
        """A Slurm command, with the node's SLURM_CONF when it names one."""
        prefix = ["env", f"SLURM_CONF={self.slurm_conf}"] if self.slurm_conf else []
        try:
            return self.login.run([*prefix, *argv], timeout_s=self.timeout_s)
        except FileNotFoundError:
            raise StageError(
                "queue", f"node {self.node_id}: `{argv[0]}` not found: is Slurm installed here?"
            ) from None

    def submit(self, script_path: str) -> str:
        """Submit a batch script; its job id."""
        result = self.run(["sbatch", "--parsable", script_path])
        job_id = parse_job_id(result.stdout) if result.ok else None
        if job_id is None:
            why = (result.stderr or result.stdout).strip()[-500:] or f"status {result.returncode}"
            raise StageError("queue", f"node {self.node_id}: sbatch refused the job: {why}")
        return job_id

    def queue_state(self, job_id: str) -> QueueState | None:
        """The job's state in the queue; None once it has left it (ended)."""
        result = self.run(["squeue", "-h", "-j", job_id, "-o", SQUEUE_FORMAT])
        return parse_queue_line(result.stdout) if result.ok else None

    def cancel(self, job_id: str) -> CommandResult:
        return self.run(["scancel", job_id])

    def final_state(self, job_id: str) -> FinalState | None:
        """sacct's record of the job; scontrol's while the controller still holds it, on a
        cluster without accounting storage (no slurmdbd)."""
        accounted = self.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ElapsedRaw"])
        if accounted.ok:
            final = parse_sacct(accounted.stdout)
            if final is not None:
                return final
        shown = self.run(["scontrol", "show", "job", "-o", job_id])
        fields = parse_fields(shown.stdout) if shown.ok else {}
        if "JobState" not in fields:
            return None
        return FinalState(
            fields["JobState"], elapsed_seconds(fields.get("RunTime", "")), "scontrol"
        )

    def node_address(self, node_name: str) -> str:
        """The address a compute node is reached at (its NodeAddr), else its name."""
        shown = self.run(["scontrol", "show", "node", "-o", node_name])
        address = parse_fields(shown.stdout).get("NodeAddr") if shown.ok else None
        return address or node_name
