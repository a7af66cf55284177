"""`clients: {node, tasks}` on an ssh node: a load point driven by 2 client tasks, each an SSH
session on the real sshd of the tests (tests/support/ssh_fixtures.py, logging in as its
unprivileged user, whose Python is a venv of the system's with this checkout copied in:
node_python), against tests/support/keepalive_server.py (a stand-in OpenAI-style streaming
server, so that the figures are the clients', not a tiny model's). The same plan, barrier,
clock offsets, raw merge and loss as the Slurm path (run/load/clients.run_clients)."""

from __future__ import annotations

import itertools
import os
import pwd
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.keepalive_server import keepalive_server
from support.remote_cells import ssh_node
from support.tls_terminator import stunnel, stunnel_binary
from test_load import INFERENCE_TEST, ledger_records, write_load_project

if TYPE_CHECKING:
    from support.ssh_fixtures import SshServer

pytest_plugins = ["support.ssh_fixtures"]


def write_project(pytester: pytest.Pytester, sshd: SshServer, url: str, load: str) -> None:
    """One cell on this machine whose load points are sent from the ssh node `far`."""
    write_load_project(
        pytester,
        f"  - {{node: local, engine: openai, model: m, endpoint: '{url}', load: {load}}}\n",
        INFERENCE_TEST,
    )
    cells = (pytester.path / "cells.yaml").read_text()
    (pytester.path / "cells.yaml").write_text(
        cells.replace(
            "nodes: {local: {kind: local}}",
            f"nodes: {{local: {{kind: local}}, far: {ssh_node(sshd)}}}",
        )
    )


