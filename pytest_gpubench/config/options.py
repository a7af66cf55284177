"""Command-line options and ini keys, read once into frozen `Options`.

Every option is `--gpubench-…` with its own `gpubench_…` dest. The design's short names
(`--baseline-update`, `--allow-dirty`, `--force-load`, `--for-publication`, `--probe`, `--smoke`)
are aliases added only once every initial conftest has registered its options, and only where
nothing else has taken the name: another plugin's or conftest's `--smoke` wins, and ours stays
reachable as `--gpubench-smoke`.

Paths: cells, prompts, baselines and runs resolve against one anchor, the ini file's directory,
else the git root of the invocation directory, else pytest's rootdir. A relative path given on the
command line resolves against the invocation directory, one given in the ini file against the ini
file's directory.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_gpubench.core.errors import GpubenchError

if TYPE_CHECKING:
    from pytest_gpubench.config.shards import Shard

CELLS_DESC = "the cell matrix file (default: cells.yaml at the project anchor, see docs/options.md)"
PROMPTS_DESC = "the frozen prompts file (default: prompts.yaml at the project anchor)"
BASELINES_DESC = "directory of committed baselines (default: baselines/ at the project anchor)"
LEDGER_DIR_DESC = "directory the JSONL ledgers go to (default: runs/ at the project anchor)"
RUNS_DESC = "warm runs per (cell, prompt); raise it (e.g. 20) when investigating a regression"
# Seconds of warm calls a (cell, prompt) whose gated figure is still undecided after its planned
# runs may take past them, by default (run/sample_on.py); its runs past them default to as many
# again as were planned: a session takes at most twice its warm calls.
DEFAULT_SAMPLE_ON_SECONDS = 120.0
# The runs a first --baseline-update measures each (cell, prompt) in, by default: one, as before
# issue 43. Three (the gate's MIN_HISTORY) give a between-run spread from the first update; the
# default stays one until the suite and the noise table are measured with three.
DEFAULT_BASELINE_RUNS = 1
CALIBRATION_DESC = (
    "mark this --baseline-update as one run of the calibration NAME: runs of one calibration "
    "measure an unchanged setup's spread between runs, and none is read as a ratified step "
    "from the one before it (`gpubench calibrate` names its runs so)"
)
BASELINE_RUNS_DESC = (
    "runs a --baseline-update measures a (cell, prompt) with no history yet in, a managed "
    "engine started again between them, an endpoint's spaced apart, so that the baseline knows "
    f"the spread between runs from its first update (3 does; default {DEFAULT_BASELINE_RUNS})"
)
SAMPLE_ON_RUNS_DESC = (
    "warm calls a (cell, prompt) whose gated figure the planned runs left blind or "
    "inconclusive may take past them, until decided; an A/B candidate's are pairs (default: as "
    "many again as planned; 0: none)"
)
SAMPLE_ON_SECONDS_DESC = (
    f"seconds of such calls per (cell, prompt) (default: {DEFAULT_SAMPLE_ON_SECONDS:g})"
)
LOAD_DESC = "refuse to start when the 1-minute load average is above this (default: 4.0)"
ENV_DESC = (
    "environment variables recorded in the ledger's meta record (secret-looking ones redacted)"
)
SHARD_DESC = (
    "run shard i of N (0 <= i < N): a deterministic share of the matrix's nodes with all their "
    "cells, for a Slurm job array (gpubench slurm submit)"
)
SKIP_DESC = "deselect every benchmark case: run a repository's other tests only (no guards)"
STEADINESS_DESC = (
    "`check` (default): time a control call before each warm call and read the CPU pressure "
    "during each warm call and load point, and call a verdict `unsteady` when the machine moved; "
    "`off`: neither (verdicts are never unsteady)"
)
STEADINESS_CHOICES = ("check", "off")

DEFAULT_LOAD_THRESHOLD = 4.0


@dataclass(frozen=True)
class Flag:
    """A switch: its `--gpubench-` name, the design's short alias, and what it does."""

    name: str
    alias: str
    help: str

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


