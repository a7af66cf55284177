"""Shared test set-up for the plugin's own tests."""

import dataclasses
import gc
import importlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.hypothesis_examples import register_profiles

from pytest_gpubench.core.cache import cache_dir

# The order in which `make test-fast`'s workers take the modules: the longest first.
pytest_plugins = ["support.schedule"]

if TYPE_CHECKING:
    from support.vllm_server import VllmServer

    from pytest_gpubench.engines.managed import ManagedLlamaServer

# What a test needs beyond Python, by the fixture that provides it, and the marker (pyproject's
# `markers`) it must then carry: `make test-fast` leaves out sshd, vllm and slurm by these.
NEEDS = {
    "llama_server": "engine",
    "sshd": "sshd",
    "vllm_install": "vllm",
    "slurm_cluster": "slurm",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a test that uses one of NEEDS' fixtures (directly or through another fixture)
    without its marker: `-m 'not sshd'` would run it and fail where sshd is missing."""
    unmarked = [
        f"{item.nodeid} uses the fixture {fixture}: mark it @pytest.mark.{marker}"
        for item in items
        for fixture, marker in NEEDS.items()
        if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None
    ]
    if unmarked:
        raise pytest.UsageError("\n".join(unmarked))


# pytester points HOME at each test's directory; keep one cache (the llama-server build, the tiny
# model) shared by the in-process and subprocess runs, so they find what `make engine` made.
os.environ.setdefault("GPUBENCH_CACHE_DIR", str(cache_dir()))
# `make test-fast` loads the lighter one (--hypothesis-profile=fast).
register_profiles()


@pytest.fixture(scope="session")
def llama_server() -> Path:
    """The llama-server binary built from source (`make engine-build`), which the tests run
    where they name a binary; skipped where it is not built, failed on CI. (The embedded
    default runs the prebuilt server, `make engine`, in the tests that do not name one.) Where
    `make test` builds it beside the suite, waited for (tests/support/schedule.py)."""
    from support.schedule import wait_for_build

    from pytest_gpubench.engines.llamacpp_build import find_llama_server

    wait_for_build()
    binary = find_llama_server(None)
    if binary is None:
        message = (
            "llama-server is not built: run `make engine-build` (gpubench install-server --build)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The project's tiny GGUF model, written once into the cache."""
    from pytest_gpubench.engines.tinymodel import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture
def server(llama_server: Path, tiny_model: Path, tmp_path: Path) -> Iterator["ManagedLlamaServer"]:
    """A running llama-server (one thread) serving the tiny model as `tiny`, stopped afterwards."""
    from support.tiny_server import tiny_llama_server

    with tiny_llama_server(llama_server, tiny_model, tmp_path) as managed:
        yield managed


@pytest.fixture(scope="session")
def vllm_install() -> Path:
    """The vLLM venv's Python (`make vllm`); skipped where it is not installed, failed on CI.
    Where `make test` installs it beside the suite, waited for (tests/support/schedule.py)."""
    from support.schedule import wait_for_vllm
    from support.vllm_server import VLLM_PYTHON, vllm_installed

    wait_for_vllm()
    missing = vllm_installed()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def vllm_server(
    vllm_install: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator["VllmServer"]:
    """One real vLLM (tiny model, served as `tiny-vllm`) shared by the session's tests: it takes
    a minute or more to start on two cores. Started with what a named tool call needs
    (SESSION_ARGS), so that the request kinds' test needs no vLLM of its own."""
    from support.vllm_server import SESSION_ARGS, running_vllm

    with running_vllm(tmp_path_factory.mktemp("vllm"), extra_args=SESSION_ARGS) as server:
        yield server


@pytest.fixture(autouse=True)
def steady_control(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control call, the CPU pressure and the neighbours' CPU time (measure/control.py) read
    this machine, which other jobs share: a test whose subject is not the machine's steadiness
    pins them to a steady 5 ms, no pressure and no neighbours (nor steal), and a local engine's
    and the client's own run-queue wait (measure/engine_wait.py) to none (their CPU time stays
    real), so the shared machine's load cannot turn its verdicts `unsteady`.
    A test of steadiness sets its own (or undoes these); a test that runs pytest in a subprocess
    passes `--gpubench-steadiness off` where its subject is not the machine's steadiness."""
    from pytest_gpubench.measure.control import ControlCall, CpuPressure, MachineCpu, Neighbours
    from pytest_gpubench.measure.engine_wait import EngineWait, EngineWaiting, SchedMark

    monkeypatch.setattr(ControlCall, "measure_ms", lambda self: 5.0)
    monkeypatch.setattr(CpuPressure, "share", lambda self, mark: 0.0)
    monkeypatch.setattr(
        MachineCpu,
        "neighbours",
        lambda self, start, *args: None if start is None else Neighbours(0.0, 0.0),
    )
    real_since = EngineWait.since

    def no_wait(self: EngineWait, start: SchedMark | None) -> EngineWaiting | None:
        waited = real_since(self, start)
        return None if waited is None else dataclasses.replace(waited, wait_ms=0.0)

    monkeypatch.setattr(EngineWait, "since", no_wait)


# pytester's in-process runs drop the modules first imported during a run. Import before any
# test what the plugin imports lazily, so that one copy stays alive: httpx's exception mapping
# needs the httpcore it first saw, and cryptography's Rust bindings (under paramiko) cannot be
# loaded twice ("cipher AES in CTR mode is not supported" on the second SSH connection
# otherwise), and numpy's extension modules refuse a second load ("cannot load module more than
# once per process") once the plugin imports pandas and scipy only when a benchmark is judged.
# pynvml (imported by each run's telemetry to look for a GPU) would otherwise be imported again
# by every run: 30 ms each. cryptography.x509 (which paramiko does not import): first imported
# inside a run and dropped after it, it came back as a second copy whose `Name` is not the class
# the Rust bindings (kept) return, and building a certificate from a loaded one's subject failed
# ("Expecting x509.Name object": tests/support/tls_terminator.py after tests/test_load.py's runs).
PRELOADED = ("cryptography.x509", "httpcore", "pandas", "paramiko", "pynvml", "scipy.stats")


def pytest_configure(config: pytest.Config) -> None:
    """PRELOADED, in every process that runs tests: not in the controller of `-n N`, which runs
    none (1.5 s of imports before it started its workers). And Ctrl-C as Python has it: a suite
    started in the background of a non-interactive shell (`make test &`, nohup) inherits SIGINT
    ignored, and so would every engine and session the tests start; the tests that send SIGINT
    (Ctrl-C ends a run, a server, a Slurm job) failed eight ways in such a run."""
    from support.schedule import is_controller  # a plugin (pytest_plugins): imported by then

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not is_controller(config):
        for name in PRELOADED:
            importlib.import_module(name)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection left (every test module, the preloaded pandas and scipy) out of the cyclic
    garbage collector's full passes: in a worker that has run many in-process sessions each pass
    took over 0.1 s, and there were one a few seconds."""
    gc.collect()
    gc.freeze()
