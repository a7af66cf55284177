"""A load point over its window (pure): when each request's tokens arrived, the throughput and
goodput per second (the gate's samples), the window's time slices, the requests in flight at
each send and whether the queue grew while the point ran (the saturation trend); and what a
request is (ok, a timeout, within the SLO), read alike by the summary (results/load_summary.py)."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any

from pytest_gpubench.config.load_profile import Slo
from pytest_gpubench.ledger.gaps import gaps_ms
from pytest_gpubench.ledger.load_figures import SaturationTrend, TimeSlice
from pytest_gpubench.results.percentiles import percentile

# A throughput sample per about this long of the window (the gate's samples of output tokens/s):
# the window is cut into round(window / THROUGHPUT_BUCKET_S) equal buckets, so that every token
# of the window falls in one and the samples' mean is the headline output tokens/s.
THROUGHPUT_BUCKET_S = 1.0
# An open-loop point is over-saturated when both its TTFT and its requests in flight rise with
# time within it, each by a one-sided Kendall test at this level (saturation_trend).
TREND_ALPHA = 0.01
# Fewer measured requests than this (after the point's fill, saturation_trend) give no trend.
TREND_MIN_REQUESTS = 20


def numbers_of(calls: Sequence[Mapping[str, Any]], field: str) -> list[float]:
    """A field's numbers over the calls that have one (a bool is not a number here)."""
    values = [call.get(field) for call in calls]
    return [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]


def is_ok(call: Mapping[str, Any]) -> bool:
    return call.get("error") is None and call.get("finish_reason") != "error"


def is_timeout(call: Mapping[str, Any]) -> bool:
    error = call.get("error")
    return isinstance(error, str) and ("did not finish within" in error or "timed out" in error)


def meets_slo(call: Mapping[str, Any], slo: Slo) -> bool:
    """A successful request within every limit the SLO sets (a limit on a figure the request
    does not have, a coalesced call's TPOT, is not met)."""
    if not is_ok(call):
        return False
    for field, limit in slo.limits.items():
        value = call.get(field)
        if not isinstance(value, int | float) or value > limit:
            return False
    return True


def content_times_ms(call: Mapping[str, Any]) -> list[float]:
    """When each content chunk of a call arrived, in ms from the point's start; never after the
    call's own end. Its TTFT, gaps and total are each kept to 4 decimals of a ms, so chunks read
    at the very end (a reply delivered whole) summed to 0.0003 ms past it: those of the last call
    to end fell outside the point's window, and vLLM's throughput samples lost 92 of 4,096
    tokens against the headline."""
    send, first = call.get("send_ms"), call.get("first_delta_ms")
    if not isinstance(send, int | float) or not isinstance(first, int | float):
        return []
    total = call.get("total_duration_ms")
    end = send + total if isinstance(total, int | float) else math.inf
    return [min(send + first + offset, end) for offset in accumulate(gaps_ms(call), initial=0.0)]


def token_times_ms(call: Mapping[str, Any]) -> list[tuple[float, float]]:
    """(arrival ms, tokens) of each content chunk of a call: the call's completion tokens spread
    evenly over its chunks (an engine may pack several tokens into one event: vLLM sent 64
    tokens in about 54), so that the chunks add up to the tokens the server counted."""
    times = content_times_ms(call)
    if not times:
        return []
    tokens = call.get("completion_tokens")
    per_chunk = float(tokens) / len(times) if isinstance(tokens, int) and tokens > 0 else 1.0
    return [(at, per_chunk) for at in times]


def throughput_samples(
    calls: Sequence[Mapping[str, Any]], start_ms: float, end_ms: float
) -> list[float]:
    """Output tokens/s per bucket of the window (tokens, not chunks: their mean is the
    headline output tokens/s when every call's content lies inside the window)."""
    tokens = (pair for call in calls if is_ok(call) for pair in token_times_ms(call))
    return _rates_per_bucket(tokens, start_ms, end_ms)


def goodput_samples(
    calls: Sequence[Mapping[str, Any]], slo: Slo, start_ms: float, end_ms: float
) -> list[float]:
    """Requests/s that met the SLO, per whole THROUGHPUT_BUCKET_S of the window (by when each
    ended)."""
    ends = []
    for call in calls:
        send, total = call.get("send_ms"), call.get("total_duration_ms")
        if not meets_slo(call, slo) or not isinstance(send, int | float):
            continue
        assert isinstance(total, int | float)
        ends.append((send + total, 1.0))
    return _rates_per_bucket(ends, start_ms, end_ms)


