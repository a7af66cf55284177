"""The batch script of an engine's job: its sbatch options and the command it runs."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from pytest_gpubench.config.nodes import SlurmNode

# Slurm keeps job names short in squeue's columns; the cell id is in the script's comment.
JOB_NAME_PATTERN = re.compile(r"[^A-Za-z0-9._-]+")


def job_name(cell_id: str) -> str:
    """`gpubench-<cell id>` with every character squeue would garble replaced by '_'."""
    return "gpubench-" + JOB_NAME_PATTERN.sub("_", cell_id)[:80]


def sbatch_options(node: SlurmNode, *, name: str, log_path: str) -> list[str]:
    """The job's options, in sbatch's long form, from the node's keys."""
    options = [f"--job-name={name}", f"--output={log_path}", "--ntasks=1", "--nodes=1"]
    for flag, value in (
        ("--partition", node.partition),
        ("--gres", node.gres),
        ("--time", node.time_limit),
        ("--account", node.account),
        ("--constraint", node.constraint),
        ("--qos", node.qos),
        ("--cpus-per-task", node.cpus_per_task),
        ("--mem", node.mem),
    ):
        if value is not None:
            options.append(f"{flag}={value}")
    options.extend(node.sbatch_args)
    return options


def engine_command(node: SlurmNode, argv: Sequence[str]) -> list[str]:
    """The argv the job runs: the engine itself, or inside the node's container image."""
    if node.container is None:
        return list(argv)
    # --nv binds the host's NVIDIA driver and devices into the container.
    return [node.container_runtime, "exec", "--nv", *node.container_args, node.container, *argv]


def job_script(
    node: SlurmNode, argv: Sequence[str], *, cell_label: str, name: str, log_path: str
) -> str:
    """A POSIX sh batch script: #SBATCH lines, then `exec` of the engine, so that scancel's
    signal reaches the engine itself. Every word is shell-quoted: no value is interpreted."""
    lines = ["#!/bin/sh", f"# pytest-gpubench: managed engine of {_one_line(cell_label)}"]
    lines.extend(
        f"#SBATCH {shlex.quote(option)}"
        for option in sbatch_options(node, name=name, log_path=log_path)
    )
    # The job's own environment (its PATH, modules loaded by sbatch_args or the site), for the
    # steps that run inside the allocation later (srun --overlap: GPU checks, telemetry); only
    # its owner may read it.
    lines.append(f"(umask 077; export -p > {shlex.quote(job_env_path(log_path))})")
    lines.append(f"exec {shlex.join(engine_command(node, argv))}")
    return "\n".join(lines) + "\n"


def job_env_path(log_path: str) -> str:
    """Where a job writes its environment: beside its log, in the shared work_dir."""
    return log_path.rsplit(".", 1)[0] + ".env"


# Runs argv in a step of the job with the job's environment (written at its start).
IN_JOB_SCRIPT = '[ -r "$0" ] && . "$0"; exec "$@"'


def in_job_argv(job_id: str, env_path: str, argv: Sequence[str]) -> list[str]:
    """argv inside the running job's allocation (its node, its GPUs, its environment)."""
    return [
        "srun", f"--jobid={job_id}", "--overlap", "--ntasks=1", "--quiet",
        "sh", "-c", IN_JOB_SCRIPT, env_path, *argv,
    ]  # fmt: skip


def _one_line(text: str) -> str:
    return " ".join(text.split())
