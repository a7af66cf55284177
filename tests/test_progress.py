"""The live progress line: cell, prompt, phase, done/total and an ETA while benchmark cases run
against the real llama-server; not under -q, not without benchmark cases."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pytest_gpubench.engines.managed import ManagedLlamaServer
from pytest_gpubench.run.progress import Progress, duration

PROMPTS = 'prompts:\n  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 4}\n'
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
CELL = "local:llamacpp:tiny"


def bench(pytester: pytest.Pytester, url: str) -> None:
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: llamacpp, model: tiny, endpoint: '{url}', runs: 3, phases: [warm]}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)


@pytest.mark.engine
def test_one_line_rewritten_per_case(pytester: pytest.Pytester, server: ManagedLlamaServer) -> None:
    bench(pytester, server.base_url)
    result = pytester.runpytest("--color=yes", "--force-load", "-p", "no:cacheprovider")
    assert result.ret == 0
    text = result.stdout.str()
    # Drawn in place: each update starts with a carriage return (pytester's lines split there)
    # and erases what is left of the one before.
    updates = [
        line.replace("test_bench.py ", "", 1)
        for line in result.outlines
        if line.replace("test_bench.py ", "", 1).startswith("gpubench ")
    ]
    assert len(updates) == 6 and all(u.endswith("\x1b[K") for u in updates)
    assert updates[0].startswith(f"gpubench 0/3 · {CELL} · P-EASY · warm #0 · ETA ?")
    assert any(u.startswith(f"gpubench 1/3 · {CELL} · P-EASY · warm #1 · ETA ") for u in updates)
    assert updates[-1].startswith("gpubench 3/3 · ETA 0s")
    assert "ETA ?" not in updates[-1]
    assert "3 passed" in text  # pytest's own count is kept


@pytest.mark.engine
def test_not_under_quiet_or_without_markup(
    pytester: pytest.Pytester, server: ManagedLlamaServer
) -> None:
    bench(pytester, server.base_url)
    quiet = pytester.runpytest("--color=yes", "-q", "--force-load", "-p", "no:cacheprovider")
    assert "gpubench 0/3" not in quiet.stdout.str()
    plain = pytester.runpytest("--color=no", "--force-load", "-p", "no:cacheprovider")
    assert "gpubench 0/3" not in plain.stdout.str()
    plain.stdout.fnmatch_lines(["test_bench.py ...*"])  # pytest's letters, as before


@dataclass(frozen=True)
class FakeCase:
    cell_id: str
    prompt_id: str
    phase: str
    run_idx: int


def test_eta_weighs_each_phase_by_its_own_mean() -> None:
    planned = {
        "c0": FakeCase("a", "P", "cold", 0),
        "w1": FakeCase("a", "P", "warm", 1),
        "c1": FakeCase("b", "P", "cold", 0),
        "w2": FakeCase("b", "P", "warm", 1),
        "w3": FakeCase("b", "P", "warm", 2),
    }
    progress = Progress(planned)
    assert progress.eta_s() is None
    progress.seconds = {"cold": [20.0], "warm": [1.0]}
    progress.finished = {"c0", "w1"}
    progress.done = 2
    assert progress.eta_s() == 22.0  # one cold at 20 s, two warm at 1 s
    assert progress.line(planned["c1"]) == "gpubench 2/5 · b · P · cold #0 · ETA 22s"
    assert duration(65.2) == "1m05s" and duration(3725) == "1h02m"
