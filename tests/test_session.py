"""BenchSession's teardown: every node is given back, even when giving one back is interrupted."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpubench.session import BenchSession


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
    session = BenchSession(matrix=None)  # type: ignore[arg-type]
    session.targets = {
        "first": Node("first", closed, interrupt=True),  # type: ignore[dict-item]
        "second": Node("second", closed),  # type: ignore[dict-item]
    }
    with pytest.raises(KeyboardInterrupt):
        session.close()
    assert closed == ["first", "second"]
    assert session.targets == {}
    session.close()  # a later close (pytest_sessionfinish after the interrupt) has nothing left
    assert closed == ["first", "second"]


def test_a_node_that_fails_to_close_does_not_stop_the_others() -> None:
    closed: list[str] = []

    class Broken(Node):
        def close(self) -> None:
            super().close()
            raise OSError("connection reset")

    session = BenchSession(matrix=None)  # type: ignore[arg-type]
    session.targets = {
        "broken": Broken("broken", closed),  # type: ignore[dict-item]
        "fine": Node("fine", closed),  # type: ignore[dict-item]
    }
    session.close()
    assert closed == ["broken", "fine"]
