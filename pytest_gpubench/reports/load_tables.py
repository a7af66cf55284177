"""The load points' tables, for the terminal, Markdown and the pull request summary: each
point's figures, and the engine's own figures checked against the client's. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pytest_gpubench.reports.formatting import NONE, fixed, plain, shortened, table

if TYPE_CHECKING:
    # The record types import the measurement's (h11, pydantic): not at the end of a session
    # that measured nothing (the terminal summary).
    from pytest_gpubench.ledger.schema import LoadRecord


# -- load cases -------------------------------------------------------------------------------

LOAD_HEADERS = (
    "prompt",
    "point",
    "offered req/s",
    "req/s",
    "out tok/s",
    "TTFT p50 / p99 ms",
    "TPOT p50 / p99 ms",
    "ITL p99 ms",
    "E2E p99 ms",
    "goodput req/s",
    "ok / err / timeout",
    "send lag p99 / max ms",
    "result",
)


# Beside the TTFT where a point has them: the engine's prefix-cache hit rate (a `prefix:`
# workload's cache, vLLM's counters or llama.cpp's cache_n) and a reasoning model's first answer.
LOAD_PREFIX_HEADERS = ("prefix cache hit",)
LOAD_REASONING_HEADERS = ("first answer p50 / p99 ms", "reasoning tok p50")
# Where the engine drafted over some point (speculative decoding, issue 35): its acceptance rate
# and mean acceptance length from the engine's counters over the point.
LOAD_DRAFT_HEADERS = ("draft accepted",)


def _load_extras(loads: Sequence[Mapping[str, Any]]) -> tuple[bool, bool, bool]:
    """(some point has a prefix-cache hit rate, some point reasoned, some point drafted)."""
    return (
        any(load.get("prefix_cache_hit_rate") is not None for load in loads),
        any(load.get("reasoning_tokens_p50") is not None for load in loads),
        any(load.get("spec_acceptance_rate") is not None for load in loads),
    )


def load_headers(loads: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """LOAD_HEADERS, with the prefix-cache, reasoning and draft columns after the TTFT where
    some point has them."""
    prefix, reasoning, draft = _load_extras(list(loads))
    at = LOAD_HEADERS.index("TTFT p50 / p99 ms") + 1
    extra = (
        *(LOAD_PREFIX_HEADERS if prefix else ()),
        *(LOAD_REASONING_HEADERS if reasoning else ()),
        *(LOAD_DRAFT_HEADERS if draft else ()),
    )
    return (*LOAD_HEADERS[:at], *extra, *LOAD_HEADERS[at:])


def _load_extra_cells(
    load: Mapping[str, Any], prefix: bool, reasoning: bool, draft: bool
) -> list[str]:
    cells = []
    if prefix:
        rate = load.get("prefix_cache_hit_rate")
        cells.append(f"{rate:.1%}" if isinstance(rate, int | float) else NONE)
    if reasoning:
        cells.append(
            f"{fixed(load.get('first_answer_ms_p50'))} / {fixed(load.get('first_answer_ms_p99'))}"
            if load.get("reasoning_tokens_p50") is not None
            else NONE
        )
        cells.append(fixed(load.get("reasoning_tokens_p50"), 0))
    if draft:
        rate, length = load.get("spec_acceptance_rate"), load.get("spec_mean_acceptance_length")
        cells.append(
            f"{rate:.0%} (mean length {fixed(length)})" if isinstance(rate, int | float) else NONE
        )
    return cells


def load_rows(loads: Iterable[LoadRecord]) -> list[list[str]]:
    """One row per load point (a sweep: per step, then the sweep's saturation point), in the
    columns of load_headers."""
    loads = list(loads)
    prefix, reasoning, draft = _load_extras(loads)
    extras = int(prefix) + 2 * int(reasoning) + int(draft)
    rows = []
    for load in loads:
        if load.get("pattern") == "sweep":
            saturation = load.get("saturation_rate")
            rows.append(
                [
                    plain(load.get("prompt_id")),
                    "sweep",
                    *([NONE] * (10 + extras)),
                    f"saturation {fixed(saturation)} req/s"
                    if saturation is not None
                    else (load.get("error") or "no step met the SLO"),
                ]
            )
            continue
        result = (
            "ok"
            if load.get("valid")
            else f"INVALID: {shortened(str(load.get('invalid_reason')), 60)}"
        )
        rows.append(
            [
                plain(load.get("prompt_id")),
                plain(load.get("load_point")),
                fixed(load.get("offered_rate")),
                fixed(load.get("achieved_rate")),
                fixed(load.get("output_tokens_per_sec"), 1),
                f"{fixed(load.get('ttft_ms_p50'))} / {fixed(load.get('ttft_ms_p99'))}",
                *_load_extra_cells(load, prefix, reasoning, draft),
                f"{fixed(load.get('tpot_ms_p50'))} / {fixed(load.get('tpot_ms_p99'))}",
                fixed(load.get("itl_ms_p99")),
                fixed(load.get("e2e_ms_p99")),
                fixed(load.get("goodput_rate")),
                f"{load.get('ok', 0)} / {load.get('errors', 0)} / {load.get('timeouts', 0)}",
                f"{fixed(load.get('send_lag_ms_p99'), 3)} / "
                f"{fixed(load.get('send_lag_ms_max'), 3)}",
                result,
            ]
        )
    return rows


def render_load_table(loads: Iterable[LoadRecord], *, markdown: bool = False) -> str:
    loads = list(loads)
    return table(load_rows(loads), load_headers(loads), markdown=markdown)


SERVER_CHECK_HEADERS = (
    "point",
    "engine",
    "TTFT client / engine / offset ms",
    "TPOT client / engine / offset ms",
    "E2E client / engine / offset ms",
    "coalesced",
    "n TTFT / TPOT",
)


def _against(figure: Any) -> str:
    if not isinstance(figure, Mapping):
        return NONE
    offset = figure.get("offset_ms")
    return f"{fixed(figure.get('client_mean'))} / {fixed(figure.get('server_mean'))} / " + (
        NONE if offset is None else f"{offset:+.2f}"
    )


def server_check_rows(loads: Iterable[LoadRecord]) -> list[list[str]]:
    """One row per load point: the client's means beside the engine's own over the same point,
    the replies that came whole in one read, and the `n` behind the percentiles."""
    rows = []
    for load in loads:
        if load.get("pattern") == "sweep":
            continue
        check = load.get("server_check") or {}
        rows.append(
            [
                plain(load.get("load_point")),
                plain(check.get("engine")),
                _against(check.get("ttft_ms")),
                _against(check.get("tpot_ms")),
                _against(check.get("e2e_ms")),
                f"{load.get('coalesced_calls', NONE)} of {load.get('ok', 0)}",
                f"{load.get('ttft_ms_n', NONE)} / {load.get('tpot_ms_n', NONE)}",
            ]
        )
    return rows


def render_server_check(loads: Sequence[LoadRecord], *, markdown: bool = False) -> str:
    """The client against the engine per point; empty when no point has either figure (a ledger
    written before they were recorded)."""
    if not any("coalesced_calls" in load or load.get("server_check") for load in loads):
        return ""
    return table(server_check_rows(loads), SERVER_CHECK_HEADERS, markdown=markdown)