FLAGS = (
    Flag("--gpubench-baseline-update", "--baseline-update", "write baselines/ from this run"),
    Flag(
        "--gpubench-allow-dirty",
        "--allow-dirty",
        "run even when the git tree has local changes",
    ),
    Flag(
        "--gpubench-force-load",
        "--force-load",
        "run even when the machine is already loaded",
    ),
    Flag(
        "--gpubench-for-publication",
        "--for-publication",
        "fail the session when any cell fails its health check",
    ),
    Flag("--gpubench-probe", "--probe", "health-check every cell, print a table, and exit"),
    Flag("--gpubench-smoke", "--smoke", "run one cell, one prompt, one run (a quick check)"),
)
GROUP = "gpubench"


def addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(GROUP, "LLM inference benchmarks")
    group.addoption("--gpubench-cells", metavar="PATH", help=CELLS_DESC)
    group.addoption("--gpubench-prompts", metavar="PATH", help=PROMPTS_DESC)
    group.addoption("--gpubench-baselines", metavar="DIR", help=BASELINES_DESC)
    group.addoption("--gpubench-ledger-dir", metavar="DIR", help=LEDGER_DIR_DESC)
    group.addoption("--gpubench-runs", metavar="N", type=int, help=RUNS_DESC)
    for flag in FLAGS:
        group.addoption(flag.name, action="store_true", dest=flag.dest, help=flag.help)
    group.addoption("--gpubench-shard", metavar="i/N", help=SHARD_DESC)
    group.addoption("--gpubench-skip", action="store_true", dest="gpubench_skip", help=SKIP_DESC)
    group.addoption(
        "--gpubench-accept-incomparable",
        action="store_true",
        dest="gpubench_accept_incomparable",
        help="judge against baselines measured on another engine version, model or GPU "
        "(otherwise their cells are `incomparable` and the session exits 8)",
    )
    group.addoption(
        "--gpubench-sample-on-runs",
        metavar="N",
        type=int,
        dest="gpubench_sample_on_runs",
        help=SAMPLE_ON_RUNS_DESC,
    )
    group.addoption(
        "--gpubench-sample-on-seconds",
        metavar="S",
        type=float,
        dest="gpubench_sample_on_seconds",
        help=SAMPLE_ON_SECONDS_DESC,
    )
    group.addoption(
        "--gpubench-baseline-runs",
        metavar="K",
        type=int,
        dest="gpubench_baseline_runs",
        help=BASELINE_RUNS_DESC,
    )
    group.addoption(
        "--gpubench-calibration",
        metavar="NAME",
        dest="gpubench_calibration",
        help=CALIBRATION_DESC,
    )
    group.addoption(
        "--gpubench-ab-seed",
        metavar="N",
        type=int,
        help="seed of the A/B pairs' call order (default: drawn from the run id; the ledger's "
        "meta record keeps it, so a session's order can be repeated)",
    )
    group.addoption(
        "--gpubench-steadiness",
        choices=STEADINESS_CHOICES,
        dest="gpubench_steadiness",
        help=STEADINESS_DESC,
    )
    parser.addini("gpubench_steadiness", STEADINESS_DESC, default="check")
    parser.addini("gpubench_cells", CELLS_DESC)
    parser.addini("gpubench_prompts", PROMPTS_DESC)
    parser.addini("gpubench_baselines", BASELINES_DESC)
    parser.addini("gpubench_ledger_dir", LEDGER_DIR_DESC)
    parser.addini("gpubench_runs", RUNS_DESC)
    parser.addini("gpubench_load_threshold", LOAD_DESC, default=str(DEFAULT_LOAD_THRESHOLD))
    parser.addini("gpubench_env", ENV_DESC, type="args", default=[])


def add_aliases(parser: pytest.Parser) -> tuple[str, ...]:
    """Add each short alias that nothing else has registered; the aliases left to others.

    Called once the initial conftests have added their options (they run after the installed
    plugins), so a conftest's own `--smoke` is registered first and keeps its meaning."""
    group = parser.getgroup(GROUP)
    taken: list[str] = []
    for flag in FLAGS:
        try:
            group.addoption(
                flag.alias, action="store_true", dest=flag.dest, help=f"same as {flag.name}"
            )
        except (argparse.ArgumentError, ValueError):
            # argparse refuses a second `--smoke` before changing anything: the name is theirs.
            taken.append(flag.alias)
    return tuple(taken)


