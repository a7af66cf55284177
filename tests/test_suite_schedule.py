"""How the parallel runs share the suite (tests/support/schedule.py): the modules that took longest
on the last parallel run go first, each module's tests together and in their order; what a run
took is recorded for the next one; a group's modules run on one worker; a serial test runs
alone."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Literal, cast

import pytest
from support import schedule
from support.schedule import (
    CACHE_KEY,
    ModuleClock,
    SerialLock,
    longest_first,
    longest_modules_first,
    module_groups,
    recorded_seconds,
)


def test_modules_run_longest_first_then_by_their_number_of_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_a="def test_1(): pass\ndef test_2(): pass\n",
        test_b="def test_1(): pass\n",
        test_c="def test_1(): pass\ndef test_2(): pass\ndef test_3(): pass\n",
        test_d="def test_1(): pass\n",
    )
    items, _ = pytester.inline_genitems()
    # test_c and test_d are new: after the known ones, the one with more tests first.
    longest_modules_first(items, {"test_b.py": 30.0, "test_a.py": 2.0})
    assert [item.nodeid for item in items] == [
        "test_b.py::test_1",
        "test_a.py::test_1",
        "test_a.py::test_2",
        "test_c.py::test_1",
        "test_c.py::test_2",
        "test_c.py::test_3",
        "test_d.py::test_1",
    ]


def test_a_run_records_each_modules_seconds_and_keeps_those_it_did_not_run(
    pytester: pytest.Pytester,
) -> None:
    config = pytester.parseconfigure()
    assert config.cache is not None
    config.cache.set(CACHE_KEY, {"test_gone.py": 9.0, "test_a.py": 1.0})
    clock = ModuleClock()
    phases: list[tuple[str, Literal["setup", "call", "teardown"], float]] = [
        ("test_a.py::test_1", "setup", 0.5),
        ("test_a.py::test_1", "call", 2.0),
        ("test_a.py::test_2", "call", 1.0),
        ("test_b.py::test_1[x]", "call", 0.25),
    ]
    for nodeid, when, duration in phases:
        report = pytest.TestReport(
            nodeid, (nodeid, 0, "test"), {}, "passed", None, when, duration=duration
        )
        clock.pytest_runtest_logreport(report)
    clock.pytest_sessionfinish(cast(pytest.Session, SimpleNamespace(config=config)))
    assert config.cache.get(CACHE_KEY, None) == {
        "test_gone.py": 9.0,
        "test_a.py": 3.5,
        "test_b.py": 0.25,
    }


GROUP_CONFTEST = """
import pytest
@pytest.fixture
def vllm_server(): return "vllm"
@pytest.fixture
def slurm_cluster(): return "cluster"
@pytest.fixture
def sshd(): return "user"
@pytest.fixture
def node(sshd, slurm_cluster): return "login node"
"""


def test_the_modules_of_a_group_run_as_one_unit_by_their_seconds_together(
    pytester: pytest.Pytester,
) -> None:
    """The modules on the session's vLLM are one unit (one worker starts it), placed by the sum
    of their modules' seconds, in their collection order; a module with one such test joins
    whole; a module on the Slurm cluster and sshd (through another fixture) is the cluster's."""
    pytester.makeconftest(GROUP_CONFTEST)
    pytester.makepyfile(
        test_a="def test_1(vllm_server): pass\n",
        test_b="def test_1(): pass\n",
        test_c="def test_1(): pass\ndef test_2(vllm_server, sshd): pass\n",
        test_d="def test_1(node): pass\n",
        test_e="def test_1(sshd): pass\n",
    )
    items, _ = pytester.inline_genitems()
    groups = module_groups(items)
    assert groups == {
        "test_a.py": "vllm",
        "test_c.py": "vllm",
        "test_d.py": "slurm",
        "test_e.py": "sshd",
    }
    # vllm: 10 + 15 = 25 s, more than test_b's 20 s, though each of its modules took less.
    seconds = {"test_a.py": 10.0, "test_b.py": 20.0, "test_c.py": 15.0, "test_e.py": 1.0}
    longest_first(items, seconds, groups)
    assert [item.nodeid for item in items] == [
        "test_a.py::test_1",
        "test_c.py::test_1",
        "test_c.py::test_2",
        "test_b.py::test_1",
        "test_e.py::test_1",
        "test_d.py::test_1",
    ]


