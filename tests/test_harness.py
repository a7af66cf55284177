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
