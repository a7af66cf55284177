"""Each load percentile's confidence interval (results/percentiles.py): the distribution-free
order-statistic interval covers the true percentile as often as it says, on samples drawn from
a known distribution; a p99 from too few requests has an open upper side and says so in the
record and in the terminal and Markdown tables. Pure: no server, no timing."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_gpubench.reports.load_tables import render_percentile_intervals
from pytest_gpubench.reports.markdown import render_markdown
from pytest_gpubench.results.load_summary import summarize_point
from pytest_gpubench.results.percentiles import (
    CONFIDENCE,
    fewest_for_interval,
    interval_ranks,
    percentile,
    percentile_interval,
)

TRIALS = 2000


@pytest.mark.parametrize("n", [50, 400])
@pytest.mark.parametrize("q", [50, 90, 99])
def test_the_interval_covers_the_true_percentile_at_least_as_often_as_its_confidence(
    q: int, n: int
) -> None:
    """Exponential samples (true q-th percentile -ln(1 - q/100)), 2000 seeded draws of n: the
    interval holds the true percentile in at least 95 % of them, less the draws' own noise
    (a standard error of 0.5 %); an open side bounds nothing, so it always holds on that side."""
    truth = -math.log(1.0 - q / 100.0)
    draw = random.Random(f"{q}:{n}")
    held = 0
    for _ in range(TRIALS):
        low, high = percentile_interval([draw.expovariate(1.0) for _ in range(n)], q)
        held += (low is None or low <= truth) and (high is None or truth <= high)
    assert held / TRIALS >= CONFIDENCE - 0.015


def test_the_interval_is_no_wider_than_its_confidence_needs() -> None:
    """At n = 1000 the p50's interval is the sorted samples 468..531 (0-based) and holds the
    true median about 95.4 % of the time, not far more: the interval is not padded to be sure."""
    assert interval_ranks(1000, 50) == (468, 531)
    truth = math.log(2.0)
    draw = random.Random("narrow")
    held = 0
    for _ in range(TRIALS):
        low, high = percentile_interval([draw.expovariate(1.0) for _ in range(1000)], 50)
        assert low is not None and high is not None
        held += low <= truth <= high
    assert held / TRIALS <= 0.975


def test_a_p99_needs_368_samples_to_be_bounded_above_at_95_percent() -> None:
    """0.99^n <= 0.025 first at n = 368: below it the upper bound is no sample's."""
    assert fewest_for_interval(99) == 368
    assert interval_ranks(367, 99)[1] is None
    assert interval_ranks(368, 99) == (359, 367)
    assert fewest_for_interval(50) == 6 and interval_ranks(5, 50) == (None, None)


@given(st.lists(st.floats(0.0, 1e6), min_size=1, max_size=600), st.sampled_from([50, 90, 99]))
def test_a_sample_big_enough_to_bound_its_percentile_brackets_the_one_shown_beside(
    values: list[float], q: int
) -> None:
    """From fewer samples the interval may lie above the sample's percentile, rightly: of two
    samples both lie below the true p99 98 % of the time, so its interval starts at the
    maximum, above the interpolated p99."""
    if len(values) < fewest_for_interval(q):
        values = values * (fewest_for_interval(q) // len(values) + 1)
    low, high = percentile_interval(values, q)
    point = percentile(values, q)
    assert point is not None
    assert low is None or low <= point + 1e-3
    assert high is None or point <= high + 1e-3


def _calls(ttfts: list[float]) -> list[dict[str, object]]:
    return [
        {
            "send_ms": 10.0 * i,
            "send_lag_ms": 0.1,
            "first_delta_ms": ttft,
            "first_answer_ms": ttft,
            "total_duration_ms": ttft + 90.0,
            "tpot_ms": 10.0,
            "inter_chunk_ms": [10.0] * 9,
            "completion_tokens": 10,
            "error": None,
            "finish_reason": "length",
            "load_window": "measured",
        }
        for i, ttft in enumerate(ttfts)
    ]


def _point(n: int) -> dict[str, object]:
    summary = summarize_point(
        _calls([float(i) for i in range(1, n + 1)]), offered_rate=None, slo=None,
        max_send_lag_ms=None,
    )  # fmt: skip
    return {"type": "load", "cell_id": "c", "prompt_id": "P", "load_point": f"c{n}", **summary}


def test_the_record_gives_each_percentile_its_interval_and_n_and_names_those_from_too_few() -> None:
    few, many = _point(50), _point(400)
    intervals = few["percentile_intervals"]
    assert isinstance(intervals, dict)
    assert intervals["ttft_ms"]["n"] == 50 and intervals["itl_ms"]["n"] == 50 * 9
    # TTFTs 1..50 ms: the p50's interval is the 18th and 33rd of them.
    assert intervals["ttft_ms"]["p50"] == [18.0, 33.0]
    assert intervals["ttft_ms"]["p99"] == [48.0, None]
    assert "ttft_ms_p99" in intervals["too_few"] and "ttft_ms_p50" not in intervals["too_few"]
    many_intervals = many["percentile_intervals"]
    assert isinstance(many_intervals, dict)
    assert many_intervals["ttft_ms"]["p99"] == [392.0, 400.0]
    assert "ttft_ms_p99" not in many_intervals["too_few"]


def test_the_terminal_and_markdown_tables_show_the_intervals_and_a_p99_from_too_few() -> None:
    few, many = _point(50), _point(400)
    text = render_percentile_intervals([few, many])  # type: ignore[list-item]
    rows = {
        (line.split()[0], line.split()[1]): line for line in text.splitlines() if " TTFT " in line
    }
    assert "25.50 [18.00, 33.00]" in rows[("c50", "TTFT")]
    assert "49.51 [48.00, open] too few" in rows[("c50", "TTFT")]
    assert "too few" not in rows[("c400", "TTFT")]
    assert "p99 [95% CI] ms" in text and "p99: 368" in text
    markdown = render_markdown([{"type": "meta"}, few, many])
    cells = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")]
        for line in markdown.splitlines()
        if "| TTFT " in line and line.startswith("| c")
    }
    assert cells["c50"][3:7] == [
        "50", "25.50 [18.00, 33.00]", "45.10 [41.00, 50.00]", "49.51 [48.00, open] too few",
    ]  # fmt: skip
    assert cells["c400"][6] == "396.01 [392.00, 400.00]"
    assert "\n\ntoo few: fewer samples than the interval needs" in markdown


def test_a_first_answer_row_only_where_the_model_reasoned() -> None:
    """Without reasoning the first answer is the TTFT: its row would repeat the TTFT's."""
    plain_point = _point(50)
    reasoned = dict(plain_point, load_point="r1", reasoning_tokens_p50=12.0)
    text = render_percentile_intervals([plain_point, reasoned])  # type: ignore[list-item]
    rows = [line.split()[:2] for line in text.splitlines() if "first" in line]
    assert rows == [["r1", "first"]]
