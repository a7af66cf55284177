"""Call records without the keys their cell record holds (issue 24, small ledgers): a session
writes them once, in the cell record, and read_ledger, the columnar frame, `gpubench merge` and
`gpubench gate` put them back; ledgers written whole (before) read as they did."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from support.ledgers import CELLS, judged_against, read, run_records, write
from support.standins import OllamaStandin, serving
from test_ledger import PROMPTS, ollama_cells
from test_merge import baselines, shard_ledger

from pytest_gpubench.cli.main import main
from pytest_gpubench.core.status import EXIT_REGRESSION
from pytest_gpubench.ledger.writer import CELL_KEYS, Ledger, read_ledger
from pytest_gpubench.reports.frame import frame_of_records, read_ledger_frame

RAW_HEAD = ["type", "cell_id", "prompt_id"]
WHOLE_HEAD = ["type", "benchmark_run_id", "cell_id", "node", "engine", "model", "prompt_id"]


def raw_records(path: Path) -> list[dict[str, Any]]:
    """The ledger's lines as written, nothing restored."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def export_rows(path: Path, tmp_path: Path) -> list[dict[str, str]]:
    target = tmp_path / f"{path.stem}.csv"
    assert main(["export", str(path), "--csv", str(target)]) == 0
    with target.open(encoding="utf-8", newline="") as file:
        return list(csv.DictReader(file))


