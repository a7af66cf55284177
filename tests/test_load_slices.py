"""`slice_s`: a load point's measured window cut into time slices, each with its throughput and
percentiles in the load record and drawn over time in the HTML report. Pure for the slicing; end
to end against tests/support/keepalive_server.py (a stand-in OpenAI-style streaming server: no
engine here slows down on cue) made to slow down partway by a set amount."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.keepalive_server import keepalive_server
from test_html_report import chromium, console_problems, needs_chromium
from test_load import ledger_records, write_load_project

from pytest_gpubench.reports.load_html import render_load_section
from pytest_gpubench.results.load_over_time import time_slices
from pytest_gpubench.results.load_summary import summarize_point


def _call(send_ms: float, ttft: float, *, tokens: int = 4) -> dict[str, object]:
    return {
        "send_ms": send_ms,
        "send_lag_ms": 0.0,
        "first_delta_ms": ttft,
        "total_duration_ms": ttft + 30.0,
        "tpot_ms": 10.0,
        "inter_chunk_ms": [10.0] * (tokens - 1),
        "completion_tokens": tokens,
        "error": None,
        "finish_reason": "length",
        "load_window": "measured",
    }


def test_each_slice_has_the_requests_sent_in_it_and_the_tokens_that_arrived_in_it() -> None:
    """Two requests a second for 2 s, the second second's TTFT ten times the first's."""
    calls = [_call(500.0 * i, 10.0 if i < 2 else 100.0) for i in range(4)]
    slices = time_slices(calls, 0.0, 2000.0, 1.0)
    assert [row["start_s"] for row in slices] == [0.0, 1.0]
    assert [row["requests"] for row in slices] == [2, 2]
    assert [row["ttft_ms_p50"] for row in slices] == [10.0, 100.0]
    assert [row["ttft_ms_n"] for row in slices] == [2, 2]
    # Four tokens of each request, every one arriving within the second it was sent in.
    assert [row["output_tokens_per_sec"] for row in slices] == [8.0, 8.0]


def test_the_last_slice_may_be_shorter_and_its_rate_is_over_its_own_span() -> None:
    calls = [_call(0.0, 10.0), _call(1000.0, 10.0)]
    # Window 0..1040 ms (the last request's end) in slices of 0.5 s: 0.5, 0.5 and 0.04 s.
    summary = summarize_point(calls, offered_rate=None, slo=None, max_send_lag_ms=None, slice_s=0.5)
    slices = summary["slices"]
    assert summary["slice_s"] == 0.5
    assert [row["span_s"] for row in slices] == [0.5, 0.5, 0.04]
    assert [row["requests"] for row in slices] == [1, 0, 1]
    assert slices[1]["ttft_ms_p50"] is None and slices[1]["output_tokens_per_sec"] == 0.0
    # The second request's four tokens at 1010, 1020, 1030 and 1040 ms: all in the last slice.
    assert slices[2]["output_tokens_per_sec"] == pytest.approx(4 / 0.04)


def test_a_point_without_slice_s_has_no_slices() -> None:
    summary = summarize_point([_call(0.0, 10.0)], offered_rate=None, slo=None, max_send_lag_ms=None)
    assert summary["slices"] is None and summary["slice_s"] is None


FAST_S, SLOW_S = 0.02, 0.15
FAST, SLOW = 25, 10


@needs_chromium
@pytest.mark.browser
def test_a_point_whose_engine_slowed_down_halfway_shows_it_in_its_slices_and_chart(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """One stream (c1) of 35 requests after the warm-up: the stand-in waits 20 ms before the
    first chunk of the first 25 measured ones and 150 ms for the last 10. What makes it certain:
    request k of one stream goes out at least 20 ms x k into the window, so the first 0.5 s
    slice holds only fast requests; the last 10 take at least 1.5 s, so the last slice with a
    send holds only slow ones, whose TTFT is at least 150 ms by the server's own wait."""
    with keepalive_server(prefill_s=FAST_S, from_request=FAST + 2, then_prefill_s=SLOW_S) as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            f" load: {{concurrency: [1], requests: {FAST + SLOW}, slice_s: 0.5}}}}\n",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
        posts = len(server.requests)
    result.assert_outcomes(passed=1)
    # One warm-up request before the point: the 27th POST is the first slow one.
    assert posts == 1 + FAST + SLOW
    records = ledger_records(pytester)
    (load,) = [r for r in records if r["type"] == "load"]
    slices = load["slices"]
    assert load["slice_s"] == 0.5 and len(slices) >= 4
    assert sum(row["requests"] for row in slices) == FAST + SLOW
    first = slices[0]
    last = [row for row in slices if row["requests"]][-1]
    assert first["requests"] >= 1 and first["ttft_ms_p50"] < SLOW_S * 1000
    assert last["ttft_ms_p50"] >= SLOW_S * 1000
    # The whole point's p50 hides it: 25 of 35 requests were fast.
    assert load["ttft_ms_p50"] < SLOW_S * 1000

    section = render_load_section([load])  # type: ignore[list-item]
    charts = re.findall(r"<svg\b.*?</svg>", section, flags=re.S)
    over_time = [chart for chart in charts if "output tokens/s per slice" in chart]
    assert len(over_time) == 1 and "s into the measured window" in over_time[0]
    page = tmp_path / "slices.html"
    page.write_text(f"<!doctype html><html><body><h2>Load</h2>{section}</body></html>\n")
    dom = chromium(page, tmp_path / "profile", "--dump-dom")
    screenshot = tmp_path / "slices.png"
    shot = chromium(page, tmp_path / "profile-2", "--window-size=1300,900", "--hide-scrollbars",
                    f"--screenshot={screenshot}")  # fmt: skip
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 30_000
    assert console_problems(dom.stderr + shot.stderr) == []
    assert "TTFT p50 (solid) and p99 (dashed) ms per slice" in dom.stdout


def test_a_slice_that_does_not_say_its_place_is_left_out_of_the_chart_not_a_crash() -> None:
    """A hand-edited or merged ledger's slice without start_s or span_s (or with null ones):
    `gpubench report` draws the slices that say where they are and leaves the rest out."""
    from pytest_gpubench.reports.load_html import _slices_chart

    point = {
        "load_point": "c2",
        "slices": [
            {"start_s": 0.0, "span_s": 0.5, "output_tokens_per_sec": 100.0, "ttft_ms_p50": 9.0},
            {"start_s": None, "span_s": 0.5, "output_tokens_per_sec": 90.0},
            {"output_tokens_per_sec": 80.0},
        ],
        "ramp_slices": [{"span_s": None, "output_tokens_per_sec": 10.0}],
    }
    svg = _slices_chart("slices", [point])
    assert "<svg" in svg


def test_a_slice_whose_number_is_past_a_floats_range_is_left_out_not_a_crash() -> None:
    """A hand-edited ledger's integer too large for a float (10**400) where a slice says its
    place: the report's own number reader raised OverflowError; it now reads such a field as
    no number, as every ledger reader does (results/stats.field_number)."""
    from pytest_gpubench.reports.load_html import _slices_chart

    point = {
        "load_point": "c2",
        "slices": [
            {"start_s": 0.0, "span_s": 0.5, "output_tokens_per_sec": 100.0, "ttft_ms_p50": 9.0},
            {"start_s": 10**400, "span_s": 0.5, "output_tokens_per_sec": 90.0},
        ],
    }
    assert "<svg" in _slices_chart("slices", [point])
