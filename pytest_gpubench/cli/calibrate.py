"""`gpubench calibrate`: measure the unchanged matrix R times in a row (an A/A run), each run
ratified with --baseline-update, so that every baseline's history holds R runs and the gate
knows how far an unchanged engine moves between runs; then the noise floor per figure."""

from __future__ import annotations

import math
import secrets
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.provenance import git_state
from pytest_gpubench.core.status import describe
from pytest_gpubench.results.baseline import read_baselines
from pytest_gpubench.results.decision import (
    ALPHA,
    MIN_HISTORY,
    Evidence,
    between_run_spread,
    could_detect,
    detectable_log_change,
)
from pytest_gpubench.results.metric import RATIO_METRICS
from pytest_gpubench.results.run_history import figures

CALIBRATION_OPTION = "--gpubench-calibration"


def calibrate(repeat: int, pytest_args: Sequence[str], baselines_dir: Path) -> int:
    """Run pytest --baseline-update `repeat` times; stop at the first run that fails. Returns
    the failed run's exit status, or 0 after printing the noise floor."""
    if repeat < 1:
        raise GpubenchError(f"--repeat must be at least 1, got {repeat}")
    clean = not git_state(Path.cwd())["git_dirty"]
    # The runs are one calibration: none is read as a ratified step from the one before it,
    # however far the engine moved between them (that spread is what they measure).
    named = any(arg.startswith(CALIBRATION_OPTION) for arg in pytest_args)
    calibration = () if named else (f"{CALIBRATION_OPTION}={calibration_name()}",)
    for index in range(repeat):
        argv = [sys.executable, "-m", "pytest", "--baseline-update", *calibration, *pytest_args]
        # Run 1 ratified baselines that are not committed yet: the tree is dirty by calibrate's
        # own doing, which the dirty-tree guard would refuse run 2 for. Only then let it run.
        if index > 0 and clean and _dirty_only_in(baselines_dir):
            argv.append("--gpubench-allow-dirty")
        print(f"gpubench calibrate: run {index + 1} of {repeat}: {' '.join(argv[1:])}", flush=True)
        status = subprocess.run(argv, check=False).returncode
        if status != 0:
            print(f"gpubench calibrate: run {index + 1} failed: {describe(status)}")
            return status
    print(noise_floor_text(baselines_dir))
    return 0


def calibration_name() -> str:
    """A name no other calibration of this baselines folder has: when it started, to the
    second, and a few random letters."""
    return f"calibrate-{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def _dirty_only_in(baselines_dir: Path) -> bool:
    """Whether every uncommitted file of the git tree here is under `baselines_dir`."""
    top = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if not top:
        return False
    inside = baselines_dir.resolve()
    dirty = [
        (Path(top) / name.strip('"')).resolve() for name in git_state(Path.cwd())["git_dirty_files"]
    ]
    return bool(dirty) and all(path == inside or inside in path.parents for path in dirty)


def noise_floor_text(baselines_dir: Path) -> str:
    """Per (cell, prompt, figure): the runs of history, the between-run spread and the smallest
    change the gate can detect against it (or why it cannot say yet)."""
    lines = [f"noise floor from {baselines_dir} (one-sided test at {ALPHA}, 80 % power):"]
    for baseline in read_baselines(baselines_dir):
        for summary in baseline.prompts:
            runs = baseline.runs(summary.prompt_id)
            for metric in RATIO_METRICS:
                values = figures(runs, metric.name)
                where = f"  {baseline.cell_id} {summary.prompt_id} {metric.label}:"
                spread = between_run_spread(values)
                if spread is None:
                    lines.append(
                        f"{where} {len(values)} run(s) of history: noise floor still unknown "
                        f"(needs {MIN_HISTORY}; calibrate with --repeat {MIN_HISTORY} or more)"
                    )
                    continue
                change, _, _ = detectable_log_change(
                    Evidence(metric.label, metric.higher_is_better, 0.0, 1.0, 1.0, history=values)
                )
                detect = could_detect(
                    metric.label,
                    math.exp(-change if metric.higher_is_better else change),
                    metric.higher_is_better,
                )
                lines.append(
                    f"{where} {len(values)} runs, between-run spread ±{math.expm1(spread):.1%}; "
                    f"{detect}"
                )
    return "\n".join(lines)
