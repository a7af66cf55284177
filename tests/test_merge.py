"""`gpubench merge` and `gpubench gate` on generated shard ledgers (tests/support/ledgers.py): the merged
ledger's shape, the gate's exit status on it, and the refusals. The real job array's ledgers are
merged and gated in test_slurm_array.py."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from support.ledgers import CELLS, judged_against, load_records, read, run_records, write

from pytest_gpubench.cli.main import main
from pytest_gpubench.config.shards import Shard, assign_nodes, node_groups, shard_matrix
from pytest_gpubench.core.status import EXIT_REGRESSION, EXIT_UNMEASURED
from pytest_gpubench.results.baseline_update import update_baselines
from pytest_gpubench.results.ledger_judgement import judge_ledger
from pytest_gpubench.results.load_baseline import load_baseline_path, write_load_baselines


def _shard_of(cell_id: str) -> int:
    groups: dict[str, list[str]] = {}
    for cell in CELLS:
        groups.setdefault(cell.split(":")[0], []).append(cell)
    return assign_nodes(groups, 2)[cell_id.split(":")[0]]


def shard_ledger(
    tmp_path: Path,
    cell_id: str,
    *,
    slowdown: float = 1.0,
    seed: int = 0,
    end: bool = True,
    load_slowdown: float | None = None,
) -> Path:
    """The ledger one array task writes: its own cell only, a meta naming its shard; with
    `load_slowdown`, load points too (ledgers.load_records)."""
    index = _shard_of(cell_id)
    records = run_records(f"run-{index}", seed=seed, slowdown=slowdown, cells=[cell_id])
    records[0]["git_sha"] = "abc1234"
    records[0]["cells_planned"] = [cell_id]
    records[0]["shard"] = {"index": index, "count": 2, "matrix_cells": list(CELLS)}
    records[-1]["cells"] = [c for c in records[-1]["cells"] if c["cell_id"] == cell_id]
    records[-1]["exit_status"] = 0
    if load_slowdown is not None:
        run_id = f"run-{index}"
        records[-1:-1] = load_records(run_id, cell_id, seed=seed, slowdown=load_slowdown)
    if not end:
        records.pop()
    return write(tmp_path / f"shard-{index}-{seed}.jsonl", records)


def baselines(tmp_path: Path) -> Path:
    directory = tmp_path / "baselines"
    update_baselines(directory, run_records("baseline-run", seed=99))
    return directory


def test_merged_ledger_has_one_meta_every_record_and_one_end(tmp_path: Path) -> None:
    paths = [shard_ledger(tmp_path, cell) for cell in CELLS]
    merged = tmp_path / "merged.jsonl"
    assert (
        main(["merge", *map(str, reversed(paths)), "-o", str(merged), *judged_against(tmp_path)])
        == 0
    )

    records = read(merged)
    shards = [read(path) for path in paths]
    assert [r["type"] for r in records].count("meta") == 1
    assert [r["type"] for r in records].count("end") == 1
    meta, end = records[0], records[-1]
    assert meta["shard"] == {
        "count": 2, "matrix_cells": list(CELLS), "merged": [0, 1], "missing": []
    }  # fmt: skip
    assert sorted(meta["cells_planned"]) == sorted(CELLS)
    assert [m["shard"] for m in meta["merged_from"]] == [0, 1]
    body = [r for r in records if r["type"] not in ("meta", "end")]
    assert len(body) == sum(len(s) - 2 for s in shards)
    assert {r["benchmark_run_id"] for r in records} == {meta["benchmark_run_id"]}
    assert {r["shard_run_id"] for r in body} == {"run-0", "run-1"}
    assert sorted(c["cell_id"] for c in end["cells"]) == sorted(CELLS)
    assert end["calls"] == sum(r["type"] == "call" for r in body)
    assert end["exit_status"] == 0


@pytest.mark.parametrize(
    ("pytest_statuses", "slowdown", "merged_status"),
    [((5, None), 1.0, EXIT_UNMEASURED), ((0, 1), 2.0, 1), ((0, 5), 1.0, 5)],
    ids=["nothing-collected-below-unmeasured", "failed-tests-above-regression", "5-above-ok"],
)
def test_the_merged_status_ranks_the_shards_tests_with_the_merged_findings_as_a_session_does(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    pytest_statuses: tuple[int, int | None],
    slowdown: float,
    merged_status: int,
) -> None:
    """The shards' pytest statuses (None: the shard died before its end record) rank with the
    findings of the merged records as a session ranks its own (core/status.py): a shard that
    collected nothing (5) must not hide another's unmeasured cells (7); a failed test (1)
    stands above a regression (6). `gpubench gate` on the merged ledger says the same."""
    directory = baselines(tmp_path)
    paths = []
    for cell, status in zip(CELLS, pytest_statuses, strict=True):
        path = shard_ledger(tmp_path, cell, slowdown=slowdown, seed=3, end=status is not None)
        if status is not None:
            records = read(path)
            records[-1]["pytest_exitstatus"] = status
            write(path, records)
        paths.append(path)
    merged = tmp_path / "merged.jsonl"
    assert main(["merge", *map(str, paths), "-o", str(merged), "--baselines", str(directory)]) == 0
    assert read(merged)[-1]["exit_status"] == merged_status
    capsys.readouterr()
    assert main(["gate", str(merged), "--baselines", str(directory)]) == merged_status


def _as_json(verdicts: Sequence[Mapping[str, Any]]) -> list[str]:
    return sorted(json.dumps(verdict, sort_keys=True) for verdict in verdicts)


def test_the_merged_end_record_is_the_gate_s_judgement_not_the_shards_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each shard's end judged its cell against no baseline (`new`, exit 0); the merged
    records, against the baselines named, are twice as slow. The merged end record, which
    `gpubench report`, the pull request summary, the exports and `gpubench history` read, holds
    what `gpubench gate` says of the merged ledger (its verdicts as JSON, each cell's outcome,
    its exit status), not the shards' verdicts concatenated and their worst status."""
    directory = baselines(tmp_path)
    paths = [shard_ledger(tmp_path, cell, slowdown=2.0, seed=3) for cell in CELLS]
    shards = [verdict for path in paths for verdict in read(path)[-1]["verdicts"]]
    merged = tmp_path / "merged.jsonl"
    assert main(["merge", *map(str, paths), "-o", str(merged), "--baselines", str(directory)]) == 0
    assert "judged against" in capsys.readouterr().out
    end = read(merged)[-1]
    judged = judge_ledger(read(merged), directory)
    gate = json.loads(json.dumps([v.to_record() for v in judged.judgement.every_verdict]))
    assert _as_json(end["verdicts"]) == _as_json(gate)
    assert _as_json(end["verdicts"]) != _as_json(shards)
    assert end["regressions"] == sum(v["verdict"] == "regression" for v in gate) > 0
    assert end["cells"] == [outcome.to_record() for outcome in judged.judgement.outcomes]
    assert main(["gate", str(merged), "--baselines", str(directory)]) == EXIT_REGRESSION
    assert end["exit_status"] == judged.exit_status == EXIT_REGRESSION
    capsys.readouterr()
    assert main(["report", str(merged)]) == 0
    assert "| regression |" in capsys.readouterr().out.split("## Regression gate")[1]


