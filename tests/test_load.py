"""Load cases without a real engine: the profile, the cases, the client's HTTP reading, the
summary, the arrival schedules, the gate on load points and the /metrics parser (pure or against
tests/support/keepalive_server.py, a timing-controlled OpenAI-style server)."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.keepalive_server import keepalive_server
from support.tls_terminator import stunnel, stunnel_binary

from pytest_gpubench.config.cases import build_cases
from pytest_gpubench.config.load_profile import LoadProfile, LoadThresholds, Slo, merged_profile
from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.ledger.writer import read_ledger
from pytest_gpubench.measure.gauges import parse_metrics
from pytest_gpubench.measure.load_client import RawResponse, _ResponseReader, stamped_lines
from pytest_gpubench.results.load_gate import judge_point
from pytest_gpubench.results.load_summary import summarize_point
from pytest_gpubench.run.load.open_loop import arrival_gaps
from pytest_gpubench.run.load.sweep import saturation_rate

PROMPTS = "prompts:\n  P-EASY: {intent: short, prompt: hi, max_tokens: 8}\n"
TEST_GENERATE = "def test_generate(gpubench_case):\n    gpubench_case.run()\n"
INFERENCE_TEST = (Path(__file__).parent.parent / "benchmarks/test_inference.py").read_text()


def write_load_project(
    pytester: pytest.Pytester, cell_lines: str, test_bench: str = TEST_GENERATE
) -> None:
    """prompts.yaml (P-EASY), cells.yaml with a local node and these cells, and the test file."""
    pytester.makefile(".yaml", prompts=PROMPTS)
    pytester.makefile(".yaml", cells="nodes: {local: {kind: local}}\ncells:\n" + cell_lines)
    pytester.makepyfile(test_bench=test_bench)


def ledger_records(pytester: pytest.Pytester) -> list[dict[str, Any]]:
    """The records of the run's only ledger."""
    (ledger,) = (pytester.path / "runs").glob("*.jsonl")
    return read_ledger(ledger)


def matrix_of(tmp_path: Path, cells: str) -> object:
    (tmp_path / "cells.yaml").write_text(cells)
    (tmp_path / "prompts.yaml").write_text(PROMPTS)
    return read_matrix(tmp_path / "cells.yaml", tmp_path / "prompts.yaml")


# -- the profile and the cases ----------------------------------------------------------------


def test_settings_load_is_every_cells_default_and_a_cells_keys_win(tmp_path: Path) -> None:
    matrix = matrix_of(
        tmp_path,
        "settings:\n  load: {concurrency: [1, 4], requests: 8, rate: [2.5]}\n"
        "nodes: {local: {kind: local}}\ncells:\n"
        "  - {node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:1'}\n"
        "  - {node: local, engine: openai, model: m, name: b, endpoint: 'http://127.0.0.1:1',"
        " load: {concurrency: [16], rate: []}}\n"
        "  - {node: local, engine: openai, model: m, name: c, endpoint: 'http://127.0.0.1:1',"
        " load: off}\n",
    )
    ids = [case.case_id for case in build_cases(matrix) if case.load_point]  # type: ignore[arg-type]
    assert ids == [
        "local:openai:m-P-EASY-load-c1",
        "local:openai:m-P-EASY-load-c4",
        "local:openai:m-P-EASY-load-r2.5",
        "local:openai:m@b-P-EASY-load-c16",
    ]


def test_a_cell_without_load_gets_no_load_cases(tmp_path: Path) -> None:
    matrix = matrix_of(
        tmp_path,
        "nodes: {local: {kind: local}}\ncells:\n"
        "  - {node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:1'}\n",
    )
    phases = {case.phase for case in build_cases(matrix)}  # type: ignore[arg-type]
    assert phases == {"cold", "warm"}


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ("load: {concurrency: [2]}", "load: needs duration_s or requests"),
        ("load: {concurrency: [2], requests: 4, prompts: [P-NONE]}", "'P-NONE' is not defined"),
        ("load: {concurrency: [0], requests: 4}", "greater than or equal to 1"),
        ("load: {rate: [1], requests: 4, arrival: bursty}", "load.arrival"),
        ("parallel: 4", "parallel: only a managed llamacpp cell"),
    ],
)
def test_a_load_profile_that_cannot_run_is_one_line(
    tmp_path: Path, cell: str, message: str
) -> None:
    with pytest.raises(GpubenchError) as error:
        matrix_of(
            tmp_path,
            "nodes: {local: {kind: local}}\ncells:\n"
            f"  - {{node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:1', {cell}}}\n",
        )
    assert message in str(error.value)
    assert "cells[0] (local:openai:m)" in str(error.value) or "cells.yaml" in str(error.value)


