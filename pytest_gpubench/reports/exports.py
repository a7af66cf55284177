"""Exports of one ledger for other tools: a Prometheus textfile (node_exporter's textfile
collector), a CSV of the call records, a CSV of the load points and a JSON of the summaries and
load points."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from pytest_gpubench.config.metrics import MEASURES, PERCENTILE_NAMES, VALIDITY
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.files import atomic_file
from pytest_gpubench.reports.frame import LedgerData
from pytest_gpubench.reports.frame_columns import EXPORT_NUMBERS, EXPORT_TEXT
from pytest_gpubench.reports.load_tables import slice_rate_spread
from pytest_gpubench.results.engine_checks import EngineChecks
from pytest_gpubench.results.stats import WARM_METRICS, PromptSummary
from pytest_gpubench.results.verdict import Verdict

# The CSV's leading columns in order; the numbers as the call record names them.
_LEADING = (
    "benchmark_run_id",
    "cell_id",
    "node",
    "engine",
    "model",
    "prompt_id",
    "prompt_sha256",
    "phase",
    "run_idx",
    "case_id",
    "cold_kind",
    "started_at_utc",
    "ok",
    "first_delta_ms",
    "total_duration_ms",
    "decode_tokens_per_sec",
    "tpot_ms",
    "e2e_tokens_per_sec",
    "engine_tokens_per_sec",
    "engine_prompt_ms",
    "engine_total_ms",
    "prompt_tokens",
    "completion_tokens",
    "client_chunks",
    "content_reads",
    "coalesced",
    "finish_reason",
    "backend",
    "error",
    "worker",
    # Issue 35, after the columns of before (a reader by position keeps them where they were):
    # the request kind and its figures (config/metrics.py), the checks against the engine.
    "kind",
    "inputs_per_sec",
    "tool_call_valid",
    "schema_valid",
    "token_mismatch",
    "prefix_cache_hit",
    "prefix_cache_off",
    "draft_tokens",
    "draft_accepted_tokens",
)
# Then each measure of config/metrics.py those leave out, in the table's order and by its name:
# a measure added there is a column added at the end.
_MEASURED = tuple(measure for measure in MEASURES if measure.name not in _LEADING)
CSV_COLUMNS = (*_LEADING, *(measure.name for measure in _MEASURED))
_COUNTS = (
    "run_idx", "prompt_tokens", "completion_tokens", "client_chunks", "content_reads",
    "tool_call_valid", "schema_valid", "draft_tokens", "draft_accepted_tokens",
    *(measure.name for measure in _MEASURED if measure.whole),
)  # fmt: skip
# The call record's booleans, read as 1/0 columns (reports/frame_columns.CHECK_NUMBERS): written as
# True/False, blank where the record had none.
_FLAGS = ("token_mismatch", "prefix_cache_hit", "prefix_cache_off")
# A load record's figures, as the record names them: the load CSV's columns after its keys, and
# the Prometheus gauge gpubench_load's `metric` label.
LOAD_FIGURES = (
    "offered_rate", "achieved_rate", "send_rate", "requests", "ok", "errors", "timeouts",
    "window_s", "output_tokens", "output_tokens_per_sec",
    "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "ttft_ms_n",
    "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99", "tpot_ms_n",
    "itl_ms_p50", "itl_ms_p99", "itl_ms_n", "e2e_ms_p50", "e2e_ms_p99", "e2e_ms_n",
    "goodput_rate", "slo_attainment", "send_lag_ms_p50", "send_lag_ms_p99", "send_lag_ms_max",
    "coalesced_calls", "coalesced_share", "saturation_rate",
)  # fmt: skip
# The engine's word over a point (issue 35): the load CSV's last columns, gpubench_load metrics.
LOAD_ENGINE_FIGURES = ("token_mismatches", "spec_acceptance_rate", "spec_mean_acceptance_length")
LOAD_KEYS = (
    "benchmark_run_id", "cell_id", "prompt_id", "load_point", "sweep_step", "pattern",
    "concurrency", "rate", "arrival", "started_at_utc", "valid", "invalid_reason",
)  # fmt: skip
SERVER_FIGURES = ("ttft_ms", "tpot_ms", "e2e_ms")
# The figures whose percentiles have a confidence interval in the load record
# (results/percentiles.percentile_intervals): the load CSV's `<figure>_p<q>_low`/`_high`.
INTERVAL_FIGURES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
INTERVAL_PERCENTILES = (50, 90, 99)
# An open-loop point's queue trend (results/load_over_time.saturation_trend): `trend_<field>`.
TREND_FIELDS = ("n", "ttft_tau", "ttft_p", "in_flight_tau", "in_flight_p", "saturated")
# A sweep's stop at saturation: `saturation_stop_<field>` (skipped: how many rates).
STOP_FIELDS = ("load_point", "rate", "skipped", "time_kept_s")
# The slices CSV: a row per slice of a point (the ramp's, then the measured window's).
SLICE_KEYS = ("benchmark_run_id", "cell_id", "prompt_id", "load_point", "window")
SLICE_FIGURES = (
    "start_s", "span_s", "requests", "ok", "output_tokens_per_sec",
    "ttft_ms_n", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_n", "tpot_ms_p50", "tpot_ms_p99",
    "e2e_ms_n", "e2e_ms_p50", "e2e_ms_p99",
)  # fmt: skip


def write_csv(data: LedgerData, path: Path) -> int:
    """One row per call record (a ledger read with export=True); returns the rows written.
    Counts are integers (blank where a failed call has none), times ISO 8601 UTC."""

    frame = data.calls
    missing = [c for c in (*EXPORT_TEXT, *EXPORT_NUMBERS) if c not in frame.columns]
    if missing:
        raise ValueError(f"write_csv needs a ledger read with export=True (no {missing[0]})")
    table = frame.reindex(columns=list(CSV_COLUMNS))
    for name in (*_COUNTS, *_FLAGS):
        # A count past int64 (an edited ledger's) is written blank, as an unknown one is.
        counts = table[name].round()
        table[name] = counts.where(counts.abs() < 2.0**63).astype("Int64")
    for name in _FLAGS:
        table[name] = table[name].astype("boolean")
    _write(path, lambda target: table.to_csv(target, index=False, lineterminator="\n"))
    return len(table)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _load_extras(load: Mapping[str, Any]) -> dict[str, Any]:
    """A point's percentile intervals (`ttft_ms_p99_low`, `_high`: blank an open side, and
    `too_few` the percentiles its sample cannot bound), its queue trend (`trend_...`), its
    slices' count and spread (`slices`, `slice_output_tokens_per_sec_min`/`_max`), its ramp's
    requests and a sweep's stop at saturation (`saturation_stop_...`)."""
    intervals = _mapping(load.get("percentile_intervals"))
    row: dict[str, Any] = {}
    for name in INTERVAL_FIGURES:
        figure = _mapping(intervals.get(name))
        for q in INTERVAL_PERCENTILES:
            bounds = figure.get(f"p{q}")
            low, high = bounds if isinstance(bounds, list | tuple) and len(bounds) == 2 else (
                None, None
            )  # fmt: skip
            row[f"{name}_p{q}_low"], row[f"{name}_p{q}_high"] = low, high
    row["too_few"] = " ".join(intervals.get("too_few") or ()) or None
    trend = _mapping(load.get("trend"))
    for field in TREND_FIELDS:
        row[f"trend_{field}"] = trend.get(field)
    slices = load.get("slices")
    spread = slice_rate_spread(load)
    row["slice_s"] = load.get("slice_s")
    row["slices"] = len(slices) if isinstance(slices, list) and slices else None
    row["slice_output_tokens_per_sec_min"] = spread[0] if spread else None
    row["slice_output_tokens_per_sec_max"] = spread[1] if spread else None
    row["ramp_requests"] = load.get("ramp_requests")
    stop = _mapping(load.get("saturation_stop"))
    for field in STOP_FIELDS:
        value = stop.get(field)
        row[f"saturation_stop_{field}"] = len(value) if isinstance(value, list) else value
    return row


