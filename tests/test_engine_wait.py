"""The engine's own waiting (measure/engine_wait.py): its threads' run-queue wait and CPU time
from Linux's schedstat, read over a call; and recorded beside each warm call of a local managed
engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pytest_gpubench.core.processes import process_tree
from pytest_gpubench.measure.engine_wait import EngineWait, cpu_list


@pytest.fixture
def real_engine_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's wait as the kernel counts it, not the none tests/conftest.py pins."""
    monkeypatch.undo()


BUSY = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def test_the_threads_counts_are_summed_and_a_gone_process_reads_none(
    tmp_path: Path, real_engine_wait: None
) -> None:
    tasks = tmp_path / "42" / "task"
    for tid, (cpu, wait) in {"42": (5_000_000, 1_000_000), "43": (2_000_000, 3_000_000)}.items():
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "schedstat").write_text(f"{cpu} {wait} 7\n")
    reader = EngineWait(42, proc=tmp_path)
    mark = reader.mark()
    assert mark is not None and (mark.cpu_ns, mark.wait_ns) == (7_000_000, 4_000_000)
    (tasks / "43" / "schedstat").write_text("2500000 9000000 9\n")
    waited = reader.since(mark)
    assert waited is not None
    assert (waited.cpu_ms, waited.wait_ms) == pytest.approx((0.5, 6.0))
    assert EngineWait(99, proc=tmp_path).mark() is None
    assert reader.since(None) is None


def test_the_engines_children_count_and_a_thread_that_ended_takes_nothing_away(
    tmp_path: Path, real_engine_wait: None
) -> None:
    """vLLM's engine core and Ollama's runners are child processes: their threads' waits are the
    engine's. A thread that ended between the marks is left out (never a negative wait); one
    started between them counts whole."""

    def thread(pid: int, tid: int, cpu: int, wait: int, children: str = "") -> None:
        task = tmp_path / str(pid) / "task" / str(tid)
        task.mkdir(parents=True, exist_ok=True)
        (task / "schedstat").write_text(f"{cpu} {wait} 1\n")
        (task / "children").write_text(children)

    thread(42, 42, 1_000_000, 0, children="77")
    thread(42, 43, 1_000_000, 5_000_000)
    thread(77, 77, 2_000_000, 1_000_000)
    reader = EngineWait(42, proc=tmp_path)
    mark = reader.mark()
    assert mark is not None and (mark.cpu_ns, mark.wait_ns) == (4_000_000, 6_000_000)
    (tmp_path / "42" / "task" / "43" / "schedstat").unlink()  # ended
    (tmp_path / "42" / "task" / "43" / "children").unlink()
    (tmp_path / "42" / "task" / "43").rmdir()
    thread(77, 77, 3_000_000, 4_000_000)  # the child ran 1 ms and waited 3 ms more
    thread(77, 78, 500_000, 250_000)  # a thread started since
    waited = reader.since(mark)
    assert waited is not None
    assert (waited.cpu_ms, waited.wait_ms) == pytest.approx((1.5, 3.25))


