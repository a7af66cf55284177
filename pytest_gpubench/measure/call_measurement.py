"""What one call measured, in the units of docs/metrics.md (`CallMeasurement`, and the fields of
its call record), and what is derived from its content's arrival times alone: its rates, and
whether the engine's token count agrees with the chunks it streamed; each delta as a stream
parser notes it. Pure: the stream (measure/stream.py) stamps the arrivals and fills it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict


class MeasurementFields(TypedDict):
    """A call record's measured fields (CallMeasurement.to_record; ledger/schema.py CallRecord)."""

    first_delta_ms: float | None
    total_duration_ms: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    client_chunks: int
    tokens_per_sec: float | None
    tpot_ms: float | None
    inter_chunk_ms: list[float]
    finish_reason: str
    backend: str
    error: str | None
    engine_timings: dict[str, object]
    e2e_tokens_per_sec: float | None
    coalesced: bool
    content_reads: int
    engine_tokens_per_sec: float | None
    engine_prompt_ms: float | None
    engine_total_ms: float | None
    system_fingerprint: str | None
    connect_ms: float | None
    tls_handshake_ms: float | None
    connection_reused: bool
    reconnected: bool
    first_answer_ms: float | None
    reasoning_tokens: int | None
    answer_tokens: int | None
    cached_prompt_tokens: int | None
    token_mismatch: bool | None
    draft_tokens: int | None
    draft_accepted_tokens: int | None


class KindFields(TypedDict, total=False):
    """A call record's fields of a request kind other than chat (CallMeasurement.kind_fields)."""

    kind: str
    inputs: int
    inputs_per_sec: float | None
    tool_calls: int
    tool_call_valid: int | None
    schema_valid: int | None


@dataclass
class CallMeasurement:
    """What one call measured, in the units of docs/metrics.md."""

    first_delta_ms: float | None = None
    total_duration_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    client_chunks: int = 0
    tokens_per_sec: float | None = None
    tpot_ms: float | None = None
    inter_chunk_ms: list[float] = field(default_factory=list)
    finish_reason: str = "error"
    backend: str = ""
    error: str | None = None
    engine_timings: dict[str, Any] = field(default_factory=dict)
    # Added with the decode-rate definition of issue 11; a record that has `coalesced` carries
    # `tokens_per_sec` and `tpot_ms` under that definition (older ledgers do not).
    e2e_tokens_per_sec: float | None = None
    coalesced: bool = False
    content_reads: int = 0
    # The engine's own figures, normalised from engine_timings (None where it reports none).
    engine_tokens_per_sec: float | None = None
    engine_prompt_ms: float | None = None
    engine_total_ms: float | None = None
    # An OpenAI-compatible stream's backend configuration (its chunks' system_fingerprint).
    system_fingerprint: str | None = None
    # The answer: the content deltas joined (reasoning text left out). Handed to the test that
    # made the call (gpubench_engine.chat), never written to the ledger: an answer may be long,
    # and may hold what the prompt gave the model.
    text: str = ""
    # The call's connection (issue 12): opened for it (connect and TLS handshake ms, outside
    # the timed span) or kept alive from the previous call; `reconnected` when a kept-alive
    # connection had been dropped and was reopened once before the clock started.
    connect_ms: float | None = None
    tls_handshake_ms: float | None = None
    connection_reused: bool = False
    reconnected: bool = False
    # Reasoning models (issue 23), alike on every engine: first_delta_ms is the first token of
    # any kind; first_answer_ms the first answer (content) token after any reasoning; the
    # completion split into reasoning and answer tokens (reasoning from the engine's usage
    # where it gives it, else its reasoning chunks counted).
    first_answer_ms: float | None = None
    reasoning_tokens: int | None = None
    answer_tokens: int | None = None
    # Prompt tokens the engine served from its prefix cache (llama.cpp's timings.cache_n, else
    # usage.prompt_tokens_details.cached_tokens); None where it says nothing.
    cached_prompt_tokens: int | None = None
    # The client's count of streamed tokens against the engine's usage (issue 35, token_check):
    # True where they disagree (token_counts_agree), None where the engine sent no count or the
    # call failed.
    token_mismatch: bool | None = None
    # Speculative decoding (llama.cpp's timings.draft_n and draft_n_accepted): the tokens the
    # draft model proposed over the call and those the target model accepted; None where the
    # engine says nothing.
    draft_tokens: int | None = None
    draft_accepted_tokens: int | None = None
    # The request kind (config/prompts.py `kind:`) and what only some kinds have (issue 35): an
    # embedding request's inputs and inputs/s; the tool calls a `tools` call streamed (name and
    # arguments text; not recorded); whether a tools or json_schema answer was valid (1 or 0,
    # measure/validity.py). None where the kind has no such figure: left out of the record.
    kind: str = "chat"
    inputs: int | None = None
    inputs_per_sec: float | None = None
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    tool_call_valid: int | None = None
    schema_valid: int | None = None
    # Filled by the stream parsers, turned into the figures above by finish_timing.
    first_answer_ns: int = 0
    reasoning_chunks: int = 0
    answer_chunks: int = 0
    # Chunks whose text has a character outside ASCII: an engine that holds back a token until
    # its character is whole (llama-server) sends two or more tokens in such a chunk.
    multibyte_chunks: int = 0

    def to_record(self) -> MeasurementFields:
        return {
            "first_delta_ms": self.first_delta_ms,
            "total_duration_ms": self.total_duration_ms,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "client_chunks": self.client_chunks,
            "tokens_per_sec": self.tokens_per_sec,
            "tpot_ms": self.tpot_ms,
            "inter_chunk_ms": self.inter_chunk_ms,
            "finish_reason": self.finish_reason,
            "backend": self.backend,
            "error": self.error,
            "engine_timings": self.engine_timings,
            "e2e_tokens_per_sec": self.e2e_tokens_per_sec,
            "coalesced": self.coalesced,
            "content_reads": self.content_reads,
            "engine_tokens_per_sec": self.engine_tokens_per_sec,
            "engine_prompt_ms": self.engine_prompt_ms,
            "engine_total_ms": self.engine_total_ms,
            "system_fingerprint": self.system_fingerprint,
            "connect_ms": self.connect_ms,
            "tls_handshake_ms": self.tls_handshake_ms,
            "connection_reused": self.connection_reused,
            "reconnected": self.reconnected,
            "first_answer_ms": self.first_answer_ms,
            "reasoning_tokens": self.reasoning_tokens,
            "answer_tokens": self.answer_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "token_mismatch": self.token_mismatch,
            "draft_tokens": self.draft_tokens,
            "draft_accepted_tokens": self.draft_accepted_tokens,
        }

    def kind_fields(self) -> KindFields:
        """The request kind's own fields of the call record: none for a chat call (its record
        is as before kinds existed), else the kind and each of its figures that applies."""
        if self.kind == "chat":
            return {}
        fields: KindFields = {"kind": self.kind}
        if self.inputs is not None:
            fields["inputs"] = self.inputs
            fields["inputs_per_sec"] = self.inputs_per_sec
        if self.kind == "tools":
            fields["tool_call_valid"] = self.tool_call_valid
            fields["tool_calls"] = len(self.tool_calls)
        if self.kind == "json_schema":
            fields["schema_valid"] = self.schema_valid
        return fields


