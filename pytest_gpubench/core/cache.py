"""Where the harness keeps what it builds or generates once per machine (engine, tiny model)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "GPUBENCH_CACHE_DIR"


def cache_dir() -> Path:
    """`$GPUBENCH_CACHE_DIR` when set, else `~/.cache/pytest-gpubench` (not created here)."""
    configured = os.environ.get(CACHE_DIR_ENV, "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "pytest-gpubench"
