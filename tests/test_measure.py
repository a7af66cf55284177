"""The per-call definitions: decode tokens/s (n − k over first to last content arrival), TPOT,
end-to-end, coalesced."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support.hypothesis_examples import examples

from pytest_gpubench.measure.call_measurement import CallMeasurement, call_rates
from pytest_gpubench.measure.stream import StreamedResponse, finish_timing

MS = 1_000_000  # nanoseconds


def even(tokens: int, gap_ns: int, start_ns: int = 5 * MS) -> list[int]:
    """One chunk per token, `gap_ns` apart."""
    return [start_ns + index * gap_ns for index in range(tokens)]


def test_n_tokens_span_n_minus_one_intervals() -> None:
    """16 tokens 1 ms apart decode at 1,000 tokens/s, not 16/15 of it (+6.7 %)."""
    rates = call_rates(even(16, MS), 16, total_ms=20.0)
    assert rates.tokens_per_sec == 1000.0 and rates.tpot_ms == 1.0
    assert rates.e2e_tokens_per_sec == 800.0  # n / total
    assert not rates.coalesced and rates.content_reads == 16


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(2, 4000), st.integers(1_000, 50 * MS), st.floats(0.0, 500.0))
def test_evenly_spaced_tokens_decode_at_one_over_the_gap(
    tokens: int, gap_ns: int, extra_ms: float
) -> None:
    arrivals = even(tokens, gap_ns)
    total_ms = arrivals[-1] / 1e6 + extra_ms
    rates = call_rates(arrivals, tokens, total_ms)
    assert rates.tokens_per_sec == pytest.approx(1e9 / gap_ns, rel=1e-3)
    assert rates.tpot_ms == pytest.approx(gap_ns / 1e6, rel=1e-3, abs=1e-4)
    assert rates.e2e_tokens_per_sec == pytest.approx(tokens / (total_ms / 1000), rel=1e-3, abs=1e-3)
    assert rates.e2e_tokens_per_sec is not None and rates.tokens_per_sec is not None
    assert rates.e2e_tokens_per_sec <= rates.tokens_per_sec * (1 + 1e-3) * tokens / (tokens - 1)


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(1, 500), st.integers(0, 10**12), st.floats(0.1, 1e4))
def test_content_in_one_read_is_coalesced_and_has_no_decode_rate(
    tokens: int, arrived_ns: int, total_ms: float
) -> None:
    rates = call_rates([arrived_ns] * tokens, tokens, total_ms)
    assert rates.coalesced and rates.content_reads == 1
    assert rates.tokens_per_sec is None and rates.tpot_ms is None
    assert rates.e2e_tokens_per_sec == pytest.approx(tokens / (total_ms / 1000), abs=1e-3)


def test_one_chunk_holding_many_tokens_is_coalesced() -> None:
    rates = call_rates([7 * MS], 64, total_ms=10.0)
    assert rates.coalesced and rates.tokens_per_sec is None
    assert rates.e2e_tokens_per_sec == 6400.0


def test_chunks_sent_together_do_not_make_the_rate_read_high() -> None:
    """Four chunks per read, a read a millisecond: 4,000 tokens/s, however they were grouped.

    The four tokens of the first read took no time of their own in the span; counted as n − 1
    intervals they would make it 15 over 3 ms, 5,000 tokens/s.
    """
    arrivals = [MS] * 4 + [2 * MS] * 4 + [3 * MS] * 4 + [4 * MS] * 4
    rates = call_rates(arrivals, 16, total_ms=5.0)
    assert not rates.coalesced and rates.content_reads == 4
    assert rates.tokens_per_sec == 4000.0 and rates.tpot_ms == 0.25


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(2, 200), st.integers(1, 64), st.integers(10_000, 10 * MS))
def test_a_first_read_holding_what_piled_up_leaves_the_pace_alone(
    tokens: int, held: int, gap_ns: int
) -> None:
    """A transport that held the first content and then let `held` chunks go at once."""
    held = min(held, tokens - 1)
    arrivals = [held * gap_ns] * held + [(index + 1) * gap_ns for index in range(held, tokens)]
    rates = call_rates(arrivals, tokens, total_ms=None)
    assert rates.tokens_per_sec == pytest.approx(1e9 / gap_ns, rel=1e-3)


def test_usage_counts_tokens_and_the_chunk_count_stands_in_without_it() -> None:
    arrivals = even(8, MS)
    assert call_rates(arrivals, 15, 10.0).tokens_per_sec == 2000.0  # 15 - 1 tokens over 7 ms
    assert call_rates(arrivals, None, 10.0).tokens_per_sec == 1000.0  # 8 - 1 chunks over 7 ms


def test_nothing_arrived_is_neither_coalesced_nor_a_rate() -> None:
    rates = call_rates([], None, None)
    assert (rates.coalesced, rates.content_reads, rates.tokens_per_sec) == (False, 0, None)
    assert rates.e2e_tokens_per_sec is None


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=2, max_size=200).map(sorted))
def test_tpot_is_the_inverse_of_the_decode_rate(arrivals: list[int]) -> None:
    # A token every microsecond at most (a million tokens/s): below that the rounding shows.
    assume(arrivals[-1] == arrivals[0] or arrivals[-1] - arrivals[0] >= 1000 * len(arrivals))
    rates = call_rates(arrivals, len(arrivals), total_ms=2000.0)
    if rates.tokens_per_sec is None:
        assert len(set(arrivals)) == 1 and rates.coalesced
    else:
        assert rates.tpot_ms is not None
        assert rates.tpot_ms * rates.tokens_per_sec == pytest.approx(1000.0, rel=1e-3)


def response(sent_ns: int, last_byte_ns: int) -> StreamedResponse:
    return StreamedResponse(
        sent_ns, 200, {}, iter(()), chunks_received=3, last_byte_ns=last_byte_ns
    )


def test_a_call_keeps_ttft_total_and_chunks_and_gets_its_rates() -> None:
    measurement = CallMeasurement(completion_tokens=4, finish_reason="length")
    finish_timing(measurement, response(0, 9 * MS), [2 * MS, 3 * MS, 4 * MS, 5 * MS])
    assert (measurement.first_delta_ms, measurement.total_duration_ms) == (2.0, 9.0)
    assert measurement.client_chunks == 4 and measurement.inter_chunk_ms == [1.0, 1.0, 1.0]
    assert measurement.tokens_per_sec == 1000.0 and measurement.e2e_tokens_per_sec == 444.444
    record = measurement.to_record()
    assert record["coalesced"] is False and record["content_reads"] == 4


def test_a_failed_call_keeps_its_partial_figures_but_no_rate() -> None:
    measurement = CallMeasurement(error="stream broke after 3 chunks: …")
    finish_timing(measurement, response(0, 6 * MS), [2 * MS, 3 * MS])
    assert (measurement.first_delta_ms, measurement.total_duration_ms) == (2.0, 6.0)
    assert measurement.client_chunks == 2
    assert measurement.tokens_per_sec is None and measurement.tpot_ms is None
    assert measurement.e2e_tokens_per_sec is None


def test_record_keeps_the_old_fields_in_their_order_and_adds_the_new_ones_after() -> None:
    fields = list(CallMeasurement().to_record())
    assert fields[:12] == [
        "first_delta_ms", "total_duration_ms", "prompt_tokens", "completion_tokens",
        "client_chunks", "tokens_per_sec", "tpot_ms", "inter_chunk_ms", "finish_reason",
        "backend", "error", "engine_timings",
    ]  # fmt: skip
    assert fields[12:19] == [
        "e2e_tokens_per_sec", "coalesced", "content_reads", "engine_tokens_per_sec",
        "engine_prompt_ms", "engine_total_ms", "system_fingerprint",
    ]  # fmt: skip
    # issue 12: the call's connection.
    assert fields[19:23] == ["connect_ms", "tls_handshake_ms", "connection_reused", "reconnected"]
    # issue 23: reasoning models alike on every engine, and the prefix cache.
    assert fields[23:27] == [
        "first_answer_ms", "reasoning_tokens", "answer_tokens", "cached_prompt_tokens",
    ]  # fmt: skip
    # issue 35: the token counts checked, and speculative decoding's draft tokens.
    assert fields[27:] == ["token_mismatch", "draft_tokens", "draft_accepted_tokens"]


def test_the_engines_token_count_is_checked_against_the_chunks_streamed() -> None:
    arrivals = [2 * MS, 3 * MS, 4 * MS, 5 * MS]
    agree = CallMeasurement(completion_tokens=4, finish_reason="length")
    finish_timing(agree, response(0, 9 * MS), arrivals)
    more = CallMeasurement(completion_tokens=7, finish_reason="length")
    finish_timing(more, response(0, 9 * MS), arrivals)
    # Ended on the end-of-sequence token: counted by the engine, streamed as no text.
    eos = CallMeasurement(completion_tokens=5, finish_reason="stop")
    finish_timing(eos, response(0, 9 * MS), arrivals)
    # One more than streamed is no stop token where the call ran to its length.
    cut = CallMeasurement(completion_tokens=5, finish_reason="length")
    finish_timing(cut, response(0, 9 * MS), arrivals)
    untold = CallMeasurement(finish_reason="length")
    finish_timing(untold, response(0, 9 * MS), arrivals)
    failed = CallMeasurement(completion_tokens=7, error="stream broke after 4 chunks")
    finish_timing(failed, response(0, 9 * MS), arrivals)
    assert [m.token_mismatch for m in (agree, more, eos, cut, untold, failed)] == [
        False, True, False, True, None, None,
    ]  # fmt: skip
    assert more.to_record()["token_mismatch"] is True


def test_multibyte_characters_and_a_reasoning_end_may_hold_more_tokens_than_chunks() -> None:
    """llama-server holds a token back until its character is whole, so a chunk with a character
    outside ASCII may carry two or more tokens; vLLM's reasoning parsers stream nothing for the
    end of thinking. Each such chunk (and one end of thinking) may count one token more; more
    chunks than tokens never agree."""
    from pytest_gpubench.measure.call_measurement import note_delta

    def streamed(texts: list[str], tokens: int, reasoning: int = 0) -> CallMeasurement:
        measurement = CallMeasurement(completion_tokens=tokens, finish_reason="length")
        arrivals = [(index + 2) * MS for index in range(len(texts))]
        for index, (text, at) in enumerate(zip(texts, arrivals, strict=True)):
            note_delta(measurement, at, reasoning=index < reasoning, answer=index >= reasoning,
                       text=text)  # fmt: skip
        finish_timing(measurement, response(0, 30 * MS), arrivals)
        return measurement

    accents = ["ca", "fé", " et", " crème"]
    assert streamed(accents, 6).token_mismatch is False  # two chunks of two tokens each
    assert streamed(accents, 7).token_mismatch is True
    assert streamed(["a", "b", "c"], 4).token_mismatch is True  # ASCII: one token a chunk
    assert streamed(["think", "ing", "Paris"], 4, reasoning=2).token_mismatch is False
    assert streamed(["a", "b", "c"], 2).token_mismatch is True  # more chunks than tokens
