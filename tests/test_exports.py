"""`gpubench export`: the Prometheus textfile read back by prometheus_client's parser, the CSV by
pandas with the right types, the JSON summary."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import ledgers

from pytest_gpubench.cli.main import main
from pytest_gpubench.results.stats import summarize


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    base = ledgers.run_records("run-base", seed=1)
    current = ledgers.run_records("run-current", seed=2, slowdown=1.5, against=base)
    return ledgers.write(tmp_path / "run-current.jsonl", current)


def test_prometheus_textfile_parses_back(ledger: Path, tmp_path: Path) -> None:
    textfile = tmp_path / "textfile" / "gpubench.prom"
    assert main(["export", str(ledger), "--prometheus", str(textfile)]) == 0
    families = {f.name: f for f in text_string_to_metric_families(textfile.read_text())}
    assert families["gpubench_warm"].type == "gauge"
    expected = {s.key: s for s in summarize(ledgers.read(ledger))}
    warm = {
        (s.labels["cell"], s.labels["prompt"], s.labels["metric"], s.labels["percentile"]): s.value
        for s in families["gpubench_warm"].samples
    }
    tiny = expected[("local:llamacpp:tiny", "P-EASY")]
    assert warm[("local:llamacpp:tiny", "P-EASY", "first_delta_ms", "p50")] == pytest.approx(
        tiny.figure("first_delta_ms", "p50")
    )
    assert warm[("gpu1:llamacpp:qwen", "P-HARD", "decode_tokens_per_sec", "p99")] > 0
    calls = {
        (s.labels["cell"], s.labels["prompt"], s.labels["outcome"]): s.value
        for s in families["gpubench_warm_calls"].samples
    }
    assert calls[("gpu1:llamacpp:qwen", "P-EASY", "failed")] == 1
    assert calls[("gpu1:llamacpp:qwen", "P-EASY", "ok")] == 29
    regressions = {
        (s.labels["cell"], s.labels["prompt"], s.labels["metric"]): s.value
        for s in families["gpubench_gate_regression"].samples
    }
    assert regressions[("local:llamacpp:tiny", "P-EASY", "warm_ttft_p50_ms")] == 1
    assert regressions[("local:llamacpp:tiny", "P-EASY", "warm_success_rate")] == 0
    cold = {(s.labels["cell"], s.labels["metric"]) for s in families["gpubench_cold"].samples}
    assert ("local:llamacpp:tiny", "first_delta_ms") in cold
    (info,) = families["gpubench_run_info"].samples
    assert info.labels == {"run_id": "run-current", "git_sha": "0000002"}
    (started,) = families["gpubench_run_started_timestamp_seconds"].samples
    assert started.value == pd.Timestamp("2026-11-01T10:00:00Z").timestamp()


def test_csv_reads_back_with_the_right_types(ledger: Path, tmp_path: Path) -> None:
    csv = tmp_path / "calls.csv"
    assert main(["export", str(ledger), "--csv", str(csv)]) == 0
    frame = pd.read_csv(csv, parse_dates=["started_at_utc"])
    calls = [r for r in ledgers.read(ledger) if r["type"] == "call"]
    assert len(frame) == len(calls) == 2 * 2 * 31
    dtypes = frame.dtypes
    for name in ("first_delta_ms", "total_duration_ms", "decode_tokens_per_sec", "tpot_ms"):
        assert dtypes[name] == "float64", name
    assert dtypes["run_idx"] == "int64"
    assert dtypes["ok"] == "bool" and dtypes["coalesced"] == "bool"
    started = dtypes["started_at_utc"]
    assert isinstance(started, pd.DatetimeTZDtype) and str(started.tz) == "UTC"
    for name in ("cell_id", "prompt_id", "phase", "error"):
        assert pd.api.types.is_string_dtype(dtypes[name]), name
    # A count with a blank for the failed call: integers when read as nullable integers.
    counts = pd.read_csv(csv, dtype={"completion_tokens": "Int64"})["completion_tokens"]
    assert counts.isna().sum() == 2 and set(counts.dropna()) == {64}
    assert frame["ok"].sum() == len(calls) - 2
    first = frame.iloc[0]
    assert (first["cell_id"], first["prompt_id"], first["phase"]) == (
        calls[0]["cell_id"],
        calls[0]["prompt_id"],
        "cold",
    )
    assert first["first_delta_ms"] == pytest.approx(calls[0]["first_delta_ms"])
    failed = frame[~frame["ok"]].iloc[0]
    assert failed["error"] == "connection reset by peer" and pd.isna(failed["first_delta_ms"])


def test_json_summary(ledger: Path, tmp_path: Path) -> None:
    output = tmp_path / "summary.json"
    assert main(["export", str(ledger), "--json", str(output)]) == 0
    data = json.loads(output.read_text())
    assert data["benchmark_run_id"] == "run-current"
    keys = {(s["cell_id"], s["prompt_id"]) for s in data["summaries"]}
    assert len(keys) == 4
    assert all("samples" not in s for s in data["summaries"])
    assert any(v["verdict"] == "regression" for v in data["verdicts"])
    assert {c["status"] for c in data["cells"]} == {"measured", "failed"}


def test_export_needs_a_format(ledger: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(ledger)]) == 2
    assert "name at least one of --prometheus, --csv, --json" in capsys.readouterr().err


def test_a_cold_figure_that_ran_warm_carries_its_cold_kind(tmp_path: Path) -> None:
    """A cold case that ran warm (`process_warm`) is told apart from a cold start in Prometheus."""
    records = ledgers.run_records("run-current", seed=2)
    for record in records:
        if record.get("type") == "call" and record.get("phase") == "cold":
            record["cold_kind"] = "process_warm"
    textfile = tmp_path / "gpubench.prom"
    assert (
        main(
            [
                "export",
                str(ledgers.write(tmp_path / "r.jsonl", records)),
                "--prometheus",
                str(textfile),
            ]
        )
        == 0
    )
    families = {f.name: f for f in text_string_to_metric_families(textfile.read_text())}
    kinds = {s.labels["cold_kind"] for s in families["gpubench_cold"].samples}
    assert kinds == {"process_warm"}
