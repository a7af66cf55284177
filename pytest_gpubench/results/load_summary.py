"""A load point's summary from its requests' call records (pure): offered and achieved rate,
requests/s, output tokens/s, TTFT/ITL/TPOT/E2E percentiles, goodput under the SLO, errors,
timeouts, send lag, and whether the point is a result at all."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any

from pytest_gpubench.config.load_profile import Slo

PERCENTILES = (50, 90, 99)
# The figures with p50/p90/p99, and the call record field each is read from.
LATENCIES = {
    "ttft_ms": "first_delta_ms",
    "tpot_ms": "tpot_ms",
    "e2e_ms": "total_duration_ms",
    # A reasoning model's first answer token (the same as TTFT where it does not reason).
    "first_answer_ms": "first_answer_ms",
}
# A throughput sample per this long of the window (the gate's samples of output tokens/s).
THROUGHPUT_BUCKET_S = 1.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, linear between order statistics (numpy's default); None if empty."""
    ordered = sorted(value for value in values if not math.isnan(value))
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    value = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return round(value, 4)


def _numbers(calls: Sequence[Mapping[str, Any]], field: str) -> list[float]:
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
    """When each content chunk of a call arrived, in ms from the point's start."""
    send, first = call.get("send_ms"), call.get("first_delta_ms")
    if not isinstance(send, int | float) or not isinstance(first, int | float):
        return []
    gaps = call.get("inter_chunk_ms") or []
    return [send + first + offset for offset in accumulate(gaps, initial=0.0)]


def throughput_samples(
    calls: Sequence[Mapping[str, Any]], start_ms: float, end_ms: float
) -> list[float]:
    """Output tokens/s per whole THROUGHPUT_BUCKET_S of the window (chunks as tokens)."""
    chunks = (at for call in calls if is_ok(call) for at in content_times_ms(call))
    return _rates_per_bucket(chunks, start_ms, end_ms)


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
        ends.append(send + total)
    return _rates_per_bucket(ends, start_ms, end_ms)


def _rates_per_bucket(times_ms: Iterable[float], start_ms: float, end_ms: float) -> list[float]:
    """Events per second in each whole THROUGHPUT_BUCKET_S of the window; events outside it
    do not count."""
    width = THROUGHPUT_BUCKET_S * 1000.0
    buckets = int((end_ms - start_ms) // width)
    if buckets < 1:
        return []
    counts = [0] * buckets
    for at in times_ms:
        index = int((at - start_ms) // width)
        if 0 <= index < buckets:
            counts[index] += 1
    return [count / THROUGHPUT_BUCKET_S for count in counts]


def summarize_point(
    calls: Sequence[Mapping[str, Any]],
    *,
    offered_rate: float | None,
    slo: Slo | None,
    max_send_lag_ms: float | None,
) -> dict[str, Any]:
    """The summary of one load point from all of its call records; only those sent in the
    measured window count (warm-up and cool-down ones are kept in the ledger, not here).

    `max_send_lag_ms` bounds an open loop's send lag (None for a closed loop: it has no
    schedule to keep; its send lag, the time from a stream's last reply to its next request, is
    reported all the same)."""
    measured = [call for call in calls if call.get("load_window") == "measured"]
    ok = [call for call in measured if is_ok(call)]
    sends = _numbers(measured, "send_ms")
    ends = [
        call["send_ms"] + call["total_duration_ms"]
        for call in ok
        if isinstance(call.get("send_ms"), int | float)
        and isinstance(call.get("total_duration_ms"), int | float)
    ]
    start = min(sends) if sends else 0.0
    window_s = (max(ends) - start) / 1000.0 if ends else 0.0
    tokens = sum(int(call.get("completion_tokens") or 0) for call in ok)
    summary: dict[str, Any] = {
        "requests": len(measured),
        "ok": len(ok),
        "errors": len(measured) - len(ok),
        "timeouts": sum(is_timeout(call) for call in measured),
        "window_s": round(window_s, 4),
        "offered_rate": offered_rate,
        "send_rate": (
            round((len(sends) - 1) / ((max(sends) - start) / 1000.0), 4)
            if len(sends) > 1 and max(sends) > start
            else None
        ),
        "achieved_rate": round(len(ok) / window_s, 4) if window_s > 0 else None,
        "output_tokens": tokens,
        "output_tokens_per_sec": round(tokens / window_s, 3) if window_s > 0 else None,
    }
    summary["requests_per_sec"] = summary["achieved_rate"]
    for name, field in LATENCIES.items():
        values = _numbers(ok, field)
        for q in PERCENTILES:
            summary[f"{name}_p{q}"] = percentile(values, q)
    gaps = [float(gap) for call in ok for gap in call.get("inter_chunk_ms") or []]
    for q in PERCENTILES:
        summary[f"itl_ms_p{q}"] = percentile(gaps, q)
    summary.update(_goodput(ok, measured, slo, window_s))
    lags = _numbers(measured, "send_lag_ms")
    summary["send_lag_ms_p50"] = percentile(lags, 50)
    summary["send_lag_ms_p99"] = percentile(lags, 99)
    summary["send_lag_ms_max"] = round(max(lags), 4) if lags else None
    summary["max_send_lag_ms"] = max_send_lag_ms
    summary["invalid_reason"] = _invalid(summary, max_send_lag_ms)
    summary["valid"] = summary["invalid_reason"] is None
    summary["samples"] = {
        "ttft_ms": _numbers(ok, "first_delta_ms"),
        "tpot_ms": _numbers(ok, "tpot_ms"),
        "output_tokens_per_sec": throughput_samples(ok, start, start + window_s * 1000.0),
        "goodput_rate": (
            goodput_samples(ok, slo, start, start + window_s * 1000.0) if slo is not None else []
        ),
    }
    return summary


def _goodput(
    ok: Sequence[Mapping[str, Any]],
    measured: Sequence[Mapping[str, Any]],
    slo: Slo | None,
    window_s: float,
) -> dict[str, Any]:
    if slo is None:
        return {"slo": None, "goodput_rate": None, "slo_attainment": None, "meets_slo": None}
    good = sum(meets_slo(call, slo) for call in ok)
    attainment = good / len(measured) if measured else 0.0
    return {
        "slo": slo.model_dump(exclude_none=True),
        "goodput_rate": round(good / window_s, 4) if window_s > 0 else None,
        "slo_attainment": round(attainment, 4),
        "meets_slo": bool(measured) and attainment >= slo.attainment,
    }


def _invalid(summary: Mapping[str, Any], max_send_lag_ms: float | None) -> str | None:
    """Why the point is no result: the client could not keep its schedule, or nothing came
    back."""
    lag = summary.get("send_lag_ms_p99")
    if lag is not None and max_send_lag_ms is not None and lag > max_send_lag_ms:
        return (
            f"send lag p99 {lag:g} ms > {max_send_lag_ms:g} ms (max_send_lag_ms): the client "
            "could not keep its schedule; its latencies would understate what a user sees"
        )
    if not summary["requests"]:
        return "no request was sent in the measured window"
    if not summary["ok"]:
        return f"all {summary['requests']} requests of the measured window failed"
    return None
