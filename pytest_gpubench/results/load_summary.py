"""A load point's summary from its requests' call records (pure): offered and achieved rate,
requests/s, output tokens/s, TTFT/ITL/TPOT/E2E percentiles, goodput under the SLO, errors,
timeouts, send lag, and whether the point is a result at all; beside them the engine's own means
over the same point (where it exposes them), the client-server offsets, the coalesced replies,
and the warnings when the client's figures are delivery delay rather than engine time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytest_gpubench.config.engine_series import (
    LLAMACPP_PREDICTED,
    LLAMACPP_PREDICTED_SECONDS,
    LLAMACPP_PROMPT_SECONDS,
    SERVER_HISTOGRAMS,
)
from pytest_gpubench.config.load_profile import Slo
from pytest_gpubench.ledger.gaps import gaps_ms
from pytest_gpubench.ledger.load_figures import AdapterSplit, ClientLag, LoadFigures
from pytest_gpubench.results.load_over_time import (
    goodput_samples,
    is_ok,
    is_timeout,
    meets_slo,
    numbers_of,
    saturation_trend,
    throughput_samples,
    time_slices,
)
from pytest_gpubench.results.percentiles import PERCENTILES, percentile, percentile_intervals

# The figures with p50/p90/p99, and the call record field each is read from.
LATENCIES = {
    "ttft_ms": "first_delta_ms",
    "tpot_ms": "tpot_ms",
    "e2e_ms": "total_duration_ms",
    # A reasoning model's first answer token (the same as TTFT where it does not reason).
    "first_answer_ms": "first_answer_ms",
}
# A point whose measured replies came whole (all their content in one read) this often measured
# the client's reads, not the engine's pace: its TTFT is the reply's end, its TPOT missing.
COALESCED_WARN_SHARE = 0.1
# A client mean further than this from the engine's own over the same point (and more than the
# engine's own mean itself: most of the client's figure is then not engine time) is delivery
# delay: the network, a proxy, or a client that was not scheduled. Floors per figure, in ms.
OFFSET_FLOOR_MS = {"ttft_ms": 5.0, "tpot_ms": 1.0, "e2e_ms": 5.0}


def summarize_point(
    calls: Sequence[Mapping[str, Any]],
    *,
    offered_rate: float | None,
    slo: Slo | None,
    max_send_lag_ms: float | None,
    server: Mapping[str, float] | None = None,
    slice_s: float | None = None,
    client_names: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """The summary of one load point from all of its call records; only those sent in the
    measured window count (warm-up and cool-down ones are kept in the ledger, not here), but
    for `server_check`: `server` is the change of the engine's own series over the whole point
    (config/engine_series.SERVER_SERIES), set against every request of the point.

    `max_send_lag_ms` bounds an open loop's send lag (None for a closed loop: it has no
    schedule to keep; its send lag, the time from a stream's last reply to its next request, is
    reported all the same). `slice_s` adds the window's time slices (time_slices).

    `client_names` (a point sent by several clients: their `process` index -> a name such as
    "client process 1 of 2") holds each client to `max_send_lag_ms` on its own: a client whose
    own send lag p99 passes it fell behind its schedule, and the point is invalid naming it,
    even where the pooled p99 (over every client's requests) stays within (lag_by_client)."""
    measured = [call for call in calls if call.get("load_window") == "measured"]
    ok = [call for call in measured if is_ok(call)]
    sends = numbers_of(measured, "send_ms")
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
    # Each percentile's `n`: a coalesced reply has no TPOT, so TPOT's may be far below `ok`.
    for name, field in LATENCIES.items():
        values = numbers_of(ok, field)
        summary[f"{name}_n"] = len(values)
        for q in PERCENTILES:
            summary[f"{name}_p{q}"] = percentile(values, q)
    # A reasoning model's tokens of thought per request (None where no request reasoned: its
    # first answer is then its TTFT, and the reports show no reasoning columns).
    reasoning = numbers_of(ok, "reasoning_tokens")
    summary["reasoning_tokens_p50"] = (
        percentile(reasoning, 50) if any(value > 0 for value in reasoning) else None
    )
    gaps = [gap for call in ok for gap in gaps_ms(call)]
    summary["itl_ms_n"] = len(gaps)
    for q in PERCENTILES:
        summary[f"itl_ms_p{q}"] = percentile(gaps, q)
    summary["percentile_intervals"] = percentile_intervals(
        {
            **{name: numbers_of(ok, field) for name, field in LATENCIES.items()},
            "itl_ms": gaps,
        }
    )
    summary["coalesced_calls"] = sum(bool(call.get("coalesced")) for call in ok)
    summary["coalesced_share"] = round(summary["coalesced_calls"] / len(ok), 4) if ok else None
    # A ramp's requests (run/load/ramp.py): sent before the window, never in its figures.
    ramp = [call for call in calls if call.get("load_window") == "ramp"]
    summary["ramp_requests"] = len(ramp)
    ramp_sends = numbers_of(ramp, "send_ms")
    # The ramp's own slices, from its first send to the window's (drawn before the window's).
    summary["ramp_slices"] = (
        time_slices(ramp, min(ramp_sends), start, slice_s)
        if slice_s is not None and ramp_sends and sends and start > min(ramp_sends)
        else None
    )
    summary["slice_s"] = slice_s
    # An open loop's queue over the point (a closed loop keeps its in-flight count fixed).
    summary["trend"] = saturation_trend(calls) if offered_rate is not None else None
    summary["slices"] = (
        time_slices(measured, start, start + window_s * 1000.0, slice_s)
        if slice_s is not None and measured
        else None
    )
    summary["server_check"] = server_check(calls, server) if server else None
    summary["delivery_warnings"] = delivery_warnings(summary) or None
    summary.update(_goodput(ok, measured, slo, window_s))
    lags = numbers_of(measured, "send_lag_ms")
    summary["send_lag_ms_p50"] = percentile(lags, 50)
    summary["send_lag_ms_p99"] = percentile(lags, 99)
    summary["send_lag_ms_max"] = round(max(lags), 4) if lags else None
    summary["max_send_lag_ms"] = max_send_lag_ms
    summary["invalid_reason"] = _behind(calls, client_names, max_send_lag_ms) or _invalid(
        summary, max_send_lag_ms
    )
    summary["valid"] = summary["invalid_reason"] is None
    summary["samples"] = {
        "ttft_ms": numbers_of(ok, "first_delta_ms"),
        "tpot_ms": numbers_of(ok, "tpot_ms"),
        "output_tokens_per_sec": throughput_samples(ok, start, start + window_s * 1000.0),
        "goodput_rate": (
            goodput_samples(ok, slo, start, start + window_s * 1000.0) if slo is not None else []
        ),
    }
    return summary


# What a point that lost a client process keeps of its summary: what it was asked and what
# became of it, not one figure of the requests the other processes sent.
LOST_CLIENT_KEEPS = ("offered_rate", "max_send_lag_ms", "slice_s", "ramp_requests")


def adapter_split(
    calls: Sequence[Mapping[str, Any]], adapters: Sequence[str]
) -> list[AdapterSplit]:
    """Per LoRA adapter (in the cell's order), over the measured window: its requests, their
    errors, and the TTFT and E2E p50 and p99 of its successful ones."""
    rows: list[AdapterSplit] = []
    for adapter in adapters:
        measured = [
            call
            for call in calls
            if call.get("load_window") == "measured" and call.get("lora_adapter") == adapter
        ]
        ok = [call for call in measured if is_ok(call)]
        ttft, e2e = numbers_of(ok, "first_delta_ms"), numbers_of(ok, "total_duration_ms")
        rows.append(
            {
                "adapter": adapter,
                "requests": len(measured),
                "errors": len(measured) - len(ok),
                "ttft_ms_p50": percentile(ttft, 50),
                "ttft_ms_p99": percentile(ttft, 99),
                "e2e_ms_p50": percentile(e2e, 50),
                "e2e_ms_p99": percentile(e2e, 99),
            }
        )
    return rows


def lost_client_summary(summary: Mapping[str, Any], lost: Sequence[str]) -> dict[str, Any]:
    """The summary of a point one of whose client processes died (or failed) mid-point:
    invalid with the reason, and no figure at all (the others' requests are a part of the
    point's load, so their rates and percentiles would be of a load nobody asked for); the
    requests the others recorded are counted, their call records kept in the ledger."""
    return {
        **{key: summary.get(key) for key in LOST_CLIENT_KEEPS},
        "requests_recorded": summary.get("requests"),
        "clients_lost": list(lost),
        "invalid_reason": "; ".join(lost)
        + ": the point has only the other processes' requests, and no figure is drawn from them",
        "valid": False,
    }


def _mean(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def server_check(
    calls: Sequence[Mapping[str, Any]], server: Mapping[str, float]
) -> dict[str, Any] | None:
    """The engine's own means over the point beside the client's over the same requests (every
    window: the /metrics reads bracket the whole point), and the offset client - server per
    figure. vLLM: its TTFT, TPOT and E2E histograms' sum / count. llama-server: its prompt time
    per request (no queueing in it: compare at concurrency <= its slots) and its generation time
    per predicted token. None when the engine exposes none of them."""
    ok = [call for call in calls if is_ok(call)]
    client = {name: numbers_of(ok, field) for name, field in LATENCIES.items()}
    figures: dict[str, dict[str, Any]] = {}
    requests_series = f"{SERVER_HISTOGRAMS['e2e_ms']}_count"
    if requests_series in server:
        engine = "vllm"
        requests: float | None = server[requests_series]
        for name, series in SERVER_HISTOGRAMS.items():
            count, total = server.get(f"{series}_count"), server.get(f"{series}_sum")
            if count and total is not None:
                figures[name] = {"server_mean": round(total * 1000.0 / count, 4), "server_n": count}
    elif LLAMACPP_PROMPT_SECONDS in server:
        engine, requests = "llamacpp", None
        prompt_s = server[LLAMACPP_PROMPT_SECONDS]
        if ok:
            figures["ttft_ms"] = {
                "server_mean": round(prompt_s * 1000.0 / len(ok), 4),
                "server_n": len(ok),
                # Not the same span as the client's TTFT: no wait for a slot, no first decode
                # step, no HTTP; shown, not warned on.
                "engine_span": "prompt processing only",
            }
        predicted = server.get(LLAMACPP_PREDICTED)
        seconds = server.get(LLAMACPP_PREDICTED_SECONDS)
        if predicted and seconds is not None:
            figures["tpot_ms"] = {
                "server_mean": round(seconds * 1000.0 / predicted, 4),
                "server_n": predicted,
            }
    else:
        return None
    for name, figure in figures.items():
        mean = _mean(client[name])
        figure["client_mean"] = mean
        figure["client_n"] = len(client[name])
        figure["offset_ms"] = round(mean - figure["server_mean"], 4) if mean is not None else None
    return {"engine": engine, "requests": requests, "client_requests": len(ok), **figures}


def delivery_warnings(summary: Mapping[str, Any]) -> list[str]:
    """Why a point's client-side figures are delivery delay rather than engine time: replies
    that came whole, or a client mean that the engine's own is a small part of."""
    warnings = []
    share = summary.get("coalesced_share")
    if isinstance(share, float) and share >= COALESCED_WARN_SHARE:
        warnings.append(
            f"{summary['coalesced_calls']} of {summary['ok']} replies ({share:.0%}) came whole "
            "in one read: their TTFT is the reply's end and they have no TPOT; the client's "
            "figures measure delivery, not the engine"
        )
    check = summary.get("server_check") or {}
    for name, floor in OFFSET_FLOOR_MS.items():
        figure = check.get(name)
        if not isinstance(figure, Mapping) or figure.get("offset_ms") is None:
            continue
        if figure.get("engine_span"):
            continue  # the engine's figure covers less than the client's: no like for like
        offset, own = float(figure["offset_ms"]), float(figure["server_mean"])
        if abs(offset) > max(floor, own):
            warnings.append(
                f"{name.removesuffix('_ms').upper()} mean {figure['client_mean']:g} ms at the "
                f"client against {own:g} ms at the engine (offset {offset:+g} ms): the client's "
                "figure is mostly delivery delay, not engine time"
            )
    return warnings


def _goodput(
    ok: Sequence[Mapping[str, Any]],
    measured: Sequence[Mapping[str, Any]],
    slo: Slo | None,
    window_s: float,
) -> LoadFigures:
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


def lag_by_client(calls: Sequence[Mapping[str, Any]]) -> list[ClientLag]:
    """Each client's own send lag (p50, p99, max ms) over the measured window, by its
    `process` index (a client process, or a client task on another node)."""
    rows: list[ClientLag] = []
    for process in sorted({call.get("process") or 0 for call in calls}):
        lags = [
            float(call["send_lag_ms"])
            for call in calls
            if (call.get("process") or 0) == process
            and call.get("load_window") == "measured"
            and isinstance(call.get("send_lag_ms"), int | float)
        ]
        rows.append(
            {
                "process": process,
                "requests": len(lags),
                "send_lag_ms_p50": percentile(lags, 50),
                "send_lag_ms_p99": percentile(lags, 99),
                "send_lag_ms_max": max(lags) if lags else None,
            }
        )
    return rows


def _behind(
    calls: Sequence[Mapping[str, Any]],
    client_names: Mapping[int, str] | None,
    max_send_lag_ms: float | None,
) -> str | None:
    """The first client whose own send lag p99 passed the bound (None: each kept its schedule,
    or the point has no schedule or one client)."""
    if client_names is None or max_send_lag_ms is None:
        return None
    for row in lag_by_client(calls):
        lag = row["send_lag_ms_p99"]
        if lag is not None and lag > max_send_lag_ms:
            name = client_names.get(row["process"], f"client {row['process']}")
            return (
                f"{name} fell behind its schedule: its send lag p99 {lag:g} ms > "
                f"{max_send_lag_ms:g} ms (max_send_lag_ms, max {row['send_lag_ms_max']:g} ms "
                f"over its {row['requests']} requests); the point's latencies would understate "
                "what a user sees"
            )
    return None


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