def find_anchor(config: pytest.Config) -> tuple[Path, str]:
    """The directory default paths resolve against, and what it is (for messages)."""
    if config.inipath is not None:
        return config.inipath.parent, f"the directory of {config.inipath.name}"
    git_root = _git_root(config.invocation_params.dir)
    if git_root is not None:
        return git_root, "the git root"
    return config.rootpath, "pytest's rootdir"


def _git_root(start: Path) -> Path | None:
    """The nearest directory at or above `start` holding `.git` (a directory, or a file in a
    worktree or submodule); no git needed."""
    for directory in (start, *start.parents):
        if (directory / ".git").exists():
            return directory
    return None


@dataclass(frozen=True)
class _PathOption:
    """A path option: its dest, which is also its ini key, and its default under the anchor."""

    key: str
    default: str

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


_CELLS = _PathOption("gpubench_cells", "cells.yaml")
_PROMPTS = _PathOption("gpubench_prompts", "prompts.yaml")
_BASELINES = _PathOption("gpubench_baselines", "baselines")
_LEDGER_DIR = _PathOption("gpubench_ledger_dir", "runs")


PATH_OPTIONS = (_CELLS, _PROMPTS, _BASELINES, _LEDGER_DIR)


def option_warnings(config: pytest.Config, taken_aliases: tuple[str, ...]) -> list[str]:
    """What the user should know about how pytest read their gpubench options."""
    args = [str(arg) for arg in config.invocation_params.args]
    warnings = [
        f"{flag.alias} is another plugin's or conftest's option here, not gpubench's; "
        f"use {flag.name}"
        for flag in FLAGS
        if flag.alias in taken_aliases and flag.alias in args
    ]
    if config.inipath is None:
        # pytest looks for its ini file before any plugin is loaded: in `--gpubench-baselines
        # /abs/dir` it took the value for a test path (and may have missed the ini file).
        flags = {spec.flag for spec in PATH_OPTIONS}
        warnings.extend(
            f"pytest found no ini file: it took the value of {flag} for a test path while "
            f"looking for one (its rootdir is now {config.rootpath}); write {flag}={value} to "
            "keep its ini file and rootdir"
            for flag, value in itertools.pairwise(args)
            if flag in flags
        )
    return warnings


def _path(config: pytest.Config, spec: _PathOption, anchor: Path) -> tuple[Path, bool]:
    """The path and whether the user named it (a named file that is missing is an error)."""
    given = config.getoption(spec.key)
    if given:
        base, value = config.invocation_params.dir, str(given)
    else:
        ini_value = config.getini(spec.key)
        if not ini_value:
            return anchor / spec.default, False
        base = config.inipath.parent if config.inipath is not None else anchor
        value = str(ini_value)
    path = Path(value).expanduser()
    return (path if path.is_absolute() else base / path), True


