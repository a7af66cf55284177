"""Aggregation of call records: percentiles, failures left out, success rate, cold calls, order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hypothesis_examples import examples

from pytest_gpubench.config.metrics import PERCENTILE_NAMES
from pytest_gpubench.results.stats import (
    WARM_METRICS,
    PromptSummary,
    WarmSamples,
    is_success,
    summarize,
)

CELL = "local:llamacpp:tiny"


def call(
    ttft: float | None = 10.0,
    total: float | None = 100.0,
    *,
    phase: str = "warm",
    run_idx: int = 0,
    prompt_id: str = "P-EASY",
    cell_id: str = CELL,
    tokens_per_sec: float | None = 50.0,
    error: str | None = None,
    cold_kind: str | None = None,
    coalesced: bool = False,
    engine_tokens_per_sec: float | None = 60.0,
) -> dict[str, Any]:
    return {
        "type": "call",
        "cell_id": cell_id,
        "prompt_id": prompt_id,
        "prompt_sha256": "ab" * 32,
        "phase": phase,
        "run_idx": run_idx,
        "cold_kind": cold_kind,
        "first_delta_ms": ttft,
        "total_duration_ms": total,
        "tokens_per_sec": tokens_per_sec,
        "finish_reason": "error" if error else "stop",
        "error": error,
        "inter_chunk_ms": [1.0, 2.0],
        "engine_timings": {"prompt_ms": 1.0},
        "e2e_tokens_per_sec": 640.0,
        "coalesced": coalesced,
        "content_reads": 1 if coalesced else 64,
        "engine_tokens_per_sec": engine_tokens_per_sec,
        "engine_prompt_ms": 1.0,
        "engine_total_ms": 90.0,
    }


def only(records: list[dict[str, Any]]) -> PromptSummary:
    (summary,) = summarize(records)
    return summary


def test_warm_percentiles_interpolate_linearly() -> None:
    values = [10.0, 20.0, 30.0, 40.0, 50.0]
    summary = only([call(v, v * 10, run_idx=i) for i, v in enumerate(values)])
    assert summary.figure("first_delta_ms", "p50") == 30.0
    assert summary.figure("first_delta_ms", "p95") == pytest.approx(48.0)
    assert summary.figure("first_delta_ms", "p99") == pytest.approx(49.6)
    assert summary.figure("total_duration_ms", "p50") == 300.0
    assert summary.figure("total_duration_ms", "p99") == pytest.approx(496.0)
    assert summary.samples["first_delta_ms"] == tuple(values)


def test_failed_calls_count_against_success_and_are_left_out_of_numbers() -> None:
    records = [call(10.0, 100.0, run_idx=i, tokens_per_sec=40.0) for i in range(4)]
    # A stream that broke after its first chunk has a TTFT but is still a failure.
    records.append(call(999.0, 9999.0, run_idx=4, tokens_per_sec=1.0, error="stream reset"))
    summary = only(records)
    assert (summary.n_warm, summary.n_warm_ok) == (5, 4)
    assert summary.warm_success_rate == 0.8
    assert summary.figure("first_delta_ms", "p99") == 10.0
    assert (
        summary.figure("decode_tokens_per_sec", "p50")
        == summary.figure("decode_tokens_per_sec", "p99")
        == 40.0
    )
    assert summary.samples == WarmSamples(
        first_delta_ms=(10.0,) * 4,
        total_duration_ms=(100.0,) * 4,
        decode_tokens_per_sec=(40.0,) * 4,
        engine_prompt_ms=(1.0,) * 4,
        engine_tokens_per_sec=(60.0,) * 4,
        engine_total_ms=(90.0,) * 4,
    )


def test_a_failed_call_is_never_a_result_even_when_it_carries_figures() -> None:
    """Broken streams keep their partial figures in the ledger, never in a percentile or count."""
    broken = call(5.0, 50.0, run_idx=1, tokens_per_sec=None, error="stream broke", coalesced=True)
    summary = only([call(10.0, 100.0), broken])
    for metric in WARM_METRICS:
        values = {summary.figure(metric, name) for name in PERCENTILE_NAMES}
        assert values == {only([call(10.0, 100.0)]).figure(metric, "p50")}, metric
    assert summary.warm_coalesced == 0 and summary.n_warm_ok == 1


def test_finish_reason_error_alone_is_a_failure() -> None:
    record = call() | {"finish_reason": "error"}
    assert not is_success(record)
    assert only([record]).n_warm_ok == 0


def test_all_warm_calls_failed() -> None:
    summary = only([call(None, None, error="refused", run_idx=i) for i in range(3)])
    assert summary.warm_success_rate == 0.0
    assert summary.figure("first_delta_ms", "p50") is None
    assert summary.figure("decode_tokens_per_sec", "p50") is None
    assert summary.samples == WarmSamples()


def test_cold_numbers_come_from_the_first_successful_cold_call() -> None:
    records = [
        call(500.0, 900.0, phase="cold", run_idx=1, cold_kind="restart"),
        call(None, None, phase="cold", run_idx=0, error="timeout"),
        call(700.0, 990.0, phase="cold", run_idx=2, cold_kind="restart"),
        call(10.0, 100.0),
    ]
    summary = only(records)
    assert (summary.n_cold, summary.n_cold_ok) == (3, 2)
    assert summary.cold_first_delta_ms == 500.0
    assert summary.cold_total_duration_ms == 900.0
    assert summary.cold_kind == "restart"
    assert summary.n_warm == 1


def test_cold_only_prompt_has_no_warm_numbers() -> None:
    summary = only([call(500.0, 900.0, phase="cold", cold_kind="process_warm")])
    assert summary.n_warm == 0 and summary.warm_success_rate is None
    assert summary.figure("first_delta_ms", "p50") is None
    assert summary.cold_kind == "process_warm"


def test_groups_are_sorted_and_other_record_types_ignored() -> None:
    records: list[dict[str, Any]] = [
        {"type": "meta", "benchmark_run_id": "r"},
        call(prompt_id="P-MEDIUM", cell_id="b:ollama:m"),
        {"type": "cell", "cell_id": "b:ollama:m"},
        call(prompt_id="P-EASY", cell_id="b:ollama:m"),
        call(prompt_id="P-HARD", cell_id="a:llamacpp:tiny"),
        {"type": "skipped", "cell_id": "c:openai:x", "reason": "down"},
        {"type": "end", "verdicts": []},
    ]
    keys = [summary.key for summary in summarize(records)]
    assert keys == [
        ("a:llamacpp:tiny", "P-HARD"),
        ("b:ollama:m", "P-EASY"),
        ("b:ollama:m", "P-MEDIUM"),
    ]


def test_older_ledger_without_some_fields() -> None:
    record = call()
    for field in ("tokens_per_sec", "prompt_sha256", "cold_kind", "engine_tokens_per_sec"):
        del record[field]
    summary = only([record, record])
    assert summary.figure("decode_tokens_per_sec", "p50") is None
    assert summary.figure("engine_tokens_per_sec", "p50") is None
    assert summary.prompt_sha256 is None
    assert summary.samples["decode_tokens_per_sec"] == ()
    assert summary.figure("first_delta_ms", "p50") == 10.0


def test_an_integer_past_a_floats_range_is_no_value_not_an_error() -> None:
    """A damaged ledger's 10**400 where a figure belongs (found by test_fuzzed_inputs: every
    report of the ledger raised OverflowError); the other calls' figures still count."""
    damaged = call(ttft=10**400)
    summary = only([call(ttft=10.0), damaged, call(ttft=12.0)])
    assert summary.samples["first_delta_ms"] == (10.0, 12.0)
    assert summary.figure("first_delta_ms", "p50") == 11.0


