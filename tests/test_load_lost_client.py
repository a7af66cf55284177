"""`processes: N` with a client process killed mid-point: the point is invalid with the reason
and has no figure (never one from the other processes' requests alone), its test fails, and the
session goes on to the next point. Against tests/support/keepalive_server.py (a stand-in
OpenAI-style streaming server), which kills one of the load's client processes with SIGKILL as
it reads a set request: a moment inside the point, the same on every run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from support.keepalive_server import keepalive_server
from test_load import INFERENCE_TEST, ledger_records, write_load_project

# The warm-up is POST 1; the c4 point's 40 requests are POSTs 2..41.
KILL_AT_REQUEST = 12


def client_processes() -> list[int]:
    """This process's children that are multiprocessing's spawned workers (the load clients:
    pytester runs the session in this process)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == os.getpid() and b"spawn_main" in command:
            pids.append(int(entry.name))
    return sorted(pids)


# Its r40 point passes only if each client process keeps its schedule (max_send_lag_ms 100): the
# machine's own timing, alone under -n (tests/support/schedule.py).
@pytest.mark.serial
def test_a_client_process_killed_mid_point_makes_it_invalid_and_the_session_goes_on(
    pytester: pytest.Pytester,
) -> None:
    killed: list[int] = []

    def kill_one_client(request: int) -> None:
        if request == KILL_AT_REQUEST and not killed:
            clients = client_processes()
            assert len(clients) == 2, clients
            os.kill(clients[0], signal.SIGKILL)
            killed.append(clients[0])

    with keepalive_server(prefill_s=0.02, on_request=kill_one_client) as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {concurrency: [4], rate: [40], arrival: constant, requests: 40,"
            " processes: 2, max_send_lag_ms: 100}}\n",
            INFERENCE_TEST,
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    assert len(killed) == 1
    # The c4 point fails with the reason; r40 after it runs and passes.
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        ["*INVALID local:openai:m-P-EASY-load-c4 [[]c4[]]: client process ? of 2 died mid-point"
         " (killed by SIGKILL)*"]
    )  # fmt: skip
    records = ledger_records(pytester)
    loads = {r["load_point"]: r for r in records if r["type"] == "load"}
    lost = loads["c4"]
    assert lost["valid"] is False
    assert lost["clients_lost"] == [lost["invalid_reason"].split(":")[0]]
    assert "no figure is drawn from them" in lost["invalid_reason"]
    for figure in ("achieved_rate", "output_tokens_per_sec", "ttft_ms_p50", "ttft_ms_p99",
                   "requests", "goodput_rate", "samples"):  # fmt: skip
        assert lost.get(figure) is None, figure
    # What the surviving process sent is kept, raw, in the ledger: one process's share at most.
    calls = [r for r in records if r["type"] == "call" and r["load_point"] == "c4"]
    assert 0 < lost["requests_recorded"] <= 20
    assert len({c["process"] for c in calls}) == 1
    assert loads["r40"]["valid"] is True and loads["r40"]["requests"] == 40
