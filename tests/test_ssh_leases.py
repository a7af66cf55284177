"""Leases, one journal: a managed server on an ssh node is written down before it starts and
struck off once stopped; after `kill -9` of pytest it keeps running (it is detached from the
connection), and `gpubench leases --release` or the next run on the node stops it and says so.

The node is the real sshd of ssh_fixtures.py with its unprivileged test user; the engine the real
llama-server with the tiny model, copied where that user may run it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.remote_cells import managed_cell, servers_of, ssh_node, write_project

from pytest_gpubench.cli.main import main

if TYPE_CHECKING:
    from support.ssh_fixtures import SshServer

pytest_plugins = ["support.ssh_fixtures"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("GPUBENCH_CACHE_DIR", str(folder))
    return folder


def kill_during_the_cell(
    pytester: pytest.Pytester, sshd: SshServer, install: tuple[Path, Path]
) -> list[str]:
    write_project(
        pytester,
        {"gpubox": ssh_node(sshd)},
        [managed_cell("gpubox", "tiny", install, phases=["warm"], runs=500)],
    )
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "--force-load", "-p", "no:cacheprovider", "-q"],
        cwd=pytester.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and run.poll() is None:
            ledgers = list(pytester.path.glob("runs/*.jsonl"))
            if ledgers and '"type":"call"' in ledgers[0].read_text():
                break
            time.sleep(0.3)
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
    time.sleep(1)
    return servers_of(sshd.user)


def test_a_server_left_by_kill_9_is_stopped_by_leases_release(
    pytester: pytest.Pytester,
    sshd: SshServer,
    node_install: tuple[Path, Path],
    cache: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    left = kill_during_the_cell(pytester, sshd, node_install)
    assert len(left) == 1, "the killed run's llama-server should still run on the node"
    (entry,) = [json.loads(p.read_text()) for p in (cache / "rentals").glob("*.json")]
    assert (entry["kind"], entry["session_id"]) == ("ssh_server", left[0])
    assert main(["leases", "--release"]) == 0
    out = capsys.readouterr().out
    assert f"ssh node gpubox: left by a killed run: {node_install[0]} (pid {left[0]})" in out
    assert f"stopped {left[0]}" in out
    assert servers_of(sshd.user) == []
    assert list((cache / "rentals").glob("*.json")) == []
