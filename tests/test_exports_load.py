"""`gpubench export` carries load points: the Prometheus textfile's gpubench_load gauges and
client-engine offsets, the load CSV (one row per point), the JSON's `loads`."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import ledgers

from pytest_gpubench.cli.main import main

CELL = ledgers.CELLS[0]
CHECK = {
    "engine": "vllm",
    "requests": 24.0,
    "client_requests": 24,
    "ttft_ms": {"server_mean": 6.0, "server_n": 24.0, "client_mean": 110.0, "client_n": 24,
                "offset_ms": 104.0},
}  # fmt: skip
WARNING = "TTFT mean 110 ms at the client against 6 ms at the engine (offset +104 ms): ..."


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    records = ledgers.run_records("run-load", seed=3, cells=(CELL,))
    loads = ledgers.load_records("run-load", CELL, seed=3)
    loads[1].update(server_check=CHECK, delivery_warnings=[WARNING], coalesced_calls=20)
    return ledgers.write(tmp_path / "run-load.jsonl", [*records[:-1], *loads, records[-1]])


def test_the_prometheus_textfile_carries_the_load_points(ledger: Path, tmp_path: Path) -> None:
    textfile = tmp_path / "gpubench.prom"
    assert main(["export", str(ledger), "--prometheus", str(textfile)]) == 0
    families = {f.name: f for f in text_string_to_metric_families(textfile.read_text())}
    samples = {
        (s.labels["point"], s.labels["metric"]): s.value for s in families["gpubench_load"].samples
    }
    loads = [r for r in ledgers.read(ledger) if r["type"] == "load"]
    for load in loads:
        point = load["load_point"]
        assert samples[(point, "output_tokens_per_sec")] == load["output_tokens_per_sec"]
        assert samples[(point, "ttft_ms_p99")] == load["ttft_ms_p99"]
    assert samples[("c4", "coalesced_calls")] == 20
    (offset,) = families["gpubench_load_server_offset_ms"].samples
    assert offset.labels == {"cell": CELL, "prompt": "P-EASY", "point": "c4", "metric": "ttft_ms"}
    assert offset.value == 104.0


def test_the_load_csv_has_a_row_per_point_with_the_engine_beside_the_client(
    ledger: Path, tmp_path: Path
) -> None:
    output = tmp_path / "loads.csv"
    assert main(["export", str(ledger), "--load-csv", str(output)]) == 0
    frame = pd.read_csv(output)
    assert list(frame["load_point"]) == ["c1", "c4"]
    row = frame.set_index("load_point").loc["c4"]
    assert row["server_engine"] == "vllm" and row["server_ttft_ms_mean"] == 6.0
    assert row["client_ttft_ms_mean"] == 110.0 and row["offset_ttft_ms"] == 104.0
    assert row["delivery_warnings"] == WARNING
    assert frame["server_engine"].isna().tolist() == [True, False]


def test_the_json_carries_the_load_points_without_their_samples(
    ledger: Path, tmp_path: Path
) -> None:
    output = tmp_path / "summary.json"
    assert main(["export", str(ledger), "--json", str(output)]) == 0
    loads = json.loads(output.read_text())["loads"]
    assert [load["load_point"] for load in loads] == ["c1", "c4"]
    assert all("samples" not in load for load in loads)
    assert loads[1]["server_check"] == CHECK
