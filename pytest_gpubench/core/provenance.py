"""Where the numbers came from: git state, load average, the clock and the chosen environment."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TypedDict

from pytest_gpubench.core.secrets import REDACTED, SECRET_NAME

# Recorded by default: they change what the numbers mean.
DEFAULT_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "OLLAMA_NUM_PARALLEL",
    "OLLAMA_FLASH_ATTENTION",
    "OMP_NUM_THREADS",
    "GPUBENCH_LLAMA_SERVER",
    "CI",
)


# What `git status` looks at: the whole repository (wherever the run starts in it) but Python's
# bytecode caches, which the run's own imports of the benchmarks and their conftest write beside
# them in a repository that does not ignore them (a fresh `gpubench init` one): never an input.
NOT_INPUTS = (
    ":(top)",
    ":(top,exclude,glob)**/__pycache__/**",
    ":(top,exclude,glob)**/*.py[co]",
)


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def load_average() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


class GitState(TypedDict):
    """The code a run measured: the meta record's git fields."""

    git_sha: str | None
    git_dirty: bool
    git_dirty_files: list[str]


def git_state(root: Path) -> GitState:
    """sha, dirty flag and the dirty files (ledgers the run itself writes are not 'dirty')."""
    sha = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=normal", "--", *NOT_INPUTS)
    dirty_files = [line[3:] for line in (status or "").splitlines() if line.strip()]
    return {
        "git_sha": sha.strip() if sha else None,
        "git_dirty": bool(dirty_files),
        "git_dirty_files": dirty_files,
    }


def chosen_environment(names: Sequence[str]) -> dict[str, str]:
    """The default variables and the named ones that are set; secret-looking values redacted."""
    chosen = {}
    for name in sorted(set(DEFAULT_ENV) | set(names)):
        if name in os.environ:
            chosen[name] = REDACTED if SECRET_NAME.search(name) else os.environ[name]
    return chosen