def test_merged_ledger_is_read_by_gpubench_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = [shard_ledger(tmp_path, cell) for cell in CELLS]
    merged = tmp_path / "merged.jsonl"
    main(["merge", *map(str, paths), "-o", str(merged), *judged_against(tmp_path)])
    capsys.readouterr()
    assert main(["report", str(merged)]) == 0
    document = capsys.readouterr().out
    assert all(cell in document for cell in CELLS)


@pytest.mark.parametrize(
    ("slowdown", "status"), [(1.0, 0), (2.0, EXIT_REGRESSION)], ids=["same", "twice-as-slow"]
)
def test_gate_judges_the_merged_ledger_with_the_sessions_exit_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], slowdown: float, status: int
) -> None:
    paths = [shard_ledger(tmp_path, cell, slowdown=slowdown, seed=3) for cell in CELLS]
    merged = tmp_path / "merged.jsonl"
    main(["merge", *map(str, paths), "-o", str(merged), *judged_against(tmp_path)])
    assert main(["gate", str(merged), "--baselines", str(baselines(tmp_path))]) == status
    out = capsys.readouterr().out
    assert all(cell in out for cell in CELLS)
    if status:
        assert "regression" in out
        assert f"exit status {status}" in out


@pytest.mark.parametrize(
    ("load_slowdown", "status"), [(1.0, 0), (2.0, EXIT_REGRESSION)], ids=["same", "halved"]
)
def test_gate_judges_the_merged_ledgers_load_points_as_the_session_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], load_slowdown: float, status: int
) -> None:
    """Each shard measured load points (c1, c4) besides its warm calls, which are unchanged:
    the merged ledger keeps every load record, and `gpubench gate` judges each point against
    baselines/load/: half the throughput (and twice the TTFT and TPOT) is exit status 6, with
    the point and the metric named, as the session's gate would have it."""
    paths = [shard_ledger(tmp_path, cell, seed=3, load_slowdown=load_slowdown) for cell in CELLS]
    merged = tmp_path / "merged.jsonl"
    assert main(["merge", *map(str, paths), "-o", str(merged), *judged_against(tmp_path)]) == 0
    loads = [r for r in read(merged) if r["type"] == "load"]
    shard_loads = [r for path in paths for r in read(path) if r["type"] == "load"]
    assert len(loads) == len(shard_loads) == 2 * len(CELLS)
    assert {(r["cell_id"], r["load_point"]) for r in loads} == {
        (cell, point) for cell in CELLS for point in ("c1", "c4")
    }
    assert [r["samples"] for r in loads] == [r["samples"] for r in shard_loads]
    directory = baselines(tmp_path)
    baseline_loads = [r for cell in CELLS for r in load_records("baseline-run", cell, seed=99)]
    write_load_baselines(directory, baseline_loads)
    assert all(load_baseline_path(directory, cell).exists() for cell in CELLS)
    capsys.readouterr()

    assert main(["gate", str(merged), "--baselines", str(directory)]) == status
    out = capsys.readouterr().out
    rows = load_rows(out)
    assert set(rows) == {(cell, point) for cell in CELLS for point in ("c1", "c4")}
    for (cell, point), verdicts in rows.items():
        key = f"{cell} P-EASY@load-{point}"
        if status:
            assert verdicts["load_output_tokens_per_sec"] == "regression"
            assert f"REGRESSION: {key}: output tokens/s -" in out
            assert f"REGRESSION: {key}: TTFT p99 +" in out
        else:
            assert "regression" not in verdicts.values()
    assert f"gpubench gate: exit status {status}" in out