def test_tokens_per_sec_of_a_ledger_before_the_decode_definition_is_not_a_decode_rate() -> None:
    """Records without `coalesced` computed tokens/s as n over (total − TTFT): left out."""
    record = call(tokens_per_sec=31861.0, engine_tokens_per_sec=None) | {"tpot_ms": 0.03}
    for field in ("coalesced", "content_reads", "e2e_tokens_per_sec"):
        del record[field]
    summary = only([record])
    assert (
        summary.figure("decode_tokens_per_sec", "p50") is None
        and summary.figure("tpot_ms", "p50") is None
    )
    assert summary.samples["decode_tokens_per_sec"] == ()
    assert summary.figure("first_delta_ms", "p50") == 10.0 and summary.n_warm_ok == 1


def test_success_without_token_rate_keeps_its_latency() -> None:
    summary = only([call(10.0, 20.0, tokens_per_sec=None), call(30.0, 40.0, run_idx=1)])
    assert summary.figure("first_delta_ms", "p50") == 20.0
    assert summary.figure("decode_tokens_per_sec", "p50") == 50.0
    assert summary.samples["decode_tokens_per_sec"] == (50.0,)


def test_coalesced_calls_are_counted_and_have_no_decode_rate() -> None:
    records = [call(run_idx=i, tokens_per_sec=100.0 + i) for i in range(3)]
    records += [call(run_idx=3 + i, tokens_per_sec=None, coalesced=True) for i in range(2)]
    summary = only(records)
    assert summary.warm_coalesced == 2 and summary.n_warm_ok == 5
    assert summary.figure("decode_tokens_per_sec", "p50") == 101.0
    assert summary.samples["decode_tokens_per_sec"] == (100.0, 101.0, 102.0)
    assert summary.samples["first_delta_ms"] == (10.0,) * 5  # their latency still counts


def test_no_calls() -> None:
    assert summarize([]) == []
    assert summarize([{"type": "meta"}]) == []


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["P-EASY", "P-HARD"]),
            st.floats(0.1, 1e5, allow_nan=False),
            st.booleans(),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_matches_numpy_per_group(rows: list[tuple[str, float, bool]]) -> None:
    records = [
        call(ttft, ttft * 2, prompt_id=prompt, run_idx=i, error=None if ok else "boom",
             tokens_per_sec=1e4 / ttft, engine_tokens_per_sec=2e4 / ttft)
        for i, (prompt, ttft, ok) in enumerate(rows)
    ]  # fmt: skip
    for summary in summarize(records):
        mine = [r for r in rows if r[0] == summary.prompt_id]
        good = [ttft for _, ttft, ok in mine if ok]
        assert summary.n_warm == len(mine) and summary.n_warm_ok == len(good)
        assert summary.samples["first_delta_ms"] == tuple(good)
        expected = {
            "first_delta_ms": good,
            "total_duration_ms": [ttft * 2 for ttft in good],
            "decode_tokens_per_sec": [1e4 / ttft for ttft in good],
            "engine_tokens_per_sec": [2e4 / ttft for ttft in good],
        }
        for metric, values in expected.items():
            for name in PERCENTILE_NAMES:
                found = summary.figure(metric, name)
                if not values:
                    assert found is None
                    continue
                wanted = float(np.percentile(values, int(name[1:])))
                assert found == pytest.approx(wanted), (metric, name)
