"""How a managed engine is started on its node (`LaunchPlan`), as each kind's builder
(managed_llamacpp.py, managed_ollama.py, managed_openai.py) describes it for `ManagedServer`
(managed.py), and what the builders read off the node (a model file's digest)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pytest_gpubench.config.cell import Cell
from pytest_gpubench.core.files import file_sha256
from pytest_gpubench.targets import Target, on_this_machine


@dataclass(frozen=True)
class LaunchPlan:
    """How one managed engine is started on its node: the argv template, the environment it is
    started with (values may hold placeholders too), the path that answers 200 once it is
    ready, the name its log file starts with, the values of the placeholders other than
    `{port}` and `{host}`, and the model's digest (None where there is no single file)."""

    launch: tuple[str, ...]
    health_path: str
    program: str
    values: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    model_digest: str | None = None
    # The engine fetches its model itself once it runs (Ollama: stage model_pull).
    pulls_model: bool = False
    # Keys the cell left out that were filled with this host's paths, which the node shares.
    shared_paths: Mapping[str, str] = field(default_factory=dict)
    # The engine version to record where the server's own does not name it (the prebuilt
    # llama.cpp server answers `b0-unknown`); None: the server's own.
    engine_version: str | None = None
    # Why the launched server cannot serve a request kind, or None (llama-server's flags).
    kind_missing: Callable[[str], str | None] = lambda kind: None


def node_file_digest(cell: Cell, target: Target, path: str) -> str | None:
    """`sha256:<hex>` of a model file on the node; None where the path is not one file (a
    model directory, a name the engine resolves itself)."""
    if on_this_machine(target):
        local = Path(path).expanduser()
        return f"sha256:{file_sha256(local)}" if local.is_file() else None
    result = target.run(["sh", "-c", 'test -f "$1" && sha256sum "$1"', "sh", path], timeout_s=600)
    if not result.ok or not result.stdout.split():
        return None
    return f"sha256:{result.stdout.split()[0]}"