def test_gate_calls_load_points_without_a_load_baseline_new(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Load points with no load baseline yet are `new`, as in the session: they fail nothing."""
    paths = [shard_ledger(tmp_path, cell, seed=3, load_slowdown=2.0) for cell in CELLS]
    merged = tmp_path / "merged.jsonl"
    main(["merge", *map(str, paths), "-o", str(merged), *judged_against(tmp_path)])
    capsys.readouterr()
    assert main(["gate", str(merged), "--baselines", str(baselines(tmp_path))]) == 0
    rows = load_rows(capsys.readouterr().out)
    assert set(rows) == {(cell, point) for cell in CELLS for point in ("c1", "c4")}
    assert {verdict for verdicts in rows.values() for verdict in verdicts.values()} == {"new"}


def load_rows(out: str) -> dict[tuple[str, str], dict[str, str]]:
    """The gate's load table: {(cell, point): {metric: verdict}}."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) > 3 and "@load-" in words[1]:
            point = words[1].rsplit("@load-", 1)[1]
            rows.setdefault((words[0], point), {})[words[2]] = words[-1]
    return rows


def test_a_missing_shard_leaves_its_cells_unmeasured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only shard 0 merged: the gate never passes the cells of shard 1."""
    first = next(cell for cell in CELLS if _shard_of(cell) == 0)
    other = next(cell for cell in CELLS if _shard_of(cell) == 1)
    merged = tmp_path / "merged.jsonl"
    assert (
        main(
            [
                "merge",
                str(shard_ledger(tmp_path, first)),
                "-o",
                str(merged),
                *judged_against(tmp_path),
            ]
        )
        == 0
    )
    assert "shards missing: [1]" in capsys.readouterr().out
    status = main(["gate", str(merged), "--baselines", str(baselines(tmp_path))])
    assert status == EXIT_UNMEASURED
    out = capsys.readouterr().out
    assert f"unmeasured: {other}: missing: shard 1/2: no ledger merged" in out


def test_a_shard_that_died_before_its_end_record_leaves_its_cells_unmeasured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = next(cell for cell in CELLS if _shard_of(cell) == 1)
    paths = [shard_ledger(tmp_path, cell, end=cell != dead) for cell in CELLS]
    merged = tmp_path / "merged.jsonl"
    main(["merge", *map(str, paths), "-o", str(merged), *judged_against(tmp_path)])
    assert main(["gate", str(merged), "--baselines", str(baselines(tmp_path))]) == EXIT_UNMEASURED
    assert f"unmeasured: {dead}: missing: shard 1/2: " in capsys.readouterr().out


@pytest.mark.parametrize("fault", ["twice", "not-a-shard", "other-matrix", "other-commit"])
def test_ledgers_of_different_runs_are_refused_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str
) -> None:
    first, second = (shard_ledger(tmp_path, cell) for cell in CELLS)
    records = read(second)
    edits: dict[str, Any] = {
        "twice": {"shard": dict(records[0]["shard"], index=_shard_of(CELLS[0]))},
        "not-a-shard": {"shard": None},
        "other-matrix": {"shard": dict(records[0]["shard"], matrix_cells=[CELLS[0]])},
        "other-commit": {"git_sha": "fff0000"},
    }
    records[0].update(edits[fault])
    write(second, records)
    merged = tmp_path / "merged.jsonl"
    assert (
        main(["merge", str(first), str(second), "-o", str(merged), *judged_against(tmp_path)]) == 2
    )
    error = capsys.readouterr().err
    assert error.startswith("gpubench: error: ") and str(second) in error
    assert error.count("\n") == 1 and "Traceback" not in error
    assert not merged.exists()


def test_shards_split_by_node_and_cover_the_matrix_once(tmp_path: Path) -> None:
    from pytest_gpubench.config.matrix import read_matrix

    (tmp_path / "prompts.yaml").write_text(
        'prompts:\n  P: {intent: x, prompt: "hi", max_tokens: 4}\n', encoding="utf-8"
    )
    (tmp_path / "cells.yaml").write_text(
        "nodes:\n  a: {kind: local}\n  b: {kind: local}\n  c: {kind: local}\n"
        "cells:\n"
        "  - {node: a, engine: llamacpp, model: m1, endpoint: 'http://127.0.0.1:1'}\n"
        "  - {node: a, engine: llamacpp, model: m2, endpoint: 'http://127.0.0.1:1'}\n"
        "  - {node: b, engine: llamacpp, model: m1, endpoint: 'http://127.0.0.1:1'}\n"
        "  - {node: c, engine: llamacpp, model: m1, endpoint: 'http://127.0.0.1:1'}\n",
        encoding="utf-8",
    )
    matrix = read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")
    shards = [[c.cell_id for c in shard_matrix(matrix, Shard(i, 2)).cells] for i in range(2)]
    assert shards == [["a:llamacpp:m1", "a:llamacpp:m2"], ["b:llamacpp:m1", "c:llamacpp:m1"]]
    assert node_groups(matrix.cells)["a"] == ["a:llamacpp:m1", "a:llamacpp:m2"]
    with pytest.raises(Exception, match="0 <= i < N"):
        Shard.parse("2/2")
    with pytest.raises(Exception, match="is not i/N"):
        Shard.parse("first")
