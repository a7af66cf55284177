"""A load record's figures, typed: what a load point's summary holds (LoadFigures) and the
parts it is made of (its time slices, its LoRA adapters' split, each client's send lag, its ramp
and its queue trend). ledger/schema.LoadRecord is a load point's head and these."""

from __future__ import annotations

from typing import Any, TypedDict

# A ramped point's ramp (run/load/ramp.Ramp.facts): its length, shape and starting share.
RampFacts = TypedDict("RampFacts", {"ramp_s": float, "shape": str, "from": float})


class SaturationTrend(TypedDict):
    """An open loop's queue over its measured window (results/load_over_time.saturation_trend):
    Kendall's tau of TTFT and of the requests in flight against send time, each one-sided p, at
    `alpha`; `saturated` when both rise."""

    alpha: float
    n: int
    ttft_tau: float
    ttft_p: float
    in_flight_tau: float
    in_flight_p: float
    saturated: bool


class TimeSlice(TypedDict):
    """A slice of a point's window (`slice_s`, results/load_over_time.time_slices): its requests
    by when each was sent, output tokens/s of the tokens that arrived in it, and the TTFT, TPOT
    and E2E p50 and p99 of its successful requests, with n."""

    start_s: float
    span_s: float
    requests: int
    ok: int
    output_tokens_per_sec: float | None
    ttft_ms_n: int
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    tpot_ms_n: int
    tpot_ms_p50: float | None
    tpot_ms_p99: float | None
    e2e_ms_n: int
    e2e_ms_p50: float | None
    e2e_ms_p99: float | None


class AdapterSplit(TypedDict):
    """One LoRA adapter's share of a point (results/load_summary.adapter_split)."""

    adapter: str
    requests: int
    errors: int
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    e2e_ms_p50: float | None
    e2e_ms_p99: float | None


class ClientLag(TypedDict):
    """One client's own send lag over a point sent by several (results/load_summary.
    lag_by_client), by its `process` index."""

    process: int
    requests: int
    send_lag_ms_p50: float | None
    send_lag_ms_p99: float | None
    send_lag_ms_max: float | None


class LoadFigures(TypedDict, total=False):
    """A load point's pattern and summary (each pattern's facts(),
    results/load_summary.summarize_load, a sweep's run/load/sweep.py): the figures the load gate
    and the reports read. Each may be absent from a ledger of an older version."""

    pattern: str
    concurrency: int | None
    rate: float | None
    arrival: str | None
    sweep_step: str
    saturation_rate: float | None
    requests: int
    ok: int
    errors: int
    timeouts: int
    window_s: float
    offered_rate: float | None
    send_rate: float | None
    achieved_rate: float | None
    requests_per_sec: float | None
    output_tokens: int
    output_tokens_per_sec: float | None
    # Each latency's percentiles and the count behind them (results/load_summary.LATENCIES).
    ttft_ms_n: int
    ttft_ms_p50: float | None
    ttft_ms_p90: float | None
    ttft_ms_p99: float | None
    tpot_ms_n: int
    tpot_ms_p50: float | None
    tpot_ms_p90: float | None
    tpot_ms_p99: float | None
    e2e_ms_n: int
    e2e_ms_p50: float | None
    e2e_ms_p90: float | None
    e2e_ms_p99: float | None
    first_answer_ms_n: int
    first_answer_ms_p50: float | None
    first_answer_ms_p90: float | None
    first_answer_ms_p99: float | None
    itl_ms_n: int
    itl_ms_p50: float | None
    itl_ms_p90: float | None
    itl_ms_p99: float | None
    # Each percentile's distribution-free interval and its n (results/load_summary.py).
    percentile_intervals: dict[str, Any]
    # `slice_s`: the measured window's time slices, each with its throughput and percentiles.
    slice_s: float | None
    # A ramped point's ramp (run/load/ramp.py Ramp.facts) and the requests sent in it.
    ramp: RampFacts | None
    ramp_requests: int
    ramp_slices: list[TimeSlice] | None
    # An open loop's TTFT and in-flight trends within it (results/load_over_time.saturation_trend);
    # a sweep's stop once a step over-saturated (run/load/sweep.py).
    trend: SaturationTrend | None
    saturation_stop: dict[str, Any] | None
    # `processes: N`: the client processes lost mid-point (the point then has no figure) and
    # the requests the others recorded.
    clients_lost: list[str]
    requests_recorded: int | None
    # `clients:` on a Slurm node: its setting and each task's clock offset to the coordinator
    # and that offset's error bound (run/load/clients.py).
    clients: dict[str, Any] | None
    client_offsets_ms: list[float]
    client_offset_errors_ms: list[float]
    slices: list[TimeSlice] | None
    # `processes:` or `clients:`: each client's own send lag.
    send_lag_by_process: list[ClientLag] | None
    coalesced_calls: int
    coalesced_share: float | None
    slo: dict[str, Any] | None
    goodput_rate: float | None
    slo_attainment: float | None
    meets_slo: bool | None
    send_lag_ms_p50: float | None
    send_lag_ms_p99: float | None
    send_lag_ms_max: float | None
    max_send_lag_ms: float | None
    valid: bool
    invalid_reason: str | None
    server_check: dict[str, Any] | None
    delivery_warnings: list[str] | None
    engine_counters: dict[str, float] | None
    samples: dict[str, list[float]]
    # A `prefix:` workload's cache, a reasoning model's tokens, the machine's CPU pressure over
    # the point (measure/control.py): present where measured.
    prefix_cache_hit_rate: float | None
    prefix_cache_source: str | None
    # Requests whose engine counted other tokens than it streamed
    # (measure.call_measurement.token_mismatch).
    token_mismatches: int
    # Speculative decoding over the point (run/load/runner.spec_decode_figures; issue 35).
    spec_acceptance_rate: float | None
    spec_mean_acceptance_length: float | None
    # A multi-turn point (`turns:`, run/load/runner.session_figures): its sessions, those that
    # ran whole, per turn the p50 TTFT and prompt tokens, and a session's span.
    turns: int
    sessions: int
    sessions_ok: int
    ttft_ms_p50_by_turn: list[float | None]
    prompt_tokens_p50_by_turn: list[float | None]
    session_ms_p50: float | None
    session_ms_p99: float | None
    # A cell that chooses LoRA adapters per request: per adapter, its measured requests, errors
    # and TTFT/E2E p50 and p99 (results/load_summary.adapter_split).
    lora_split: list[AdapterSplit]
    reasoning_tokens_p50: float | None
    cpu_pressure: float