def load_rows(loads: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per load record: its keys, figures, the engine's own means beside the
    client's with the offsets (`server_ttft_ms_mean`, `client_ttft_ms_mean`,
    `offset_ttft_ms`, ...), its delivery warnings joined, then its intervals, trend, slices and
    sweep stop (_load_extras)."""
    rows = []
    for load in loads:
        row = {name: load.get(name) for name in (*LOAD_KEYS, *LOAD_FIGURES)}
        check = load.get("server_check") or {}
        row["server_engine"] = check.get("engine")
        for name in SERVER_FIGURES:
            figure = check.get(name) or {}
            row[f"server_{name}_mean"] = figure.get("server_mean")
            row[f"client_{name}_mean"] = figure.get("client_mean")
            row[f"offset_{name}"] = figure.get("offset_ms")
        row["delivery_warnings"] = " | ".join(load.get("delivery_warnings") or ()) or None
        row.update({name: load.get(name) for name in LOAD_ENGINE_FIGURES})
        row.update(_load_extras(load))
        rows.append(row)
    return rows


def slice_rows(loads: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per time slice of each point (`slice_s`): the ramp's (`window: ramp`, start_s
    from the ramp's first send) then the measured window's (`window: measured`)."""
    rows = []
    for load in loads:
        keys = {name: load.get(name) for name in SLICE_KEYS if name != "window"}
        for window in ("ramp", "measured"):
            slices = load.get("ramp_slices" if window == "ramp" else "slices")
            for piece in slices if isinstance(slices, list) else ():
                if isinstance(piece, Mapping):
                    figures = {name: piece.get(name) for name in SLICE_FIGURES}
                    rows.append({**keys, "window": window, **figures})
    return rows


