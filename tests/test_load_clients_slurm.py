"""`clients: {node, tasks}`: a load point driven by 2 client tasks of one `srun` step on the real
single-node Slurm of the tests (tests/support/slurm_fixtures.py), against
tests/support/keepalive_server.py (a stand-in OpenAI-style streaming server, so that the figures
are the clients', not a tiny model's): merged, each request once, the schedule kept per request,
the clock offsets recorded, and the same figures as one client within the noise."""

from __future__ import annotations

import itertools
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.keepalive_server import keepalive_server
from test_load import INFERENCE_TEST, ledger_records, write_load_project

from pytest_gpubench.config.load_profile import Clients, LoadProfile
from pytest_gpubench.config.nodes import SlurmNode
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.run.load.clients import clock_offset
from pytest_gpubench.targets.slurm.clients import srun_argv

if TYPE_CHECKING:
    from support.slurm_fixtures import SlurmCluster

pytest_plugins = ["support.slurm_fixtures"]


def test_the_offset_is_taken_from_the_exchange_with_the_shortest_round_trip() -> None:
    """Their clock 5 ms ahead of ours: the quick exchange (1 ms each way) gives 5 ms within
    1 ms; a slow one (its reply held 9 ms on the way back) would have said 0.5 ms."""
    ms = 1_000_000
    quick = (0, 6 * ms, 6 * ms, 2 * ms)
    slow = (10 * ms, 16 * ms, 16 * ms, 30 * ms)
    assert clock_offset([slow, quick]) == (5 * ms, 1 * ms)


def test_the_step_is_k_tasks_on_one_node_of_the_partition(tmp_path: Path) -> None:
    node = SlurmNode(kind="slurm", partition="bench", time_limit="10:00")
    argv = srun_argv(node, 3, tmp_path / "plan.pkl")
    assert argv[:4] == ["srun", "--ntasks=3", "--nodes=1", "--kill-on-bad-exit=0"]
    assert "--partition=bench" in argv and "--time=10:00" in argv
    assert argv[-4:] == [
        sys.executable, "-m", "pytest_gpubench.run.load.client_task", str(tmp_path / "plan.pkl"),
    ]  # fmt: skip


def test_clients_and_processes_are_one_or_the_other() -> None:
    with pytest.raises(ValueError, match="give one"):
        LoadProfile(rate=[1.0], requests=2, processes=2, clients=Clients(node="hpc", tasks=2))


def test_clients_on_a_node_that_is_not_slurm_is_one_line(tmp_path: Path) -> None:
    from test_load import matrix_of

    cells = (
        "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: openai, model: m,"
        " endpoint: 'http://127.0.0.1:9', load: {rate: [1], requests: 2,"
        " clients: {node: local, tasks: 2}}}\n"
    )
    with pytest.raises(GpubenchError) as caught:
        matrix_of(tmp_path, cells)
    assert "load.clients.node: 'local' is not an ssh node or a Slurm node" in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.slurm
