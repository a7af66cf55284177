"""Projects with remote nodes for pytester: nodes and cells as YAML flow mappings, the
marketplace stand-in serving the test sshd, and the run's ledger."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpubench.ledger.writer import read_ledger
from support.bench_files import CHECKED_TEST_FILE, ONE_PROMPT
from support.provider_standin import ProviderStandIn, Scenario

if TYPE_CHECKING:
    from pytest_gpubench.targets.ssh import SshTarget
    from support.ssh_fixtures import SshServer

TOKEN = "tok-remote-cells-7d1e"
TOKEN_ENV = "GPUBENCH_TEST_PROVIDER_TOKEN"


def yaml_value(value: Any) -> str:
    """A string, number or bool, or a list or mapping of them, as YAML flow style."""
    if isinstance(value, dict):
        return flow_mapping(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(item) for item in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def flow_mapping(options: dict[str, Any]) -> str:
    """The options as one YAML flow mapping: `{key: value, ...}`."""
    return "{" + ", ".join(f"{key}: {yaml_value(value)}" for key, value in options.items()) + "}"


def ssh_node(sshd: SshServer, **extra: Any) -> str:
    """An ssh node on the test sshd, with short timeouts."""
    return flow_mapping(
        {
            "kind": "ssh",
            "host": sshd.host,
            "port": sshd.port,
            "user": sshd.user,
            "key_file": str(sshd.key_file),
            "known_hosts": str(sshd.known_hosts),
            "connect_timeout_s": 5,
            "command_timeout_s": 20,
            **extra,
        }
    )


def ssh_target(sshd: SshServer, node_id: str) -> SshTarget:
    """A connection to the test sshd as the node `node_id`, with ssh_node's timeouts."""
    from pytest_gpubench.targets.ssh import SshTarget

    return SshTarget(
        node_id, sshd.host, sshd.port, sshd.user, key_file=str(sshd.key_file),
        known_hosts=str(sshd.known_hosts), connect_timeout_s=5.0, command_timeout_s=20.0,
    )  # fmt: skip


def managed_cell(node: str, model: str, install: tuple[Path, Path], **extra: Any) -> str:
    """A cell whose llama-server (install: its binary and GGUF) the node starts."""
    binary, gguf = install
    return flow_mapping(
        {
            "node": node,
            "engine": "llamacpp",
            "model": model,
            "server_binary": str(binary),
            "model_path": str(gguf),
            "server_args": ["--threads", "1"],
            **extra,
        }
    )


def write_project(pytester: pytest.Pytester, nodes: dict[str, str], cells: list[str]) -> None:
    """cells.yaml with these nodes and cells, one prompt, and the checked test file."""
    pytester.makefile(
        ".yaml",
        prompts=ONE_PROMPT,
        cells="nodes:\n"
        + "".join(f"  {name}: {node}\n" for name, node in nodes.items())
        + "cells:\n"
        + "".join(f"  - {cell}\n" for cell in cells),
    )
    pytester.makepyfile(test_bench=CHECKED_TEST_FILE)


def run_matrix(
    pytester: pytest.Pytester, nodes: dict[str, str], cells: list[str], *args: str
) -> Any:
    """Write the project and run pytest on it in process."""
    write_project(pytester, nodes, cells)
    return pytester.runpytest("--force-load", "-p", "no:cacheprovider", *args)


def ledger_of(pytester: pytest.Pytester) -> list[dict[str, Any]]:
    """The records of the run's only ledger."""
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    return read_ledger(ledger)


def servers_of(user: str) -> list[str]:
    """The user's live llama-server processes (zombies awaiting their reaper do not count)."""
    listing = subprocess.run(
        ["ps", "-u", user, "-o", "pid=,stat=,args="], capture_output=True, text=True, check=False
    )
    return [
        line.split()[0]
        for line in listing.stdout.splitlines()
        if "llama-server" in line and not line.split()[1].startswith("Z")
    ]


@contextlib.contextmanager
def marketplace(
    sshd: SshServer,
    private_key: str,
    offers: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[ProviderStandIn]:
    """The marketplace stand-in offering these GPUs; each session it starts is the test sshd,
    reached with private_key; its API token is set in TOKEN_ENV."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    scenario = Scenario(
        offers=offers,
        private_key=private_key,
        ssh_host=sshd.host,
        ssh_port=sshd.port,
        ssh_user=sshd.user,
        statuses=["running"],
        token=TOKEN,
    )
    with ProviderStandIn(scenario) as api:
        yield api
