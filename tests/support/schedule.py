"""The order in which `make test-fast`'s workers take the test modules (`--dist loadfile
--no-loadscope-reorder`: a module runs whole on one worker, so its module-scoped servers and
reports are made once; each worker takes the next module as it runs out).

Longest first: a module that took 30 s and started last would run alone for its last 30 s. Each
parallel run records, in pytest's cache, how long each module took; the next run orders the
modules by those seconds, longest first (longest processing time first: within a second of an
even split on the fast loop's figures), modules not seen before by their number of tests as
xdist would. Within a module the tests keep their order. Serial runs (`make test`) keep the
collection order and record nothing.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

# Under .pytest_cache/v/; one number per module path, the whole module's seconds (set-up, call
# and tear-down of each test) on the last parallel run that ran it.
CACHE_KEY = "gpubench-tests/module-seconds"


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def is_controller(config: pytest.Config) -> bool:
    """The process of `-n N` that starts the workers and runs no test itself."""
    return getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")


def _parallel(config: pytest.Config) -> bool:
    """A worker of `-n N`, or the controller that started them."""
    return hasattr(config, "workerinput") or is_controller(config)


def longest_modules_first(items: list[pytest.Item], seconds: dict[str, float]) -> None:
    """Reorder `items` in place: the modules by `seconds` (longest first), then the modules
    `seconds` lacks by their number of tests (most first); a module's tests stay together and in
    their order."""
    tests: dict[str, int] = defaultdict(int)
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        module = _module(item.nodeid)
        tests[module] += 1
        first_seen.setdefault(module, index)

    def rank(item: pytest.Item) -> tuple[bool, float, int, int]:
        module = _module(item.nodeid)
        known = module in seconds
        return (not known, -seconds.get(module, 0.0), -tests[module], first_seen[module])

    items.sort(key=rank)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cache = getattr(config, "cache", None)
    if cache is None or not _parallel(config):
        return
    recorded = cache.get(CACHE_KEY, {})
    if not isinstance(recorded, dict):
        recorded = {}
    seconds = {
        str(module): float(value)
        for module, value in recorded.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    longest_modules_first(items, seconds)


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


def pytest_configure(config: pytest.Config) -> None:
    if is_controller(config):
        config.pluginmanager.register(ModuleClock(), "gpubench-module-clock")