def write_load_slices_csv(data: LedgerData, path: Path) -> int:
    """One row per slice of each load point (slice_rows); returns the rows written."""
    rows = slice_rows(data.of_type("load"))
    table = pd.DataFrame(rows, columns=[*SLICE_KEYS, *SLICE_FIGURES])
    _write(path, lambda target: table.to_csv(target, index=False, lineterminator="\n"))
    return len(table)


def write_load_csv(data: LedgerData, path: Path) -> int:
    """One row per load record (load_rows); returns the rows written."""
    rows = load_rows(data.of_type("load"))
    table = pd.DataFrame(rows, columns=list(load_rows([{}])[0]))
    _write(path, lambda target: table.to_csv(target, index=False, lineterminator="\n"))
    return len(table)


def summaries_json(
    data: LedgerData, summaries: Sequence[PromptSummary], checks: Sequence[EngineChecks] = ()
) -> dict[str, Any]:
    """The run's summaries (without raw samples; with a tools or json_schema prompt's valid
    rate where its samples were read), its checks against the engine, its load points (without
    their per-request samples), its verdicts and cell outcomes."""
    meta, end = data.meta, data.end
    rows = []
    for summary in summaries:
        row = asdict(summary)
        row.pop("samples")
        row["warm_success_rate"] = summary.warm_success_rate
        for rate in VALIDITY:
            values = summary.samples[rate.measure]
            if values:
                row[rate.name] = sum(values) / len(values)
        rows.append(row)
    return {
        "benchmark_run_id": meta.get("benchmark_run_id"),
        "git_sha": meta.get("git_sha"),
        "started_at_utc": meta.get("started_at_utc"),
        "finished_at_utc": end.get("finished_at_utc"),
        "exit_status": end.get("exit_status"),
        "summaries": rows,
        "engine_checks": [_checks_json(found) for found in checks if found.shown],
        "loads": [
            {key: value for key, value in load.items() if key != "samples"}
            for load in data.of_type("load")
        ],
        "verdicts": end.get("verdicts") or [],
        "cells": end.get("cells") or [],
    }


