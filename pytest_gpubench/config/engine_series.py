"""The engines' own Prometheus `/metrics`, part of the table of figures (config/metrics.py): the
counters read before and after each warm call (`ENGINE_COUNTERS`, those the engine checks table
shows and those cells.yaml's `thresholds:` may limit), and the series a load point reads before
and after it. Every series name the plugin reads is written here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EngineCounter:
    """One of the engine's own counters read from its Prometheus `/metrics` before and after each
    warm call (measure/gauges.case_counters): the change of a counter over the call, or the peak
    of a gauge at the two reads. Recorded under the call record's `engine_counters` by `name`."""

    name: str
    label: str
    # Its series on each engine: the first alternative whose every name the page holds, added
    # up (llama.cpp's prompt tokens looked up are the ones it evaluated and the ones it found).
    series: tuple[tuple[str, ...], ...]
    # "delta": a counter's change over the call; "peak": a gauge's larger reading of the two.
    kind: Literal["delta", "peak"] = "delta"
    # In the engine checks table's counters column (the prefix cache and the draft have their own).
    shown: bool = False
    # The key of cells.yaml's `thresholds:` that limits its sum over a (cell, prompt)'s warm
    # calls (a count, 0 or more): over it is a regression, not read is inconclusive.
    limit_key: str | None = None


ENGINE_COUNTERS: tuple[EngineCounter, ...] = (
    EngineCounter(
        "prefix_cache_queries",
        "prefix cache tokens looked up",
        (
            ("vllm:prefix_cache_queries_total",),
            ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),
        ),
    ),
    EngineCounter(
        "prefix_cache_hits",
        "prefix cache tokens found",
        (("vllm:prefix_cache_hits_total",), ("llamacpp:prompt_tokens_cached_total",)),
    ),
    EngineCounter(
        "preemptions",
        "preemptions",
        (("vllm:num_preemptions_total",),),
        shown=True,
        limit_key="max_preemptions",
    ),
    EngineCounter(
        "requests_waiting_peak",
        "requests queued (peak)",
        (("vllm:num_requests_waiting",), ("llamacpp:requests_deferred",)),
        kind="peak",
        shown=True,
    ),
    EngineCounter(
        "kv_cache_usage_peak",
        "KV-cache usage (peak)",
        (
            ("vllm:kv_cache_usage_perc",),
            ("vllm:gpu_cache_usage_perc",),
            ("llamacpp:kv_cache_usage_ratio",),
        ),
        kind="peak",
        shown=True,
    ),
    EngineCounter(
        "spec_drafts",
        "speculative drafts",
        (("vllm:spec_decode_num_drafts_total",), ("llamacpp:spec_decode_num_drafts_total",)),
    ),
    EngineCounter(
        "spec_draft_tokens",
        "draft tokens proposed",
        (
            ("vllm:spec_decode_num_draft_tokens_total",),
            ("llamacpp:spec_decode_num_draft_tokens_total",),
        ),
    ),
    EngineCounter(
        "spec_accepted_tokens",
        "draft tokens accepted",
        (
            ("vllm:spec_decode_num_accepted_tokens_total",),
            ("llamacpp:spec_decode_num_accepted_tokens_total",),
        ),
    ),
)
# The counters a cell may limit: each `max_` key of cells.yaml's `thresholds:`.
COUNTER_LIMITS = {
    counter.limit_key: counter for counter in ENGINE_COUNTERS if counter.limit_key is not None
}


# The engine's own /metrics series a load point reads before and after it (measure/gauges).
# vLLM's prefix cache over a point: prompt tokens looked up, and those found cached.
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits_total"
# The engines' counts of the tokens they generated (vLLM's, llama.cpp's).
GENERATED = ("vllm:generation_tokens_total", "llamacpp:tokens_predicted_total")
# Counters whose change over a point is the engine's own count of what it generated and read.
TOKEN_COUNTERS = (
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:request_success_total",
    # vLLM's prefix cache: prompt tokens looked up, and those found cached.
    VLLM_PREFIX_QUERIES,
    VLLM_PREFIX_HITS,
    "llamacpp:tokens_predicted_total",
    "llamacpp:prompt_tokens_total",
    "llamacpp:n_decode_total",
    # Preemptions and speculative decoding over the point (issue 35): drafts, the tokens they
    # proposed and those accepted.
    "vllm:num_preemptions_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "llamacpp:spec_decode_num_drafts_total",
    "llamacpp:spec_decode_num_draft_tokens_total",
    "llamacpp:spec_decode_num_accepted_tokens_total",
)
# The engine's own latency figures: a histogram's `_sum` and `_count` (vLLM), or the seconds it
# spent and the tokens it spent them on (llama-server); their change over a point gives the
# point's server-side means (results/load_summary.server_check).
# vLLM: a histogram per client figure; llama-server: its seconds and the tokens they were spent on.
SERVER_HISTOGRAMS = {
    "ttft_ms": "vllm:time_to_first_token_seconds",
    "tpot_ms": "vllm:request_time_per_output_token_seconds",
    "e2e_ms": "vllm:e2e_request_latency_seconds",
}
LLAMACPP_PROMPT_SECONDS = "llamacpp:prompt_seconds_total"
LLAMACPP_PREDICTED_SECONDS = "llamacpp:tokens_predicted_seconds_total"
LLAMACPP_PREDICTED = "llamacpp:tokens_predicted_total"
SERVER_SERIES = (
    *(f"{name}_{part}" for name in SERVER_HISTOGRAMS.values() for part in ("sum", "count")),
    LLAMACPP_PROMPT_SECONDS,
    LLAMACPP_PREDICTED_SECONDS,
    LLAMACPP_PREDICTED,
)