def test_a_session_writes_cell_keys_once_and_every_reader_restores_them(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Ollama cannot run here: the stand-in follows Ollama's docs/api.md field by field.

    The call lines on disk hold no run id, node, engine or model (the cell record does); read
    back, each call record has them again, in their old place, equal to the cell's, and the
    CSV export (the frame's columns) names them on every row."""
    with serving(OllamaStandin()) as url:
        pytester.makefile(".yaml", prompts=PROMPTS, cells=ollama_cells(url))
        pytester.makepyfile("def test_generate(gpubench_case):\n    gpubench_case.run()\n")
        result = pytester.runpytest("--force-load")
    result.assert_outcomes(passed=6)
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")

    raw = raw_records(ledger)
    raw_calls = [r for r in raw if r["type"] == "call"]
    (cell,) = [r for r in raw if r["type"] == "cell"]
    assert len(raw_calls) == 6
    for call in raw_calls:
        assert not set(CELL_KEYS) & set(call), call
        assert list(call)[:3] == RAW_HEAD

    records = read_ledger(ledger)
    calls = [r for r in records if r["type"] == "call"]
    run_id = records[0]["benchmark_run_id"]
    for call, written in zip(calls, raw_calls, strict=True):
        assert list(call)[:7] == WHOLE_HEAD
        assert call["benchmark_run_id"] == run_id == cell["benchmark_run_id"]
        assert (call["node"], call["engine"], call["model"]) == ("local", "ollama", "qwen3.5:0.8b")
        assert {key: call[key] for key in written} == written
        assert set(call) - set(written) == set(CELL_KEYS)

    # The frame restores the columns from the cell record, as the dicts above have them.
    frame = read_ledger_frame(ledger, export=True).calls
    expected = frame_of_records(records, export=True).calls
    for name in CELL_KEYS:
        assert frame[name].astype(object).tolist() == expected[name].astype(object).tolist()
    assert frame["node"].astype(object).tolist() == ["local"] * 6
    assert frame["benchmark_run_id"].astype(object).tolist() == [run_id] * 6
    rows = export_rows(ledger, tmp_path)
    assert [(row["node"], row["engine"], row["model"]) for row in rows] == [
        ("local", "ollama", "qwen3.5:0.8b")
    ] * 6


def test_a_ledger_written_whole_reads_as_written(tmp_path: Path) -> None:
    """A ledger from before issue 24 (every key in every call record) reads unchanged, key order
    included, through read_ledger and the frame."""
    records = run_records("run-old", samples=False)
    path = write(tmp_path / "old.jsonl", records)
    assert all(set(CELL_KEYS) <= set(r) for r in raw_records(path) if r["type"] == "call")
    read_back = read_ledger(path)
    assert read_back == records
    assert [list(r) for r in read_back] == [list(r) for r in records]
    frame = read_ledger_frame(path, export=True).calls
    calls = [r for r in records if r["type"] == "call"]
    assert frame["node"].astype(object).tolist() == [r["node"] for r in calls]
    assert frame["model"].astype(object).tolist() == [r["model"] for r in calls]


def test_compact_and_whole_ledgers_read_the_same(tmp_path: Path) -> None:
    """The same run written both ways: equal records through read_ledger, equal frames, equal
    CSV exports; the compact one is smaller."""
    records = run_records("run-same")
    whole = write(tmp_path / "whole.jsonl", records)
    compact = write(tmp_path / "compact.jsonl", records, compact=True)
    assert compact.stat().st_size < whole.stat().st_size
    assert read_ledger(compact) == read_ledger(whole) == records
    for export in (False, True):
        a = read_ledger_frame(compact, export=export).calls
        b = read_ledger_frame(whole, export=export).calls
        assert list(a.columns) == list(b.columns)
        for name in a.columns:
            # As objects: a restored column's categories may stand in another order.
            pd.testing.assert_series_equal(a[name].astype(object), b[name].astype(object))
    assert export_rows(compact, tmp_path) == export_rows(whole, tmp_path)


def test_a_key_that_differs_from_its_cell_is_kept(tmp_path: Path) -> None:
    """Only what equals the cell record's is left out; a call record written before its cell
    record, or of a cell without one, is written whole."""
    path = tmp_path / "runs" / "run-x.jsonl"
    ledger = Ledger(path)
    head = {"benchmark_run_id": "run-x", "cell_id": "n:llamacpp:tiny", "node": "n"}
    early = {"type": "call", **head, "engine": "llamacpp", "model": "tiny", "run_idx": 0}
    cell = {"type": "cell", **head, "engine": "llamacpp", "model": "tiny"}
    other = {"type": "call", **head, "engine": "llamacpp", "model": "tiny-b", "run_idx": 1}
    alone = {**early, "cell_id": "m:llamacpp:tiny", "node": "m", "run_idx": 2}
    for record in ({"type": "meta", "benchmark_run_id": "run-x"}, early, cell, other, alone):
        ledger.append(record)
    ledger.close()
    raw = raw_records(path)
    assert raw[1] == early and raw[4] == alone
    assert raw[3] == {"type": "call", "cell_id": "n:llamacpp:tiny", "model": "tiny-b", "run_idx": 1}
    assert read_ledger(path)[1:] == [early, cell, other, alone]


def test_merge_and_gate_work_on_compact_shards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Shards written as sessions write them: `gpubench merge` restores each shard's keys,
    gives every record the merged run id, and writes compact again; read back, the call
    records carry the merged run id and their cells' keys; the gate's verdict is the one on
    the same shards written whole (a regression planted: exit status 6)."""
    statuses = {}
    for compact in (False, True):
        folder = tmp_path / ("compact" if compact else "whole")
        paths = [shard_ledger(folder, cell, slowdown=2.0, seed=3) for cell in CELLS]
        if compact:
            for path in paths:
                write(path, read(path), compact=True)
            assert all(
                "engine" not in r for p in paths for r in raw_records(p) if r["type"] == "call"
            )
        merged = folder / "merged.jsonl"
        assert main(["merge", *map(str, paths), "-o", str(merged), *judged_against(folder)]) == 0
        raw_calls = [r for r in raw_records(merged) if r["type"] == "call"]
        assert raw_calls and not any(
            {"benchmark_run_id", "engine", "model"} & set(r) for r in raw_calls
        )
        records = read(merged)
        merged_id = records[0]["benchmark_run_id"]
        calls = [r for r in records if r["type"] == "call"]
        assert {r["benchmark_run_id"] for r in calls} == {merged_id}
        assert {r["shard_run_id"] for r in calls} == {"run-0", "run-1"}
        assert {(r["cell_id"], r["engine"], r["model"]) for r in calls} == {
            (cell, "llamacpp", cell.rsplit(":", 1)[-1]) for cell in CELLS
        }
        capsys.readouterr()
        statuses[compact] = main(["gate", str(merged), "--baselines", str(baselines(folder))])
        out = capsys.readouterr().out
        assert all(cell in out for cell in CELLS) and "regression" in out
    assert statuses == {False: EXIT_REGRESSION, True: EXIT_REGRESSION}
