"""An engine the user started outside the harness, on this machine, found from its endpoint
(measure/listener.py): the socket listening on the endpoint's port, the process holding it, and
its own threads' CPU wait read over each warm call as a managed engine's is."""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.bench_files import CHECKED_TEST_FILE, ONE_PROMPT
from support.quiet_machine import machine_moved, wait_for_quiet
from support.tiny_server import users_llama_server

from pytest_gpubench.measure.listener import (
    endpoint_process,
    is_this_machine,
    listening_inodes,
    socket_holders,
    topmost,
)

TCP_HEAD = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
    "timeout inode\n"
)
ANY6 = "00000000000000000000000000000000"


def tcp_line(slot: int, local: str, remote: str, state: str, inode: int) -> str:
    return (
        f"   {slot}: {local} {remote} {state} 00000000:00000000 00:00000000 00000000     0        "
        f"0 {inode} 1 0000000000000000 100 0 0 10 0\n"
    )


def fake_process(proc: Path, pid: int, comm: str, ppid: int, sockets: list[int]) -> None:
    (proc / str(pid) / "fd").mkdir(parents=True)
    (proc / str(pid) / "comm").write_text(f"{comm}\n")
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n")
    for number, inode in enumerate(sockets, start=3):
        (proc / str(pid) / "fd" / str(number)).symlink_to(f"socket:[{inode}]")
    (proc / str(pid) / "fd" / "0").symlink_to("/dev/null")


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """A /proc with: port 8080 listening on IPv4 (inode 111) and IPv6 (inode 222), held by a
    server (pid 500) and the worker it forked (501); port 9090 only in an established
    connection (inode 333); port 7070 listening on a socket no process holds (inode 444)."""
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(
        TCP_HEAD
        + tcp_line(0, "0100007F:1F90", "00000000:0000", "0A", 111)
        + tcp_line(1, "0100007F:2382", "0100007F:D431", "01", 333)
        + tcp_line(2, "00000000:1B9E", "00000000:0000", "0A", 444)
        + tcp_line(3, "0100007F:C350", "0100007F:1F90", "01", 555)
    )
    (tmp_path / "net" / "tcp6").write_text(
        TCP_HEAD + tcp_line(0, f"{ANY6}:1F90", f"{ANY6}:0000", "0A", 222)
    )
    fake_process(tmp_path, 500, "llama-server", 1, [111, 222])
    fake_process(tmp_path, 501, "llama-server", 500, [111])
    fake_process(tmp_path, 600, "python3", 1, [333, 555])
    return tmp_path


def test_the_listening_sockets_of_a_port_are_read_from_tcp_and_tcp6(proc: Path) -> None:
    """IPv4 and IPv6 listeners of the port both count; a connection on a port (state 01,
    established) is no listener, nor is the client's end of a connection to the port."""
    assert listening_inodes(8080, proc) == {111, 222}
    assert listening_inodes(9090, proc) == set()
    assert listening_inodes(7070, proc) == {444}
    assert listening_inodes(1234, proc) == set()


def test_the_process_holding_the_socket_is_the_server_not_its_forked_worker(proc: Path) -> None:
    holders = socket_holders({111, 222}, proc)
    assert holders == {500, 501}
    assert topmost(holders, proc) == 500
    assert socket_holders({444}, proc) == set()  # an inode no process holds


def test_the_endpoint_names_its_process_or_says_why_none_was_found(proc: Path) -> None:
    found = endpoint_process("http://127.0.0.1:8080/v1", proc)
    assert (found.pid, found.comm, found.missing) == (500, "llama-server", None)
    assert found.facts() == {"pid": 500, "comm": "llama-server"}
    assert endpoint_process("http://[::1]:8080", proc).pid == 500
    assert endpoint_process("http://localhost:8080", proc).pid == 500

    unheld = endpoint_process("http://127.0.0.1:7070", proc)
    assert unheld.pid is None
    assert unheld.missing is not None and "no process this user may read" in unheld.missing
    nothing = endpoint_process("http://127.0.0.1:9090", proc)
    assert nothing.missing is not None and "container" in nothing.missing
    remote = endpoint_process("http://192.0.2.7:8080", proc)
    assert remote.missing is not None and "192.0.2.7 is not this machine" in remote.missing
    assert remote.facts() == {"missing": remote.missing}


