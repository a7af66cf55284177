"""The warm calls' checks against the engine (results/engine_checks.py) as a table beside the
figures, and the warnings they call for: token counts that disagree, warm calls served from
the prefix cache although the request asked for none, and an engine waiting for its own threads.
Pure: summaries in, text out."""

from __future__ import annotations

from collections.abc import Iterable

from pytest_gpubench.config.engine_series import ENGINE_COUNTERS
from pytest_gpubench.reports.formatting import NONE, table
from pytest_gpubench.results.engine_checks import EngineChecks, mismatch_words

ENGINE_CHECK_HEADERS = (
    "cell",
    "prompt",
    "token counts",
    "prefix cache",
    "engine counters",
    "draft accepted",
)
# Shown in the counters column: the prefix cache and the draft have columns of their own.
_SHOWN = tuple(counter.name for counter in ENGINE_COUNTERS if counter.shown)
_LABELS = {counter.name: counter.label for counter in ENGINE_COUNTERS}


def _tokens(checks: EngineChecks) -> str:
    if not checks.token_checked:
        return NONE
    if not checks.token_mismatches:
        return f"{checks.token_checked}/{checks.token_checked} agree"
    return f"{checks.token_mismatches} of {checks.token_checked} differ"


def _cache(checks: EngineChecks) -> str:
    if not checks.cache_known:
        return NONE
    text = f"{checks.cache_hits}/{checks.cache_known} hit"
    hits, queries = (
        checks.counters.get("prefix_cache_hits"),
        checks.counters.get("prefix_cache_queries"),
    )
    if hits is not None and queries:
        text += f" ({hits:g}/{queries:g} tokens)"
    if checks.unwanted_cache_hits:
        text += " ASKED OFF"
    return text


def _counters(checks: EngineChecks) -> str:
    shown = [
        f"{_LABELS[name]} {checks.counters[name]:g}" for name in _SHOWN if name in checks.counters
    ]
    return ", ".join(shown) or NONE


def _draft(checks: EngineChecks) -> str:
    acceptance = checks.acceptance
    if acceptance is None:
        return NONE
    accepted, proposed = acceptance
    return f"{accepted:g}/{proposed:g} ({accepted / proposed:.0%})"


def engine_check_rows(checks: Iterable[EngineChecks]) -> list[list[str]]:
    return [
        [c.cell_id, c.prompt_id, _tokens(c), _cache(c), _counters(c), _draft(c)]
        for c in checks
        if c.shown
    ]


def render_engine_checks(checks: Iterable[EngineChecks], *, markdown: bool = False) -> str:
    """The table (the terminal's, or a Markdown one), or "" where the engines told nothing to
    check against."""
    rows = engine_check_rows(checks)
    return table(rows, ENGINE_CHECK_HEADERS, markdown=markdown) if rows else ""


def engine_check_warnings(checks: Iterable[EngineChecks]) -> list[str]:
    """One line per (cell, prompt) whose token counts disagree, per one whose warm calls the
    prefix cache served although the request asked for none (their TTFT is no prefill), and per
    one whose engine waited for its own threads (EngineChecks.own_threads)."""
    lines: list[str] = []
    for found in checks:
        where = f"{found.cell_id} {found.prompt_id}"
        if found.token_mismatches:
            lines.append(f"TOKEN COUNTS: {where}: {mismatch_words(found)}")
        if found.unwanted_cache_hits:
            lines.append(
                f"PREFIX CACHE: {where}: {found.unwanted_cache_hits} of {found.cache_known} warm "
                "calls were served from the engine's prefix cache although the request asked "
                "for none: their TTFT is not a prefill (the engine ignores the request's "
                "switch; vLLM: cache_salt: per_call, or --no-enable-prefix-caching)"
            )
        if found.own_threads:
            lines.append(
                f"OWN THREADS: {where}: the engine kept every CPU it may use "
                f"{found.cpus_filled:.0%} busy and its threads waited {found.engine_wait:.2f} ms "
                "for a CPU per ms they ran: with more compute threads than CPUs they wait for "
                "each other, which the gate reads as a busy machine; give the engine as many "
                "CPUs as threads (taskset -c, --threads) and leave one to the client "
                "(docs/gate-noise.md)"
            )
    return lines
