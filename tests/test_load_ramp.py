"""Ramps (`ramp_s`, `ramp`, `ramp_from`): a point's rate or concurrency rising before its
measured window. The schedule is pure (run/load/ramp.py); end to end against
tests/support/keepalive_server.py (a stand-in OpenAI-style streaming server: no engine here
answers slowly on cue) the ramp's requests are recorded as such and left out of the figures."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.keepalive_server import keepalive_server
from test_html_report import CHROMIUM, chromium, console_problems
from test_load import ledger_records, matrix_of, write_load_project

from pytest_gpubench.config.load_profile import LoadProfile
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.reports.load_html import render_load_section
from pytest_gpubench.run.load import make_pattern
from pytest_gpubench.run.load.clients import share
from pytest_gpubench.run.load.closed_loop import ClosedLoop
from pytest_gpubench.run.load.open_loop import OpenLoop
from pytest_gpubench.run.load.ramp import Ramp


def sends_s(pattern: OpenLoop, until_s: float) -> list[float]:
    return list(itertools.takewhile(lambda at: at < until_s, pattern.ramped_s()))


def test_a_linear_rate_ramp_from_nothing_sends_a_quarter_of_its_ramp_in_the_first_half() -> None:
    """20 req/s constant, ramped linearly from 0 over 4 s: 40 requests expected in the ramp
    (the triangle's area), 10 of them in its first half; then 20 a second."""
    pattern = OpenLoop(20.0, "constant", ramp=Ramp(4.0, "linear", 0.0))
    sends = sends_s(pattern, 6.0)
    assert sum(at < 2.0 for at in sends) == 10
    assert sum(at < 4.0 for at in sends) == 40
    assert sum(4.0 <= at < 6.0 for at in sends) == 40
    # After the ramp: one every 1/20 s, as the unramped point.
    after = [at for at in sends if at >= 4.0]
    assert [round(b - a, 9) for a, b in itertools.pairwise(after)] == [0.05] * (len(after) - 1)


def test_an_exponential_rate_ramp_grows_by_the_same_factor_each_second() -> None:
    """From 1/16 of 32 req/s over 4 s: the rate doubles each second (2, 4, 8, 16 at the
    starts of the seconds), so each second of the ramp sends twice the one before."""
    pattern = OpenLoop(32.0, "constant", ramp=Ramp(4.0, "exponential", 1 / 16))
    sends = sends_s(pattern, 4.0)
    per_second = [sum(s <= at < s + 1 for at in sends) for s in range(4)]
    expected = [32 / 16 / math.log(2) * (2 ** (s + 1) - 2**s) for s in range(4)]
    assert per_second == pytest.approx(expected, abs=1)
    assert per_second[3] >= 2 * per_second[2] - 2


def test_a_poisson_ramp_keeps_its_seeded_gaps() -> None:
    """The same seed gives the same ramped schedule; after the ramp the Poisson point's mean
    gap is 1 / rate."""
    ramp = Ramp(2.0, "linear", 0.0)
    first = sends_s(OpenLoop(50.0, "poisson", seed=3, ramp=ramp), 40.0)
    assert first == sends_s(OpenLoop(50.0, "poisson", seed=3, ramp=ramp), 40.0)
    after = [at for at in first if at >= 2.0]
    mean = (after[-1] - after[0]) / (len(after) - 1)
    assert mean == pytest.approx(1 / 50, rel=0.1)


@given(
    st.sampled_from(["linear", "exponential"]),
    st.floats(0.01, 0.9),
    st.floats(0.1, 100.0),
    st.floats(0.1, 1000.0),
    st.floats(0.0, 5000.0),
)
def test_when_arrivals_are_due_is_the_inverse_of_how_many_are_due(
    shape: str, share_: float, ramp_s: float, rate: float, arrivals: float
) -> None:
    ramp = Ramp(ramp_s, shape, share_)
    at_s = ramp.time_of(rate, arrivals)
    assert ramp.arrivals_by(rate, at_s) == pytest.approx(arrivals, rel=1e-6, abs=1e-6)


def test_a_concurrency_ramp_starts_its_streams_in_turn() -> None:
    assert Ramp(8.0, "linear", 0.0).stream_starts_s(4) == [0.0, 2.0, 4.0, 6.0]
    # Exponential from a quarter: two streams at once, then at 1/2 and 3/4 of the level.
    starts = Ramp(8.0, "exponential", 0.25).stream_starts_s(4)
    assert starts[:2] == [0.0, 0.0]
    assert starts[2] == pytest.approx(4.0)
    assert starts[3] == pytest.approx(8.0 * (1 - math.log(0.75) / math.log(0.25)))


def test_the_profile_gives_each_point_its_ramp_and_processes_keep_it() -> None:
    profile = LoadProfile(concurrency=[4], rate=[10.0], requests=5, ramp_s=3.0)
    closed, opened = make_pattern(profile, "c4"), make_pattern(profile, "r10")
    assert closed.facts()["ramp"] == {"ramp_s": 3.0, "shape": "linear", "from": 0.0}
    exponential = LoadProfile(rate=[10.0], requests=5, ramp_s=3.0, ramp="exponential")
    assert make_pattern(exponential, "r10").facts()["ramp"] == {
        "ramp_s": 3.0, "shape": "exponential", "from": 0.05,
    }  # fmt: skip
    assert isinstance(closed, ClosedLoop) and isinstance(opened, OpenLoop)
    halves = [share(opened, process, 2) for process in range(2)]
    assert all(isinstance(half, OpenLoop) and half.ramp == opened.ramp for half in halves)
    assert share(closed, 1, 2) == ClosedLoop(2, closed.ramp)
    assert make_pattern(LoadProfile(rate=[1.0], requests=1), "r1").facts()["ramp"] is None


@pytest.mark.parametrize(
    ("load", "message"),
    [
        ("{rate: [1], requests: 2, ramp: exponential}", "a ramp needs ramp_s"),
        (
            "{rate: [1], requests: 2, ramp_s: 2, ramp: exponential, ramp_from: 0}",
            "cannot start at 0",
        ),
        ("{rate: [1], requests: 2, ramp_s: -1}", "ramp_s"),
        ("{rate: [1], requests: 2, ramp_s: 1, ramp: steps}", "ramp"),
        ("{rate: [1], requests: 2, ramp_s: 1, ramp_from: 1.5}", "ramp_from"),
    ],
)
def test_a_bad_ramp_key_is_one_line_naming_it(tmp_path: Path, load: str, message: str) -> None:
    cells = f"nodes: {{local: {{kind: local}}}}\ncells:\n  - {{node: local, engine: llamacpp, model: tiny, load: {load}}}\n"
    with pytest.raises(GpubenchError) as caught:
        matrix_of(tmp_path, cells)
    text = str(caught.value)
    assert "\n" not in text.strip() and message in text and "cells.yaml" in text


RAMP_PREFILL_S = 0.3


def test_a_ramps_requests_are_recorded_as_such_and_left_out_of_the_figures(
    pytester: pytest.Pytester,
) -> None:
    """6 req/s constant ramped linearly from 0 over 2.35 s: 7.05 arrivals expected in the ramp,
    so 8 requests (arrivals 0..7) go out in it. The stand-in answers them (POSTs 2..9, after the
    one warm-up) 300 ms late and the 10 measured ones at once: every ramp request's TTFT is at
    least 300 ms by the server's own wait, and a point whose figures took them in would have a
    TTFT p99 of at least that. The stand-in tells them apart by the order they reach it, so the
    last ramp request (due at 2.342 s) and the first measured one (2.508 s) are 166 ms apart,
    past the point's 100 ms bound on send lag: they cannot pass each other on the way."""
    with keepalive_server(
        prefill_s=RAMP_PREFILL_S, from_request=10, then_prefill_s=0.002
    ) as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {rate: [6], arrival: constant, requests: 10, ramp_s: 2.35,"
            " max_send_lag_ms: 100, slice_s: 0.25}}\n",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
        posts = len(server.requests)
    result.assert_outcomes(passed=1)
    assert posts == 1 + 8 + 10
    records = ledger_records(pytester)
    (load,) = [r for r in records if r["type"] == "load"]
    calls = [r for r in records if r["type"] == "call"]
    ramp = [c for c in calls if c["load_window"] == "ramp"]
    measured = [c for c in calls if c["load_window"] == "measured"]
    assert len(ramp) == 8 and len(measured) == 10
    assert all(c["scheduled_send_ms"] < 2350 for c in ramp)
    assert all(c["scheduled_send_ms"] >= 2350 for c in measured)
    assert all(c["first_delta_ms"] >= RAMP_PREFILL_S * 1000 for c in ramp)
    assert load["ramp"] == {"ramp_s": 2.35, "shape": "linear", "from": 0.0}
    assert load["ramp_requests"] == 8
    assert load["requests"] == 10 and load["ttft_ms_n"] == 10
    assert load["ttft_ms_p99"] < RAMP_PREFILL_S * 1000
    # Its rate is the measured window's: 10 requests at 6/s, not the ramp's.
    assert load["send_rate"] == pytest.approx(6.0, rel=0.05)
    # The ramp's slices apart from the window's, drawn before them in the HTML report.
    assert sum(row["requests"] for row in load["ramp_slices"]) == 8
    assert sum(row["requests"] for row in load["slices"]) == 10
    assert all(row["ttft_ms_p50"] >= RAMP_PREFILL_S * 1000 for row in load["ramp_slices"]
               if row["requests"])  # fmt: skip
    section = render_load_section([load])  # type: ignore[list-item]
    assert "r6 ramp" in section and "(a ramp before 0)" in section
    if CHROMIUM is not None:  # the page parsed as a browser does, where one is installed
        page = pytester.path / "ramp.html"
        page.write_text(f"<!doctype html><html><body>{section}</body></html>\n")
        dom = chromium(page, pytester.path / "profile", "--dump-dom")
        assert console_problems(dom.stderr) == [] and "r6 ramp" in dom.stdout


def test_a_concurrency_ramp_starts_one_stream_first_and_the_rest_in_turn(
    pytester: pytest.Pytester,
) -> None:
    """c4 ramped linearly over 0.4 s: streams start at 0, 0.1, 0.2 and 0.3 s. The stand-in
    waits 150 ms before each reply, so the first stream's second request cannot go out before
    150 ms: in the first 100 ms exactly one request is sent (four without the ramp)."""
    with keepalive_server(prefill_s=0.15) as server:
        write_load_project(
            pytester,
            f"  - {{node: local, engine: openai, model: m, endpoint: '{server.url}',"
            " load: {concurrency: [4], requests: 4, ramp_s: 0.4}}\n",
        )
        result = pytester.runpytest("--force-load", "-p", "no:cacheprovider", "-m", "load")
    result.assert_outcomes(passed=1)
    records = ledger_records(pytester)
    calls = [r for r in records if r["type"] == "call"]
    (load,) = [r for r in records if r["type"] == "load"]
    assert sum(c["send_ms"] < 100 for c in calls) == 1
    ramp = [c for c in calls if c["load_window"] == "ramp"]
    assert load["ramp_requests"] == len(ramp) >= 4
    assert all(c["send_ms"] < 400 for c in ramp)
    assert load["requests"] == 4
