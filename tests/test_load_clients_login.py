"""`clients: {node, tasks}` on a Slurm node reached through its login node (`login:`): the plan
written over SSH to the node's shared work folder, the `srun` step started in an SSH session on
the login node (the real sshd of the tests, as its unprivileged user, whose step it then is) on
the real single-node Slurm (tests/support/slurm_fixtures.py), each task the node's own Python
(node_python), against tests/support/keepalive_server.py (a stand-in OpenAI-style streaming
server: the figures are the clients', not a model's)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.keepalive_server import keepalive_server
from support.remote_cells import flow_mapping
from test_load import INFERENCE_TEST, ledger_records, write_load_project

if TYPE_CHECKING:
    from support.slurm_fixtures import SlurmCluster
    from support.ssh_fixtures import SshServer

pytestmark = [pytest.mark.slurm, pytest.mark.sshd]
pytest_plugins = ["support.slurm_fixtures", "support.ssh_fixtures"]


def login_node(sshd: SshServer, slurm_conf: Path, folder: str, **keys: str) -> tuple[str, Path]:
    """The Slurm node (flow YAML) reached through the tests' sshd as its login node, and its
    work folder: a folder of the sshd user's, shared with the compute node."""
    work_dir = sshd.remote_dir / folder
    work_dir.mkdir(exist_ok=True)
    subprocess.run(["chown", f"{sshd.user}:{sshd.user}", str(work_dir)], check=True)
    login = {
        "host": sshd.host, "port": sshd.port, "user": sshd.user,
        "key_file": str(sshd.key_file), "known_hosts": str(sshd.known_hosts),
    }  # fmt: skip
    node = {
        "kind": "slurm",
        "login": login,
        "slurm_conf": str(slurm_conf),
        "work_dir": str(work_dir),
    }
    return flow_mapping({**node, **keys}), work_dir


def write_project_with_node(pytester: pytest.Pytester, cell: str, node: str) -> None:
    """A load project of one cell, with the node `hpc` beside `local`."""
    write_load_project(pytester, cell, INFERENCE_TEST)
    cells = (pytester.path / "cells.yaml").read_text()
    (pytester.path / "cells.yaml").write_text(
        cells.replace(
            "nodes: {local: {kind: local}}", f"nodes: {{local: {{kind: local}}, hpc: {node}}}"
        )
    )


def test_two_client_tasks_of_an_srun_step_started_on_the_login_node_drive_a_point(
    pytester: pytest.Pytester, slurm_cluster: SlurmCluster, sshd: SshServer, node_python: str
) -> None:
    node, work_dir = login_node(
        sshd,
        slurm_cluster.conf,
        "clients-work",
        partition=slurm_cluster.partition,
        time_limit="10:00",
    )
    with keepalive_server() as server:
        write_project_with_node(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {rate: [40], arrival: constant, requests: 40, max_send_lag_ms: 100,"
            f" clients: {{node: hpc, tasks: 2, python: '{node_python}'}}}}}}\n",
            node,
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    assert result.ret == 0, result.stdout.str()[-3000:]
    records = ledger_records(pytester)
    (merged,) = [r for r in records if r["type"] == "load"]
    calls = [r for r in records if r["type"] == "call" and r.get("load_point") == "r40"]
    assert merged["valid"], merged["invalid_reason"]
    # Each request once: 40 measured, 20 from each task of the step.
    assert merged["requests"] == len(calls) == 40
    assert len({(c["process"], c["request_idx"]) for c in calls}) == 40
    assert [row["requests"] for row in merged["send_lag_by_process"]] == [20, 20]
    assert len(merged["client_offsets_ms"]) == 2
    # Nothing is left: no step in the queue, no plan in the shared folder (the refusal below
    # shows that srun ran on the login node).
    assert slurm_cluster.jobs() == []
    assert list(work_dir.glob("gpubench-load-plan-*")) == []


def test_a_step_that_cannot_start_on_the_login_node_fails_the_case_in_one_line(
    pytester: pytest.Pytester, slurm_cluster: SlurmCluster, sshd: SshServer
) -> None:
    """A partition the cluster lacks: srun refuses, and the case says so with srun's words."""
    node, work_dir = login_node(
        sshd, slurm_cluster.conf, "clients-work-refused", partition="no-such-partition"
    )
    with keepalive_server() as server:
        write_project_with_node(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {concurrency: [2], requests: 4, clients: {node: hpc, tasks: 2}}}\n",
            node,
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    assert result.ret != 0
    result.stdout.fnmatch_lines(
        ["*clients: 0 of 2 client tasks on node 'hpc' reached this machine at 127.0.0.1:*"
         ": srun on the login node ended (*): *no-such-partition*"]
    )  # fmt: skip
    assert "Traceback" not in result.stdout.str()
    assert list(Path(work_dir).glob("gpubench-load-plan-*")) == []
