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
            result = (
                f"saturation {fixed(saturation)} req/s"
                if saturation is not None
                else (load.get("error") or "no step met the SLO")
            )
            rows.append(
                [
                    plain(load.get("prompt_id")),
                    "sweep",
                    *([NONE] * (10 + extras)),
                    result + sweep_stop_text(load.get("saturation_stop")),
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
                f"{load.get('ok', 0)} / {load.get('errors', 0)} / {load.get('timeouts', 0)}"
                if "ok" in load or "requests" in load
                else NONE,  # a point that lost a client process counts nothing
                f"{fixed(load.get('send_lag_ms_p99'), 3)} / "
                f"{fixed(load.get('send_lag_ms_max'), 3)}",
                result,
            ]
        )
    return rows


def slice_rate_spread(load: Mapping[str, Any]) -> tuple[float, float, int] | None:
    """A point's slices' output tokens/s: (lowest, highest, how many slices had one); None
    without slices (no slice_s)."""
    slices = load.get("slices")
    rates = [
        float(piece["output_tokens_per_sec"])
        for piece in (slices if isinstance(slices, list) else [])
        if isinstance(piece, Mapping)
        and isinstance(piece.get("output_tokens_per_sec"), int | float)
    ]
    return (min(rates), max(rates), len(rates)) if rates else None


def sweep_stop_text(stop: Any) -> str:
    """`; over-saturated at <rate> req/s (<step>), <n> higher rates not run (<s> s kept)`, or
    nothing where the sweep ran every rate."""
    if not isinstance(stop, Mapping):
        return ""
    skipped = len(stop.get("skipped") or ())
    return (
        f"; over-saturated at {fixed(stop.get('rate'))} req/s ({plain(stop.get('load_point'))}),"
        f" {skipped} higher rate{'' if skipped == 1 else 's'} not run"
        f" ({fixed(stop.get('time_kept_s'), 1)} s kept)"
    )


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


# -- each percentile's interval -----------------------------------------------------------------

INTERVAL_FIGURES = {
    "ttft_ms": "TTFT",
    "tpot_ms": "TPOT",
    "itl_ms": "ITL",
    "e2e_ms": "E2E",
    "first_answer_ms": "first answer",
}
INTERVAL_HEADERS = ("point", "figure", "n", "p50 [CI] ms", "p90 [CI] ms", "p99 [CI] ms")


def _with_interval(value: Any, bounds: Any, few: bool) -> str:
    if value is None:
        return NONE
    low, high = bounds if isinstance(bounds, list | tuple) and len(bounds) == 2 else (None, None)
    side = [fixed(low) if low is not None else "open", fixed(high) if high is not None else "open"]
    return f"{fixed(value)} [{side[0]}, {side[1]}]" + (" too few" if few else "")


def percentile_interval_rows(loads: Iterable[LoadRecord]) -> list[list[str]]:
    """One row per point and figure with samples: its n, and each percentile with its interval
    (an open side where the sample cannot bound it; `too few` then, the percentile drawn from
    fewer requests than its interval needs)."""
    rows = []
    for load in loads:
        intervals = load.get("percentile_intervals")
        if load.get("pattern") == "sweep" or not isinstance(intervals, Mapping):
            continue
        too_few = set(intervals.get("too_few") or ())
        for name, label in INTERVAL_FIGURES.items():
            if name == "first_answer_ms" and load.get("reasoning_tokens_p50") is None:
                continue  # no reasoning: its first answer is its TTFT, shown above
            figure = intervals.get(name)
            if not isinstance(figure, Mapping) or not figure.get("n"):
                continue
            cells = [
                _with_interval(
                    load.get(f"{name}_p{q}"), figure.get(f"p{q}"), f"{name}_p{q}" in too_few
                )
                for q in (50, 90, 99)
            ]
            rows.append([plain(load.get("load_point")), label, str(figure["n"]), *cells])
    return rows


def render_percentile_intervals(loads: Sequence[LoadRecord], *, markdown: bool = False) -> str:
    """Each point's percentiles with their confidence intervals and n; empty when no point has
    them (a ledger written before they were recorded)."""
    rows = percentile_interval_rows(loads)
    if not rows:
        return ""
    confidence = next(
        (
            load["percentile_intervals"].get("confidence")
            for load in loads
            if isinstance(load.get("percentile_intervals"), Mapping)
        ),
        None,
    )
    headers = tuple(
        header.replace("CI", f"{confidence:.0%} CI") if isinstance(confidence, float) else header
        for header in INTERVAL_HEADERS
    )
    text = table(rows, headers, markdown=markdown)
    if any(cell.endswith(" too few") for row in rows for cell in row):
        fewest = next(
            (
                load["percentile_intervals"].get("fewest")
                for load in loads
                if isinstance(load.get("percentile_intervals"), Mapping)
            ),
            None,
        )
        needs = (
            " (" + ", ".join(f"{q}: {n}" for q, n in fewest.items()) + ")"
            if isinstance(fewest, Mapping)
            else ""
        )
        text += (
            ("\n\n" if markdown else "\n")
            + "too few: fewer samples than the interval needs"
            + needs
            + "; the sample does not "
            "bound that percentile (a p99 from under a few hundred requests is about the maximum)"
        )
    return text


# -- the LoRA adapters' split -------------------------------------------------------------------

ADAPTER_HEADERS = (
    "point",
    "adapter",
    "requests",
    "errors",
    "TTFT p50 / p99 ms",
    "E2E p50 / p99 ms",
)


def adapter_split_rows(loads: Iterable[LoadRecord]) -> list[list[str]]:
    """One row per point and LoRA adapter of a cell that chooses them per request: its
    measured requests, errors and latency percentiles."""
    rows = []
    for load in loads:
        split = load.get("lora_split")
        if load.get("pattern") == "sweep" or not isinstance(split, list):
            continue
        for row in split:
            rows.append(
                [
                    plain(load.get("load_point")),
                    plain(row.get("adapter")),
                    str(row.get("requests", NONE)),
                    str(row.get("errors", NONE)),
                    f"{fixed(row.get('ttft_ms_p50'))} / {fixed(row.get('ttft_ms_p99'))}",
                    f"{fixed(row.get('e2e_ms_p50'))} / {fixed(row.get('e2e_ms_p99'))}",
                ]
            )
    return rows


def render_adapter_split(loads: Sequence[LoadRecord], *, markdown: bool = False) -> str:
    """Each point's requests and latency per LoRA adapter; empty where no point chose any."""
    rows = adapter_split_rows(loads)
    return table(rows, ADAPTER_HEADERS, markdown=markdown) if rows else ""
