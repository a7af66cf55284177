"""Hooks another package implements to add an engine kind or a node kind to pytest-gpubench.

An engine plugin names its kinds (`pytest_gpubench_engine_kinds`) so that cells.yaml accepts
them, and builds the engine for a cell of its kind (`pytest_gpubench_make_engine`); a target
plugin does the same for nodes (`pytest_gpubench_node_kinds`, `pytest_gpubench_open_target`).
Register them from a `pytest11` entry point or a conftest.py at the rootdir: cells.yaml is read
in `pytest_configure`, after both are loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_gpubench.config.cell import Cell
    from pytest_gpubench.config.nodes import PluginNode
    from pytest_gpubench.engines import Engine
    from pytest_gpubench.targets import Target


def pytest_gpubench_engine_kinds() -> Sequence[str]:
    """Engine kinds this plugin serves, beyond llamacpp, ollama and openai.

    Their cells need an `endpoint` (only llamacpp is launched by the harness itself).
    """
    return ()


@pytest.hookspec(firstresult=True)
def pytest_gpubench_make_engine(
    cell: Cell, base_url: str, api_key: str | None, model_digest: str | None
) -> Engine | None:
    """The engine for `cell` at `base_url`, or None to leave the cell to the built-in kinds.

    It must follow the `pytest_gpubench.engines.Engine` protocol: `chat()` returns a
    `CallMeasurement` (build it with `pytest_gpubench.engines.measure_stream`, the streaming call
    the built-in engines use, so the first content bytes are timed the same way) and never raises
    for a failed call.
    """
    return None


def pytest_gpubench_node_kinds() -> Sequence[str]:
    """Node kinds this plugin opens; cells.yaml keeps their other keys as `PluginNode.options`."""
    return ()


@pytest.hookspec(firstresult=True)
def pytest_gpubench_open_target(node_id: str, node: PluginNode) -> Target | None:
    """A connected target for a node of one of this plugin's kinds, or None if not ours.

    It follows the `pytest_gpubench.targets.Target` protocol (its `work_dir` is where a managed
    engine keeps its log and pid files on the node). Raise
    `pytest_gpubench.targets.stages.StageError` naming the stage that failed: the node's
    cells are then skipped with it, and the other nodes go on. `close()` is called once, at the
    end of the session.
    """
    return None
