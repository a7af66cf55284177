"""The fast loop's module order (tests/support/schedule.py): the modules that took longest on the
last parallel run go first, each module's tests together and in their order; what a run took is
recorded for the next one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal, cast

import pytest
from support.schedule import CACHE_KEY, ModuleClock, longest_modules_first


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
