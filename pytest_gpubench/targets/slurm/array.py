"""The Slurm job array that spreads a matrix: one task per shard, each writing its ledger to a
shared folder (`gpubench slurm submit`)."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pytest_gpubench.config.shards import node_groups
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.targets.slurm.commands import parse_job_id

ARRAY_JOB_NAME = "gpubench-array"


@dataclass(frozen=True)
class ArraySpec:
    """What each task runs and where: the project, its pytest arguments, the shared folder."""

    shards: int
    root: Path
    ledger_dir: Path
    python: str
    pytest_args: tuple[str, ...] = ()
    # sbatch options of every task, in long form ("--partition=gpu", "--gres=gpu:1").
    sbatch_options: tuple[str, ...] = ()


def ledger_folder(ledger_dir: Path, array_job_id: str) -> Path:
    """Where the tasks of one array write their ledgers: one folder per run."""
    return ledger_dir / f"array-{array_job_id}"


def array_script(spec: ArraySpec) -> str:
    """A POSIX sh batch script: task i runs `pytest ... --gpubench-shard i/N` in the project
    and writes its ledger under LEDGER_DIR/array-<array job id>/."""
    if spec.shards < 1:
        raise GpubenchError("slurm submit: --shards must be at least 1")
    options = [
        f"--job-name={ARRAY_JOB_NAME}",
        f"--array=0-{spec.shards - 1}",
        f"--output={spec.ledger_dir / 'logs' / 'array-%A_%a.out'}",
        "--ntasks=1",
        "--nodes=1",
        *spec.sbatch_options,
    ]
    pytest_command = shlex.join([spec.python, "-m", "pytest", *spec.pytest_args])
    folder = shlex.quote(str(spec.ledger_dir)) + '/array-"$SLURM_ARRAY_JOB_ID"'
    lines = [
        "#!/bin/sh",
        f"# pytest-gpubench: {spec.shards} shards of the matrix of {spec.root}",
        *(f"#SBATCH {shlex.quote(option)}" for option in options),
        "set -eu",
        f"cd {shlex.quote(str(spec.root))}",
        f"exec {pytest_command} "
        f'--gpubench-shard "$SLURM_ARRAY_TASK_ID/{spec.shards}" '
        f"--gpubench-ledger-dir={folder}",
    ]
    return "\n".join(lines) + "\n"


def submit(script_path: Path, *, env: dict[str, str] | None = None) -> str:
    """sbatch --parsable the script on this machine (a login node); the array's job id."""
    try:
        done = subprocess.run(
            ["sbatch", "--parsable", str(script_path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=env,
        )
    except FileNotFoundError:
        raise GpubenchError("slurm submit: sbatch not found: run this on a login node") from None
    job_id = parse_job_id(done.stdout)
    if done.returncode != 0 or job_id is None:
        why = (done.stderr or done.stdout).strip()[-500:]
        raise GpubenchError(f"slurm submit: sbatch refused {script_path}: {why}")
    return job_id


def default_shards(cells_path: Path, prompts_path: Path) -> int:
    """One shard per node group of the matrix (the most it can be split into)."""
    from pytest_gpubench.config.matrix import read_matrix

    if not cells_path.exists():
        raise GpubenchError(f"slurm submit: {cells_path} not found (--root, --cells)")
    return len(node_groups(read_matrix(cells_path, prompts_path).cells))


def next_steps(job_id: str, spec: ArraySpec, baselines: Path | None) -> Sequence[str]:
    folder = ledger_folder(spec.ledger_dir, job_id)
    merged = spec.ledger_dir / f"merged-{job_id}.jsonl"
    # The merged end record is judged as the gate judges it: against the same baselines.
    against = [] if baselines is None else ["--baselines", str(baselines)]
    merge = ["gpubench", "merge", "-o", str(merged), *against]
    return [
        f"submitted job array {job_id}: {spec.shards} tasks, ledgers in {folder}/",
        "when every task has ended:",
        "  " + shlex.join(merge) + f" {folder}/*.jsonl",
        "  " + shlex.join(["gpubench", "gate", str(merged), *against]),
    ]