def _checks_json(found: EngineChecks) -> dict[str, Any]:
    """One (cell, prompt)'s checks as results/engine_checks.py counts them, with the draft's
    acceptance (accepted and proposed tokens, their rate) where the engine drafted."""
    row = asdict(found)
    acceptance = found.acceptance
    row["draft_acceptance"] = (
        None
        if acceptance is None
        else {
            "accepted": acceptance[0],
            "proposed": acceptance[1],
            "rate": acceptance[0] / acceptance[1],
        }
    )
    return row


def write_json(
    data: LedgerData,
    summaries: Sequence[PromptSummary],
    path: Path,
    checks: Sequence[EngineChecks] = (),
) -> None:
    text = json.dumps(
        summaries_json(data, summaries, checks), indent=2, sort_keys=True, default=str
    )
    _write(path, lambda target: Path(target).write_text(text + "\n", encoding="utf-8"))


def write_prometheus(
    data: LedgerData,
    summaries: Sequence[PromptSummary],
    path: Path,
    checks: Sequence[EngineChecks] = (),
) -> None:
    """The textfile collector's file, written atomically by prometheus_client."""
    from prometheus_client import CollectorRegistry, write_to_textfile

    registry = prometheus_registry(data, summaries, CollectorRegistry(), checks)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(path), registry)
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot write the Prometheus textfile: {exc}") from None


def prometheus_registry(
    data: LedgerData,
    summaries: Iterable[PromptSummary],
    registry: Any,
    checks: Iterable[EngineChecks] = (),
) -> Any:
    """Gauges labelled cell/prompt/metric: the warm percentiles, the cold call, the counts, a
    tools or json_schema prompt's valid rate, the checks against the engine, the gate's change
    and verdict, and the run's start time and identity."""
    from prometheus_client import Gauge

    labels = ("cell", "prompt", "metric")
    warm = Gauge(
        "gpubench_warm",
        "Warm percentile of a metric per cell and prompt (ms, or tokens/s for rates)",
        [*labels, "percentile"],
        registry=registry,
    )
    cold = Gauge(
        "gpubench_cold",
        "The first successful cold call per cell and prompt (ms); cold_kind process_warm: the "
        "engine could not unload its model, so the call ran warm",
        [*labels, "cold_kind"],
        registry=registry,
    )
    calls = Gauge(
        "gpubench_warm_calls",
        "Warm calls per cell and prompt",
        ["cell", "prompt", "outcome"],
        registry=registry,
    )
    ratio = Gauge(
        "gpubench_gate_change_ratio",
        "Current over baseline, per gated metric",
        labels,
        registry=registry,
    )
    regression = Gauge(
        "gpubench_gate_regression",
        "1 when the gate found a regression in this metric",
        labels,
        registry=registry,
    )
    valid = Gauge(
        "gpubench_warm_valid_rate",
        "Share of the successful warm calls whose answer was valid for the prompt's kind (a "
        "tool call, a JSON schema), where the summaries' samples were read",
        labels,
        registry=registry,
    )
    for summary in summaries:
        key = (summary.cell_id, summary.prompt_id)
        for metric in WARM_METRICS:
            for percentile in PERCENTILE_NAMES:
                value = summary.figure(metric, percentile)
                if value is not None:
                    warm.labels(*key, metric, percentile).set(value)
        for metric, value in (
            ("first_delta_ms", summary.cold_first_delta_ms),
            ("total_duration_ms", summary.cold_total_duration_ms),
        ):
            if value is not None:
                cold.labels(*key, metric, summary.cold_kind or "").set(value)
        calls.labels(*key, "ok").set(summary.n_warm_ok)
        calls.labels(*key, "failed").set(summary.n_warm - summary.n_warm_ok)
        for rate in VALIDITY:
            values = summary.samples[rate.measure]
            if values:
                valid.labels(*key, rate.name).set(sum(values) / len(values))
    _check_gauges(checks, registry)
    _load_gauges(data.of_type("load"), registry)
    for verdict in Verdict.all_from_records(data.end.get("verdicts")):
        names = (verdict.cell_id, verdict.prompt_id, verdict.metric)
        if verdict.change_ratio is not None:
            ratio.labels(*names).set(verdict.change_ratio)
        regression.labels(*names).set(1 if verdict.verdict == "regression" else 0)
    _run_gauges(data, registry)
    return registry


