"""Engines the harness launches itself: start, health-wait, restart (a true cold start), stop."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from pathlib import PurePosixPath

import httpx

from pytest_gpubench.errors import GpubenchError
from pytest_gpubench.targets import BackgroundProcess, Target

READY_POLL_S = 0.05


class ManagedLlamaServer:
    """A llama-server process on a target, serving one GGUF under the cell's model name."""

    def __init__(
        self,
        target: Target,
        *,
        cell_id: str,
        binary: str,
        model_path: str,
        alias: str,
        log_dir: str,
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.target = target
        self.cell_id = cell_id
        self.binary = binary
        self.model_path = model_path
        self.alias = alias
        # The cell id holds the model name, which may hold anything: keep the file name plain.
        self.log_path = str(PurePosixPath(log_dir) / f"llama-server-{plain_file_name(cell_id)}.log")
        self.extra_args = tuple(extra_args)
        self.ready_timeout_s = ready_timeout_s
        self.base_url = ""
        self.starts = 0
        self._process: BackgroundProcess | None = None

    def argv(self, port: int) -> list[str]:
        return [
            self.binary,
            "--model", self.model_path,
            "--alias", self.alias,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--parallel", "1",
            "--no-webui",
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> str:
        """Start the server and return its base URL once /health answers 200."""
        port = self.target.free_port()
        self._process = self.target.start(self.argv(port), log_path=self.log_path)
        self.starts += 1
        host, local_port = self.target.reach("127.0.0.1", port)
        self.base_url = f"http://{host}:{local_port}"
        self._wait_ready()
        return self.base_url

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        last = "no answer yet"
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self._process is not None and not self._process.alive():
                    tail = self._process.log_tail(1500)
                    raise GpubenchError(
                        f"cell {self.cell_id}: llama-server exited while starting; "
                        f"log tail:\n{tail}"
                    )
                try:
                    answer = client.get(f"{self.base_url}/health")
                    if answer.status_code == 200:
                        return
                    last = f"HTTP {answer.status_code}"
                except httpx.HTTPError as exc:
                    last = type(exc).__name__
                time.sleep(READY_POLL_S)
        self.stop()
        raise GpubenchError(
            f"cell {self.cell_id}: llama-server not healthy after "
            f"{self.ready_timeout_s:g} s ({last})"
        )

    def restart(self) -> str:
        """Stop and start again: the model leaves memory with the process, a true cold start."""
        self.stop()
        return self.start()

    def alive(self) -> bool:
        return self._process is not None and self._process.alive()

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None


def plain_file_name(text: str, limit: int = 80) -> str:
    """A short, plain file name for any text; distinct texts keep distinct names (a hash)."""
    plain = re.sub(r"[^A-Za-z0-9._-]", "_", text)
    if plain == text and len(plain) <= limit:
        return plain
    return f"{plain[: limit - 13]}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