def test_two_client_tasks_of_one_srun_step_drive_a_point_merged_exactly(
    pytester: pytest.Pytester, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    node = (
        f"{{kind: slurm, partition: {slurm_cluster.partition}, slurm_conf: '{slurm_cluster.conf}',"
        f" work_dir: '{tmp_path}', time_limit: '10:00'}}"
    )
    with keepalive_server() as server:
        cell = (
            f"{{node: local, engine: openai, model: m, endpoint: '{server.url}', name: NAME,"
            " load: {concurrency: [4], rate: [40], arrival: constant, requests: 40,"
            " max_send_lag_ms: 100CLIENTS}}"
        )
        write_load_project(
            pytester,
            "  - " + cell.replace("NAME", "tasks").replace(
                "CLIENTS", ", clients: {node: hpc, tasks: 2}"
            ) + "\n  - " + cell.replace("NAME", "one").replace("CLIENTS", "") + "\n",
        )  # fmt: skip
        cells = (pytester.path / "cells.yaml").read_text()
        (pytester.path / "cells.yaml").write_text(
            cells.replace(
                "nodes: {local: {kind: local}}", f"nodes: {{local: {{kind: local}}, hpc: {node}}}"
            )
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.assert_outcomes(passed=4)
    records = ledger_records(pytester)
    loads = {(r["cell_id"], r["load_point"]): r for r in records if r["type"] == "load"}
    calls = [r for r in records if r["type"] == "call"]
    for point in ("c4", "r40"):
        merged = loads[("local:openai:m@tasks", point)]
        own = [
            c for c in calls if c["cell_id"] == "local:openai:m@tasks" and c["load_point"] == point
        ]
        assert merged["valid"], merged["invalid_reason"]
        # Each request once: 40 measured, 20 from each task, no (task, index) twice.
        assert merged["requests"] == len(own) == 40
        assert {c["process"] for c in own} == {0, 1}
        assert len({(c["process"], c["request_idx"]) for c in own}) == 40
        assert [row["requests"] for row in merged["send_lag_by_process"]] == [20, 20]
        # The offsets: one per task, within their error bound of 0 (one machine, one clock).
        offsets, errors = merged["client_offsets_ms"], merged["client_offset_errors_ms"]
        assert len(offsets) == len(errors) == 2
        assert all(abs(o) <= e + 0.5 for o, e in zip(offsets, errors, strict=True))
        assert merged["clients"] == {"node": "hpc", "tasks": 2, "coordinator": "127.0.0.1"}
    # The schedule kept per request: two constant shares at 20/s interleave into one at 40/s,
    # each request's actual send after its scheduled one and close to it.
    due = sorted(
        c["scheduled_send_ms"]
        for c in calls
        if c["cell_id"] == "local:openai:m@tasks" and c["load_point"] == "r40"
    )
    assert [round(b - a, 1) for a, b in itertools.pairwise(due)] == [25.0] * 39
    for c in calls:
        if c["cell_id"] == "local:openai:m@tasks":
            assert c["send_ms"] >= c["scheduled_send_ms"] - 0.001
    # The same figures as one client within the noise: the rate a schedule sets, and every
    # reply's eight tokens.
    tasks, one = loads[("local:openai:m@tasks", "r40")], loads[("local:openai:m@one", "r40")]
    assert tasks["send_rate"] == pytest.approx(one["send_rate"], rel=0.05)
    assert tasks["achieved_rate"] == pytest.approx(one["achieved_rate"], rel=0.15)
    assert tasks["output_tokens"] == one["output_tokens"] == 40 * 8


def client_tasks(conf: Path) -> list[int]:
    """The client tasks' processes that this cluster's slurmstepd started (an srun step of a job
    whose SLURM_CONF is `conf`): not another test's client tasks, which a worker beside this one
    may be running at the same time (a fresh clone's CI run found six, 2026-11-29)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes()
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if (
                b"pytest_gpubench.run.load.client_task" in command
                and b"srun" not in command
                and any(name.startswith(b"SLURM_STEP_ID=") for name in environ)
                and f"SLURM_CONF={conf}".encode() in environ
            ):
                pids.append(int(entry.name))
    return sorted(pids)


@pytest.mark.slurm
def test_a_client_task_killed_mid_point_makes_it_invalid_and_the_session_goes_on(
    pytester: pytest.Pytester, slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The stand-in SIGKILLs one of the two tasks as it reads the c4 point's 11th request (the
    warm-up is the first): the point is invalid, named by the task, with no figure; r40 after
    it runs on a new step and passes."""
    killed: list[int] = []

    def kill_one_task(request: int) -> None:
        if request == 12 and not killed:
            tasks = client_tasks(slurm_cluster.conf)
            assert len(tasks) == 2, tasks
            os.kill(tasks[0], signal.SIGKILL)
            killed.append(tasks[0])

    node = (
        f"{{kind: slurm, partition: {slurm_cluster.partition}, slurm_conf: '{slurm_cluster.conf}',"
        f" work_dir: '{tmp_path}', time_limit: '10:00'}}"
    )
    with keepalive_server(prefill_s=0.02, on_request=kill_one_task) as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {concurrency: [4], rate: [40], arrival: constant, requests: 40,"
            " max_send_lag_ms: 100, clients: {node: hpc, tasks: 2}}}\n",
            INFERENCE_TEST,
        )
        cells = (pytester.path / "cells.yaml").read_text()
        (pytester.path / "cells.yaml").write_text(
            cells.replace(
                "nodes: {local: {kind: local}}", f"nodes: {{local: {{kind: local}}, hpc: {node}}}"
            )
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    assert len(killed) == 1
    result.assert_outcomes(failed=1, passed=1)
    records = ledger_records(pytester)
    loads = {r["load_point"]: r for r in records if r["type"] == "load"}
    lost = loads["c4"]
    assert lost["valid"] is False
    assert (
        "client task" in lost["invalid_reason"] and "of 2 on node 'hpc'" in lost["invalid_reason"]
    )
    assert "ended without its requests" in lost["invalid_reason"]
    assert lost.get("achieved_rate") is None and lost.get("ttft_ms_p99") is None
    assert loads["r40"]["valid"] is True and loads["r40"]["requests"] == 40


@pytest.mark.timeout(30)  # before the fix, the wrong-key client waited forever for a challenge
def test_a_stray_connection_to_the_coordinator_does_not_stop_it_accepting_the_tasks() -> None:
    """A port probe (connected and closed at once, with a FIN or with a reset) and a client with
    the wrong key reach the coordinator's listener before the task: none is a task, and the task
    is accepted (before, the first stray connection ended the accepting thread and the point
    failed after 120 s; a probe that reset still did, and failed CI at stop 42 now and then)."""
    import socket
    import struct
    import threading
    from multiprocessing.connection import Client, Connection, Listener

    from pytest_gpubench.run.load.clients import accept_tasks

    listener = Listener(("127.0.0.1", 0), authkey=b"right")
    accepted: list[Connection] = []
    thread = threading.Thread(target=accept_tasks, args=(listener, accepted, 1), daemon=True)
    thread.start()
    try:
        socket.create_connection(listener.address).close()  # a port probe
        reset = socket.create_connection(listener.address)
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()  # a probe that resets: the coordinator's challenge meets ECONNRESET
        with pytest.raises(Exception):  # noqa: B017 (multiprocessing's AuthenticationError)
            Client(listener.address, authkey=b"wrong")
        task = Client(listener.address, authkey=b"right")
        thread.join(timeout=10)
        assert len(accepted) == 1 and not thread.is_alive()
        task.close()
    finally:
        listener.close()
