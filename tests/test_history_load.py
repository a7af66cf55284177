"""`gpubench history` tracks load points: 10 generated ledgers with load records, a load
regression planted in one (its throughput 40 % down, judged by the load gate into its end
record), the baseline update marked B, the regression R, in the terminal and in HTML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import ledgers

from pytest_gpubench.cli.main import main
from pytest_gpubench.reports.history import read_history
from pytest_gpubench.results.load_gate import baseline_point, judge_loads, point_key

CELL = ledgers.CELLS[0]
PLANTED = 6
RUNS = 10


def run_with_loads(index: int, baseline: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    records = ledgers.run_records(
        f"run-{index:02d}",
        seed=index,
        started=f"2026-11-{index + 1:02d}T10:00:00.000Z",
        baseline_update=index == 0,
        samples=False,
        cells=(CELL,),
    )
    loads = ledgers.load_records(
        f"run-{index:02d}", CELL, seed=index, slowdown=1.6 if index == PLANTED else 1.0
    )
    end = records[-1]
    if baseline is not None:
        points = {point_key(r): baseline_point(r) for r in baseline}
        verdicts = [v.to_record() for v in judge_loads(loads, {CELL: points}, {})]
        end["verdicts"] = [*end["verdicts"], *verdicts]
        end["regressions"] += sum(v["verdict"] == "regression" for v in verdicts)
    return [*records[:-1], *loads, end]


@pytest.fixture(scope="module")
def history_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("runs")
    baseline: list[dict[str, Any]] | None = None
    for index in range(RUNS):
        records = run_with_loads(index, baseline)
        ledgers.write(directory / f"run-{index:02d}.jsonl", records)
        if index == 0:
            baseline = [r for r in records if r["type"] == "load"]
    return directory


def test_load_points_have_trends_with_the_regression_marked(
    history_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    history = read_history(history_dir)
    regressed = {index for index, run in enumerate(history.runs) if run.regressions}
    assert regressed == {PLANTED}
    throughput = next(
        t
        for t in history.trends
        if (t.cell_id, t.prompt_id, t.metric)
        == (CELL, "P-EASY@load-c4", "load_output_tokens_per_sec")
    )
    assert len(throughput.values) == RUNS and None not in throughput.values
    assert min(range(RUNS), key=lambda i: throughput.values[i] or 0) == PLANTED

    assert main(["history", str(history_dir)]) == 0
    out = capsys.readouterr().out
    row = next(
        line for line in out.splitlines() if "P-EASY@load-c4" in line and "output tokens/s" in line
    )
    marks = next(cell for cell in row.split() if set(cell) <= {"R", "B", "·"} and len(cell) == 10)
    assert marks[0] == "B" and marks[PLANTED] == "R" and set(marks) == {"R", "B", "·"}
    for label in ("TTFT p99", "TPOT p99"):
        assert any("P-EASY@load-c1" in line and label in line for line in out.splitlines())
    assert f"REGRESSION in run run-{PLANTED:02d}" in out and "output tokens/s" in out


def test_the_html_history_charts_the_load_points(history_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "history.html"
    assert main(["history", str(history_dir), "--html", "-o", str(output)]) == 0
    text = output.read_text(encoding="utf-8")
    # Per cell: the warm prompts' charts and one per load point.
    assert "P-EASY@load-c1" in text and "P-EASY@load-c4" in text
    assert "output tokens/s" in text
