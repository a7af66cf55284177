"""`gpubench compare OLD NEW` is the gate with OLD as the reference (issue 44): NEW is judged
through the one pipeline (results/judging.py) with the settings it recorded, and the command
exits with the gate's statuses, so what could not be told never exits 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.ledgers import CELLS, run_records, write

from pytest_gpubench.cli.main import main
from pytest_gpubench.config.cell import Thresholds
from pytest_gpubench.core.status import EXIT_INCOMPARABLE, EXIT_REGRESSION, EXIT_UNSTEADY
from pytest_gpubench.results.baseline_update import update_baselines
from pytest_gpubench.results.judging_settings import (
    CellJudging,
    JudgingSettings,
    resolved_thresholds,
)


def _with_settings(records: list[dict[str, Any]], **thresholds: float) -> list[dict[str, Any]]:
    """The run's meta records the settings it was judged with: these thresholds for each cell."""
    settings = JudgingSettings(
        cells={
            cell_id: CellJudging(
                node=cell_id.split(":")[0],
                thresholds=resolved_thresholds(Thresholds(**thresholds)),
                runs=30,
            )
            for cell_id in CELLS
        }
    )
    records[0]["judging"] = settings.to_record()
    return records


def _verdict_words(out: str) -> set[str]:
    return {line.split()[-1] for line in out.splitlines() if line.startswith(CELLS)}


@pytest.mark.parametrize("reference", ["ledger", "baselines"])
def test_compare_of_a_run_whose_only_finding_is_blind_does_not_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], reference: str
) -> None:
    """Three warm calls a side cannot show a change of 20 %: the gate calls that `blind` and
    holds the run back (exit 10). compare exited 0 on it: only a regression failed it."""
    one = CELLS[:1]  # (the other cell fails a call of three: a regression of its success rate)
    old = write(tmp_path / "old.jsonl", run_records("old", seed=1, warm=3, cells=one))
    if reference == "baselines":
        update_baselines(tmp_path / "baselines", run_records("old", seed=1, warm=3, cells=one))
        old = tmp_path / "baselines"
    new = write(tmp_path / "new.jsonl", run_records("new", seed=2, warm=3, cells=one))
    status = main(["compare", str(old), str(new)])
    out = capsys.readouterr().out
    assert _verdict_words(out) == {"blind", "ok"}, out  # ok: the success rate
    assert status == EXIT_UNSTEADY, out
    assert f"gpubench compare: exit status {EXIT_UNSTEADY}:" in out


def test_compare_judges_with_the_thresholds_the_new_run_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TTFT 10 % slower passes the default 20 % but not the 5 % the run was judged with."""
    old = write(tmp_path / "old.jsonl", run_records("old", seed=1))
    new_records = run_records("new", seed=2, slowdown=1.1)
    new = write(tmp_path / "new.jsonl", new_records)
    assert main(["compare", str(old), str(new)]) == 0, capsys.readouterr().out
    capsys.readouterr()
    write(new, _with_settings(new_records, ttft_p50=0.05))
    status = main(["compare", str(old), str(new)])
    out = capsys.readouterr().out
    assert status == EXIT_REGRESSION, out
    assert "REGRESSION: local:llamacpp:tiny P-EASY: warm TTFT p50 +" in out


def test_compare_finds_a_reference_of_another_engine_version_incomparable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OLD measured another engine version: nothing is compared (exit 8), as the gate has it."""
    old_records = run_records("old", seed=1)
    for record in old_records:
        if record["type"] == "cell":
            record["engine_version"] = "b5000 (def456)"
    old = write(tmp_path / "old.jsonl", old_records)
    new = write(tmp_path / "new.jsonl", run_records("new", seed=2))
    status = main(["compare", str(old), str(new)])
    out = capsys.readouterr().out
    assert status == EXIT_INCOMPARABLE, out
    assert _verdict_words(out) == {"incomparable"}, out


def test_compare_of_a_directory_as_new_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = write(tmp_path / "old.jsonl", run_records("old", seed=1))
    assert main(["compare", str(old), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpubench: error: {tmp_path}: not a ledger") and err.count("\n") == 1
    assert main(["compare", str(tmp_path / "nothing"), str(old)]) == 2
    assert "no such ledger or baselines directory" in capsys.readouterr().err
