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


# A point's intervals, slices and queue trend as summarize_point records them, and a sweep
# that stopped rising at saturation (results/load_summary.py, run/load/sweep.py).
INTERVALS = {
    "confidence": 0.95, "method": "order statistics (binomial)",
    "fewest": {"p50": 6, "p90": 36, "p99": 368},
    "ttft_ms": {"n": 24, "p50": [18.5, 21.0], "p90": [21.5, 24.0], "p99": [23.0, None]},
    "tpot_ms": {"n": 24, "p50": [2.4, 2.6], "p90": [2.6, 2.8], "p99": [2.7, None]},
    "too_few": ["ttft_ms_p99", "tpot_ms_p99"],
}  # fmt: skip
SLICES = [
    {"start_s": 0.0, "span_s": 1.0, "requests": 12, "ok": 12, "output_tokens_per_sec": 640.0,
     "ttft_ms_n": 12, "ttft_ms_p50": 19.0, "ttft_ms_p99": 21.0},
    {"start_s": 1.0, "span_s": 0.5, "requests": 12, "ok": 12, "output_tokens_per_sec": 310.5,
     "ttft_ms_n": 12, "ttft_ms_p50": 40.0, "ttft_ms_p99": 55.0},
]  # fmt: skip
RAMP_SLICES = [{"start_s": 0.0, "span_s": 1.0, "requests": 3, "ok": 3}]
TREND = {"alpha": 0.01, "n": 24, "ttft_tau": 0.81, "ttft_p": 1e-9, "in_flight_tau": 0.7,
         "in_flight_p": 2e-6, "saturated": True}  # fmt: skip
STOP = {"load_point": "sweep-r135.9", "sweep_step": "s1", "rate": 135.9, "skipped": ["s2", "s3"],
        "time_kept_s": 4.5}  # fmt: skip


@pytest.fixture
def shaped(tmp_path: Path) -> Path:
    records = ledgers.run_records("run-load", seed=3, cells=(CELL,))
    loads = ledgers.load_records("run-load", CELL, seed=3)
    loads[1].update(
        percentile_intervals=INTERVALS, slices=SLICES, ramp_slices=RAMP_SLICES, slice_s=1.0,
        ramp_requests=3, trend=TREND,
    )  # fmt: skip
    sweep = {**loads[0], "load_point": "sweep", "pattern": "sweep", "saturation_rate": 120.0,
             "saturation_stop": STOP}  # fmt: skip
    return ledgers.write(tmp_path / "run-load.jsonl", [*records[:-1], *loads, sweep, records[-1]])


def test_the_load_csv_carries_the_intervals_trend_slices_and_sweep_stop(
    shaped: Path, tmp_path: Path
) -> None:
    output = tmp_path / "loads.csv"
    assert main(["export", str(shaped), "--load-csv", str(output)]) == 0
    row = pd.read_csv(output).set_index("load_point").loc["c4"]
    assert (row["ttft_ms_p50_low"], row["ttft_ms_p50_high"]) == (18.5, 21.0)
    # An open side is blank, and the percentiles the sample cannot bound are named.
    assert row["ttft_ms_p99_low"] == 23.0 and pd.isna(row["ttft_ms_p99_high"])
    assert row["too_few"] == "ttft_ms_p99 tpot_ms_p99"
    assert row["trend_saturated"] and row["trend_ttft_tau"] == 0.81 and row["trend_n"] == 24
    assert row["slices"] == 2 and row["slice_s"] == 1.0
    assert (row["slice_output_tokens_per_sec_min"], row["slice_output_tokens_per_sec_max"]) == (
        310.5, 640.0,
    )  # fmt: skip
    assert row["ramp_requests"] == 3
    sweep = pd.read_csv(output).set_index("load_point").loc["sweep"]
    assert sweep["saturation_stop_rate"] == 135.9
    assert sweep["saturation_stop_load_point"] == "sweep-r135.9"
    assert sweep["saturation_stop_skipped"] == 2 and sweep["saturation_stop_time_kept_s"] == 4.5


def test_the_slices_csv_has_a_row_per_slice_the_ramps_first(shaped: Path, tmp_path: Path) -> None:
    output = tmp_path / "slices.csv"
    assert main(["export", str(shaped), "--load-slices-csv", str(output)]) == 0
    frame = pd.read_csv(output)
    assert list(frame["window"]) == ["ramp", "measured", "measured"]
    assert set(frame["load_point"]) == {"c4"}
    assert list(frame["output_tokens_per_sec"].iloc[1:]) == [640.0, 310.5]
    assert list(frame["ttft_ms_p99"].iloc[1:]) == [21.0, 55.0]


def test_the_json_carries_the_intervals_trend_slices_and_sweep_stop(
    shaped: Path, tmp_path: Path
) -> None:
    output = tmp_path / "summary.json"
    assert main(["export", str(shaped), "--json", str(output)]) == 0
    loads = {load["load_point"]: load for load in json.loads(output.read_text())["loads"]}
    assert loads["c4"]["percentile_intervals"] == INTERVALS
    assert loads["c4"]["slices"] == SLICES and loads["c4"]["ramp_slices"] == RAMP_SLICES
    assert loads["c4"]["trend"] == TREND
    assert loads["sweep"]["saturation_stop"] == STOP