def test_ollama_cells_cannot_be_load_tested_yet(tmp_path: Path) -> None:
    with pytest.raises(GpubenchError, match="engine 'ollama' cannot be load-tested yet"):
        matrix_of(
            tmp_path,
            "nodes: {local: {kind: local}}\ncells:\n  - {node: local, engine: ollama, model: m,"
            " endpoint: 'http://127.0.0.1:1', load: {concurrency: [2], duration_s: 1}}\n",
        )


def test_merged_profile_off_and_empty() -> None:
    default = LoadProfile(concurrency=[2], duration_s=1.0)
    assert merged_profile(default, False) is None
    assert merged_profile(None, None) is None
    merged = merged_profile(default, LoadProfile(duration_s=5.0, sweep=True))  # type: ignore[arg-type]
    assert merged is not None and merged.points == ["c2", "sweep"] and merged.duration_s == 5.0


# -- the client's reading of a response --------------------------------------------------------


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + chunk(b'data: {"a": 1}\n\ndata: {"b"')  # an event split across two chunks
    + chunk(b": 2}\n\n")
    + chunk(b"data: [DONE]\n\n")
    + b"0\r\n\r\n"
)


@pytest.mark.parametrize("piece", [len(RESPONSE), 11, 5, 2, 1])
def test_a_chunked_response_is_read_whole_however_it_is_split(piece: int) -> None:
    response = RawResponse(sent_ns=0)
    reader = _ResponseReader(response)
    reads = [RESPONSE[start : start + piece] for start in range(0, len(RESPONSE), piece)]
    for stamp, data in enumerate(reads, start=1):
        assert not reader.done
        reader.feed(stamp * 1000, data)
    assert reader.done and response.status == 200
    lines = [line.text for line in stamped_lines(response.pieces) if line.text]
    assert lines == [b'data: {"a": 1}', b'data: {"b": 2}', b"data: [DONE]"]
    # Each line keeps the stamp of the read that brought its first byte.
    first = stamped_lines(response.pieces)[0]
    assert first.arrived_ns == 1000 * (1 + RESPONSE.index(b"data: {") // piece)


def test_a_sized_response_ends_at_its_length() -> None:
    response = RawResponse(sent_ns=0)
    reader = _ResponseReader(response)
    reader.feed(1, b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{")
    assert not reader.done
    reader.feed(2, b"}")
    assert reader.done and response.status == 404 and response.keep_alive


# -- the summary --------------------------------------------------------------------------------


def call(
    send_ms: float, ttft: float, total: float, *, window: str = "measured", **extra: object
) -> dict[str, object]:
    record: dict[str, object] = {
        "send_ms": send_ms,
        "scheduled_send_ms": send_ms,
        "send_lag_ms": 0.1,
        "first_delta_ms": ttft,
        "total_duration_ms": total,
        "tpot_ms": (total - ttft) / 9,
        "inter_chunk_ms": [(total - ttft) / 9] * 9,
        "completion_tokens": 10,
        "error": None,
        "finish_reason": "length",
        "load_window": window,
    }
    record.update(extra)
    return record


def test_the_summary_counts_only_the_measured_window() -> None:
    calls = [call(0.0, 10.0, 100.0, window="warmup")]
    calls += [call(100.0 * i, 10.0 + i, 1000.0) for i in range(10)]
    calls += [call(1000.0, 5.0, 50.0, window="cooldown")]
    calls += [
        call(500.0, 5.0, 5.0, error="stream did not finish within 1 s", finish_reason="error")
    ]
    summary = summarize_point(calls, offered_rate=10.0, slo=Slo(ttft_ms=15.0), max_send_lag_ms=1.0)
    assert summary["requests"] == 11 and summary["ok"] == 10
    assert summary["errors"] == 1 and summary["timeouts"] == 1
    assert summary["window_s"] == pytest.approx(1.9)  # first send to last end
    assert summary["output_tokens"] == 100
    assert summary["output_tokens_per_sec"] == pytest.approx(100 / 1.9, rel=1e-3)
    assert summary["ttft_ms_p50"] == pytest.approx(14.5)
    # Goodput: the requests within the SLO (TTFT 10..15 ms: six of the eleven sent), over the
    # window.
    assert summary["slo_attainment"] == pytest.approx(6 / 11, rel=1e-3)
    assert summary["goodput_rate"] == pytest.approx(6 / 1.9, rel=1e-3)
    assert summary["meets_slo"] is False
    assert summary["valid"] is True and summary["invalid_reason"] is None


def test_a_point_whose_sends_were_late_is_invalid_with_the_reason() -> None:
    calls = [call(10.0 * i, 5.0, 50.0, send_lag_ms=float(i)) for i in range(20)]
    summary = summarize_point(calls, offered_rate=100.0, slo=None, max_send_lag_ms=5.0)
    assert summary["valid"] is False
    assert summary["send_lag_ms_max"] == 19.0
    assert "send lag p99 18.81 ms > 5 ms" in summary["invalid_reason"]


def test_the_saturation_point_is_the_highest_rate_that_met_the_slo() -> None:
    steps = [
        (None, {"valid": True, "achieved_rate": 2.0, "meets_slo": True}),
        (None, {"valid": True, "achieved_rate": 9.0, "meets_slo": False}),
        (4.0, {"valid": True, "achieved_rate": 4.0, "meets_slo": True}),
        (6.0, {"valid": True, "achieved_rate": 5.9, "meets_slo": True}),
        (8.0, {"valid": False, "achieved_rate": 7.9, "meets_slo": True}),
    ]
    assert saturation_rate(steps) == 5.9  # type: ignore[arg-type]


# -- arrivals -----------------------------------------------------------------------------------


def take(gaps: object, n: int) -> list[float]:
    return [next(gaps) for _ in range(n)]  # type: ignore[call-overload]


def test_arrival_schedules_are_seeded_and_have_the_rate() -> None:
    poisson = take(arrival_gaps(5.0, "poisson", 1.0, seed=7), 4000)
    assert poisson == take(arrival_gaps(5.0, "poisson", 1.0, seed=7), 4000)
    assert poisson != take(arrival_gaps(5.0, "poisson", 1.0, seed=8), 4000)
    assert statistics.mean(poisson) == pytest.approx(0.2, rel=0.05)
    assert take(arrival_gaps(4.0, "constant", 1.0, seed=0), 3) == [0.25] * 3
    bursty = take(arrival_gaps(5.0, "gamma", 0.25, seed=1), 4000)
    regular = take(arrival_gaps(5.0, "gamma", 4.0, seed=1), 4000)
    assert statistics.mean(bursty) == pytest.approx(0.2, rel=0.1)
    # Coefficient of variation 1/sqrt(shape): 2 for shape 0.25, 0.5 for shape 4.
    assert statistics.stdev(bursty) / statistics.mean(bursty) > 1.5
    assert statistics.stdev(regular) / statistics.mean(regular) < 0.6


# -- the gate on a load point ---------------------------------------------------------------------


def load(throughput: list[float], ttft: list[float], **extra: object) -> dict[str, object]:
    record: dict[str, object] = {
        "type": "load",
        "cell_id": "c",
        "prompt_id": "P",
        "prompt_sha256": "s",
        "load_point": "c4",
        "pattern": "closed",
        "valid": True,
        "output_tokens_per_sec": statistics.median(throughput),
        "ttft_ms_p99": max(ttft),
        "tpot_ms_p99": 2.0,
        "slo": None,
        "samples": {"output_tokens_per_sec": throughput, "ttft_ms": ttft, "tpot_ms": [2.0] * 20},
    }
    record.update(extra)
    return record


def test_halved_throughput_at_a_load_point_is_a_regression_naming_point_and_metric() -> None:
    baseline = load([1000.0 + i for i in range(10)], [10.0 + i / 10 for i in range(20)])
    halved = load([500.0 + i for i in range(10)], [10.0 + i / 10 for i in range(20)])
    verdicts = {v.metric: v for v in judge_point(halved, baseline, LoadThresholds())}
    found = verdicts["load_output_tokens_per_sec"]
    assert found.verdict == "regression"
    assert "P@load-c4" in found.message and "output tokens/s -49.8%" in found.message
    assert verdicts["load_ttft_p99_ms"].verdict == "ok"
    same = {v.verdict for v in judge_point(baseline, baseline, LoadThresholds())}
    assert same == {"ok"}


def test_a_point_whose_cpu_pressure_moved_from_the_baselines_is_unsteady_not_a_regression() -> None:
    """A load point keeps tasks waiting by its own requests (so a high pressure alone is not a
    verdict), but one whose pressure moved past 10 points from its baseline's runs ran on another
    machine, in effect: halved throughput then is unsteady (exit 10), not a regression."""
    history = [{"benchmark_run_id": f"r{i}", "cpu_pressure": 0.55 + i / 100} for i in range(3)]
    baseline = load([1000.0 + i for i in range(10)], [10.0] * 20, cpu_pressure=0.56)
    baseline["history"] = history
    busy = load([500.0 + i for i in range(10)], [10.0] * 20, cpu_pressure=0.95)
    verdicts = {v.metric: v for v in judge_point(busy, baseline, LoadThresholds())}
    found = verdicts["load_output_tokens_per_sec"]
    assert found.verdict == "unsteady"
    assert "tasks waited for a CPU 95% of the point's time against 56%" in found.message
    as_busy = load([500.0 + i for i in range(10)], [10.0] * 20, cpu_pressure=0.6)
    same_level = {v.metric: v for v in judge_point(as_busy, baseline, LoadThresholds())}
    assert same_level["load_output_tokens_per_sec"].verdict == "regression"


def test_an_invalid_point_is_never_judged_ok() -> None:
    baseline = load([1000.0] * 10, [10.0] * 20)
    late = load([1000.0] * 10, [10.0] * 20, valid=False, invalid_reason="send lag p99 ...")
    assert {v.verdict for v in judge_point(late, baseline, LoadThresholds())} == {"inconclusive"}


# -- /metrics -------------------------------------------------------------------------------------

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 640.0
vllm:generation_tokens_created{engine="0",model_name="tiny"} 1.7e9
"""


def test_the_metrics_page_gives_gauges_and_token_counters() -> None:
    gauges, counters = parse_metrics(VLLM_METRICS)
    assert gauges == {
        "vllm:num_requests_running": 3.0,
        "vllm:num_requests_waiting": 1.0,
        "vllm:kv_cache_usage_perc": 0.25,
    }
    assert counters == {"vllm:generation_tokens_total": 640.0}


# -- a whole load run against a timing-controlled server ----------------------------------------


@pytest.mark.serial
def test_load_cases_run_end_to_end_and_write_their_records(pytester: pytest.Pytester) -> None:
    """The keepalive server streams 8 chunks per request with usage; `-m load` runs only the
    load cases, and their records and the terminal's load table follow. Its subject is not
    whether the client keeps its schedule on a busy machine (a send lag of 13 ms beside three
    other test workers made the point invalid at the default 10 ms): it allows 100. Its r50 point
    holds the client to a schedule all the same, and beside the other workers and the set-up of
    `make test-parallel` (a 2-core machine) it lagged 156 ms once: serial, on a machine left to
    it."""
    with keepalive_server() as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {concurrency: [1, 4], rate: [50], arrival: poisson, requests: 24,"
            " warmup_s: 0.05, max_send_lag_ms: 100, slo: {ttft_ms: 1000}}}\n",
            INFERENCE_TEST,
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    result.assert_outcomes(passed=3)
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        ["load: local:openai:m", "*P-EASY*c1*", "*P-EASY*c4*", "*P-EASY*r50*50.00*"]
    )
    records = ledger_records(pytester)
    loads = {r["load_point"]: r for r in records if r["type"] == "load"}
    calls = [r for r in records if r["type"] == "call"]
    assert set(loads) == {"c1", "c4", "r50"}
    for point, summary in loads.items():
        measured = [c for c in calls if c["load_point"] == point and c["load_window"] == "measured"]
        assert summary["requests"] == len(measured) == 24, point
        assert summary["ok"] == 24 and summary["valid"], summary["invalid_reason"]
        assert summary["output_tokens"] == 24 * 8
        assert summary["goodput_rate"] == summary["achieved_rate"]
        # The point's CPU pressure (tests/conftest.py pins the gauge at none).
        assert summary["cpu_pressure"] == 0.0
    for record in calls:
        assert record["phase"] == "load" and record["completion_tokens"] == 8
        assert record["send_ms"] >= record["scheduled_send_ms"]
        assert record["send_lag_ms"] == pytest.approx(
            record["send_ms"] - record["scheduled_send_ms"], abs=1e-3
        )
    # The open loop's schedule: Poisson gaps of mean 1/50 s, the same on every run (seed 0).
    due = sorted(c["scheduled_send_ms"] for c in calls if c["load_point"] == "r50")
    assert 5 < statistics.mean(b - a for a, b in itertools.pairwise(due)) < 60
    end = records[-1]
    assert end["type"] == "end" and end["calls"] == len(calls)


def test_markers_select_load_cases_apart_from_cold_and_warm(pytester: pytest.Pytester) -> None:
    write_load_project(
        pytester,
        "  - {node: local, engine: openai, model: m, endpoint: 'http://127.0.0.1:9', runs: 2,"
        " load: {concurrency: [2], rate: [1], duration_s: 1}}\n",
    )
    warm = pytester.runpytest("--collect-only", "-q", "-m", "warm", "-p", "no:cacheprovider")
    load = pytester.runpytest("--collect-only", "-q", "-m", "load", "-p", "no:cacheprovider")
    everything = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider")
    assert [line for line in warm.outlines if "load" in line and "::" in line] == []
    load.stdout.fnmatch_lines(
        [
            "test_bench.py::test_generate[[]local:openai:m-P-EASY-load-c2[]]",
            "test_bench.py::test_generate[[]local:openai:m-P-EASY-load-r1[]]",
            "2/5 tests collected (3 deselected)*",
        ]
    )
    everything.stdout.fnmatch_lines(["5 tests collected*"])


def test_the_markdown_report_has_a_load_table_per_cell() -> None:
    from pytest_gpubench.reports.markdown import render_markdown

    point = load([1000.0] * 3, [10.0, 11.0, 12.0])
    point.update(
        achieved_rate=12.5, ttft_ms_p50=10.5, ok=30, errors=1, timeouts=0, send_lag_ms_p99=0.2,
        send_lag_ms_max=0.4, offered_rate=None, goodput_rate=None, e2e_ms_p99=80.0,
    )  # fmt: skip
    late = dict(point, load_point="r50", valid=False, invalid_reason="send lag p99 12 ms > 10 ms")
    text = render_markdown([{"type": "meta"}, point, late])
    assert "## c\n" in text and "### Load" in text
    rows = {
        line.split("|")[2].strip(): line for line in text.splitlines() if line.startswith("| P ")
    }
    assert set(rows) == {"c4", "r50"}
    assert "12.50" in rows["c4"] and "30 / 1 / 0" in rows["c4"] and "| ok" in rows["c4"]
    assert "INVALID: send lag p99 12 ms > 10 ms" in rows["r50"]


@pytest.mark.serial
def test_processes_share_a_point_and_each_reports_its_send_lag(pytester: pytest.Pytester) -> None:
    """Its r40 point must be valid at the default send lag (10 ms): a schedule kept by the
    machine, as the end-to-end run's above, so serial too."""
    with keepalive_server() as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {concurrency: [4], rate: [40], arrival: constant, requests: 20,"
            " processes: 2}}\n",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    result.assert_outcomes(passed=2)
    records = ledger_records(pytester)
    for point in ("c4", "r40"):
        (summary,) = [r for r in records if r["type"] == "load" and r["load_point"] == point]
        calls = [r for r in records if r["type"] == "call" and r["load_point"] == point]
        assert summary["requests"] == summary["ok"] == len(calls) == 20
        assert {c["process"] for c in calls} == {0, 1}
        rows = summary["send_lag_by_process"]
        assert [row["process"] for row in rows] == [0, 1]
        assert [row["requests"] for row in rows] == [10, 10]
    # Two constant schedules at 20/s, interleaved: one at 40/s.
    due = sorted(
        r["scheduled_send_ms"] for r in records if r["type"] == "call" and r["load_point"] == "r40"
    )
    assert [round(b - a, 1) for a, b in itertools.pairwise(due)] == [25.0] * 19


def test_a_sweep_runs_its_steps_and_reports_the_saturation_point(pytester: pytest.Pytester) -> None:
    with keepalive_server() as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {sweep: {rates: 2, max_concurrency: 4}, requests: 12,"
            " slo: {ttft_ms: 10000}}}\n",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    result.assert_outcomes(passed=1)
    records = ledger_records(pytester)
    loads = [r for r in records if r["type"] == "load"]
    (sweep,) = [r for r in loads if r["pattern"] == "sweep"]
    steps = {r["load_point"]: r for r in loads if r["pattern"] != "sweep"}
    low, high = steps["sweep-c1"]["achieved_rate"], steps["sweep-c4"]["achieved_rate"]
    rates = sorted(r["rate"] for r in steps.values() if r["pattern"] == "open")
    # Two open-loop rates evenly between one-at-a-time and as-fast-as-it-takes (in either order:
    # beside three test workers four at a time once went slower than one at a time).
    between = sorted([low + (high - low) / 3, low + 2 * (high - low) / 3])
    assert rates == pytest.approx(between, rel=1e-3)
    assert [row["load_point"] for row in sweep["steps"]] == list(steps)
    # Every step met the (generous) SLO: the saturation point is the highest achieved rate.
    assert sweep["saturation_rate"] == max(r["achieved_rate"] for r in steps.values())
    assert {c["load_point"] for c in records if c["type"] == "call"} == set(steps)
    result.stdout.fnmatch_lines(["*P-EASY*sweep*saturation*req/s*"])


def test_a_point_that_missed_its_schedule_fails_its_test_and_keeps_its_records(
    pytester: pytest.Pytester,
) -> None:
    """A send lag bound no client can keep (1 µs): the point is measured, recorded and shown,
    marked invalid with the reason, and its test fails; nothing measured is lost."""
    with keepalive_server() as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {rate: [40], requests: 12, max_send_lag_ms: 0.001}}\n",
            INFERENCE_TEST,
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*local:openai:m-P-EASY-load-r40: send lag p99 * ms > 0.001 ms (max_send_lag_ms)*",
            "*INVALID local:openai:m-P-EASY-load-r40 [[]r40[]]: send lag p99*",
        ]
    )
    records = ledger_records(pytester)
    (point,) = [r for r in records if r["type"] == "load"]
    assert point["valid"] is False and point["requests"] == 12
    assert "could not keep its schedule" in point["invalid_reason"]
    assert len([r for r in records if r["type"] == "call"]) == 12


def test_a_corrupt_load_baseline_is_one_line_naming_the_file(tmp_path: Path) -> None:
    from pytest_gpubench.results.load_baseline import load_baseline_path, read_load_baseline

    path = load_baseline_path(tmp_path, "local:openai:m")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(GpubenchError, match=r"local_openai_m\.json: corrupt load baseline"):
        read_load_baseline(tmp_path, "local:openai:m")
    path.write_text(json.dumps({"cell_id": "other", "points": {}}))
    with pytest.raises(GpubenchError, match="not the load baseline of local:openai:m"):
        read_load_baseline(tmp_path, "local:openai:m")


@pytest.mark.parametrize("processes", [1, 2])
def test_a_load_case_on_an_https_endpoint_trusts_what_the_cell_trusts(
    pytester: pytest.Pytester, tmp_path: Path, processes: int
) -> None:
    """stunnel (tests/support/tls_terminator.py, a CA made for the test) in front of the keepalive
    server: the load client connects over TLS with the cell's ca_file, from this process or from
    `processes: 2` spawned client processes (the CA travels to them as its text: an SSLContext
    cannot be pickled, and once failed the point with "cannot pickle 'SSLContext' object")."""
    if stunnel_binary() is None:
        pytest.skip("stunnel4 is not installed (scripts/setup-system.sh)")
    with keepalive_server() as server, stunnel(server.url, tmp_path / "tls") as terminator:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{terminator.url}',"
            f" ca_file: '{terminator.ca_file}',"
            f" load: {{concurrency: [2], requests: 6, processes: {processes}}}}}\n",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
        handshakes = terminator.handshakes()
    result.assert_outcomes(passed=1)
    records = ledger_records(pytester)
    (point,) = [r for r in records if r["type"] == "load"]
    assert point["ok"] == 6 and point["valid"]
    calls = [r for r in records if r["type"] == "call" and r.get("load_point") == "c2"]
    assert len(calls) == 6
    if processes > 1:
        assert {c["process"] for c in calls} == {0, 1}
    # The warm-up's connection and each client process's own (one per concurrent stream).
    assert handshakes >= 1 + processes


def test_the_gauges_are_scraped_over_tls_with_what_the_cell_trusts(tmp_path: Path) -> None:
    """The scraping thread (measure/gauges.GaugeScraper.run: a plain socket of its own, beside
    the load client's event loop) reads an https endpoint's /metrics through a real stunnel with
    the cell's CA, with the cell's headers, every interval until the point stops."""
    import asyncio
    import http.server
    import ssl
    import threading
    import time

    from pytest_gpubench.measure.gauges import GaugeScraper
    from pytest_gpubench.measure.stream import Endpoint

    if stunnel_binary() is None:
        pytest.skip("stunnel4 is not installed (scripts/setup-system.sh)")
    seen: list[str | None] = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = (
                f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {len(seen)}\n"
            )
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with stunnel(f"http://127.0.0.1:{server.server_port}", tmp_path / "tls") as terminator:
            trust = ssl.create_default_context(cafile=str(terminator.ca_file))
            scraper = GaugeScraper(
                Endpoint.parse(terminator.url), [("Authorization", "Bearer s3")], 50, trust
            )

            async def point() -> None:
                # Until the server has been asked three times (a scrape that has begun ends
                # before `stop` is read), not for a fixed 0.6 s: beside a whole parallel suite on
                # 2 cores a TLS scrape took over 200 ms, and 0.6 s held two.
                stop = asyncio.Event()
                scraping = asyncio.create_task(scraper.run(time.perf_counter_ns(), stop))
                deadline = time.monotonic() + 60
                while len(seen) < 3 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                stop.set()
                await scraping

            asyncio.run(point())
    finally:
        server.shutdown()
    running = scraper.samples.columns["vllm:num_requests_running"]
    assert scraper.samples.notes == []
    assert len(running) >= 3 and None not in running
    assert running == sorted(value or 0.0 for value in running)
    assert set(seen) == {"Bearer s3"}


@given(
    text=st.lists(st.sampled_from([b"data: {}", b"\r", b"\n", b"ab", b"\r\n", b"x"]), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
)
def test_stamped_lines_match_a_plain_split_whatever_the_reads(
    text: list[bytes], cuts: list[int]
) -> None:
    body = b"".join(text)
    bounds = sorted({0, len(body), *(cut for cut in cuts if cut < len(body))})
    pieces = [(index, body[a:b]) for index, (a, b) in enumerate(itertools.pairwise(bounds))]
    lines = stamped_lines([piece for piece in pieces if piece[1]])
    expected = [line.rstrip(b"\r") for line in body.split(b"\n") if line and line != b"\r"]
    assert [line.text for line in lines] == expected
    # Each line carries the stamp of the read that brought its first byte.
    starts, position = [], 0
    for line in body.split(b"\n"):
        if line and line != b"\r":
            starts.append(
                next(i for i, (a, b) in enumerate(itertools.pairwise(bounds)) if a <= position < b)
            )
        position += len(line) + 1
    assert [line.arrived_ns for line in lines] == starts
