"""The run's short Markdown summary for a pull request: the exit status, the verdicts that
matter (regressions first), the cells' status, the load points, and where the full report is;
appended to `$GITHUB_STEP_SUMMARY` in a GitHub Actions job (its summary page), written beside
the ledger otherwise."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpubench.core.status import describe
from pytest_gpubench.results.steadiness import signed_percent

if TYPE_CHECKING:
    # The record types import the measurement's (h11, pydantic): not at the end of a session
    # that measured nothing.
    from pytest_gpubench.ledger.outcomes import CellOutcomeRecord
    from pytest_gpubench.ledger.schema import (
        EndRecord,
        LoadRecord,
        VerdictRecord,
    )
    from pytest_gpubench.results.engine_checks import EngineChecks
    from pytest_gpubench.results.stats import PromptSummary

STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"
# Verdict words in the order a reviewer needs them; a word not listed here (a newer gate's)
# comes after these, and `ok` rows are only counted.
VERDICT_RANK = ("regression", "incomparable", "inconclusive", "win", "new")
MAX_VERDICT_ROWS = 15
NONE = "-"


def _md(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _number(value: Any, digits: int = 2) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return NONE
    return f"{value:.{digits}f}"


def _change(ratio: Any) -> str:
    if isinstance(ratio, bool) or not isinstance(ratio, int | float):
        return NONE
    return signed_percent(ratio)


def _p_value(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return NONE
    return f"{value:.2g}"


def _rank(verdict: VerdictRecord) -> int:
    word = str(verdict.get("verdict"))
    return VERDICT_RANK.index(word) if word in VERDICT_RANK else len(VERDICT_RANK)


def verdict_section(verdicts: Sequence[VerdictRecord]) -> list[str]:
    """The verdicts other than `ok`, regressions first, at most MAX_VERDICT_ROWS of them."""
    shown = sorted((v for v in verdicts if v.get("verdict") != "ok"), key=_rank)
    ok = len(verdicts) - len(shown)
    if not verdicts:
        return ["No verdicts: nothing was judged against a baseline."]
    lines = [
        "| verdict | cell | case | metric | change | p |",
        "|---|---|---|---|---:|---:|",
    ]
    for verdict in shown[:MAX_VERDICT_ROWS]:
        word = str(verdict.get("verdict"))
        lines.append(
            f"| {'**' + word.upper() + '**' if word == 'regression' else word} "
            f"| {_md(verdict.get('cell_id'))} | {_md(verdict.get('prompt_id'))} "
            f"| {_md(verdict.get('metric'))} | {_change(verdict.get('change_ratio'))} "
            f"| {_p_value(verdict.get('p_value'))} |"
        )
    rest = len(shown) - MAX_VERDICT_ROWS
    notes = []
    if rest > 0:
        notes.append(f"{rest} more not shown")
    notes.append(f"{ok} within their thresholds")
    return [*(lines if shown else []), "", f"_{'; '.join(notes)}._"]


def cells_section(cells: Sequence[CellOutcomeRecord]) -> list[str]:
    if not cells:
        return []
    lines = ["| cell | status | calls ok | reason |", "|---|---|---:|---|"]
    for cell in cells:
        reason = cell.get("reason") or NONE
        lines.append(
            f"| {_md(cell.get('cell_id'))} | {_md(cell.get('status'))} "
            f"| {cell.get('ok_calls', 0)}/{cell.get('calls', 0)} | {_md(reason)[:120]} |"
        )
    return lines


def _p99(load: Mapping[str, Any], name: str) -> tuple[str, bool]:
    """`27.81 [26.28, open]` (the p99 and its confidence interval, an open side where the
    sample cannot bound it; `*` then: too few requests), and whether it was too few."""
    value = load.get(f"{name}_p99")
    intervals = load.get("percentile_intervals")
    if not isinstance(value, int | float) or not isinstance(intervals, Mapping):
        return _number(value), False
    figure = intervals.get(name)
    bounds = figure.get("p99") if isinstance(figure, Mapping) else None
    if not isinstance(bounds, list | tuple) or len(bounds) != 2:
        return _number(value), False
    low, high = (_number(b) if b is not None else "open" for b in bounds)
    few = f"{name}_p99" in (intervals.get("too_few") or ())
    return f"{_number(value)} [{low}, {high}]" + ("\\*" if few else ""), few


def _slices(load: Mapping[str, Any]) -> str:
    """The slices' output tokens/s, lowest to highest, and how many (`-` without slice_s)."""
    from pytest_gpubench.reports.load_tables import slice_rate_spread

    spread = slice_rate_spread(load)
    if spread is None:
        return NONE
    low, high, count = spread
    return f"{_number(low, 1)} to {_number(high, 1)} ({count})"