def _not_a_directory(path: Path, what: str, source: str) -> None:
    if path.exists() and not path.is_dir():
        raise pytest.UsageError(f"{path}: {what} must be a directory, not a file ({source})")


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
    # Deselect every benchmark case (the matrix is then not even read).
    skip: bool = False
    # Where default paths resolve, and what that directory is ("the git root", ...).
    anchor: Path = Path()
    anchor_kind: str = "pytest's rootdir"
    # Judge against baselines measured on another setup (--gpubench-accept-incomparable).
    accept_incomparable: bool = False
    # Run only this shard of the matrix (--gpubench-shard i/N).
    shard: Shard | None = None
    # The seed of the A/B pairs' call order (--gpubench-ab-seed); None: drawn from the run id.
    ab_seed: int | None = None
    # Whether the machine's steadiness is checked beside each warm call (--gpubench-steadiness).
    steadiness: bool = True
    # An undecided figure's budget past the planned runs, per (cell, prompt): its runs (None: as
    # many again as were planned; 0: none) and seconds (--gpubench-sample-on-runs, -seconds).
    sample_on_runs: int | None = None
    sample_on_seconds: float = DEFAULT_SAMPLE_ON_SECONDS
    # The runs a first --baseline-update measures a (cell, prompt) in (--gpubench-baseline-runs).
    baseline_runs: int = DEFAULT_BASELINE_RUNS
    # The calibration this --baseline-update is a run of (--gpubench-calibration).
    calibration: str | None = None

    @classmethod
    def from_config(cls, config: pytest.Config) -> Options:
        anchor, anchor_kind = find_anchor(config)
        cells_path, cells_named = _path(config, _CELLS, anchor)
        prompts_path, _ = _path(config, _PROMPTS, anchor)
        baselines_dir, baselines_named = _path(config, _BASELINES, anchor)
        ledger_dir, ledger_named = _path(config, _LEDGER_DIR, anchor)
        _not_a_directory(
            baselines_dir, "the baselines", _BASELINES.flag if baselines_named else "default"
        )
        _not_a_directory(
            ledger_dir, "the ledger directory", _LEDGER_DIR.flag if ledger_named else "default"
        )
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
        steadiness = config.getoption("gpubench_steadiness") or config.getini("gpubench_steadiness")
        if steadiness not in STEADINESS_CHOICES:
            raise pytest.UsageError(
                f"ini gpubench_steadiness: must be one of {', '.join(STEADINESS_CHOICES)} "
                f"(got {steadiness!r})"
            )
        sample_on_runs = config.getoption("gpubench_sample_on_runs")
        sample_on_seconds = config.getoption("gpubench_sample_on_seconds")
        if sample_on_runs is not None and sample_on_runs < 0:
            raise pytest.UsageError(
                f"--gpubench-sample-on-runs: must be 0 or more (got {sample_on_runs})"
            )
        if sample_on_seconds is not None and not sample_on_seconds >= 0:
            raise pytest.UsageError(
                f"--gpubench-sample-on-seconds: must be 0 or more (got {sample_on_seconds})"
            )
        baseline_runs = config.getoption("gpubench_baseline_runs")
        if baseline_runs is not None and baseline_runs < 1:
            raise pytest.UsageError(
                f"--gpubench-baseline-runs: must be at least 1 (got {baseline_runs})"
            )
        shard_text = config.getoption("gpubench_shard")
        shard = None
        if shard_text:
            # Only a sharded session (a job array's task) reads its share.
            from pytest_gpubench.config.shards import Shard

            try:
                shard = Shard.parse(shard_text)
            except GpubenchError as exc:
                raise pytest.UsageError(str(exc)) from None
        return cls(
            cells_path=cells_path,
            prompts_path=prompts_path,
            cells_named=cells_named,
            baselines_dir=baselines_dir,
            ledger_dir=ledger_dir,
            runs=runs,
            baseline_update=bool(config.getoption("gpubench_baseline_update")),
            allow_dirty=bool(config.getoption("gpubench_allow_dirty")),
            force_load=bool(config.getoption("gpubench_force_load")),
            load_threshold=load_threshold,
            for_publication=bool(config.getoption("gpubench_for_publication")),
            probe=bool(config.getoption("gpubench_probe")),
            smoke=bool(config.getoption("gpubench_smoke")),
            env_names=tuple(config.getini("gpubench_env")),
            skip=bool(config.getoption("gpubench_skip")),
            anchor=anchor,
            anchor_kind=anchor_kind,
            accept_incomparable=bool(config.getoption("gpubench_accept_incomparable")),
            shard=shard,
            ab_seed=config.getoption("gpubench_ab_seed"),
            steadiness=steadiness == "check",
            baseline_runs=DEFAULT_BASELINE_RUNS if baseline_runs is None else baseline_runs,
            calibration=config.getoption("gpubench_calibration") or None,
            sample_on_runs=sample_on_runs,
            sample_on_seconds=(
                DEFAULT_SAMPLE_ON_SECONDS if sample_on_seconds is None else sample_on_seconds
            ),
        )
