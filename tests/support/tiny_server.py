"""The real llama-server the tests run: one thread, serving the project's tiny model as `tiny`."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
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


@contextmanager
def users_llama_server(binary: Path, model: Path, *prefix: str) -> Iterator[tuple[str, int]]:
    """llama-server (one thread) on the tiny model, started as a user starts one: a process of
    its own, in a session of its own, not the harness's (`prefix`: a command it runs under,
    `taskset -c 0`). Its base URL and pid; killed on the way out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [
            *prefix, str(binary), "--model", str(model), "--alias", "tiny", "--host",
            "127.0.0.1", "--port", str(port), "--threads", "1", "--parallel", "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, "llama-server ended before it was healthy"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "llama-server never became healthy"
            time.sleep(0.2)
        yield url, server.pid
    finally:
        server.kill()
        server.wait()