def test_loopback_and_this_hosts_own_addresses_are_this_machine() -> None:
    assert is_this_machine("127.0.0.1") and is_this_machine("127.3.2.1")
    assert is_this_machine("::1") and is_this_machine("localhost")
    assert not is_this_machine("192.0.2.7")  # TEST-NET-1: no host's own
    assert not is_this_machine("no-such-host.invalid")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.7", 9))  # no packet is sent: it picks the outgoing address
            own = probe.getsockname()[0]
        except OSError:
            own = None
    if own is not None and own != "0.0.0.0":
        assert is_this_machine(own)


@pytest.fixture
def own_listener() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


def test_a_port_the_harness_itself_serves_is_not_read_as_an_engine(own_listener: int) -> None:
    """An in-process engine (a test's stand-in, a plugin's) is the client's own process: its wait
    is the client's."""
    found = endpoint_process(f"http://127.0.0.1:{own_listener}")
    assert found.pid is None
    assert found.missing is not None and "the harness's own process" in found.missing


def test_a_listening_child_process_is_found_on_the_real_proc() -> None:
    """The real /proc: a child process listening on a port is found from it, by name."""
    child = subprocess.Popen(
        [
            "python3", "-c",
            "import socket, sys, time\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
            "print(s.getsockname()[1], flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        found = endpoint_process(f"http://localhost:{port}")
        assert (found.pid, found.comm) == (child.pid, "python3"), found
    finally:
        child.kill()
        child.wait()
    assert os.getpid() != child.pid


@pytest.mark.engine
def test_an_engine_started_outside_the_harness_is_found_from_its_endpoint(
    pytester: pytest.Pytester, llama_server: Path, tiny_model: Path
) -> None:
    """The real llama-server, started by hand (as most users run theirs) and named by its
    endpoint in cells.yaml: the cell record names the process found listening on its port, and
    each warm call carries that process's own CPU wait, as a managed engine's does; the
    baseline keeps the waits, the gate's steadiness from the next run on."""
    from pytest_gpubench.ledger.writer import read_ledger

    with users_llama_server(llama_server, tiny_model) as (url, pid):
        pytester.makefile(
            ".yaml",
            prompts=ONE_PROMPT,
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{url}', "
            "phases: [warm], runs: 4}\n",
        )
        pytester.makepyfile(test_bench=CHECKED_TEST_FILE)
        result = pytester.runpytest("--force-load", "--baseline-update", "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()[-2000:]
    records = read_ledger(next((pytester.path / "runs").glob("*.jsonl")))
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert cell["engine_process"] == {"pid": pid, "comm": "llama-server"}, cell
    calls = [r for r in records if r["type"] == "call" and r["phase"] == "warm"]
    assert len(calls) == 4
    for call in calls:
        assert call["engine_cpu_ms"] > 0.0, call
        assert call["engine_wait_per_cpu"] >= 0.0, call
        assert 0.0 < call["engine_cpus_filled"] <= 1.1, call
    stored = next((pytester.path / "baselines").glob("*.json")).read_text()
    assert '"engine_wait_per_cpu"' in stored


def test_an_engine_that_cannot_be_found_is_said_once_in_the_cell_record(
    pytester: pytest.Pytester,
) -> None:
    """An endpoint served by no process the harness can read (here: the harness's own, a
    stand-in in its process): the cell record says why, the calls carry no engine wait, and
    the machine's figures judge as before."""
    from support.standins import FaultyOpenAIServer, serving

    from pytest_gpubench.ledger.writer import read_ledger

    with serving(FaultyOpenAIServer("tiny")) as url:
        pytester.makefile(
            ".yaml",
            prompts=ONE_PROMPT,
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: tiny, endpoint: '{url}', "
            "phases: [warm], runs: 2}\n",
        )
        pytester.makepyfile(test_bench=CHECKED_TEST_FILE)
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()[-2000:]
    records = read_ledger(next((pytester.path / "runs").glob("*.jsonl")))
    (cell,) = [r for r in records if r["type"] == "cell"]
    assert "the harness's own process" in cell["engine_process"]["missing"], cell
    calls = [r for r in records if r["type"] == "call" and r["phase"] == "warm"]
    assert calls and not [c for c in calls if "engine_wait_per_cpu" in c]


# How many times the quiet-machine test below measures its baseline run and its unchanged run,
# where the engine's own speed did not hold (engine_moved) and the unchanged run did not pass.
UNCHANGED_ATTEMPTS = 3
# llama-server's own prompt time within one run, its p90 over its p10, past which the engine ran at
# two speeds: 1.13 and 1.37 in runs that passed, 1.68 and 1.71 in the pair of a fresh clone's CI run
# whose calls took 17-18 ms or 28-32 ms by turns (2026-11-29, later), and the gate rightly found
# the unchanged run `blind`.
TWO_SPEEDS = 1.5


def engine_moved(ledger_dir: Path) -> str | None:
    """How llama-server's own prompt time did not hold: its p50 moved past the 20 % threshold
    from the first run's to the last run's, or it ran at two speeds within either run (its p90
    over its p10 past TWO_SPEEDS); None where it held."""
    from pytest_gpubench.ledger.writer import read_ledger

    ledgers = sorted(ledger_dir.glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
    first, last = (
        sorted(
            float(r["engine_prompt_ms"])
            for r in read_ledger(ledger)
            if r["type"] == "call" and r["phase"] == "warm" and r.get("engine_prompt_ms")
        )
        for ledger in (ledgers[0], ledgers[-1])
    )
    ratio = statistics.median(last) / statistics.median(first)
    if not 1 / 1.2 < ratio < 1.2:
        return (
            f"llama-server's own prompt time p50 {statistics.median(first):.2f} → "
            f"{statistics.median(last):.2f} ms ({ratio - 1:+.0%})"
        )
    for name, times in (("baseline", first), ("unchanged", last)):
        deciles = statistics.quantiles(times, n=10)
        if deciles[-1] / deciles[0] > TWO_SPEEDS:
            return (
                f"llama-server's own prompt time in the {name} run {times[0]:.1f}-{times[-1]:.1f} "
                f"ms (p90/p10 {deciles[-1] / deciles[0]:.2f}: two speeds)"
            )
    return None


@pytest.mark.engine
@pytest.mark.serial
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: none to keep apart")
@pytest.mark.skipif(shutil.which("taskset") is None, reason="no taskset to pin with")
def test_the_clients_and_engines_own_tasks_do_not_make_a_quiet_machine_unsteady(
    pytester: pytest.Pytester, llama_server: Path, tiny_model: Path
) -> None:
    """Issue 43: on an idle 2-core machine, an engine started by hand and its client waited for
    each other, which the machine's CPU pressure counts, and half of the unchanged sessions
    exited 10. Here the real llama-server (one thread) is pinned to one CPU and the client (the
    pytest session) to the other, so that neither waits for the other; each call prefills a
    ~600-word prompt (no prompt cache: a TTFT of tens of ms, which 12 calls can judge). The
    baseline run, then the unchanged run: exit 0, the steadiness read from the engine's and the
    client's own waits, not the machine's pressure (which still goes into each call record).

    It holds on a quiet machine: where other processes took more than the busy limit of the
    CPUs' time during either run (their share, read beside each call), the engine's CPU was
    theirs too and the gate rightly says so; the test ends with the figures (a failure
    under CI, support/quiet_machine.py; it runs alone there, marked serial). So does an engine
    whose own speed did not hold: where the unchanged run did not pass and llama-server's own
    prompt time moved past the 20 % threshold from the baseline run's (a process ran 27 % slower
    for a while and back), or ran at two speeds within either run (engine_moved), the gate
    rightly could not tell, and the baseline run and the unchanged run are measured again from a
    fresh baseline after a wait for quiet, up to UNCHANGED_ATTEMPTS times."""
    from pytest_gpubench.ledger.writer import read_ledger
    from pytest_gpubench.results.steadiness import PRESSURE_LIMIT

    engine_cpu, client_cpu = sorted(os.sched_getaffinity(0))[:2]
    words = " ".join(["sea sky road home"] * 150)
    with users_llama_server(llama_server, tiny_model, "taskset", "-c", str(engine_cpu)) as (
        url,
        _,
    ):
        pytester.makefile(
            ".yaml",
            prompts=f'prompts:\n  P-R1: {{intent: short, prompt: "{words}", max_tokens: 32}}\n',
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{url}', "
            "phases: [warm], runs: 12, request: {extra_body: {cache_prompt: false}}}\n",
        )
        pytester.makepyfile(test_bench=CHECKED_TEST_FILE)
        session = ["taskset", "-c", str(client_cpu), sys.executable, "-m", "pytest",
                   "--force-load", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*session, *args], check=False, cwd=pytester.path, env=env, capture_output=True,
                text=True, timeout=300,
            )  # fmt: skip

        moved: list[str] = []
        for attempt in range(UNCHANGED_ATTEMPTS):
            if attempt:  # the pair measured again from a fresh baseline
                shutil.rmtree(pytester.path / "baselines")
                shutil.rmtree(pytester.path / "runs")
            ratified = run("--baseline-update")
            assert ratified.returncode == 0, ratified.stdout[-3000:]
            unchanged = run()
            engine = engine_moved(pytester.path / "runs")
            if unchanged.returncode == 0 or engine is None:
                break
            moved.append(f"{engine} ({wait_for_quiet()})")
        else:
            machine_moved(f"the engine's own speed moved in every unchanged run: {moved}")
    ledgers = sorted((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
    # The baseline's run and the unchanged run judged last.
    ledgers = [ledgers[0], ledgers[-1]]
    runs = [
        [r for r in read_ledger(ledger) if r["type"] == "call" and r["phase"] == "warm"]
        for ledger in ledgers
    ]
    # The 12 planned calls each; an undecided figure may have been measured further in the
    # unchanged run (issue 43: sampled on until decided), as one run here was (24 calls).
    assert [len(calls) >= 12 for calls in runs] == [True, True], [len(c) for c in runs]

    def p50(calls: list[dict[str, Any]], name: str) -> float:
        return statistics.median(float(call[name]) for call in calls)

    names = ("first_delta_ms", "cpu_pressure", "neighbour_cpu_share", "engine_wait_per_cpu",
             "client_wait_per_cpu")  # fmt: skip
    figures = [{name: round(p50(calls, name), 4) for name in names} for calls in runs]
    print(f"p50 over the calls, baseline run then unchanged run: {figures}")
    busiest = max(run_figures["neighbour_cpu_share"] for run_figures in figures)
    if busiest > PRESSURE_LIMIT:
        machine_moved(f"not a quiet machine: other processes took {busiest:.0%} of the CPUs' time")
    assert unchanged.returncode == 0, unchanged.stdout[-3000:]
    assert "UNSTEADY" not in unchanged.stdout
    (end,) = [r for r in read_ledger(ledgers[-1]) if r["type"] == "end"]
    for verdict in end["verdicts"]:
        assert verdict["verdict"] != "unsteady", verdict
        assert "tasks waited for a CPU" not in verdict.get("message", ""), verdict