def _trend(load: Mapping[str, Any]) -> str:
    """`; queue rising` where an open-loop point's TTFT and requests in flight both rose."""
    trend = load.get("trend")
    if not isinstance(trend, Mapping) or not trend.get("saturated"):
        return ""
    return (
        f"; queue rising (TTFT τ {_number(trend.get('ttft_tau'))}, "
        f"in flight τ {_number(trend.get('in_flight_tau'))})"
    )


def load_section(loads: Sequence[LoadRecord]) -> list[str]:
    """One row per load point (a sweep's saturation rate, and where it stopped rising, as its
    own row): its p99s with their confidence intervals and n, its slices' throughput spread,
    its queue trend; then each point's delivery warnings, and what `*` means."""
    from pytest_gpubench.reports.load_tables import sweep_stop_text

    if not loads:
        return []
    confidence = next(
        (
            intervals.get("confidence")
            for intervals in (load.get("percentile_intervals") for load in loads)
            if isinstance(intervals, Mapping)
        ),
        None,
    )
    ci = f"{confidence:.0%} CI" if isinstance(confidence, float) else "CI"
    lines = [
        f"| cell | point | req/s | out tok/s | slices out tok/s | n | TTFT p99 [{ci}] ms "
        f"| TPOT p99 [{ci}] ms | goodput req/s | result |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    warnings = []
    any_few = False
    for load in loads:
        cell, point = _md(load.get("cell_id")), _md(load.get("load_point"))
        if load.get("pattern") == "sweep":
            rate = load.get("saturation_rate")
            result = f"saturation {_number(rate)} req/s" if rate is not None else NONE
            result += _md(sweep_stop_text(load.get("saturation_stop")))
            lines.append(f"| {cell} | sweep | | | | | | | | {result} |")
            continue
        result = "ok" if load.get("valid") else f"INVALID: {_md(load.get('invalid_reason'))[:80]}"
        result += _trend(load)
        if load.get("delivery_warnings"):
            result += " ⚠"
            warnings += [
                f"- ⚠ {cell} {point}: {_md(w)}" for w in load.get("delivery_warnings") or []
            ]
        (ttft, few_ttft), (tpot, few_tpot) = _p99(load, "ttft_ms"), _p99(load, "tpot_ms")
        any_few = any_few or few_ttft or few_tpot
        lines.append(
            f"| {cell} | {point} | {_number(load.get('achieved_rate'))} "
            f"| {_number(load.get('output_tokens_per_sec'), 1)} | {_slices(load)} "
            f"| {load.get('ttft_ms_n') if load.get('ttft_ms_n') is not None else NONE} "
            f"| {ttft} | {tpot} | {_number(load.get('goodput_rate'))} | {result} |"
        )
    notes = (
        [
            "",
            "_\\* too few requests for the interval: the sample does not bound that p99 "
            "(a p99 from under a few hundred requests is about the maximum)._",
        ]
        if any_few
        else []
    )
    return [*lines, *notes, *(["", *warnings] if warnings else [])]


def kinds_section(summaries: Sequence[PromptSummary]) -> list[str]:
    """The request kinds' figures (the terminal's) of each (cell, prompt) that is not chat."""
    from pytest_gpubench.reports.formatting import table
    from pytest_gpubench.reports.terminal import KIND_HEADERS, kind_rows

    rows = kind_rows(summaries)
    return [table(rows, ("cell", "prompt", *KIND_HEADERS), markdown=True)] if rows else []


def engine_checks_section(checks: Sequence[EngineChecks]) -> list[str]:
    """The terminal's table of the checks against the engine, then its warnings."""
    from pytest_gpubench.reports.engine_checks_table import (
        engine_check_warnings,
        render_engine_checks,
    )

    rendered = render_engine_checks(checks, markdown=True)
    if not rendered:
        return []
    warnings = [f"- ⚠ {_md(line)}" for line in engine_check_warnings(checks)]
    return [rendered, *(["", *warnings] if warnings else [])]


def render_pr_summary(
    end: EndRecord,
    loads: Sequence[LoadRecord],
    *,
    ledger: str,
    report: str,
    summaries: Sequence[PromptSummary] = (),
    checks: Sequence[EngineChecks] = (),
) -> str:
    """The summary from a run's end record and its load records, and from its judgement the
    request kinds' figures and the checks against the engine; `report` says where the full
    report is (a link or a command)."""
    status = end.get("exit_status")
    regressions = int(end.get("regressions") or 0)
    mark = "❌" if status not in (0, None) else "✅"
    head = f"## {mark} gpubench: {describe(int(status)) if status is not None else 'no status'}"
    parts = [head]
    if regressions:
        parts.append(f"**{regressions} regression(s)**")
    if end.get("gate_error"):
        parts.append(f"Gate error: {_md(end['gate_error'])}")
    verdicts = list(end.get("verdicts") or [])
    parts.append("### Verdicts\n\n" + "\n".join(verdict_section(verdicts)))
    cells = cells_section(list(end.get("cells") or []))
    if cells:
        parts.append("### Cells\n\n" + "\n".join(cells))
    kinds = kinds_section(summaries)
    if kinds:
        parts.append("### Request kinds\n\n" + "\n".join(kinds))
    engine = engine_checks_section(checks)
    if engine:
        parts.append("### Checks against the engine\n\n" + "\n".join(engine))
    load = load_section(loads)
    if load:
        parts.append("### Load points\n\n" + "\n".join(load))
    parts.append(f"Ledger: `{ledger}` · Full report: {report}")
    return "\n\n".join(parts) + "\n"


def report_pointer(ledger: str, environ: Mapping[str, str]) -> str:
    """Where the HTML report is: the job's artifacts in a GitHub Actions run (the shipped
    workflow uploads report.html there), else the command that writes it."""
    command = f"`gpubench report --html {ledger} -o report.html`"
    server, repository, run = (
        environ.get("GITHUB_SERVER_URL"),
        environ.get("GITHUB_REPOSITORY"),
        environ.get("GITHUB_RUN_ID"),
    )
    if server and repository and run:
        link = f"{server}/{repository}/actions/runs/{run}"
        return f"[report.html in the run's artifacts]({link}) ({command})"
    return command


def write_pr_summary(
    text: str, ledger_dir: Path, run_id: str, environ: Mapping[str, str] | None = None
) -> Path:
    """Append to $GITHUB_STEP_SUMMARY when it is set (GitHub's documented way: every step may
    add to the file), else write `<run_id>.summary.md` beside the ledger; the path written."""
    env = os.environ if environ is None else environ
    target = env.get(STEP_SUMMARY_ENV)
    if target:
        path = Path(target)
        with path.open("a", encoding="utf-8") as out:
            out.write(text)
        return path
    path = ledger_dir / f"{run_id}.summary.md"
    path.write_text(text, encoding="utf-8")
    return path
