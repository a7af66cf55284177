"""The live progress line while benchmark cases run: cell, prompt, phase, done/total and an ETA,
rewritten in place on a terminal that understands cursor control."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest

ERASE_TO_END = "\x1b[K"


class CaseLike(Protocol):
    @property
    def cell_id(self) -> str: ...
    @property
    def prompt_id(self) -> str: ...
    @property
    def phase(self) -> str: ...
    @property
    def run_idx(self) -> int: ...


@dataclass
class Progress:
    """Pure bookkeeping: which cases are planned, which ended, how long each phase takes."""

    planned: Mapping[str, CaseLike]
    done: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: dict[str, list[float]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)

    def eta_s(self) -> float | None:
        """The cases left, each at the mean time of the cases of its phase that ended (or of
        all cases, for a phase none has ended in); None before the first ends."""
        every = [s for times in self.seconds.values() for s in times]
        if not every:
            return None
        overall = sum(every) / len(every)
        means = {phase: sum(times) / len(times) for phase, times in self.seconds.items()}
        return sum(
            means.get(case.phase, overall)
            for nodeid, case in self.planned.items()
            if nodeid not in self.finished
        )

    def line(self, current: CaseLike | None) -> str:
        parts = [f"gpubench {self.done}/{len(self.planned)}"]
        if current is not None:
            parts += [current.cell_id, current.prompt_id, f"{current.phase} #{current.run_idx}"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        if self.skipped:
            parts.append(f"{self.skipped} skipped")
        eta = self.eta_s()
        parts.append("ETA " + ("?" if eta is None else duration(eta)))
        return " · ".join(parts)


def duration(seconds: float) -> str:
    """65.2 -> "1m05s"; 3725 -> "1h02m"."""
    whole = round(seconds)
    if whole >= 3600:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    if whole >= 60:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole}s"


class ProgressLine:
    """Registered by the plugin in the process that draws (never in an xdist worker; xdist's
    controller collects no items, so it draws nothing there either). Active only with benchmark
    cases, at the default verbosity (not -q, not -v: those lines are pytest's), on a terminal
    with markup; it then replaces pytest's letters for the benchmark cases (their outcomes are
    counted on the line and in pytest's summary)."""

    def __init__(self, config: pytest.Config, case_of: Callable[[pytest.Item], Any]) -> None:
        self.config = config
        self.case_of = case_of
        self.progress: Progress | None = None
        self.started: dict[str, float] = {}

    def _terminal(self) -> Any:
        return self.config.pluginmanager.get_plugin("terminalreporter")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        terminal = self._terminal()
        if terminal is None or not terminal.hasmarkup or self.config.get_verbosity() != 0:
            return
        planned = {item.nodeid: self.case_of(item) for item in session.items}
        planned = {nodeid: case for nodeid, case in planned.items() if case is not None}
        if planned and not self.config.option.collectonly:
            self.progress = Progress(planned)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        if self.progress is None or nodeid not in self.progress.planned:
            return
        self.started[nodeid] = time.monotonic()
        self._draw(self.progress.planned[nodeid])

    def pytest_report_teststatus(
        self, report: pytest.TestReport, config: pytest.Config
    ) -> tuple[str, str, str] | None:
        """pytest's letter for a benchmark case is left out: the line counts it."""
        if self.progress is None or report.nodeid not in self.progress.planned:
            return None
        if report.when == "call" or report.outcome != "passed":
            category = "error" if report.failed and report.when != "call" else report.outcome
            return category, "", ""
        return None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        progress = self.progress
        if progress is None or report.nodeid not in progress.planned:
            return
        if report.failed:
            progress.failed += 1
        elif report.skipped:
            progress.skipped += 1

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        progress = self.progress
        if progress is None or nodeid not in progress.planned:
            return
        case = progress.planned[nodeid]
        progress.done += 1
        progress.finished.add(nodeid)
        began = self.started.pop(nodeid, None)
        if began is not None:
            progress.seconds.setdefault(case.phase, []).append(time.monotonic() - began)
        self._draw(None if progress.done == len(progress.planned) else case)

    def _draw(self, current: CaseLike | None) -> None:
        terminal = self._terminal()
        if terminal is None or self.progress is None:
            return
        text = self.progress.line(current)[: max(terminal._tw.fullwidth - 1, 20)]
        terminal.write("\r" + text + ERASE_TO_END)
