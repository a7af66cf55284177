"""Managed llama.cpp: the llama-server argv, its binary and GGUF on this machine or a node."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pytest_gpubench.config.matrix import TINY_MODEL, Cell
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.engines.managed import LaunchPlan, node_file_digest
from pytest_gpubench.targets import Target


def llama_server_launch(
    binary: str, extra_args: Sequence[str] = (), *, parallel: int = 1, metrics: bool = False
) -> list[str]:
    """The launch template of a llama-server serving `{model_path}` as `{model}`, with
    `parallel` slots (the cell's `parallel`) and /metrics where a load case scrapes it."""
    return [
        binary,
        "--model", "{model_path}",
        "--alias", "{model}",
        "--host", "{host}",
        "--port", "{port}",
        "--parallel", str(parallel),
        "--no-webui",
        *(["--metrics"] if metrics else []),
        *extra_args,
    ]  # fmt: skip


def llamacpp_plan(cell: Cell, target: Target, log_dir: Path) -> LaunchPlan:
    """On this machine the binary is found or built and the model is the cell's GGUF (or the
    tiny model); on a remote node both are paths there, put in place by the node's setup. A
    cell's `launch:` replaces the argv (its `{model_path}` is still the cell's model_path)."""
    from pytest_gpubench.targets.local import LocalTarget

    spec = cell.spec
    binary = spec.server_binary or ""
    if isinstance(target, LocalTarget):
        model_path = str(_local_model(cell))
        if spec.launch is None:
            from pytest_gpubench.engines.llamacpp_build import ensure_llama_server

            binary = str(ensure_llama_server(spec.server_binary))
    else:
        if not spec.model_path or (spec.launch is None and not spec.server_binary):
            raise GpubenchError(
                f"cell {cell.cell_id}: a managed llamacpp cell on a remote node needs "
                "server_binary and model_path (paths on the node; install them with setup)"
            )
        model_path = spec.model_path
    digest = node_file_digest(cell, target, model_path)
    if digest is None:
        raise GpubenchError(
            f"cell {cell.cell_id}: model_path: cannot read {model_path} on the node"
        )
    launch = spec.launch or llama_server_launch(
        binary, spec.server_args, parallel=spec.parallel or 1, metrics=cell.load is not None
    )
    return LaunchPlan(
        launch=tuple(launch),
        health_path="/health",
        program="llama-server",
        values={"model": spec.model, "model_path": model_path},
        model_digest=digest,
    )


def _local_model(cell: Cell) -> Path:
    spec = cell.spec
    if spec.model_path:
        model = Path(spec.model_path).expanduser()
        if not model.is_file():
            raise GpubenchError(f"cell {cell.cell_id}: model_path: {model} does not exist")
        return model
    if spec.model == TINY_MODEL:
        from pytest_gpubench.engines.tinymodel import ensure_tiny_model

        return ensure_tiny_model()
    raise GpubenchError(
        f"cell {cell.cell_id}: model_path: a managed llamacpp cell needs a GGUF "
        f"file (or model: {TINY_MODEL} for the generated tiny model)"
    )
