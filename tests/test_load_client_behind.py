"""A client that falls behind its schedule makes its point invalid, named: each client (a
process here, or a task on another node) is held to `max_send_lag_ms` on its own send lag p99,
not only the pooled one over every client's requests, which lets one client of four be late
on 2 % of its requests unnoticed."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from support.keepalive_server import keepalive_server
from test_load import INFERENCE_TEST, call, ledger_records, write_load_project
from test_load_lost_client import client_processes

from pytest_gpubench.results.load_summary import summarize_point

NAMES = {i: f"client process {i} of 4" for i in range(4)}


def four_clients(late: list[float]) -> list[dict[str, object]]:
    """100 requests from each of 4 clients at 1 ms of send lag, client 3's first ones `late`."""
    calls = []
    for process in range(4):
        for i in range(100):
            lag = late[i] if process == 3 and i < len(late) else 1.0
            calls.append(call(10.0 * i + process, 5.0, 50.0, send_lag_ms=lag, process=process))
    return calls


def test_one_client_of_four_late_on_2_percent_is_invalid_though_the_pooled_p99_is_within() -> None:
    calls = four_clients([50.0, 50.0])
    summary = summarize_point(
        calls, offered_rate=400.0, slo=None, max_send_lag_ms=10.0, client_names=NAMES
    )
    # Pooled over 400 requests the two late sends are above the p99: it stays at 1 ms.
    assert summary["send_lag_ms_p99"] == 1.0
    assert summary["valid"] is False
    assert summary["invalid_reason"].startswith(
        "client process 3 of 4 fell behind its schedule: its send lag p99 50 ms > 10 ms"
    )
    assert "over its 100 requests" in summary["invalid_reason"]
    # Nothing dropped: the figures are every client's requests.
    assert summary["requests"] == 400


def test_clients_that_keep_their_schedule_or_a_closed_loop_are_not_held_to_it() -> None:
    kept = summarize_point(
        four_clients([]), offered_rate=400.0, slo=None, max_send_lag_ms=10.0, client_names=NAMES
    )
    assert kept["valid"] is True
    # A closed loop has no schedule (max_send_lag_ms None): its lag is never held against it.
    closed = summarize_point(
        four_clients([50.0] * 10), offered_rate=None, slo=None, max_send_lag_ms=None,
        client_names=NAMES,
    )  # fmt: skip
    assert closed["valid"] is True


# The warm-up is POST 1; the r40 point's 60 requests are POSTs 2..61.
STOP_AT_REQUEST = 16
STOPPED_S = 0.5


# The other client must keep its schedule (send lag under 100 ms): alone under -n
# (tests/support/schedule.py).
@pytest.mark.serial
def test_a_client_process_stopped_mid_point_makes_it_invalid_naming_it(
    pytester: pytest.Pytester,
) -> None:
    """One of 2 client processes stopped with SIGSTOP for 0.5 s inside the r40 point, then
    continued: the sends it owed meanwhile (about 10 of its 30, at 20/s) go out up to 0.5 s late,
    far past max_send_lag_ms (100 ms), whatever the machine's load. The point is invalid naming
    that process, with all 60 requests kept; r20 after it passes."""
    stopped: list[int] = []

    def stop_one_client(request: int) -> None:
        if request == STOP_AT_REQUEST and not stopped:
            clients = client_processes()
            assert len(clients) == 2, clients
            os.kill(clients[1], signal.SIGSTOP)
            stopped.append(clients[1])
            threading.Timer(STOPPED_S, os.kill, (clients[1], signal.SIGCONT)).start()

    with keepalive_server(on_request=stop_one_client) as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {rate: [40, 20], arrival: constant, requests: 60, processes: 2,"
            " max_send_lag_ms: 100}}\n",
            INFERENCE_TEST,
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    assert len(stopped) == 1
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        ["*INVALID local:openai:m-P-EASY-load-r40 [[]r40[]]: client process ? of 2 fell behind"
         " its schedule: its send lag p99 * ms > 100 ms*"]
    )  # fmt: skip
    loads = {r["load_point"]: r for r in ledger_records(pytester) if r["type"] == "load"}
    behind = loads["r40"]
    assert behind["valid"] is False
    named = int(behind["invalid_reason"].split()[2])
    rows = {row["process"]: row for row in behind["send_lag_by_process"]}
    assert rows[named]["send_lag_ms_max"] > 300
    assert rows[named]["send_lag_ms_p99"] > 100
    # Every request is there, each client's share: the point is not cut to the punctual one.
    assert behind["requests"] == 60 and [row["requests"] for row in rows.values()] == [30, 30]
    assert loads["r20"]["valid"] is True and loads["r20"]["requests"] == 60
