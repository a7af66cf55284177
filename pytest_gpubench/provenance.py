"""Where the numbers came from: git state, host, load, versions and environment for `meta`."""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pytest_gpubench import HARNESS_VERSION, __version__

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
REDACTED = "[REDACTED]"
# Recorded by default: they change what the numbers mean.
DEFAULT_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "OLLAMA_NUM_PARALLEL",
    "OLLAMA_FLASH_ATTENTION",
    "OMP_NUM_THREADS",
    "GPUBENCH_LLAMA_SERVER",
    "CI",
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


def git_state(root: Path) -> dict[str, Any]:
    """sha, dirty flag and the dirty files (ledgers the run itself writes are not 'dirty')."""
    sha = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=normal")
    dirty_files = [line[3:] for line in (status or "").splitlines() if line.strip()]
    return {
        "git_sha": sha.strip() if sha else None,
        "git_dirty": bool(dirty_files),
        "git_dirty_files": dirty_files,
    }


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    """Values of environment variables whose names look secret: never written anywhere."""
    environ = dict(os.environ) if environ is None else environ
    return [value for name, value in environ.items() if SECRET_NAME.search(name) and value]


def chosen_environment(names: tuple[str, ...]) -> dict[str, str]:
    chosen = {}
    for name in sorted(set(DEFAULT_ENV) | set(names)):
        if name in os.environ:
            chosen[name] = REDACTED if SECRET_NAME.search(name) else os.environ[name]
    return chosen


def meta_record(
    *,
    run_id: str,
    root: Path,
    git: dict[str, Any],
    env_names: tuple[str, ...],
    cells_planned: list[str],
    cases_planned: int,
    argv: list[str],
    cells_path: Path,
    prompts_path: Path,
) -> dict[str, Any]:
    return {
        "type": "meta",
        "benchmark_run_id": run_id,
        **git,
        "harness_version": HARNESS_VERSION,
        "started_at_utc": utc_now(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "load_avg_start": load_average(),
        "env": chosen_environment(env_names),
        "cells_planned": cells_planned,
        "cases_planned": cases_planned,
        "python_version": platform.python_version(),
        "pytest_version": pytest.__version__,
        "plugin_version": __version__,
        "command_line": [sys.argv[0], *argv],
        "rootdir": str(root),
        "cells_file": str(cells_path),
        "prompts_file": str(prompts_path),
    }
