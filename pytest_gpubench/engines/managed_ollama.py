"""Managed Ollama: `ollama serve` on the node's loopback, with the cell's environment.

`OLLAMA_HOST` is set to the port the harness chose; `launch_env` adds the rest (`OLLAMA_MODELS`
for the models directory, `OLLAMA_KEEP_ALIVE`). The model is pulled afterwards, as its own
stage (model_pull), through the API the `ollama pull` command itself uses.
"""

from __future__ import annotations

from pytest_gpubench.engines.managed import LaunchPlan
from pytest_gpubench.matrix import Cell
from pytest_gpubench.targets import Target

OLLAMA_LAUNCH = ("ollama", "serve")


def ollama_plan(cell: Cell, target: Target) -> LaunchPlan:
    """`ollama serve` (or the cell's `launch:`), healthy once `/api/version` answers."""
    spec = cell.spec
    return LaunchPlan(
        launch=tuple(spec.launch or OLLAMA_LAUNCH),
        health_path="/api/version",
        program="ollama",
        values={"model": spec.model, "model_path": spec.model_path or spec.model},
        env={"OLLAMA_HOST": "{host}:{port}"},
    )
