"""The pull request summary: a regressed session in a GitHub Actions job appends its Markdown to
$GITHUB_STEP_SUMMARY (regressions first, the cells, the load points, where the report is);
without the variable it is written beside the ledger.

Ollama cannot run here: the warm cell is the stand-in that follows Ollama's docs/api.md (its speed
is the test's to set, tests/support/standins.py); the load cell is the timing-controlled keep-alive
server (tests/support/keepalive_server.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

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


def test_the_load_points_show_their_intervals_slices_trend_and_the_sweeps_stop() -> None:
    """The p99s with their intervals and n (an open side and `*` where too few requests bound
    them), the slices' throughput spread (a point that degraded halfway), a rising queue, and
    where a sweep stopped rising."""
    point = {
        "cell_id": "local:openai:m", "load_point": "r40", "pattern": "open", "valid": True,
        "achieved_rate": 39.9, "output_tokens_per_sec": 319.1, "ttft_ms_p99": 27.81,
        "tpot_ms_p99": 2.84, "ttft_ms_n": 40,
        "percentile_intervals": {
            "confidence": 0.95,
            "ttft_ms": {"n": 40, "p99": [26.28, None]},
            "tpot_ms": {"n": 40, "p99": [2.57, 3.1]},
            "too_few": ["ttft_ms_p99"],
        },
        "slices": [{"output_tokens_per_sec": 640.0}, {"output_tokens_per_sec": 310.5}],
        "trend": {"saturated": True, "ttft_tau": 0.81, "in_flight_tau": 0.7},
    }  # fmt: skip
    sweep = {
        "cell_id": "local:openai:m", "load_point": "sweep", "pattern": "sweep",
        "saturation_rate": 120.0,
        "saturation_stop": {"load_point": "sweep-r135.9", "rate": 135.9, "skipped": ["s2"],
                            "time_kept_s": 0.11},
    }  # fmt: skip
    text = render_pr_summary(
        cast(EndRecord, {"exit_status": 0, "verdicts": [], "cells": []}),
        cast(Any, [point, sweep]),
        ledger="runs/x.jsonl",
        report="-",
    )
    assert "| TTFT p99 [95% CI] ms | TPOT p99 [95% CI] ms |" in text
    (row,) = [line for line in text.splitlines() if line.startswith("| local:openai:m | r40 ")]
    cells = [cell.strip() for cell in row.strip("|").split(" | ")]
    assert cells[4:8] == ["310.5 to 640.0 (2)", "40", "27.81 [26.28, open]\\*", "2.84 [2.57, 3.10]"]
    assert cells[9] == "ok; queue rising (TTFT τ 0.81, in flight τ 0.70)"
    assert "_\\* too few requests for the interval" in text
    assert (
        "saturation 120.00 req/s; over-saturated at 135.90 req/s (sweep-r135.9), 1 higher rate"
        " not run (0.1 s kept)"
    ) in text