def test_units_that_need_the_build_beside_the_suite_go_last_and_last_within_their_group(
    pytester: pytest.Pytester,
) -> None:
    """While llama-server is built beside the suite, a unit with a module that needs it (a test
    of the module uses it) goes after the others, however long; a group's modules that need it go
    after its others."""
    pytester.makeconftest(GROUP_CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    built\n")
    pytester.makepyfile(
        test_a="import pytest\n@pytest.mark.built\ndef test_1(vllm_server): pass\n",
        test_b="import pytest\n@pytest.mark.built\ndef test_1(): pass\ndef test_2(): pass\n",
        test_c="def test_1(vllm_server): pass\n",
        test_d="def test_1(): pass\n",
    )
    items, _ = pytester.inline_genitems()
    longest_first(
        items,
        {"test_a.py": 5.0, "test_b.py": 90.0, "test_c.py": 5.0, "test_d.py": 1.0},
        module_groups(items),
        late=lambda item: item.get_closest_marker("built") is not None,
    )
    # The vLLM group (test_c, test_a: 10 s) after test_d, which needs nothing; then test_b (90 s).
    assert [item.nodeid for item in items] == [
        "test_d.py::test_1",
        "test_b.py::test_1",
        "test_b.py::test_2",
        "test_c.py::test_1",
        "test_a.py::test_1",
    ]


def test_a_fresh_clone_orders_by_the_seed_file_and_a_run_of_its_own_overrides_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed = pytester.path / "seconds.json"
    seed.write_text(json.dumps({"test_a.py": 5.0, "test_b.py": 7.0}))
    monkeypatch.setattr(schedule, "SEED_FILE", seed)
    config = pytester.parseconfigure()
    assert recorded_seconds(config) == {"test_a.py": 5.0, "test_b.py": 7.0}
    assert config.cache is not None
    config.cache.set(CACHE_KEY, {"test_b.py": 1.0})
    assert recorded_seconds(config) == {"test_a.py": 5.0, "test_b.py": 1.0}


def test_the_seed_file_names_modules_of_the_suite() -> None:
    """module_seconds.json (a past run's seconds, the order of a fresh clone) is read as numbers
    and names test modules that exist (a stale one would only be ignored)."""
    seeded = json.loads(schedule.SEED_FILE.read_text(encoding="utf-8"))
    tests_dir = Path(schedule.__file__).parent.parent
    assert seeded and all(isinstance(value, int | float) for value in seeded.values())
    missing = [module for module in seeded if not (tests_dir.parent / module).is_file()]
    assert len(missing) <= len(seeded) // 4, missing


def test_a_serial_test_waits_for_the_others_and_holds_back_new_ones(tmp_path: Path) -> None:
    """The readers-writer lock over the workers: a serial test waits for the test running beside
    it to end, and while it waits or runs no other test starts."""
    lock = SerialLock(tmp_path)
    events: list[str] = []
    reader_in = threading.Event()
    release_reader = threading.Event()

    def reader(name: str, hold: threading.Event | None = None) -> None:
        with lock.held(serial=False):
            events.append(f"{name} in")
            if hold is not None:
                reader_in.set()
                hold.wait(10)
            events.append(f"{name} out")

    def writer() -> None:
        with lock.held(serial=True):
            events.append("serial in")
            time.sleep(0.2)
            events.append("serial out")

    first = threading.Thread(target=reader, args=("first", release_reader))
    first.start()
    assert reader_in.wait(10)
    serial = threading.Thread(target=writer)
    serial.start()
    time.sleep(0.2)  # the serial test waits for the first
    late = threading.Thread(target=reader, args=("late",))
    late.start()
    time.sleep(0.2)  # the late test waits behind the serial one
    assert events == ["first in"]
    release_reader.set()
    for thread in (first, serial, late):
        thread.join(10)
    assert events == ["first in", "first out", "serial in", "serial out", "late in", "late out"]


def test_a_serial_test_starts_once_every_set_up_step_beside_the_suite_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the build only: a serial test that ran while vLLM's install or the wheel check still
    ran beside the suite found other processes taking 43% of the CPUs (`make test-parallel`,
    test_engine_process). It waits for each step's status file, whatever the step's exit; a test
    that is not serial waits for none."""
    steps = {env: tmp_path / f"{env}.status" for env in schedule.SETUP_STATUS_ENVS}
    assert set(steps) >= {
        schedule.BUILD_STATUS_ENV,
        schedule.VLLM_STATUS_ENV,
        schedule.WHEEL_STATUS_ENV,
    }
    for env, status in steps.items():
        monkeypatch.setenv(env, str(status))
    steps[schedule.BUILD_STATUS_ENV].write_text("0\n")
    steps[schedule.VLLM_STATUS_ENV].write_text("2\n")  # failed: `vllm_install` says so
    lock = SerialLock(tmp_path / "shared")
    lock.shared.mkdir()

    def item(serial: bool) -> pytest.Item:
        marker = SimpleNamespace(name="serial") if serial else None
        return cast(
            pytest.Item,
            SimpleNamespace(
                nodeid="test_x.py::test_1",
                fixturenames=(),
                get_closest_marker=lambda name: marker,
            ),
        )

    started: list[str] = []

    def run(name: str, serial: bool) -> None:
        protocol = lock.pytest_runtest_protocol(item(serial))
        next(protocol)
        started.append(name)
        with contextlib.suppress(StopIteration):
            next(protocol)

    plain = threading.Thread(target=run, args=("plain", False))
    plain.start()
    plain.join(10)
    assert started == ["plain"]
    serial = threading.Thread(target=run, args=("serial", True))
    serial.start()
    time.sleep(2.5)  # the status files are looked for each second
    assert started == ["plain"]  # the wheel check still runs
    steps[schedule.WHEEL_STATUS_ENV].write_text("0\n")
    serial.join(10)
    assert started == ["plain", "serial"]


def test_under_xdist_a_group_runs_on_one_worker_and_a_serial_test_alone(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole parallel run with this schedule: the modules on the session's vLLM on one worker,
    the serial test with no other test running beside it, and no two tests that use `sshd` (the
    SSH tests' user) at once, though one of them is in the vLLM group and the other in the SSH
    tests' (each test records when it ran)."""
    pytester.makeini("[pytest]\nmarkers =\n    serial\n")
    pytester.makeconftest(GROUP_CONFTEST)
    body = (
        "import os, time, pytest\n"
        "def _ran(name):\n"
        "    start = time.monotonic()\n"
        "    time.sleep(0.3)\n"
        "    with open(os.environ['RAN_LOG'], 'a') as log:\n"
        "        log.write(f\"{name} {os.environ['PYTEST_XDIST_WORKER']} {start} {time.monotonic()}\\n\")\n"
    )
    tests = "".join(f"def test_{i}(): _ran(__name__ + '{i}')\n" for i in range(4))
    on_vllm = "".join(f"def test_{i}(vllm_server): _ran(__name__ + '{i}')\n" for i in range(4))
    # Six: the second unit by its number of tests, so that it starts beside the vLLM group,
    # whose first module (test_u2, first collected) uses sshd too.
    user = "".join(f"def test_{i}(sshd): _ran(__name__ + '{i}')\n" for i in range(6))
    user_on_vllm = "".join(
        f"def test_{i}(vllm_server, sshd): _ran(__name__ + '{i}')\n" for i in range(3)
    )
    pytester.makepyfile(
        test_v1=body + on_vllm,
        test_v2=body + on_vllm,
        test_p1=body + tests,
        test_p2=body + tests,
        test_s=body + "@pytest.mark.serial\ndef test_alone(): _ran('serial')\n" + tests,
        test_u1=body + user,
        test_u2=body + user_on_vllm,
    )
    ran_log = pytester.path / "ran.log"
    monkeypatch.setenv("RAN_LOG", str(ran_log))
    monkeypatch.setenv("PYTHONPATH", str(Path(schedule.__file__).parent.parent))
    result = pytester.runpytest_subprocess(
        "-p", "support.schedule", "-n", "3", "--dist", "loadfile", "--no-loadscope-reorder",
    )  # fmt: skip
    result.assert_outcomes(passed=30)
    ran = [
        (name, worker, float(s), float(e))
        for name, worker, s, e in map(str.split, ran_log.read_text().splitlines())
    ]

    def beside(names: list[str]) -> list[tuple[str, str]]:
        spans = [row for row in ran if row[0] in names]
        return [
            (a[0], b[0])
            for a in spans
            for b in ran
            if b is not a and b[0] in names and a[2] < b[3] and b[2] < a[3]
        ]

    assert len({worker for name, worker, _, _ in ran if name.startswith("test_v")}) == 1
    ((_, _, start, end),) = [row for row in ran if row[0] == "serial"]
    assert [row[0] for row in ran if row[0] != "serial" and row[2] < end and row[3] > start] == []
    user_tests = [row[0] for row in ran if row[0].startswith("test_u")]
    assert len(user_tests) == 9
    assert beside(user_tests) == []
