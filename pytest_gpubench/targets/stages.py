"""The stages of bringing up a node and benchmarking on it: each timed against its own timeout
and the node's total budget, each outcome reported; a failure names its stage."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, get_args

from pytest_gpubench.config.nodes import StageName
from pytest_gpubench.core.errors import GpubenchError

# The stage names, in the order a rented node goes through them (matrix.StageName: cells.yaml's
# stage_timeouts keys).
Stage = StageName
STAGES: tuple[Stage, ...] = get_args(StageName)


class StageError(GpubenchError):
    """A remote node failed in one stage; `stage` says which, the message says why."""

    timed_out = False

    def __init__(self, stage: Stage, message: str, *, timed_out: bool = False) -> None:
        super().__init__(f"[{stage}] {message}")
        self.stage: Stage = stage
        self.message = message
        # The stage ran past its timeout (rather than failing of itself).
        self.timed_out = timed_out

    def __reduce__(self) -> Any:
        # xdist and multiprocessing pickle exceptions; the default would call __init__ with the
        # formatted text as the only argument.
        return _rebuild_stage_error, (type(self), self.stage, self.message, self.timed_out)


def _rebuild_stage_error(
    kind: type[StageError], stage: Stage, message: str, timed_out: bool
) -> StageError:
    return kind(stage, message, timed_out=timed_out)


@dataclass(frozen=True)
class SetupStep:
    """One shell command of a node's setup (install the engine, pull a model), run with sh -c."""

    stage: Stage
    command: str

    def label(self) -> str:
        """How errors name the step: its program only, since arguments may carry tokens."""
        words = self.command.split()
        return words[0] if words else "(empty)"


Outcome = Literal["ok", "failed", "timeout", "skipped"]


class StageFacts(TypedDict):
    """How a stage ended, as its `stage` record says (ledger/schema.py StageRecord)."""

    node: str
    cell_id: str | None
    stage: Stage
    outcome: Outcome
    elapsed_s: float
    timeout_s: float | None
    error: str | None
    details: dict[str, Any] | None


@dataclass(frozen=True)
class StageOutcome:
    """How one stage ended on a node (for one cell, where the stage is a cell's): `ok`,
    `failed`, `timeout` or `skipped` (it could not be done: `error` says why), after
    `elapsed_s`, against `timeout_s` (None: no limit of its own)."""

    node: str
    stage: Stage
    outcome: Outcome
    elapsed_s: float
    timeout_s: float | None
    error: str | None = None
    cell_id: str | None = None
    # What the stage found on the way (a model pull's progress).
    details: Mapping[str, Any] | None = None

    def to_facts(self) -> StageFacts:
        return {
            "node": self.node,
            "cell_id": self.cell_id,
            "stage": self.stage,
            "outcome": self.outcome,
            "elapsed_s": round(self.elapsed_s, 3),
            "timeout_s": self.timeout_s,
            "error": self.error,
            "details": dict(self.details) if self.details is not None else None,
        }


# Told each stage's outcome as it ends (the harness turns them into `stage` records).
StageReport = Callable[[StageOutcome], None]


def ignore_stage(outcome: StageOutcome) -> None:
    """A StageReport for callers that keep no stage records."""


