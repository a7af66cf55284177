"""A load point checked against the engine (pure parts): histogram sums and counts read from a
/metrics page, the engine's means set against the client's with the offsets, the coalesced
replies and the `n` behind each percentile, the warnings, and throughput samples in tokens."""

from __future__ import annotations

import statistics
from typing import cast

import pytest

from pytest_gpubench.ledger.schema import LoadRecord
from pytest_gpubench.measure.gauges import GaugeSamples, parse_metrics
from pytest_gpubench.reports.terminal import load_lines
from pytest_gpubench.results.load_summary import server_check, summarize_point

VLLM_PAGE = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.04
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 640.0
"""


def test_a_histograms_sum_and_count_are_read_beside_the_counters() -> None:
    _, counters = parse_metrics(VLLM_PAGE)
    assert counters == {
        "vllm:time_to_first_token_seconds_count": 4.0,
        "vllm:time_to_first_token_seconds_sum": 0.04,
        "vllm:generation_tokens_total": 640.0,
    }
    samples = GaugeSamples(100)
    samples.counters_before = counters
    samples.counters_after = {**counters, "vllm:time_to_first_token_seconds_sum": 0.1}
    samples.counters_after["vllm:time_to_first_token_seconds_count"] = 10.0
    assert samples.server_changes() == {
        "vllm:time_to_first_token_seconds_sum": 0.06,
        "vllm:time_to_first_token_seconds_count": 6.0,
    }


def call(
    send_ms: float, ttft: float, total: float, chunks: int = 4, tokens: int = 8, **extra: object
) -> dict[str, object]:
    gap = (total - ttft) / (chunks - 1)
    record: dict[str, object] = {
        "send_ms": send_ms,
        "send_lag_ms": 0.0,
        "first_delta_ms": ttft,
        "total_duration_ms": total,
        "tpot_ms": (total - ttft) / (tokens - 1),
        "inter_chunk_ms": [gap] * (chunks - 1),
        "completion_tokens": tokens,
        "coalesced": False,
        "error": None,
        "finish_reason": "length",
        "load_window": "measured",
    }
    record.update(extra)
    return record


VLLM_CHANGES = {
    "vllm:time_to_first_token_seconds_sum": 0.04,
    "vllm:time_to_first_token_seconds_count": 4.0,
    "vllm:request_time_per_output_token_seconds_sum": 0.008,
    "vllm:request_time_per_output_token_seconds_count": 4.0,
    "vllm:e2e_request_latency_seconds_sum": 0.4,
    "vllm:e2e_request_latency_seconds_count": 4.0,
}


def test_the_engines_means_stand_beside_the_clients_with_the_offsets() -> None:
    calls = [call(i * 200.0, 12.0, 103.0) for i in range(4)]
    summary = summarize_point(calls, offered_rate=None, slo=None, max_send_lag_ms=None,
                              server=VLLM_CHANGES)  # fmt: skip
    check = summary["server_check"]
    assert check["engine"] == "vllm" and check["requests"] == 4 and check["client_requests"] == 4
    assert check["ttft_ms"] == {
        "server_mean": 10.0,
        "server_n": 4.0,
        "client_mean": 12.0,
        "client_n": 4,
        "offset_ms": 2.0,
    }
    assert check["tpot_ms"]["server_mean"] == 2.0
    assert check["tpot_ms"]["offset_ms"] == pytest.approx(13.0 - 2.0)
    assert check["e2e_ms"]["offset_ms"] == pytest.approx(3.0)
    # TPOT 13 ms at the client against 2 ms at the engine: mostly not engine time.
    assert summary["delivery_warnings"] == [
        "TPOT mean 13 ms at the client against 2 ms at the engine (offset +11 ms): the "
        "client's figure is mostly delivery delay, not engine time"
    ]


def test_llama_servers_prompt_and_generation_seconds_give_its_means() -> None:
    calls = [call(i * 200.0, 12.0, 103.0) for i in range(4)]
    check = server_check(
        calls,
        {
            "llamacpp:prompt_seconds_total": 0.04,
            "llamacpp:tokens_predicted_seconds_total": 0.32,
            "llamacpp:tokens_predicted_total": 32.0,
        },
    )
    assert check is not None and check["engine"] == "llamacpp"
    assert check["ttft_ms"]["server_mean"] == 10.0 and check["ttft_ms"]["offset_ms"] == 2.0
    assert check["tpot_ms"]["server_mean"] == 10.0
    assert server_check(calls, {"vllm:generation_tokens_total": 1.0}) is None
    # Its prompt time leaves out the wait for a slot and the first decode step: a client TTFT
    # ten times as long is shown, not warned about.
    summary = summarize_point(
        calls,
        offered_rate=None,
        slo=None,
        max_send_lag_ms=None,
        server={"llamacpp:prompt_seconds_total": 0.004},
    )
    assert summary["server_check"]["ttft_ms"]["offset_ms"] == pytest.approx(11.0)
    assert summary["delivery_warnings"] is None


def test_coalesced_replies_are_counted_with_the_n_of_each_percentile_and_warned_about() -> None:
    calls = [call(i * 100.0, 10.0, 50.0) for i in range(8)]
    calls += [
        call(800.0 + i, 50.0, 50.0, coalesced=True, tpot_ms=None, inter_chunk_ms=[0.0] * 3)
        for i in range(2)
    ]
    summary = summarize_point(calls, offered_rate=None, slo=None, max_send_lag_ms=None)
    assert summary["ok"] == 10 and summary["coalesced_calls"] == 2
    assert summary["coalesced_share"] == 0.2
    assert (summary["ttft_ms_n"], summary["tpot_ms_n"], summary["e2e_ms_n"]) == (10, 8, 10)
    assert summary["itl_ms_n"] == 30
    (warning,) = summary["delivery_warnings"]
    assert warning.startswith("2 of 10 replies (20%) came whole in one read")
    point = cast(LoadRecord, {**summary, "cell_id": "c", "load_point": "c4"})
    lines = [line.text for line in load_lines([point])]
    assert any(text.startswith("WARNING") and "came whole" in text for text in lines)
    assert any("2 of 10" in text and "10 / 8" in text for text in lines)
    # One whole reply in twenty is no warning.
    few = [call(i * 100.0, 10.0, 50.0) for i in range(19)] + calls[-1:]
    assert (
        summarize_point(few, offered_rate=None, slo=None, max_send_lag_ms=None)["delivery_warnings"]
        is None
    )


def test_a_reply_read_whole_at_its_end_counts_inside_the_window() -> None:
    """The last call to end read its content at its very end (a reply delivered whole); its TTFT,
    gaps and total, each kept to 4 decimals of a ms, sum to 0.0003 ms past that end, as in a real
    vLLM point whose throughput samples lost 92 of 4,096 tokens (their mean 571.4 against the
    headline 584.5 tokens/s). Every token of the window counts: the samples' mean is the
    headline."""
    calls = [call(i * 250.0, 20.0, 400.0) for i in range(19)]
    calls.append(call(4750.0, 12.3462, 828.5381, inter_chunk_ms=[816.1922, 0.0, 0.0]))
    summary = summarize_point(calls, offered_rate=None, slo=None, max_send_lag_ms=None)
    samples = summary["samples"]["output_tokens_per_sec"]
    assert summary["output_tokens"] == 160
    assert statistics.mean(samples) == pytest.approx(summary["output_tokens_per_sec"], rel=1e-3)


def test_throughput_samples_count_tokens_and_their_mean_is_the_headline() -> None:
    """Four chunks carry eight tokens each call (an engine that packs tokens into events): the
    samples add up tokens, not chunks."""
    calls = [call(i * 250.0, 20.0, 400.0) for i in range(20)]
    summary = summarize_point(calls, offered_rate=None, slo=None, max_send_lag_ms=None)
    samples = summary["samples"]["output_tokens_per_sec"]
    assert len(samples) == 5  # a window of 5.15 s in five equal buckets
    assert summary["output_tokens"] == 160
    assert statistics.mean(samples) == pytest.approx(summary["output_tokens_per_sec"], rel=1e-3)
