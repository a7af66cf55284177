"""The table of measures and gated figures (config/metrics.py) is the one place a figure is
declared: summaries, the baseline file, the thresholds of cells.yaml, the gate and the reports
follow it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from pytest_gpubench.config.cell import Cell, Thresholds
from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.config.metrics import GATED, MEASURE_BY_NAME, MEASURES, PERCENTILE_NAMES
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.reports.comparison import render_comparison
from pytest_gpubench.results.baseline import (
    CellBaseline,
    Provenance,
    dumps_baseline,
    loads_baseline,
)
from pytest_gpubench.results.gate import compare
from pytest_gpubench.results.stats import SAMPLE_FIELDS, summarize

CELL = "local:llamacpp:tiny"


def calls(slowdown: float = 1.0, *, seed: int = 0, runs: int = 12) -> list[dict[str, Any]]:
    """Warm calls whose every measure has a value (the reasoning ones too)."""
    rng = random.Random(seed)
    records = []
    for run_idx in range(runs):
        ttft = 20.0 * slowdown * rng.lognormvariate(0, 0.03)
        decode = 400.0 / slowdown * rng.lognormvariate(0, 0.03)
        total = ttft + 32 / decode * 1000
        records.append(
            {
                "type": "call",
                "cell_id": CELL,
                "prompt_id": "P-EASY",
                "prompt_sha256": "sha",
                "phase": "warm",
                "run_idx": run_idx,
                "error": None,
                "finish_reason": "length",
                "coalesced": False,
                "first_delta_ms": ttft,
                "total_duration_ms": total,
                "tokens_per_sec": decode,
                "tpot_ms": 1000 / decode,
                "e2e_tokens_per_sec": 32 / total * 1000,
                "engine_tokens_per_sec": decode,
                "engine_prompt_ms": ttft * 0.9,
                "engine_total_ms": total * 0.95,
                "control_ms": 2.0,
                "first_answer_ms": ttft * 3,
                "reasoning_tokens": 12,
                "cpu_pressure": 0.0,
                "engine_wait_ms": 0.2,
                "engine_cpu_ms": ttft * 0.8,
                "engine_wait_per_cpu": 0.2 / (ttft * 0.8),
                "client_wait_per_cpu": 0.01,
                "neighbour_cpu_share": 0.02,
                "steal_share": 0.001,
                "gpu_other_process_count": 0,
                "gpu_clock_event_bits": 4,
                # The request kinds' (issue 35): a call has those of its kind; this one all.
                "inputs_per_sec": 1000 / total,
                "tool_call_valid": 1,
                "schema_valid": 1,
            }
        )
    return records


def cell_with_thresholds(tmp_path: Path, keys: str) -> Cell:
    """The one cell of a cells.yaml whose `thresholds:` are `keys` (YAML, a flow mapping's)."""
    (tmp_path / "prompts.yaml").write_text(
        "prompts:\n  P-EASY: {intent: short, prompt: hi, max_tokens: 4}\n"
    )
    (tmp_path / "cells.yaml").write_text(
        "nodes: {local: {kind: local}}\n"
        f"cells:\n  - {{node: local, engine: llamacpp, model: tiny, thresholds: {{{keys}}}}}\n"
    )
    (cell,) = read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml").cells
    return cell


def test_the_table_is_consistent() -> None:
    assert len({m.name for m in MEASURES}) == len(MEASURES)
    assert len({f.name for f in GATED}) == len(GATED)
    assert len({f.threshold_key for f in GATED}) == len(GATED)
    for figure in GATED:
        assert figure.measure in MEASURE_BY_NAME, figure
        assert figure.engine_measure is None or figure.engine_measure in MEASURE_BY_NAME
        assert figure.percentile in PERCENTILE_NAMES
        # Judging a figure tests significance on its measure's raw values.
        assert MEASURE_BY_NAME[figure.measure].samples, figure


def test_every_measure_is_summarized_and_round_trips_through_a_baseline_file() -> None:
    (summary,) = summarize(calls())
    for measure in MEASURES:
        assert summary.figure(measure.name, "p50") is not None, measure.name
    assert all(summary.samples[name] for name in SAMPLE_FIELDS)
    baseline = CellBaseline(CELL, Provenance(), (summary,))
    assert loads_baseline(dumps_baseline(baseline), "mem.json") == baseline


def test_every_gated_figure_has_its_key_in_cells_yaml(tmp_path: Path) -> None:
    keys = ", ".join(f"{figure.threshold_key}: 0.{index + 1}" for index, figure in enumerate(GATED))
    cell = cell_with_thresholds(tmp_path, keys)
    for index, figure in enumerate(GATED):
        assert cell.thresholds.ratio(figure.threshold_key) == pytest.approx(0.1 * (index + 1))
    (tmp_path / "cells.yaml").write_text(
        "nodes: {local: {kind: local}}\n"
        "cells:\n  - {node: local, engine: llamacpp, model: tiny, thresholds: {ttft_p5O: 0.2}}\n"
    )
    with pytest.raises(GpubenchError) as bad:
        read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")
    assert "thresholds.ttft_p5O: unknown key" in str(bad.value)


def test_each_gated_figure_is_judged_and_labelled_in_the_reports() -> None:
    """Twice as slow everywhere: every default figure (and a reasoning model's, which this one
    is) regresses, each under its own name and its column's label."""
    baseline = summarize(calls(seed=1))
    current = summarize(calls(2.0, seed=2))
    thresholds = Thresholds(**{figure.threshold_key: 0.2 for figure in GATED})
    verdicts = {v.metric: v for v in compare(baseline, current, thresholds)}
    table = render_comparison(list(verdicts.values()))
    for figure in GATED:
        assert verdicts[figure.name].verdict == "regression", figure.name
        assert figure.column in table


def test_end_to_end_p99_is_judged_where_a_cell_asks_for_it(tmp_path: Path) -> None:
    """`warm_total_p99_ms`, an opt-in figure: a cell without `total_p99` gets no verdict on it
    (and its judging settings write no default for it); with it, twice as slow is a regression
    named `warm_total_p99_ms`, in the table as `total p99 ms`."""
    from pytest_gpubench.results.judging_settings import resolved_thresholds

    baseline = summarize(calls(seed=1))
    current = summarize(calls(2.0, seed=2))
    plain = {v.metric for v in compare(baseline, current, Thresholds())}
    assert "warm_total_p99_ms" not in plain and "warm_total_p50_ms" in plain
    assert resolved_thresholds(Thresholds()).ratio("total_p99") is None
    asked = Thresholds(total_p99=0.3)
    verdicts = {v.metric: v for v in compare(baseline, current, asked)}
    tail = verdicts["warm_total_p99_ms"]
    assert tail.verdict == "regression" and tail.message.startswith(
        f"{CELL} P-EASY: warm total p99"
    )
    assert tail.current == pytest.approx(current[0].figure("total_duration_ms", "p99"))
    assert "total p99 ms" in render_comparison([tail])


def test_every_measure_reaches_the_reports_columnar_reader(tmp_path: Path) -> None:
    """`gpubench report` reads a ledger into columns (reports/frame.py): its summaries hold
    every measure's figures and samples as the session's own summaries do."""
    import json

    from pytest_gpubench.reports.frame import read_ledger_frame

    ledger = tmp_path / "run.jsonl"
    records = [{"type": "meta", "benchmark_run_id": "r"}, *calls()]
    ledger.write_text("".join(json.dumps(record) + "\n" for record in records))
    (from_columns,) = read_ledger_frame(ledger).summaries()
    (from_records,) = summarize(calls())
    for measure in MEASURES:
        assert from_columns.warm[measure.name] == from_records.warm[measure.name], measure.name
    assert from_columns.samples == from_records.samples


def test_every_resource_figure_is_summarized_shown_and_limited_as_the_table_says(
    tmp_path: Path,
) -> None:
    """config/metrics.RESOURCES: each figure is summed up over the warm calls as declared (the
    peak, else the median), the same from the records and from the report's columns, has its
    column in the resource table, and one with a `max_` key is a cells.yaml key whose breach the
    gate calls a regression under the figure's name."""
    import json

    from pytest_gpubench.config.metrics import RESOURCE_LIMITS, RESOURCES
    from pytest_gpubench.reports.frame import read_ledger_frame
    from pytest_gpubench.reports.telemetry_table import TELEMETRY_HEADERS, telemetry_rows
    from pytest_gpubench.results.gate import telemetry_verdicts
    from pytest_gpubench.telemetry.aggregate import telemetry_summaries

    records = calls(runs=3)
    for run_idx, record in enumerate(records):
        record.update({figure.name: 10.0 * (run_idx + 1) for figure in RESOURCES})
    ledger = tmp_path / "run.jsonl"
    ledger.write_text(
        "".join(json.dumps(r) + "\n" for r in [{"type": "meta", "benchmark_run_id": "r"}, *records])
    )
    (summary,) = telemetry_summaries(records)
    assert read_ledger_frame(ledger).telemetry() == [summary]
    (row,) = telemetry_rows([summary])
    for figure in RESOURCES:
        assert getattr(summary, figure.name) == (30.0 if figure.peak else 20.0), figure.name
        assert (
            row[TELEMETRY_HEADERS.index(figure.header)]
            == f"{(30.0 if figure.peak else 20.0):.{figure.digits}f}"
        )

    keys = ", ".join(f"{key}: 15" for key in RESOURCE_LIMITS)
    cell = cell_with_thresholds(tmp_path, keys)
    verdicts = {v.metric: v for v in telemetry_verdicts(records, {CELL: cell.thresholds})}
    assert set(verdicts) == set(RESOURCE_LIMITS.values())
    for key, name in RESOURCE_LIMITS.items():
        assert verdicts[name].verdict == "regression" and f"({key}: 15)" in verdicts[name].message


def test_every_measure_is_a_csv_column_and_a_junit_property(tmp_path: Path) -> None:
    """`gpubench export --csv` and `--junitxml` follow the table: each measure of a call is a
    column (a count written as an integer) and a property, a reasoning model's where the call
    reasoned."""
    import csv
    import json

    from pytest_gpubench.reports.exports import write_csv
    from pytest_gpubench.reports.frame import read_ledger_frame
    from pytest_gpubench.reports.junit import call_properties

    records = calls(runs=2)
    ledger = tmp_path / "run.jsonl"
    ledger.write_text(
        "".join(json.dumps(r) + "\n" for r in [{"type": "meta", "benchmark_run_id": "r"}, *records])
    )
    write_csv(read_ledger_frame(ledger, export=True), tmp_path / "calls.csv")
    with (tmp_path / "calls.csv").open() as file:
        first = next(csv.DictReader(file))
    properties = dict(call_properties(records[0]))
    for measure in MEASURES:
        value = records[0][measure.field]
        assert float(first[measure.name]) == pytest.approx(value), measure.name
        if measure.whole:
            assert first[measure.name] == str(value), measure.name
        assert properties[measure.field] == value, measure.field
