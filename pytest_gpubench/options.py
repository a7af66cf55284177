"""Command-line options and ini keys, read once into frozen `Options`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

CELLS_DESC = "the cell matrix file (default: cells.yaml at the rootdir)"
PROMPTS_DESC = "the frozen prompts file (default: prompts.yaml at the rootdir)"
BASELINES_DESC = "directory of committed baselines (default: baselines/ at the rootdir)"
LEDGER_DIR_DESC = "directory the JSONL ledgers are written to (default: runs/ at the rootdir)"
RUNS_DESC = "warm runs per (cell, prompt); raise it (e.g. 20) when investigating a regression"
LOAD_DESC = "refuse to start when the 1-minute load average is above this (default: 4.0)"
ENV_DESC = (
    "environment variables recorded in the ledger's meta record (secret-looking ones redacted)"
)

DEFAULT_LOAD_THRESHOLD = 4.0


def addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpubench", "LLM inference benchmarks")
    group.addoption("--gpubench-cells", metavar="PATH", help=CELLS_DESC)
    group.addoption("--gpubench-prompts", metavar="PATH", help=PROMPTS_DESC)
    group.addoption("--gpubench-baselines", metavar="DIR", help=BASELINES_DESC)
    group.addoption("--gpubench-ledger-dir", metavar="DIR", help=LEDGER_DIR_DESC)
    group.addoption("--gpubench-runs", metavar="N", type=int, help=RUNS_DESC)
    group.addoption(
        "--baseline-update", action="store_true", help="write baselines/ from this run's numbers"
    )
    group.addoption(
        "--gpubench-accept-incomparable",
        action="store_true",
        dest="gpubench_accept_incomparable",
        help="judge against baselines measured on another engine version, model or GPU "
        "(otherwise their cells are `incomparable` and the session exits 8)",
    )
    group.addoption(
        "--allow-dirty", action="store_true", help="run even when the git tree has local changes"
    )
    group.addoption(
        "--force-load", action="store_true", help="run even when the machine is already loaded"
    )
    group.addoption(
        "--for-publication",
        action="store_true",
        help="fail the session when any cell fails its health check",
    )
    group.addoption(
        "--probe", action="store_true", help="health-check every cell, print a table, and exit"
    )
    group.addoption(
        "--smoke", action="store_true", help="run one cell, one prompt, one run (a quick check)"
    )
    parser.addini("gpubench_cells", CELLS_DESC)
    parser.addini("gpubench_prompts", PROMPTS_DESC)
    parser.addini("gpubench_baselines", BASELINES_DESC)
    parser.addini("gpubench_ledger_dir", LEDGER_DIR_DESC)
    parser.addini("gpubench_runs", RUNS_DESC)
    parser.addini("gpubench_load_threshold", LOAD_DESC, default=str(DEFAULT_LOAD_THRESHOLD))
    parser.addini("gpubench_env", ENV_DESC, type="args", default=[])


def _path(config: pytest.Config, option: str, ini: str, default: str) -> tuple[Path, bool]:
    """The path and whether the user named it (a named file that is missing is an error)."""
    value = config.getoption(option) or config.getini(ini)
    if value:
        path = Path(str(value)).expanduser()
        return (path if path.is_absolute() else Path.cwd() / path), True
    return config.rootpath / default, False


@dataclass(frozen=True)
class Options:
    cells_path: Path
    prompts_path: Path
    cells_named: bool
    baselines_dir: Path
    ledger_dir: Path
    runs: int | None
    baseline_update: bool
    allow_dirty: bool
    force_load: bool
    load_threshold: float
    for_publication: bool
    probe: bool
    smoke: bool
    env_names: tuple[str, ...]
    accept_incomparable: bool = False

    @classmethod
    def from_config(cls, config: pytest.Config) -> Options:
        cells_path, cells_named = _path(config, "gpubench_cells", "gpubench_cells", "cells.yaml")
        prompts_path, _ = _path(config, "gpubench_prompts", "gpubench_prompts", "prompts.yaml")
        baselines_dir, _ = _path(config, "gpubench_baselines", "gpubench_baselines", "baselines")
        ledger_dir, _ = _path(config, "gpubench_ledger_dir", "gpubench_ledger_dir", "runs")
        # `is None`, not `or`: --gpubench-runs 0 is a mistake to report, not "unset".
        runs_option = config.getoption("gpubench_runs")
        runs_source = "--gpubench-runs" if runs_option is not None else "ini gpubench_runs"
        runs_value = runs_option if runs_option is not None else config.getini("gpubench_runs")
        try:
            runs = int(runs_value) if runs_value not in (None, "") else None
            load_threshold = float(config.getini("gpubench_load_threshold"))
        except ValueError as exc:
            raise pytest.UsageError(
                f"gpubench: bad number in an option or ini key: {exc}"
            ) from None
        if runs is not None and runs < 1:
            raise pytest.UsageError(f"{runs_source}: must be at least 1 (got {runs})")
        return cls(
            cells_path=cells_path,
            prompts_path=prompts_path,
            cells_named=cells_named,
            baselines_dir=baselines_dir,
            ledger_dir=ledger_dir,
            runs=runs,
            baseline_update=bool(config.getoption("baseline_update")),
            allow_dirty=bool(config.getoption("allow_dirty")),
            force_load=bool(config.getoption("force_load")),
            load_threshold=load_threshold,
            for_publication=bool(config.getoption("for_publication")),
            probe=bool(config.getoption("probe")),
            smoke=bool(config.getoption("smoke")),
            env_names=tuple(config.getini("gpubench_env")),
            accept_incomparable=bool(config.getoption("gpubench_accept_incomparable")),
        )
