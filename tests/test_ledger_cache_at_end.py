"""A large session writes its ledger's columnar cache as it writes the ledger, so that the first
report on it reads the cache and nothing re-reads the ledger as the session ends (the thresholds
are lowered here: a session of 10,000 calls is a benchmark's job, not a test's). The engine is
the Ollama stand-in (tests/support/standins.py)."""

from __future__ import annotations

import pytest
from support.standins import OllamaStandin, serving

from pytest_gpubench.reports import frame_cache
from pytest_gpubench.reports.frame import cache_path, read_cached, read_ledger_frame

PROMPTS = 'prompts:\n  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 6}\n'
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"


def run_session(pytester: pytest.Pytester, url: str) -> None:
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: ollama, model: 'qwen3.5:0.8b', endpoint: '{url}',"
        " runs: 4, phases: [warm]}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)
    assert pytester.runpytest("--force-load").ret == 0


def test_a_large_session_leaves_the_cache_its_first_report_reads(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frame_cache, "SMALL_LEDGER_LINES", 4)
    monkeypatch.setattr(frame_cache, "FRAME_LINES", 3)  # frames added while the run goes
    with serving(OllamaStandin()) as url:
        run_session(pytester, url)
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    assert cache_path(ledger).is_file()
    cached = read_cached(ledger)
    assert cached is not None  # it holds the closed ledger whole: the report's first read uses it
    assert len(cached.calls) == 4
    assert cached.end["type"] == "end"
    assert read_ledger_frame(ledger).summaries(with_samples=False)


def test_a_small_session_writes_no_cache(pytester: pytest.Pytester) -> None:
    with serving(OllamaStandin()) as url:
        run_session(pytester, url)
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    assert not cache_path(ledger).exists()
