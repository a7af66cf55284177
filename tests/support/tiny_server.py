"""The real llama-server the tests run: one thread, serving the project's tiny model as `tiny`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.targets.local import LocalTarget


@contextmanager
def tiny_llama_server(
    binary: Path, model: Path, log_dir: Path, cell_id: str = "local:llamacpp:tiny"
) -> Iterator[ManagedLlamaServer]:
    """A started llama-server (`binary` may be a wrapper around it), stopped on the way out."""
    target = LocalTarget()
    managed = ManagedLlamaServer(
        target,
        cell_id=cell_id,
        binary=str(binary),
        model_path=str(model),
        alias="tiny",
        log_dir=str(log_dir),
        extra_args=("--threads", "1"),
    )
    try:
        managed.start()
        yield managed
    finally:
        managed.stop()
        target.close()