# Its point holds each send to 100 ms of its schedule (40 requests/s over two SSH sessions), which
# the machine's own timing decides: beside two other workers on 2 cores one task fell 295 ms
# behind once (a fresh clone's CI run, 2026-11-29). Alone under -n (tests/support/schedule.py).
@pytest.mark.sshd
@pytest.mark.serial
def test_two_client_tasks_as_ssh_sessions_drive_a_point_merged_exactly(
    pytester: pytest.Pytester, sshd: SshServer, node_python: str
) -> None:
    with keepalive_server() as server:
        write_project(
            pytester,
            sshd,
            server.url,
            "{rate: [40], arrival: constant, requests: 40, max_send_lag_ms: 100,"
            f" clients: {{node: far, tasks: 2, python: '{node_python}'}}}}",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.assert_outcomes(passed=1)
    records = ledger_records(pytester)
    (merged,) = [r for r in records if r["type"] == "load"]
    calls = [r for r in records if r["type"] == "call" and r.get("load_point") == "r40"]
    assert merged["valid"], merged["invalid_reason"]
    # Each request once: 40 measured, 20 from each task, no (task, index) twice.
    assert merged["requests"] == len(calls) == 40
    assert {c["process"] for c in calls} == {0, 1}
    assert len({(c["process"], c["request_idx"]) for c in calls}) == 40
    assert [row["requests"] for row in merged["send_lag_by_process"]] == [20, 20]
    # The offsets: one per task, within their error bound of 0 (one machine, one clock).
    offsets, errors = merged["client_offsets_ms"], merged["client_offset_errors_ms"]
    assert len(offsets) == len(errors) == 2
    assert all(abs(o) <= e + 0.5 for o, e in zip(offsets, errors, strict=True))
    assert merged["clients"] == {
        "node": "far", "tasks": 2, "coordinator": "127.0.0.1", "python": node_python,
    }  # fmt: skip
    # The schedule kept per request: two constant shares at 20/s interleave into one at 40/s,
    # each request's actual send after its scheduled one.
    due = sorted(c["scheduled_send_ms"] for c in calls)
    assert [round(b - a, 1) for a, b in itertools.pairwise(due)] == [25.0] * 39
    assert all(c["send_ms"] >= c["scheduled_send_ms"] - 0.001 for c in calls)
    assert merged["output_tokens"] == 40 * 8


@pytest.mark.sshd
def test_ssh_client_tasks_trust_an_https_endpoint_by_the_cells_ca_file(
    pytester: pytest.Pytester, sshd: SshServer, node_python: str, tmp_path: Path
) -> None:
    """stunnel (a CA made for the test) in front of the stand-in, its CA file where only this
    process's user can read it: the tasks, logged in as the node's unprivileged user, connect
    over TLS with the CA's text carried in the plan (an ssl.SSLContext cannot be pickled, and
    the file's path is not theirs to read)."""
    if stunnel_binary() is None:
        pytest.skip("stunnel4 is not installed (scripts/setup-system.sh)")
    with keepalive_server() as server, stunnel(server.url, tmp_path / "tls") as terminator:
        (tmp_path / "tls").chmod(0o700)
        write_project(
            pytester,
            sshd,
            terminator.url,
            "{concurrency: [2], requests: 8,"
            f" clients: {{node: far, tasks: 2, python: '{node_python}'}}}}",
        )
        cells = (pytester.path / "cells.yaml").read_text()
        (pytester.path / "cells.yaml").write_text(
            cells.replace(
                f"endpoint: '{terminator.url}'",
                f"endpoint: '{terminator.url}', ca_file: '{terminator.ca_file}'",
            )
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
        handshakes = terminator.handshakes()
    assert result.ret == 0, result.stdout.str()[-3000:]
    records = ledger_records(pytester)
    (merged,) = [r for r in records if r["type"] == "load"]
    assert merged["valid"], merged["invalid_reason"]
    calls = [r for r in records if r["type"] == "call" and r.get("load_point") == "c2"]
    assert merged["ok"] == len(calls) == 8
    assert {c["process"] for c in calls} == {0, 1}
    assert handshakes >= 3  # the warm-up's connection and each task's own


@pytest.mark.sshd
def test_client_tasks_reach_the_coordinator_through_a_tunnel_over_the_ssh_connection(
    pytester: pytest.Pytester, sshd: SshServer, node_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`coordinator: tunnel`, for a node that cannot reach this machine: the tasks connect to a
    port the node's sshd listens on (its loopback), carried back over the SSH connection to the
    listener, which then listens on this machine's loopback alone. The carrying is counted by
    wrapping the real RemoteForward's (pytester runs the session in this process)."""
    from pytest_gpubench.targets.ssh.forward import RemoteForward

    carried: list[int] = []
    serve = RemoteForward._serve

    def counted(self: RemoteForward, channel: Any) -> None:
        carried.append(self.remote_port)
        serve(self, channel)

    monkeypatch.setattr(RemoteForward, "_serve", counted)
    with keepalive_server() as server:
        write_project(
            pytester,
            sshd,
            server.url,
            "{concurrency: [2], requests: 8,"
            f" clients: {{node: far, tasks: 2, coordinator: tunnel, python: '{node_python}'}}}}",
        )
        result = pytester.runpytest_inprocess(
            "--force-load", "-p", "no:cacheprovider", "-m", "load"
        )
    assert result.ret == 0, result.stdout.str()[-3000:]
    records = ledger_records(pytester)
    (merged,) = [r for r in records if r["type"] == "load"]
    assert merged["valid"], merged["invalid_reason"]
    calls = [r for r in records if r["type"] == "call" and r.get("load_point") == "c2"]
    assert merged["ok"] == len(calls) == 8 and {c["process"] for c in calls} == {0, 1}
    assert merged["clients"]["coordinator"] == "tunnel"
    assert len(merged["client_offsets_ms"]) == 2
    # Each task's one connection to the coordinator came through the node's forwarded port.
    assert len(carried) == 2 and len(set(carried)) == 1, carried


def test_a_tunnel_to_a_slurm_node_is_one_line(tmp_path: Path) -> None:
    from pytest_gpubench.config.matrix import read_matrix
    from pytest_gpubench.core.errors import GpubenchError

    (tmp_path / "prompts.yaml").write_text(
        "prompts:\n  P-EASY: {intent: short, prompt: hi, max_tokens: 8}\n"
    )
    (tmp_path / "cells.yaml").write_text(
        "nodes: {local: {kind: local}, hpc: {kind: slurm}}\ncells:\n"
        "  - {node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:9',"
        " load: {concurrency: [2], requests: 8, clients: {node: hpc, tasks: 2,"
        " coordinator: tunnel}}}\n"
    )
    with pytest.raises(GpubenchError, match="coordinator: tunnel is for an ssh node") as raised:
        read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")
    assert "\n" not in str(raised.value)


def ssh_client_tasks(user: str) -> list[int]:
    """The client tasks' processes on this machine: the test user's Pythons running the task
    module (started by sshd, not by us)."""
    uid = pwd.getpwnam(user).pw_uid
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().split(b"\0")
                owner = entry.stat().st_uid
            except OSError:
                continue
            if (
                owner == uid
                and b"python" in command[0]
                and b"pytest_gpubench.run.load.client_task" in command
            ):
                pids.append(int(entry.name))
    return sorted(pids)


# Its r40 point holds each send to 100 ms of its schedule, as above: beside two other workers
# one task fell 294 ms behind (a fresh clone's CI run, 2026-11-29, later). Alone under -n.
@pytest.mark.sshd
@pytest.mark.serial
def test_an_ssh_client_task_killed_mid_point_makes_it_invalid_and_the_session_goes_on(
    pytester: pytest.Pytester, sshd: SshServer, node_python: str
) -> None:
    """The stand-in SIGKILLs one of the two tasks as it reads the c4 point's 11th request (the
    warm-up is the first): the point is invalid, named by the task, with no figure; r40 after
    it runs on two new sessions and passes."""
    killed: list[int] = []

    def kill_one_task(request: int) -> None:
        if request == 12 and not killed:
            tasks = ssh_client_tasks(sshd.user)
            assert len(tasks) == 2, tasks
            os.kill(tasks[0], signal.SIGKILL)
            killed.append(tasks[0])

    with keepalive_server(prefill_s=0.02, on_request=kill_one_task) as server:
        write_project(
            pytester,
            sshd,
            server.url,
            "{concurrency: [4], rate: [40], arrival: constant, requests: 40, max_send_lag_ms: 100,"
            f" clients: {{node: far, tasks: 2, python: '{node_python}'}}}}",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    assert len(killed) == 1
    result.assert_outcomes(failed=1, passed=1)
    records = ledger_records(pytester)
    loads = {r["load_point"]: r for r in records if r["type"] == "load"}
    lost = loads["c4"]
    assert lost["valid"] is False
    assert "client task" in lost["invalid_reason"]
    assert "of 2 on node 'far' ended without its requests" in lost["invalid_reason"]
    assert "(its SSH session ended: killed by SIGKILL)" in lost["invalid_reason"]
    assert lost.get("achieved_rate") is None and lost.get("ttft_ms_p99") is None
    assert loads["r40"]["valid"] is True and loads["r40"]["requests"] == 40
    assert ssh_client_tasks(sshd.user) == []


@pytest.mark.sshd
def test_a_python_the_node_lacks_fails_the_case_in_one_line(
    pytester: pytest.Pytester, sshd: SshServer
) -> None:
    """`clients.python` not on the node: the sessions end at once, and the case fails with one
    line saying how many tasks reached this machine and what the session said."""
    with keepalive_server() as server:
        write_project(
            pytester,
            sshd,
            server.url,
            "{rate: [40], arrival: constant, requests: 4,"
            " clients: {node: far, tasks: 2, python: /nonexistent/python}}",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    result.assert_outcomes(failed=1)
    (line,) = [
        line for line in result.stdout.lines if "clients: 0 of 2 client tasks on node 'far'" in line
    ][:1]
    assert "reached this machine at 127.0.0.1:" in line
    assert "the SSH session of task" in line and "/nonexistent/python" in line


@pytest.mark.sshd
def test_the_plan_is_written_on_the_node_for_its_user_only(sshd: SshServer) -> None:
    """The plan holds the connection's key: SshTarget.write_file makes it mode 600, owned by
    the node's user, its folder made first, the bytes whole."""
    from support.remote_cells import ssh_target

    target = ssh_target(sshd, "far")
    path = f"{sshd.remote_dir}/plans/plan.pkl"
    data = bytes(range(256)) * 300
    try:
        target.write_file(path, data)
    finally:
        target.close()
    written = Path(path)
    assert written.read_bytes() == data
    assert written.stat().st_mode & 0o777 == 0o600
    assert written.stat().st_uid == pwd.getpwnam(sshd.user).pw_uid