@contextmanager
def pinned(cpu: int, count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` busy Python processes, each allowed on one CPU only."""
    started = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(count)]
    try:
        for process in started:
            os.sched_setaffinity(process.pid, {cpu})
        yield started
    finally:
        for process in started:
            process.kill()
            process.wait()


# Busy processes pinned to one CPU, timed: alone under -n (tests/support/schedule.py).
@pytest.mark.serial
@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="no schedstat here")
def test_a_process_pinned_beside_a_busy_one_waits_for_its_cpu_half_the_time(
    real_engine_wait: None,
) -> None:
    """Two busy processes that may run on one CPU only take turns: each waits on the run queue
    about as long as it runs (the share is certain: it does not depend on what else the machine
    does, only on the two sharing their one CPU)."""
    cpu = max(os.sched_getaffinity(0))
    with pinned(cpu, 2) as (engine, _neighbour):
        time.sleep(0.3)  # both started and pinned
        reader = EngineWait(engine.pid)
        mark = reader.mark()
        time.sleep(1.5)
        waited = reader.since(mark)
    assert waited is not None
    assert waited.wall_ms == pytest.approx(1500, rel=0.3)
    assert waited.share > 0.3, waited
    assert waited.cpu_ms > 0.2 * waited.wall_ms, waited


# Busy processes pinned to one CPU, timed: alone under -n (tests/support/schedule.py).
@pytest.mark.serial
@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="no schedstat here")
def test_a_child_of_the_engine_pinned_beside_a_busy_process_shows_its_wait(
    real_engine_wait: None,
) -> None:
    """An engine whose work runs in a child process (as vLLM's engine core does): the parent
    sleeps, its busy child shares one CPU with a busy neighbour, so the wait read from the
    parent's pid is the child's, about as long as it runs."""
    cpu = max(os.sched_getaffinity(0))
    child = f"import os, subprocess, sys\nos.sched_setaffinity(0, {{{cpu}}})\n" + (
        "subprocess.run([sys.executable, '-c', sys.argv[1]])"
    )
    engine = subprocess.Popen([sys.executable, "-c", child, BUSY])
    try:
        with pinned(cpu, 1):
            reader = EngineWait(engine.pid)
            deadline = time.monotonic() + 10
            mark = reader.mark()
            while mark is None or len(mark.threads) < 2:  # the child started
                assert time.monotonic() < deadline, "the child never started"
                time.sleep(0.05)
                mark = reader.mark()
            time.sleep(1.5)
            waited = reader.since(mark)
    finally:
        engine.kill()
        engine.wait()
    assert waited is not None
    assert waited.share > 0.3, waited


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: none to pin narrower")
def test_the_cpus_an_engine_is_pinned_to_are_read_and_an_unpinned_one_reads_none() -> None:
    """A/B's two engines are placed alike only when pinned to the same CPUs (results/paired):
    the reader says which CPUs an engine's processes may run on where they are narrower than
    the harness's own (taskset in the cell's launch:), and None where they are not."""
    cpu = max(os.sched_getaffinity(0))
    parent = "import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', sys.argv[1]])"
    engine = subprocess.Popen([sys.executable, "-c", parent, "import time; time.sleep(60)"])
    try:
        reader = EngineWait(engine.pid)
        deadline = time.monotonic() + 10
        while len(process_tree(engine.pid)) < 2:  # the child started
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        assert reader.pinned_cpus() is None
        assert reader.allowed_cpus() == os.sched_getaffinity(0)
        # The parent pinned, its child not: the child may still run anywhere.
        os.sched_setaffinity(engine.pid, {cpu})
        assert reader.pinned_cpus() is None
        for member in process_tree(engine.pid):
            os.sched_setaffinity(member, {cpu})
        assert reader.pinned_cpus() == str(cpu)
        assert reader.allowed_cpus() == {cpu}
        # A call's waiting names the processes its mark read: read again without a walk.
        waited = reader.since(reader.mark())
        assert waited is not None and waited.pids == process_tree(engine.pid)
        assert reader.allowed_cpus(waited.pids) == {cpu}
    finally:
        engine.kill()
        engine.wait()
    assert reader.pinned_cpus() is None  # gone
    assert reader.allowed_cpus() is None
    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


@pytest.mark.engine
def test_each_warm_call_of_a_local_managed_engine_records_its_own_wait(
    pytester: pytest.Pytester, llama_server: Path, tiny_model: Path
) -> None:
    """The real llama-server on the tiny model, started by the harness on this machine: each
    warm call carries the engine's run-queue wait and CPU time over the call, and the baseline
    keeps the waits as samples."""
    from support.bench_files import CHECKED_TEST_FILE, ONE_PROMPT

    from pytest_gpubench.ledger.writer import read_ledger

    pytester.makefile(
        ".yaml",
        prompts=ONE_PROMPT,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, phases: [warm], runs: 5, "
        f"server_binary: '{llama_server}', model_path: '{tiny_model}', "
        "server_args: ['--threads', '1']}\n",
    )
    pytester.makepyfile(test_bench=CHECKED_TEST_FILE)
    result = pytester.runpytest("--force-load", "--baseline-update", "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()[-2000:]
    ledger = next((pytester.path / "runs").glob("*.jsonl"))
    calls = [r for r in read_ledger(ledger) if r["type"] == "call" and r["phase"] == "warm"]
    assert len(calls) == 5
    for call in calls:
        wait, cpu = call["engine_wait_ms"], call["engine_cpu_ms"]
        assert wait >= 0.0 and cpu > 0.0, call
        # The ratio is rounded to 4 decimals from the unrounded times, which are recorded to 3:
        # it may differ from theirs by half its last place and what theirs' rounding moves.
        moved = 5e-4 * (1 + wait / cpu) / (cpu - 5e-4)
        assert abs(call["engine_wait_per_cpu"] - wait / cpu) <= 5e-5 + moved + 1e-9, call
        # How busy it kept the CPUs it may use: its CPU time over the call's, on every CPU.
        assert 0.0 < call["engine_cpus_filled"] <= 1.1, call
        # Not pinned narrower than the harness: no CPUs said (A/B reads them: results/paired).
        assert "engine_cpus" not in call
    stored = next((pytester.path / "baselines").glob("*.json")).read_text()
    assert '"engine_wait_ms"' in stored
    # The run's p50 of the wait per CPU ms is kept in the history: the next runs' steadiness.
    assert '"engine_wait_per_cpu"' in stored


SUPPORT = Path(__file__).resolve().parent / "support"


@pytest.mark.engine
def test_a_slower_path_is_a_regression_and_a_neighbour_on_the_engines_cpu_is_unsteady(
    pytester: pytest.Pytester,
    llama_server: Path,
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 37: a path that paced the decode slower moved the machine's CPU pressure by itself
    (21 % in the baseline's run, 33 % with the change: the proxy and the client are tasks too),
    and the change came out `unsteady`, twice. The real llama-server, started by the harness
    behind a pacing proxy in its own process (support/paced_engine.py: each content event 10 ms
    after the one before in the second run, 2 ms in the first: paced in both, so that no reply's
    chunks arrive coalesced and leave it without a decode rate); the readings of the
    machine are set, so that the verdict is certain on a shared machine: the pressure 21 % then
    33 %, the engine's own wait 0.02 ms per CPU ms both times. The decode rate's fall is a
    regression (exit 6), not unsteady. Then the path as it was, with the engine's wait at
    0.5 ms per CPU ms (a neighbour taking its CPU) and the pressure as in the baseline: unsteady
    (exit 10), in the engine's words, with the neighbour's share of the machine's CPU time read
    beside it (35 %)."""
    from support.bench_files import CHECKED_TEST_FILE

    from pytest_gpubench.ledger.writer import read_ledger
    from pytest_gpubench.measure.control import CpuPressure, MachineCpu, Neighbours
    from pytest_gpubench.measure.engine_wait import EngineWait, EngineWaiting, SchedMark

    real_since = EngineWait.since

    def engine_waits(per_cpu: float) -> None:
        def since(self: EngineWait, start: SchedMark | None) -> EngineWaiting | None:
            waited = real_since(self, start)
            if waited is None:
                return None
            return EngineWaiting(per_cpu * waited.cpu_ms, waited.cpu_ms, waited.wall_ms)

        monkeypatch.setattr(EngineWait, "since", since)

    def pressure(share: float) -> None:
        monkeypatch.setattr(CpuPressure, "share", lambda self, mark: share)

    gap = pytester.path / "gap_ms"
    gap.write_text("2")
    launch = [
        sys.executable, str(SUPPORT / "paced_engine.py"), "--port", "{port}", "--gap-file",
        str(gap), "--", str(llama_server), "--model", "{model_path}", "--alias", "{model}",
        "--threads", "1", "--parallel", "1",
    ]  # fmt: skip
    pytester.makefile(
        ".yaml",
        prompts='prompts:\n  P-EASY: {intent: short, prompt: "Count to ten.", max_tokens: 24}\n',
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, phases: [warm], runs: 10, "
        f"model_path: '{tiny_model}', launch: {json.dumps(launch)}, "
        "request: {extra_body: {ignore_eos: true}}}\n",
    )
    pytester.makepyfile(test_bench=CHECKED_TEST_FILE)
    args = ("--force-load", "-p", "no:cacheprovider")

    def verdicts() -> dict[str, dict[str, Any]]:
        newest = max((pytester.path / "runs").glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
        (end,) = [r for r in read_ledger(newest) if r["type"] == "end"]
        return {v["metric"]: v for v in end["verdicts"]}

    engine_waits(0.02)
    pressure(0.21)
    ratified = pytester.runpytest(*args, "--baseline-update")
    assert ratified.ret == 0, ratified.stdout.str()[-2000:]

    gap.write_text("10")
    pressure(0.33)
    slowed = pytester.runpytest(*args)
    judged = verdicts()
    assert slowed.ret == 6, slowed.stdout.str()[-3000:]
    decode = judged["warm_decode_tokens_per_sec_p50"]
    assert decode["verdict"] == "regression", decode
    assert not [v for v in judged.values() if v["verdict"] == "unsteady"], judged

    gap.write_text("2")
    pressure(0.21)
    engine_waits(0.5)
    # A neighbour that takes the engine's CPU takes the machine's CPU time too: its share is
    # read beside each call (without it, a wait is the benchmark's own threads', not busy).
    monkeypatch.setattr(
        MachineCpu,
        "neighbours",
        lambda self, start, *rest: None if start is None else Neighbours(0.35, 0.0),
    )
    crowded = pytester.runpytest(*args)
    assert crowded.ret == 10, crowded.stdout.str()[-3000:]
    ttft = verdicts()["warm_ttft_p50_ms"]
    assert ttft["verdict"] == "unsteady", ttft
    assert "the engine's threads waited 0.50 ms for a CPU per ms they ran" in ttft["message"]


def test_each_warm_call_records_the_clients_own_wait(pytester: pytest.Pytester) -> None:
    """The harness's own threads (the client's) over each warm call: how long they waited for a
    CPU, and ran, and the ratio the gate's steadiness reads beside the engine's. The wait is the kernel's count, pinned to none here
    (tests/conftest.py) as the engine's is: the CPU time is real."""
    from support.bench_files import CHECKED_TEST_FILE, ONE_PROMPT
    from support.standins import FaultyOpenAIServer, serving

    from pytest_gpubench.ledger.writer import read_ledger

    with serving(FaultyOpenAIServer("tiny")) as url:
        pytester.makefile(
            ".yaml",
            prompts=ONE_PROMPT,
            cells="nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: tiny, endpoint: '{url}', runs: 5, "
            "phases: [warm]}\n",
        )
        pytester.makepyfile(test_bench=CHECKED_TEST_FILE)
        result = pytester.runpytest("--force-load", "--baseline-update", "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()[-2000:]
    calls = [
        r
        for r in read_ledger(next((pytester.path / "runs").glob("*.jsonl")))
        if r["type"] == "call"
    ]
    warm = [call for call in calls if call["phase"] == "warm"]
    assert len(warm) == 5
    for call in warm:
        assert call["client_wait_ms"] == 0.0 and call["client_cpu_ms"] > 0.0, call
        assert call["client_wait_per_cpu"] == 0.0, call
    stored = next((pytester.path / "baselines").glob("*.json")).read_text()
    assert '"client_wait_per_cpu"' in stored
