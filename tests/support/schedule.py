"""How the workers of `make test` and `make test-fast` share the suite (`-n 3 --dist loadfile
--no-loadscope-reorder`): a module runs whole on one worker, so its module-scoped servers and
reports are made once; each worker takes the next unit of work as it runs out.

Units. A unit is a module, except that the modules of a group run together on one worker, one
after another: every module with a test on the session's vLLM (fixture `vllm_server`) is one
unit, so that one worker starts it (a minute or more on two cores); every module with a test on
the Slurm cluster (`slurm_cluster`) another, so that one cluster runs their jobs; every other
module with an SSH test (`sshd`) a third: they log the same unprivileged user in, and some count
its processes, so they run one after another anyway (a lock, `SerialLock`). Each worker writes
what it grouped into a folder the controller made (`SHARED_DIR_KEY`), and the controller's
scheduler (`GroupedFileScheduling`) reads it when it splits the collection into units.

Order. Longest first: a unit that took 30 s and started last would run alone for its last 30 s.
Each parallel run records, in pytest's cache, how long each module took; the next run orders the
units by those seconds, longest first (longest processing time first), a fresh clone by the
seconds in `module_seconds.json` beside this file (a past run's, updated by hand), and modules
seen in neither by their number of tests, as xdist would. Within a unit the modules and tests keep
their collection order. The units with a serial test go last, and within a group so do the modules
with one; where llama-server is still being built beside the suite (`BUILD_STATUS_ENV`, `make
test`), so do those with a test that needs the built binary.

Serial tests. A test marked `serial` measures the machine's own timing or loads it on purpose
(busy loops pinned to a CPU): under `-n N` it runs while no other worker runs a test
(`SerialLock`), and once every set-up step beside the suite has ended (llama-server's build,
vLLM's install, the wheel check: `SETUP_STATUS_ENVS`), each of which takes CPUs of its own. A
test that uses sshd's test user runs while no other worker runs one that does.

A serial run (no `-n`) keeps the collection order and records nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

# Under .pytest_cache/v/; one number per module path, the whole module's seconds (set-up, call
# and tear-down of each test) on the last parallel run that ran it.
CACHE_KEY = "gpubench-tests/module-seconds"
# A past whole-suite run's seconds per module: the order of a fresh clone, which has no cache.
SEED_FILE = Path(__file__).with_name("module_seconds.json")
# The groups of modules that run on one worker, by the fixture of a shared resource one of their
# tests uses (the first that matches names the group): the session's one vLLM, the one Slurm
# cluster, and the SSH tests' user, whose tests run one after another anyway (RESOURCE_FIXTURES).
GROUP_FIXTURES = (("vllm_server", "vllm"), ("slurm_cluster", "slurm"), ("sshd", "sshd"))
# The folder the controller shares with its workers (workerinput): each worker's groups and the
# serial tests' lock files.
SHARED_DIR_KEY = "gpubench_shared_dir"
# Set by `make test` while llama-server is built from source beside the suite: the file the build
# writes its exit status to once it has ended.
BUILD_STATUS_ENV = "GPUBENCH_TEST_BUILD_STATUS"
# The fixture that hands out the built binary (tests/conftest.py).
BUILD_FIXTURE = "llama_server"
# The fixtures of a resource of the machine that the workers share, by the lock a test that uses
# one takes alone (SerialLock): sshd's test user (tests/support/ssh_fixtures.py).
RESOURCE_FIXTURES = {"sshd": "ssh-user"}
# Set by `make test` while vLLM is installed beside the suite (`make vllm`): its status file.
VLLM_STATUS_ENV = "GPUBENCH_TEST_VLLM_STATUS"
# Set by `make test-parallel` while the wheel check runs beside the suite: its status file. No
# test needs the wheel, but building it and installing it take the CPUs for minutes.
WHEEL_STATUS_ENV = "GPUBENCH_TEST_WHEEL_STATUS"
# Every set-up step beside the suite: a serial test starts once each has ended (a serial test
# beside vLLM's install or the wheel check found other processes taking 43% of the CPUs).
SETUP_STATUS_ENVS = (BUILD_STATUS_ENV, VLLM_STATUS_ENV, WHEEL_STATUS_ENV)
# How long a test waits for a set-up step beside the suite (the build takes about 5 minutes on 2
# cores, vLLM's install about 2).
SETUP_WAIT_S = 30 * 60.0


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def is_controller(config: pytest.Config) -> bool:
    """The process of `-n N` that starts the workers and runs no test itself."""
    return getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")


def _parallel(config: pytest.Config) -> bool:
    """A worker of `-n N`, or the controller that started them."""
    return hasattr(config, "workerinput") or is_controller(config)


def _shared_dir(config: pytest.Config) -> Path | None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or SHARED_DIR_KEY not in workerinput:
        return None
    return Path(workerinput[SHARED_DIR_KEY])


def module_groups(items: list[pytest.Item]) -> dict[str, str]:
    """The group of each module that has one: the first of GROUP_FIXTURES one of its tests uses
    (directly or through another fixture)."""
    used: dict[str, set[str]] = defaultdict(set)
    for item in items:
        names = getattr(item, "fixturenames", ())
        for fixture, group in GROUP_FIXTURES:
            if fixture in names:
                used[_module(item.nodeid)].add(group)
    return {
        module: next(group for _, group in GROUP_FIXTURES if group in groups)
        for module, groups in used.items()
    }


def is_serial(item: pytest.Item) -> bool:
    """Whether a test runs with no other test beside it (SerialLock)."""
    return item.get_closest_marker("serial") is not None


def needs_build(item: pytest.Item) -> bool:
    """Whether a test waits for the build beside the suite: it uses the built binary or runs
    serially (tests/conftest.py's `llama_server`, SerialLock)."""
    return BUILD_FIXTURE in getattr(item, "fixturenames", ()) or is_serial(item)


def longest_first(
    items: list[pytest.Item],
    seconds: Mapping[str, float],
    groups: Mapping[str, str] | None = None,
    *,
    late: Callable[[pytest.Item], bool] | None = None,
) -> None:
    """Reorder `items` in place by unit (a module, or the modules of a group): the units whose
    modules `seconds` knows by those seconds (longest first), then the others by their number of
    tests (most first); a unit's tests stay together and, module by module, in their order.

    With `late`: a module with a test that is `late` is late, and so is a unit with a late
    module: those go after every other unit, and within a group its late modules go last. (A
    group taken early and left waiting halfway for the build holds its worker while modules that
    need nothing wait their turn: in a fresh clone's run three workers each waited 4.5 to 11
    minutes so.)"""
    groups = groups or {}
    tests: dict[str, int] = defaultdict(int)
    first_seen: dict[str, int] = {}
    members: dict[str, set[str]] = defaultdict(set)
    late_modules: set[str] = set()
    for index, item in enumerate(items):
        module = _module(item.nodeid)
        unit = groups.get(module, module)
        tests[unit] += 1
        first_seen.setdefault(unit, index)
        first_seen.setdefault(module, index)
        members[unit].add(module)
        if late is not None and late(item):
            late_modules.add(module)
    unit_seconds = {
        unit: sum(seconds[module] for module in modules if module in seconds)
        for unit, modules in members.items()
        if any(module in seconds for module in modules)
    }

    def rank(item: pytest.Item) -> tuple[bool, bool, float, int, int, bool, int]:
        module = _module(item.nodeid)
        unit = groups.get(module, module)
        return (
            bool(members[unit] & late_modules),
            unit not in unit_seconds,
            -unit_seconds.get(unit, 0.0),
            -tests[unit],
            first_seen[unit],
            module in late_modules,
            first_seen[module],
        )

    items.sort(key=rank)


def longest_modules_first(items: list[pytest.Item], seconds: dict[str, float]) -> None:
    """Reorder `items` in place: the modules by `seconds` (longest first), then the modules
    `seconds` lacks by their number of tests (most first); a module's tests stay together and in
    their order."""
    longest_first(items, seconds)


def _numbers(recorded: object) -> dict[str, float]:
    if not isinstance(recorded, dict):
        return {}
    return {
        str(module): float(value)
        for module, value in recorded.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def recorded_seconds(config: pytest.Config) -> dict[str, float]:
    """Each module's seconds: the last parallel run's (pytest's cache) over the seed file's."""
    try:
        seeded = _numbers(json.loads(SEED_FILE.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        seeded = {}
    cache = getattr(config, "cache", None)
    cached = _numbers(cache.get(CACHE_KEY, {})) if cache is not None else {}
    return {**seeded, **cached}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _parallel(config):
        return
    groups = module_groups(items)
    # The serial tests late in any case: at the end the other workers have less left to wait with
    # (and a group's session server is started by a test that does not hold the others back).
    building = bool(os.environ.get(BUILD_STATUS_ENV))
    longest_first(
        items, recorded_seconds(config), groups, late=needs_build if building else is_serial
    )
    shared = _shared_dir(config)
    if shared is not None:
        worker = str(getattr(config, "workerinput", {}).get("workerid", "worker"))
        written = shared / f".{worker}.groups.json"
        written.write_text(json.dumps(groups), encoding="utf-8")
        written.replace(shared / f"{worker}.groups.json")


def _scheduler_class() -> type[Any] | None:
    try:
        from xdist.scheduler import LoadFileScheduling
    except ImportError:  # pragma: no cover - xdist is a test dependency
        return None

    class GroupedFileScheduling(LoadFileScheduling):  # type: ignore[misc]
        """`--dist loadfile` with the modules of a group (module_groups, as the workers wrote
        them into the shared folder) as one unit."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self._groups: dict[str, str] | None = None
            shared = getattr(config, "_gpubench_shared_dir", None)
            self._shared = Path(shared) if shared is not None else None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                # Read when the collection is split: every worker has written its groups
                # (before it reported its collection).
                self._groups = {}
                if self._shared is not None:
                    for written in sorted(self._shared.glob("*.groups.json")):
                        with contextlib.suppress(OSError, ValueError):
                            self._groups.update(json.loads(written.read_text(encoding="utf-8")))
            module = _module(nodeid)
            group = self._groups.get(module)
            return f"group:{group}" if group is not None else module

    return GroupedFileScheduling


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    scheduling = _scheduler_class()
    return None if scheduling is None else scheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    shared = getattr(node.config, "_gpubench_shared_dir", None)
    if shared is not None:
        node.workerinput[SHARED_DIR_KEY] = str(shared)


class ModuleClock:
    """Sums each module's reported seconds on the controller, and records them at the end."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[_module(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        cache = getattr(session.config, "cache", None)
        if cache is None or not self.seconds:
            return
        recorded = cache.get(CACHE_KEY, {})
        merged = dict(recorded) if isinstance(recorded, dict) else {}
        merged.update({module: round(value, 3) for module, value in self.seconds.items()})
        cache.set(CACHE_KEY, merged)


def setup_status(env: str = BUILD_STATUS_ENV, timeout_s: float = SETUP_WAIT_S) -> str | None:
    """Wait until the set-up step beside the suite whose status file `env` names has written its
    exit status, and return it; None where none runs beside the suite, or it did not end in
    `timeout_s`."""
    status_file = os.environ.get(env)
    if not status_file:
        return None
    status = Path(status_file)
    deadline = time.monotonic() + timeout_s
    while not status.exists():
        if time.monotonic() > deadline:
            return None
        time.sleep(1.0)
    return status.read_text(encoding="utf-8").strip()


def wait_for_setup(env: str, what: str, timeout_s: float = SETUP_WAIT_S) -> None:
    """Wait for the set-up step beside the suite whose status file `env` names (`what`, in the
    message) to end; fail where it failed or did not end in `timeout_s`. Nothing to wait for
    where none runs."""
    status_file = os.environ.get(env)
    if not status_file:
        return
    code = setup_status(env, timeout_s)
    if code is None:
        pytest.fail(f"{what} beside the suite did not end in {timeout_s:.0f} s")
    if code != "0":
        log = Path(status_file).with_suffix(".log")
        tail = log.read_text(encoding="utf-8", errors="replace")[-2000:] if log.exists() else ""
        pytest.fail(f"{what} beside the suite failed (exit {code}):\n{tail}")


def wait_for_every_setup(timeout_s: float = SETUP_WAIT_S) -> None:
    """Wait until every set-up step beside the suite (SETUP_STATUS_ENVS) has ended, however it
    ended: a failed one fails the fixture that needs it, and `make test-parallel`."""
    for env in SETUP_STATUS_ENVS:
        setup_status(env, timeout_s)


def wait_for_build() -> None:
    """Wait for llama-server's source build beside the suite (BUILD_STATUS_ENV)."""
    wait_for_setup(BUILD_STATUS_ENV, "make engine-build")


def wait_for_vllm() -> None:
    """Wait for vLLM's install beside the suite (VLLM_STATUS_ENV)."""
    wait_for_setup(VLLM_STATUS_ENV, "make vllm")


class SerialLock:
    """Locks over the workers of `-n N` (flock on files in the shared folder), each held for a
    test's whole protocol (set-up, call, tear-down, so a module's servers start and stop inside).

    A readers-writer lock: a test marked `serial` takes it alone, every other test shared. A
    serial test first takes the turnstile, which every other test passes on its way in, so that
    no new test starts while it waits for those running to end.

    And one lock per resource of the machine that tests of several workers would share, taken
    alone by each test that uses it (RESOURCE_FIXTURES): the SSH tests' unprivileged user, whose
    processes some tests count (no llama-server of theirs left once a run ends) while each
    worker's sshd logs that same user in."""

    def __init__(self, shared: Path) -> None:
        self.shared = shared
        self.turnstile = shared / "serial.turnstile"
        self.room = shared / "serial.lock"

    @contextlib.contextmanager
    def _locked(self, path: Path, mode: int) -> Iterator[None]:
        with path.open("a+b") as handle:
            fcntl.flock(handle.fileno(), mode)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    @contextlib.contextmanager
    def held(self, serial: bool) -> Iterator[None]:
        mode = fcntl.LOCK_EX if serial else fcntl.LOCK_SH
        with self.room.open("a+b") as room:
            with self._locked(self.turnstile, mode):
                fcntl.flock(room.fileno(), mode)
            try:
                yield
            finally:
                fcntl.flock(room.fileno(), fcntl.LOCK_UN)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, None, None]:
        serial = item.get_closest_marker("serial") is not None
        if serial:
            wait_for_every_setup()  # not beside a set-up step's own processes either
        used = getattr(item, "fixturenames", ())
        with contextlib.ExitStack() as locks:
            locks.enter_context(self.held(serial))
            # Always after the room, in one order: no worker holds one and waits for another
            # that a waiting worker holds.
            for fixture, resource in sorted(RESOURCE_FIXTURES.items()):
                if fixture in used:
                    locks.enter_context(
                        self._locked(self.shared / f"{resource}.lock", fcntl.LOCK_EX)
                    )
            yield


def pytest_configure(config: pytest.Config) -> None:
    if is_controller(config):
        shared = Path(tempfile.mkdtemp(prefix="gpubench-xdist-"))
        config._gpubench_shared_dir = shared  # type: ignore[attr-defined]
        config.add_cleanup(lambda: shutil.rmtree(shared, ignore_errors=True))
        config.pluginmanager.register(ModuleClock(), "gpubench-module-clock")
    shared_dir = _shared_dir(config)
    if shared_dir is not None:
        config.pluginmanager.register(SerialLock(shared_dir), "gpubench-serial-lock")
