"""Managed OpenAI-compatible servers (vLLM, SGLang, TGI): the cell's launch template as written.

- {node: gpubox, engine: openai, model: Qwen/Qwen3-0.6B, ready_timeout_s: 900,
   launch: [vllm, serve, "{model}", --host, "{host}", --port, "{port}"]}
"""

from __future__ import annotations

from pytest_gpubench.config.cell import Cell
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.engines.launch_plan import LaunchPlan, node_file_digest
from pytest_gpubench.targets import Target


def openai_plan(cell: Cell, target: Target) -> LaunchPlan:
    """The cell's `launch:`; `/health` (vLLM, SGLang, TGI all answer it) unless `health_path`
    says otherwise. `{model_path}` is the cell's model_path, else the model name."""
    spec = cell.spec
    if spec.launch is None:
        raise GpubenchError(
            f"cell {cell.cell_id}: launch: a managed openai cell needs a launch template "
            '(e.g. [vllm, serve, "{model}", --port, "{port}"]), or give it an endpoint or port'
        )
    model_path = spec.model_path or spec.model
    digest = node_file_digest(cell, target, spec.model_path) if spec.model_path else None
    program = spec.launch[0].rsplit("/", 1)[-1] or "server"
    return LaunchPlan(
        launch=tuple(spec.launch),
        health_path="/health",
        program=program,
        values={"model": spec.model, "model_path": model_path},
        model_digest=digest,
    )