def _rates_per_bucket(
    weighted_ms: Iterable[tuple[float, float]], start_ms: float, end_ms: float
) -> list[float]:
    """Events (each with its weight) per second in each of the round(window /
    THROUGHPUT_BUCKET_S) equal buckets that tile the window; events outside it do not count (one
    at its very end falls in the last bucket)."""
    span = end_ms - start_ms
    buckets = round(span / (THROUGHPUT_BUCKET_S * 1000.0))
    if buckets < 1:
        return []
    width = span / buckets
    sums = [0.0] * buckets
    for at, weight in weighted_ms:
        index = int((at - start_ms) // width)
        if index == buckets and at <= end_ms:
            index -= 1
        if 0 <= index < buckets:
            sums[index] += weight
    return [round(total / (width / 1000.0), 4) for total in sums]


def time_slices(
    calls: Sequence[Mapping[str, Any]], start_ms: float, end_ms: float, slice_s: float
) -> list[TimeSlice]:
    """The measured window cut into slices of `slice_s` from its start (the last one may be
    shorter): per slice its requests (by when each was sent), their TTFT/TPOT/E2E p50 and p99
    with n, and output tokens/s of the tokens that arrived in it, so that a point whose engine
    slowed down halfway shows where."""
    width = slice_s * 1000.0
    count = max(1, math.ceil((end_ms - start_ms) / width - 1e-9))
    sent: list[list[Mapping[str, Any]]] = [[] for _ in range(count)]
    for call in calls:
        at = call.get("send_ms")
        if isinstance(at, int | float):
            sent[min(count - 1, max(0, int((at - start_ms) // width)))].append(call)
    tokens = [0.0] * count
    for call in calls:
        if is_ok(call):
            for at, weight in token_times_ms(call):
                index = int((at - start_ms) // width)
                if index == count and at <= end_ms:
                    index -= 1  # the window's last token, at its very end
                if 0 <= index < count:
                    tokens[index] += weight
    slices: list[TimeSlice] = []
    for index, own in enumerate(sent):
        begin = start_ms + index * width
        span_s = (min(begin + width, end_ms) - begin) / 1000.0
        ok = [call for call in own if is_ok(call)]
        ttft, tpot = numbers_of(ok, "first_delta_ms"), numbers_of(ok, "tpot_ms")
        e2e = numbers_of(ok, "total_duration_ms")
        slices.append(
            {
                "start_s": round(index * slice_s, 4),
                "span_s": round(span_s, 4),
                "requests": len(own),
                "ok": len(ok),
                "output_tokens_per_sec": round(tokens[index] / span_s, 3) if span_s > 0 else None,
                "ttft_ms_n": len(ttft),
                "ttft_ms_p50": percentile(ttft, 50),
                "ttft_ms_p99": percentile(ttft, 99),
                "tpot_ms_n": len(tpot),
                "tpot_ms_p50": percentile(tpot, 50),
                "tpot_ms_p99": percentile(tpot, 99),
                "e2e_ms_n": len(e2e),
                "e2e_ms_p50": percentile(e2e, 50),
                "e2e_ms_p99": percentile(e2e, 99),
            }
        )
    return slices


def in_flight_at_sends(calls: Sequence[Mapping[str, Any]]) -> list[tuple[float, int]]:
    """(send ms, requests of the point in flight then, itself included) per request with a
    send time, in send order: every request of the point counts (warm-up and ramp too), each
    from its send to its end (a failed one without a duration: to the point's end)."""
    starts, ends = [], []
    for call in calls:
        send, total = call.get("send_ms"), call.get("total_duration_ms")
        if isinstance(send, int | float):
            starts.append(float(send))
            ends.append(float(send) + float(total) if isinstance(total, int | float) else math.inf)
    starts.sort()
    ends.sort()
    return [(at, bisect_right(starts, at) - bisect_right(ends, at)) for at in starts]


def saturation_trend(calls: Sequence[Mapping[str, Any]]) -> SaturationTrend | None:
    """Whether an open-loop point's queue grew while it ran: Kendall's tau of the measured
    requests' TTFT against their send time, and of the requests in flight at each send against
    it, each tested one-sided (rising) with scipy.stats.kendalltau. `saturated` when both rise
    at TREND_ALPHA: the engine took requests more slowly than they came, so the point's figures
    are the length of a growing queue, not a steady state. The sends in the point's first
    shortest E2E are left out: an open loop fills from one request in flight to its steady
    count in about one latency, a rise of every point. None from fewer than TREND_MIN_REQUESTS
    measured requests after that."""
    from scipy.stats import kendalltau

    measured = sorted(
        (
            (float(call["send_ms"]), float(call["first_delta_ms"]))
            for call in calls
            if call.get("load_window") == "measured"
            and is_ok(call)
            and isinstance(call.get("send_ms"), int | float)
            and isinstance(call.get("first_delta_ms"), int | float)
        ),
    )
    sends = numbers_of(calls, "send_ms")
    latencies = numbers_of([c for c in calls if is_ok(c)], "total_duration_ms")
    filled = min(sends) + min(latencies) if sends and latencies else -math.inf
    measured = [(at, ttft) for at, ttft in measured if at >= filled]
    if len(measured) < TREND_MIN_REQUESTS:
        return None
    # In flight at each send of the measured window (the ramp's and warm-up's count while they
    # last, but are no samples of the trend).
    first, last = measured[0][0], measured[-1][0]
    flights = [(at, count) for at, count in in_flight_at_sends(calls) if first <= at <= last]

    def rising(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
        """Kendall's tau of the second against the first, and its one-sided p (rising)."""
        xs, ys = [x for x, _ in pairs], [float(y) for _, y in pairs]
        if len(set(ys)) < 2:
            return 0.0, 1.0
        result = kendalltau(xs, ys, alternative="greater")
        return round(float(result.statistic), 4), float(f"{float(result.pvalue):.3g}")

    (ttft_tau, ttft_p), (in_flight_tau, in_flight_p) = rising(measured), rising(flights)
    return {
        "alpha": TREND_ALPHA,
        "n": len(measured),
        "ttft_tau": ttft_tau,
        "ttft_p": ttft_p,
        "in_flight_tau": in_flight_tau,
        "in_flight_p": in_flight_p,
        "saturated": bool(ttft_p < TREND_ALPHA and in_flight_p < TREND_ALPHA),
    }
