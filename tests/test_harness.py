"""The harness's teardown: every node is given back, even when giving one back is interrupted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpubench.core.secrets import SecretScrubber
from pytest_gpubench.run.harness import Harness
from pytest_gpubench.run.live_cell import LiveCell


class Node:
    """A target that only records being closed; `interrupt` makes close() raise Ctrl-C."""

    def __init__(self, name: str, closed: list[str], interrupt: bool = False) -> None:
        self.node_id = name
        self._closed = closed
        self._interrupt = interrupt

    def close(self) -> None:
        self._closed.append(self.node_id)
        if self._interrupt:
            raise KeyboardInterrupt

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"teardown should only close the node, not call {name}")


def test_a_second_ctrl_c_while_closing_still_gives_back_the_other_nodes() -> None:
    closed: list[str] = []
    session = Harness(None, log_dir=Path("runs"), scrub=SecretScrubber([]))  # type: ignore[arg-type]
    session.nodes.targets = {
        "first": Node("first", closed, interrupt=True),
        "second": Node("second", closed),
    }
    with pytest.raises(KeyboardInterrupt):
        session.close()
    assert closed == ["first", "second"]
    assert session.nodes.targets == {}
    session.close()  # a later close (pytest_sessionfinish after the interrupt) has nothing left
    assert closed == ["first", "second"]


def test_a_node_that_fails_to_close_does_not_stop_the_others() -> None:
    closed: list[str] = []

    class Broken(Node):
        def close(self) -> None:
            super().close()
            raise OSError("connection reset")

    session = Harness(None, log_dir=Path("runs"), scrub=SecretScrubber([]))  # type: ignore[arg-type]
    session.nodes.targets = {
        "broken": Broken("broken", closed),
        "fine": Node("fine", closed),
    }
    session.close()
    assert closed == ["broken", "fine"]


def test_an_engine_log_that_cannot_be_read_back_loses_nothing_else(tmp_path: Any) -> None:
    """fetch_log is a nicety: a plugin target that raises, or an unwritable folder, is logged."""
    from pytest_gpubench.targets import CommandResult

    class Unreadable:
        def run(self, argv: Any, *, timeout_s: float) -> Any:
            raise RuntimeError("no such thing as a log here")

    class Readable:
        def run(self, argv: Any, *, timeout_s: float) -> CommandResult:
            return CommandResult(tuple(argv), 0, "server is listening\n", "")

    runtime = LiveCell(cell=Cell(), log_dir=tmp_path / "logs", node_target=_no_node)  # type: ignore[arg-type]
    assert runtime.fetch_log(Unreadable(), "/tmp/x.log") is None  # type: ignore[arg-type]
    fetched = runtime.fetch_log(Readable(), "/tmp/x.log")  # type: ignore[arg-type]
    assert fetched is not None and fetched.read_text() == "server is listening\n"
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    runtime.log_dir = blocked
    assert runtime.fetch_log(Readable(), "/tmp/x.log") is None  # type: ignore[arg-type]


class Cell:
    class spec:
        node = "box"

    cell_id = "box:llamacpp:tiny"


def _no_node(cell: Any) -> Any:
    raise AssertionError("fetch_log should not open the node")


def test_a_node_whose_cleanup_hangs_is_left_after_its_timeout_and_the_others_closed() -> None:
    """stage_timeouts.cleanup bounds giving a node back; the stage says it timed out."""
    import time

    from pytest_gpubench.targets.stages import StageClock, StageOutcome

    closed: list[str] = []

    class Hanging(Node):
        def close(self) -> None:
            super().close()
            time.sleep(5)

    outcomes: list[StageOutcome] = []
    session = Harness(None, log_dir=Path("runs"), scrub=SecretScrubber([]))  # type: ignore[arg-type]
    session.nodes.clocks["hung"] = StageClock(
        "hung", report=outcomes.append, timeouts={"cleanup": 0.3}
    )
    session.nodes.targets = {"hung": Hanging("hung", closed), "fine": Node("fine", closed)}
    begun = time.monotonic()
    session.close()
    assert time.monotonic() - begun < 3
    assert closed == ["hung", "fine"]
    (cleanup,) = outcomes
    assert (cleanup.stage, cleanup.outcome, cleanup.timeout_s) == ("cleanup", "timeout", 0.3)
    assert cleanup.error is not None and "ran past its timeout of 0.3 s" in cleanup.error


def test_a_benchmark_stage_past_its_timeout_stops_the_cells_cases(tmp_path: Path) -> None:
    """stage_timeouts.benchmark: once a ready cell has run that long, its next case is not run
    (skipped with the reason, stage `benchmark`) and its benchmark stage ends as `timeout`."""
    import time
    from types import SimpleNamespace

    from pytest_gpubench.targets.stages import StageClock, StageOutcome

    outcomes: list[StageOutcome] = []
    clock = StageClock("gpubox", report=outcomes.append, timeouts={"benchmark": 60.0})
    cell = SimpleNamespace(cell_id="gpubox:llamacpp:tiny", spec=SimpleNamespace(node="gpubox"))
    live = LiveCell(
        cell=cell,  # type: ignore[arg-type]
        log_dir=tmp_path,
        node_target=_no_node,
        node_clock=lambda _: clock,
        ready_at=time.monotonic() - 30,
    )
    live.check_benchmark_time()
    assert live.unavailable is None and live.benchmark_left() == pytest.approx(30, abs=1)
    live.ready_at = time.monotonic() - 61
    live.check_benchmark_time()
    assert live.unavailable == "node gpubox: benchmark ran past its timeout of 60 s"
    assert live.unavailable_stage == "benchmark"
    live.close()
    (benchmark,) = outcomes
    assert (benchmark.stage, benchmark.outcome, benchmark.timeout_s) == ("benchmark", "timeout", 60)
