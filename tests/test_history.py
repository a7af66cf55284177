"""`gpubench history DIR`: the trend of 30 runs, a regression planted in one marked, the baseline
updates marked; in the terminal and in HTML."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import ledgers

from pytest_gpubench.cli.main import main
from pytest_gpubench.reports.history import read_history, sparkline
from pytest_gpubench.results.judging_settings import JudgingSettings

PLANTED = 17  # the run that is 60 % slower
UPDATES = (0, 20)  # runs started with --baseline-update


@pytest.fixture(scope="module")
def history_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("runs")
    baseline = ledgers.run_records("run-00", seed=0, baseline_update=True, samples=False)
    ledgers.write(directory / "run-00.jsonl", baseline)
    for index in range(1, 30):
        records = ledgers.run_records(
            f"run-{index:02d}",
            seed=index,
            slowdown=1.6 if index == PLANTED else 1.0,
            # File names out of order: the history orders runs by their start time.
            started=f"2026-11-{index + 1:02d}T10:00:00.000Z",
            baseline_update=index in UPDATES,
            samples=False,
            against=baseline,
        )
        ledgers.write(directory / f"z-{29 - index:02d}.jsonl", records)
        if index in UPDATES:
            baseline = records
    return directory


def test_thirty_runs_in_start_order_with_the_regression_marked(history_dir: Path) -> None:
    history = read_history(history_dir)
    assert [run.run_id for run in history.runs] == [f"run-{i:02d}" for i in range(30)]
    regressed = [index for index, run in enumerate(history.runs) if run.regressions]
    assert regressed == [PLANTED]
    assert [i for i, run in enumerate(history.runs) if run.baseline_update] == list(UPDATES)
    ttft = next(
        t
        for t in history.trends
        if (t.cell_id, t.prompt_id, t.metric)
        == ("local:llamacpp:tiny", "P-EASY", "warm_ttft_p50_ms")
    )
    assert len(ttft.values) == 30 and all(value is not None for value in ttft.values)
    peak = max(range(30), key=lambda i: ttft.values[i] or 0)
    assert peak == PLANTED


def test_terminal_shows_the_trend_and_marks(
    history_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["history", str(history_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("30 runs from 2026-11-01T10:00:00.000Z to 2026-11-30T10:00:00.000Z")
    row = next(
        line
        for line in out.splitlines()
        if line.startswith("local:llamacpp:tiny") and "TTFT p50 ms" in line
    )
    spark = sparkline_in(row)
    assert len(spark) == 30 and spark[PLANTED] == "█"
    assert max(spark[:PLANTED] + spark[PLANTED + 1 :]) < "▄"
    marks = row.split(spark, 1)[1].split()[0]
    assert len(marks) == 30
    assert marks[PLANTED] == "R" and marks[0] == "B" and marks[20] == "B"
    assert set(marks) == {"R", "B", "·"}
    assert f"REGRESSION in run run-{PLANTED} (2026-11-18T10:00:00.000Z)" in out
    assert "baseline update: run run-20" in out


def sparkline_in(row: str) -> str:
    cells = [cell for cell in row.split("  ") if cell.strip()]
    return next(cell.strip() for cell in cells if set(cell.strip()) <= set("▁▂▃▄▅▆▇█ "))


def test_html_marks_the_regression(history_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "history.html"
    assert main(["history", str(history_dir), "--html", "-o", str(output)]) == 0
    text = output.read_text(encoding="utf-8")
    assert text.count("<svg") == 4  # one chart per (cell, prompt)
    assert "run-17" in text and "baseline update" in text
    assert "<script" not in text


def test_sparkline_scales_between_min_and_max() -> None:
    assert sparkline([1.0, 2.0, None, 3.0]) == "▁▅ █"
    assert sparkline([5.0, 5.0]) == "▁▁"


def test_an_empty_directory_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["history", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip() == f"gpubench: error: {tmp_path}: holds no ledger (*.jsonl)"
    )


def test_a_baseline_update_is_marked_from_the_settings_the_run_recorded(tmp_path: Path) -> None:
    """The run's recorded settings say whether it ratified, not its command line: the long name
    `--gpubench-baseline-update` and an `addopts` flag (no word on the command line) were never
    marked; `--smoke` writes no baseline, whatever flag it ran with. A ledger of an earlier
    release, with no settings, is read from its command line, by either name."""
    runs = {
        "long-name": (["--gpubench-baseline-update"], {"baseline_update": True}, True),
        "addopts": ([], {"baseline_update": True}, True),
        "smoke": (
            ["--baseline-update", "--smoke"],
            {"baseline_update": True, "smoke": True},
            False,
        ),
        "plain": (["-k", "P-EASY"], {}, False),
        "older-long-name": (["--gpubench-baseline-update"], None, True),
        "older-short-name": (["--baseline-update"], None, True),
    }
    for index, (name, (flags, settings, _)) in enumerate(runs.items()):
        records = ledgers.run_records(
            name, seed=index, started=f"2026-11-{index + 1:02d}T10:00:00.000Z", samples=False
        )
        records[0]["command_line"] = ["pytest", "benchmarks/", *flags]
        if settings is not None:
            records[0]["judging"] = JudgingSettings.model_validate(settings).to_record()
        ledgers.write(tmp_path / f"{name}.jsonl", records)
    history = read_history(tmp_path)
    assert {run.run_id: run.baseline_update for run in history.runs} == {
        name: marked for name, (_, _, marked) in runs.items()
    }
