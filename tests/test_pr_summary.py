"""The pull request summary: a regressed session in a GitHub Actions job appends its Markdown to
$GITHUB_STEP_SUMMARY (regressions first, the cells, the load points, where the report is);
without the variable it is written beside the ledger.

Ollama cannot run here: the warm cell is the stand-in that follows Ollama's docs/api.md (its speed
is the test's to set, tests/support/standins.py); the load cell is the timing-controlled keep-alive
server (tests/support/keepalive_server.py)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
from support.keepalive_server import keepalive_server
from support.standins import OllamaStandin, serving

from pytest_gpubench.ledger.schema import EndRecord
from pytest_gpubench.reports.pr_summary import render_pr_summary

PROMPTS = """\
prompts:
  P-EASY: {intent: short, prompt: "Say hi.", max_tokens: 6}
"""
TEST_FILE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"


def bench(pytester: pytest.Pytester, ollama: str, load: str) -> None:
    pytester.makefile(
        ".yaml",
        prompts=PROMPTS,
        cells="nodes: {local: {kind: local}}\ncells:\n"
        f"  - {{node: local, engine: ollama, model: 'qwen3.5:0.8b', endpoint: '{ollama}',"
        " runs: 10, phases: [warm]}\n"
        f"  - {{node: local, engine: openai, model: m, endpoint: '{load}', phases: [warm],"
        " runs: 2, load: {concurrency: [2], requests: 8,"
        # Only the warm cell is slowed: the load point's thresholds leave a shared machine's
        # noise alone.
        " thresholds: {throughput: 0.95, ttft_p99: 100, tpot_p99: 100}}}\n",
    )
    pytester.makepyfile(test_bench=TEST_FILE)


def test_a_regressed_session_appends_its_summary_to_the_github_step_summary(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    summary = tmp_path / "step_summary.md"
    summary.write_text("# an earlier step's summary\n")
    server = OllamaStandin(token_s=0.003)
    with serving(server) as ollama, keepalive_server() as load:
        bench(pytester, ollama, load.url)
        update = pytester.runpytest("--force-load", "--baseline-update")
        assert update.ret == 0, update.stdout.str()[-2000:]
        # Without the variable the summary lies beside the ledger.
        (written,) = (pytester.path / "runs").glob("*.summary.md")
        assert "## ✅ gpubench: exit status 0" in written.read_text()
        server.token_s = 0.009  # three times slower per token
        monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
        monkeypatch.setenv("GITHUB_SERVER_URL", "https://github.com")
        monkeypatch.setenv("GITHUB_REPOSITORY", "acme/llm")
        monkeypatch.setenv("GITHUB_RUN_ID", "42")
        slower = pytester.runpytest("--force-load")
    assert slower.ret == 6
    slower.stdout.fnmatch_lines([f"pull request summary: {summary}"])
    text = summary.read_text()
    print(text)
    # Appended after what an earlier step wrote, as GitHub documents.
    assert text.startswith("# an earlier step's summary\n## ❌ gpubench: exit status 6: ")
    assert "regression(s)**" in text
    verdicts = text.split("### Verdicts", 1)[1].split("###", 1)[0]
    rows = [line for line in verdicts.splitlines() if line.startswith("| ")][1:]
    # Regressions first, the worst news on top.
    assert rows[0].startswith("| **REGRESSION** | local:ollama:qwen3.5:0.8b | P-EASY |")
    words = [row.split(" | ")[0] for row in rows]
    assert words == sorted(words, key=lambda word: word != "| **REGRESSION**")
    assert "### Cells" in text and "| local:openai:m | measured |" in text
    assert "### Load points" in text and "| local:openai:m | c2 |" in text
    assert "(https://github.com/acme/llm/actions/runs/42)" in text
    assert len(text.splitlines()) < 60  # read in ten seconds
    # Only the ledger's own summary file from the first run: the second went to GitHub's.
    assert len(list((pytester.path / "runs").glob("*.summary.md"))) == 1


def test_verdicts_are_ordered_regressions_first_and_ok_ones_only_counted() -> None:
    verdicts = [
        {"verdict": "ok", "cell_id": "c", "prompt_id": "P", "metric": "m1"},
        {"verdict": "win", "cell_id": "c", "prompt_id": "P", "metric": "m2", "change_ratio": 0.5},
        {"verdict": "a-newer-word", "cell_id": "c", "prompt_id": "P", "metric": "m3"},
        {"verdict": "regression", "cell_id": "c|d", "prompt_id": "P", "metric": "m4",
         "change_ratio": 1.35, "p_value": 0.001},
    ]  # fmt: skip
    text = render_pr_summary(
        cast(EndRecord, {"exit_status": 6, "regressions": 1, "verdicts": verdicts, "cells": []}),
        [],
        ledger="runs/x.jsonl",
        report="`gpubench report --html runs/x.jsonl -o report.html`",
    )
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0] for row in rows[1:]] == [
        "| **REGRESSION**",
        "| win",
        "| a-newer-word",
    ]
    assert "| c\\|d | P | m4 | +35.0% | 0.001 |" in rows[1]
    assert "_1 within their thresholds._" in text
    assert text.rstrip().endswith("`gpubench report --html runs/x.jsonl -o report.html`")