# gpubench_engine_check's `check` label: EngineChecks' counts (results/engine_checks.py).
CHECK_COUNTS = (
    "calls",
    "token_checked",
    "token_mismatches",
    "cache_known",
    "cache_hits",
    "unwanted_cache_hits",
    "draft_tokens",
    "draft_accepted_tokens",
)


def _check_gauges(checks: Iterable[EngineChecks], registry: Any) -> None:
    """gpubench_engine_check{cell, prompt, check}: per (cell, prompt) the warm calls' checks
    against the engine (CHECK_COUNTS, the draft's acceptance rate) and, as `counter:<name>`,
    the engine's counters over them (config/engine_series.ENGINE_COUNTERS: changes added up, gauges'
    peak)."""
    from prometheus_client import Gauge

    gauge = Gauge(
        "gpubench_engine_check",
        "The warm calls checked against the engine per cell and prompt: token counts, prefix "
        "cache hits, draft tokens, the engine's counters over the calls",
        ["cell", "prompt", "check"],
        registry=registry,
    )
    for found in checks:
        if not found.shown:
            continue
        key = (found.cell_id, found.prompt_id)
        for name in CHECK_COUNTS:
            gauge.labels(*key, name).set(getattr(found, name))
        acceptance = found.acceptance
        if acceptance is not None:
            gauge.labels(*key, "draft_acceptance_rate").set(acceptance[0] / acceptance[1])
        for name, value in sorted(found.counters.items()):
            gauge.labels(*key, f"counter:{name}").set(value)


def _load_gauges(loads: Iterable[Mapping[str, Any]], registry: Any) -> None:
    """gpubench_load{cell, prompt, point, metric}: each load point's figures (the verdicts'
    `prompt` label for a point is `<prompt>@load-<point>`); gpubench_load_server_offset_ms: the
    client's mean minus the engine's own."""
    from prometheus_client import Gauge

    labels = ("cell", "prompt", "point", "metric")
    figures = Gauge(
        "gpubench_load",
        "A load point's figure (rates per second, latencies in ms, counts)",
        labels,
        registry=registry,
    )
    offsets = Gauge(
        "gpubench_load_server_offset_ms",
        "A load point's client mean minus the engine's own mean over the same point (ms)",
        labels,
        registry=registry,
    )
    for row in load_rows(loads):
        key = (str(row["cell_id"]), str(row["prompt_id"]), str(row["load_point"]))
        for name in (*LOAD_FIGURES, *LOAD_ENGINE_FIGURES):
            value = row.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                figures.labels(*key, name).set(value)
        for name in SERVER_FIGURES:
            offset = row.get(f"offset_{name}")
            if isinstance(offset, int | float):
                offsets.labels(*key, name).set(offset)


def _run_gauges(data: LedgerData, registry: Any) -> None:
    from prometheus_client import Gauge

    meta, end = data.meta, data.end
    info = Gauge(
        "gpubench_run_info",
        "The run this file describes (always 1)",
        ["run_id", "git_sha"],
        registry=registry,
    )
    info.labels(str(meta.get("benchmark_run_id", "")), str(meta.get("git_sha") or "")).set(1)
    started = _epoch(meta.get("started_at_utc"))
    if started is not None:
        Gauge(
            "gpubench_run_started_timestamp_seconds", "When the run started", registry=registry
        ).set(started)
    if isinstance(end.get("exit_status"), int):
        Gauge("gpubench_run_exit_status", "The run's exit status", registry=registry).set(
            end["exit_status"]
        )


def _epoch(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _write(path: Path, write: Any) -> None:
    try:
        with atomic_file(path) as temporary:
            write(temporary)
    except OSError as exc:
        raise GpubenchError(f"{path}: cannot write: {exc.strerror or exc}") from None