class StageClock:
    """Times a node's stages against each one's timeout and the node's total budget.

    `stage()` gives the body the seconds it may take (its own timeout, cut to what is left of
    the budget); a body that ran past them, or a budget already spent, fails the stage with a
    StageError that says which limit it was.
    """

    def __init__(
        self,
        node_id: str,
        *,
        report: StageReport = ignore_stage,
        timeouts: Mapping[str, float] | None = None,
        budget_s: float | None = None,
    ) -> None:
        self.node_id = node_id
        self.report = report
        self.timeouts = dict(timeouts or {})
        self.budget_s = budget_s
        self.started = time.monotonic()
        self._skipped: dict[tuple[Stage, str | None], str] = {}
        self._details: dict[tuple[Stage, str | None], Mapping[str, Any]] = {}

    def note(
        self,
        stage: Stage,
        outcome: Outcome,
        elapsed_s: float,
        *,
        error: str | None = None,
        cell_id: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Report a stage timed elsewhere (a cell's benchmark, from ready to closed)."""
        shown = None if timeout_s is None else round(timeout_s, 3)
        self.report(StageOutcome(self.node_id, stage, outcome, elapsed_s, shown, error, cell_id))

    def left(self, stage: Stage, begun: float, default_s: float | None = None) -> float | None:
        """Seconds a stage timed elsewhere (begun at `begun`, time.monotonic) may still run: its
        own timeout less what it has run, cut to what is left of the budget; None: no limit."""
        own = self.timeouts.get(stage, default_s)
        limits = [] if own is None else [own - (time.monotonic() - begun)]
        if self.budget_s is not None:
            limits.append(self.budget_s - (time.monotonic() - self.started))
        return min(limits) if limits else None

    def overrun(self, stage: Stage, begun: float) -> str | None:
        """Why a stage timed elsewhere must stop now (its timeout or the node's budget is
        spent), or None."""
        left = self.left(stage, begun)
        if left is None or left > 0:
            return None
        own = self.timeouts.get(stage)
        if own is not None and own - (time.monotonic() - begun) <= 0:
            return f"node {self.node_id}: {stage} ran past its timeout of {own:g} s"
        return f"node {self.node_id}: budget of {self.budget_s:g} s spent during {stage}"

    def detail(self, stage: Stage, details: Mapping[str, Any], cell_id: str | None = None) -> None:
        """Inside `stage()`: what the stage found, kept with its outcome."""
        self._details[(stage, cell_id)] = details

    def skip(self, stage: Stage, reason: str, cell_id: str | None = None) -> None:
        """Inside `stage()`: the stage could not be done here, and passes as `skipped`."""
        self._skipped[(stage, cell_id)] = reason

    def limit(self, stage: Stage, default_s: float | None) -> float | None:
        """The stage's timeout: the node's `stage_timeouts` entry, else `default_s`; cut to what
        is left of the budget."""
        own = self.timeouts.get(stage, default_s)
        if self.budget_s is None:
            return own
        left = self.budget_s - (time.monotonic() - self.started)
        return left if own is None else min(own, left)

    @contextmanager
    def stage(
        self, stage: Stage, default_s: float | None = None, *, cell_id: str | None = None
    ) -> Iterator[float | None]:
        limit = self.limit(stage, default_s)
        begun = time.monotonic()
        if limit is not None and limit <= 0:
            error = StageError(
                stage, f"node {self.node_id}: budget of {self.budget_s:g} s spent before {stage}"
            )
            self._report(stage, "timeout", begun, limit, error.message, cell_id)
            raise error
        try:
            yield limit
        except BaseException as exc:
            timed_out = isinstance(exc, subprocess.TimeoutExpired | TimeoutError) or (
                isinstance(exc, StageError) and exc.timed_out
            )
            message = (
                exc.message if isinstance(exc, StageError) else (str(exc) or type(exc).__name__)
            )
            self._report(
                stage, "timeout" if timed_out else "failed", begun, limit, message, cell_id
            )
            raise
        skipped = self._skipped.pop((stage, cell_id), None)
        outcome: Outcome = "ok" if skipped is None else "skipped"
        self._report(stage, outcome, begun, limit, skipped, cell_id)

    def _report(
        self,
        stage: Stage,
        outcome: Outcome,
        begun: float,
        limit: float | None,
        error: str | None,
        cell_id: str | None,
    ) -> None:
        elapsed = time.monotonic() - begun
        shown = None if limit is None else round(limit, 3)
        details = self._details.pop((stage, cell_id), None)
        self.report(
            StageOutcome(self.node_id, stage, outcome, elapsed, shown, error, cell_id, details)
        )