@dataclass(frozen=True)
class Rates:
    """A call's rates from its content arrival times (docs/metrics.md)."""

    tokens_per_sec: float | None
    tpot_ms: float | None
    e2e_tokens_per_sec: float | None
    coalesced: bool
    content_reads: int


def call_rates(
    content_arrivals_ns: Sequence[int], completion_tokens: int | None, total_ms: float | None
) -> Rates:
    """Decode tokens/s: the tokens after the first read over the time from it to the last.

    (n - k) / (last content arrival - first content arrival), n the server's completion_tokens
    (the client's content chunk count where the server sent no usage), k the content chunks that
    came in the first read. With one chunk per read k = 1: n tokens, n - 1 intervals. A larger k
    (chunks held back and sent together: a proxy, a late client read) would otherwise put k - 1
    tokens that took no time of their own into the span and make the rate read high. Content
    that arrived in a single read spans no time: the call is `coalesced` and has no decode rate;
    its end-to-end rate, n / total, still stands.
    """
    arrivals = content_arrivals_ns
    tokens = len(arrivals) if completion_tokens is None else completion_tokens
    reads = len(set(arrivals))
    coalesced = reads == 1
    decode = tpot = e2e = None
    if not coalesced and arrivals:
        span_ns = arrivals[-1] - arrivals[0]
        decoded = tokens - arrivals.count(arrivals[0])
        if decoded > 0 and span_ns > 0:
            decode = round(decoded / (span_ns / 1e9), 3)
            tpot = round(span_ns / 1e6 / decoded, 6)
    if total_ms and total_ms > 0 and tokens > 0:
        e2e = round(tokens / (total_ms / 1000.0), 3)
    return Rates(decode, tpot, e2e, coalesced, reads)


def token_mismatch(
    chunks: int, completion_tokens: int | None, finish_reason: str, slack: int = 0
) -> bool | None:
    """Whether the engine's count of the tokens it generated (usage.completion_tokens, Ollama's
    eval_count) disagrees with the client's: the content (and reasoning) chunks it streamed, one
    token each. A call that ended on the model's end-of-sequence token (`stop`) may count one
    token more, which streams no text; `slack`: how many more tokens than chunks the stream may
    hold otherwise (multibyte characters, a reasoning parser's end of thinking). More chunks
    than tokens never agree. None where the engine sent no count."""
    if isinstance(completion_tokens, bool) or not isinstance(completion_tokens, int):
        return None
    allowed = slack + (1 if finish_reason == "stop" else 0)
    return not chunks <= completion_tokens <= chunks + allowed


def note_delta(
    measurement: CallMeasurement, arrived_ns: int, *, reasoning: bool, answer: bool, text: str = ""
) -> None:
    """One streamed delta that carried reasoning text, answer text, or both."""
    if not text.isascii():
        measurement.multibyte_chunks += 1
    if reasoning:
        measurement.reasoning_chunks += 1
    if answer:
        measurement.answer_chunks += 1
        if not measurement.first_answer_ns:
            measurement.first_answer_ns = arrived_ns
