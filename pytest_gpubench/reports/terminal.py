"""The terminal at the end of a pytest session: the outcome of each cell, the summary table
with its verdicts and notes, A/B and load tables, the probe table and rented nodes (the
comparison of two runs is reports/comparison.py). Pure: text in, text out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tabulate import tabulate

from pytest_gpubench.config.metrics import VALIDITY
from pytest_gpubench.ledger.outcomes import CellOutcome
from pytest_gpubench.reports.engine_checks_table import (
    engine_check_warnings,
    render_engine_checks,
)
from pytest_gpubench.reports.formatting import (
    METRIC_LABELS,
    NONE,
    NOTEWORTHY,
    change,
    fixed,
    plain,
    shortened,
    success,
    table,
)
from pytest_gpubench.reports.load_tables import (
    render_adapter_split,
    render_load_table,
    render_percentile_intervals,
    render_server_check,
)
from pytest_gpubench.reports.telemetry_table import TELEMETRY_HEADERS, telemetry_rows
from pytest_gpubench.results.engine_checks import EngineChecks
from pytest_gpubench.results.gate import Verdict, incomparables, overall_by_key, regressions
from pytest_gpubench.results.judging import holds_back
from pytest_gpubench.results.metric import (
    ALL_METRIC_NAMES,
    GATED_METRICS,
    METRIC_NAMES,
    RATIO_METRICS,
    SUCCESS_RATE,
    reasoned,
)
from pytest_gpubench.results.stats import PromptSummary
from pytest_gpubench.targets.rentals import rental_text
from pytest_gpubench.telemetry.aggregate import TelemetrySummary

if TYPE_CHECKING:
    # The record types import the measurement's (h11, pydantic): not at the end of a session
    # that measured nothing (the terminal summary).
    from pytest_gpubench.ledger.schema import (
        LoadRecord,
    )


class ProbeRowLike(Protocol):
    """A cell's health as --probe found it (the run controller's ProbeRow)."""

    @property
    def cell_id(self) -> str: ...
    @property
    def engine_version(self) -> str | None: ...
    @property
    def model_digest(self) -> str | None: ...
    @property
    def status(self) -> str: ...


# -- the terminal summary ---------------------------------------------------------------------

# The gated figures' columns (config/metrics.GATED), their changes, and what the run could
# have seen of the first (TTFT).
SUMMARY_HEADERS = (
    "cell",
    "prompt",
    *(metric.figure.column for metric in RATIO_METRICS),
    "cold TTFT ms",
    "cold total ms",
    "coalesced",
    "success",
    "Δ " + " / ".join(metric.figure.short for metric in RATIO_METRICS),
    f"could detect Δ {RATIO_METRICS[0].figure.short}",
    "verdict",
)


# A reasoning model's columns (issue 23), after the decode rate; only in a table where some
# (cell, prompt) reasoned: a model that does not reason gets no empty columns.
REASONING_HEADERS = ("first answer p50 ms", "Δ first answer", "reasoning tok p50")


def reasoning_shown(summaries: Iterable[PromptSummary]) -> bool:
    """Whether some (cell, prompt) reasoned: the reasoning columns are shown."""
    return any(reasoned(summary) for summary in summaries)


# The request kinds' columns (issue 35), after the success rate; only in a table where some
# (cell, prompt) is of a kind other than chat.
KIND_HEADERS = ("kind", "inputs/s p50", "valid")


def kinds_shown(summaries: Iterable[PromptSummary]) -> bool:
    """Whether some (cell, prompt) is of a request kind other than chat."""
    return any(summary.kind != "chat" for summary in summaries)


def kind_rows(summaries: Iterable[PromptSummary]) -> list[list[str]]:
    """The KIND_HEADERS of each (cell, prompt) of a kind other than chat, after its cell and
    prompt (the Markdown, HTML and pull request reports' table of request kinds)."""
    return [
        [summary.cell_id, summary.prompt_id, *kind_cells(summary)]
        for summary in sorted(summaries, key=lambda item: item.key)
        if summary.kind != "chat"
    ]


def summary_headers(summaries: Iterable[PromptSummary]) -> tuple[str, ...]:
    """SUMMARY_HEADERS, with the reasoning columns where some (cell, prompt) reasoned and the
    request kinds' where some is not chat."""
    summaries = list(summaries)
    headers = SUMMARY_HEADERS
    if kinds_shown(summaries):
        at = headers.index("success") + 1
        headers = (*headers[:at], *KIND_HEADERS, *headers[at:])
    if not reasoning_shown(summaries):
        return headers
    at = 2 + len(RATIO_METRICS)
    return (*headers[:at], *REASONING_HEADERS, *headers[at:])


def kind_cells(summary: PromptSummary) -> list[str]:
    """The request kind, an embedding's inputs/s, a tools or json_schema prompt's valid answers
    (`3/3 tool calls`); `-` where the figure does not apply. The valid answers need the
    summary's samples."""
    valid = NONE
    for rate in VALIDITY:
        values = summary.samples[rate.measure]
        if values:
            valid = f"{int(sum(values))}/{len(values)} {rate.column}"
    return [summary.kind, fixed(summary.figure("inputs_per_sec", "p50"), 1), valid]


def summary_rows(
    summaries: Iterable[PromptSummary], verdicts: Iterable[Verdict], *, accepted: bool = False
) -> list[list[str]]:
    """One row per (cell, prompt): warm numbers, the first cold call, the change against the
    baseline, the verdict (the columns of summary_headers). `accepted`: --baseline-update."""
    summaries = list(summaries)
    verdicts = list(verdicts)
    by_key = _verdicts_by_key(verdicts)
    worst: Mapping[tuple[str, str], str] = overall_by_key(verdicts)
    if accepted:
        worst = {key: _ratified(kind, key, verdicts) for key, kind in worst.items()}
    shown = reasoning_shown(summaries)
    kinds = kinds_shown(summaries)
    return [
        [
            summary.cell_id,
            summary.prompt_id,
            *(fixed(metric.value(summary), metric.measure.decimals) for metric in RATIO_METRICS),
            *(_reasoning_cells(summary, by_key.get(summary.key, {})) if shown else ()),
            _cold_figure(summary, summary.cold_first_delta_ms),
            _cold_figure(summary, summary.cold_total_duration_ms),
            str(summary.warm_coalesced),
            success(summary),
            *(kind_cells(summary) if kinds else ()),
            _changes(by_key.get(summary.key, {})),
            detectable(by_key.get(summary.key, {}).get(TTFT_NAME)),
            worst.get(summary.key, NONE),
        ]
        for summary in sorted(summaries, key=lambda item: item.key)
    ]


# What --baseline-update did with a finding against a baseline (verdict_notes' `ACCEPTED`).
ACCEPTED = "accepted"


def _ratified(kind: str, key: tuple[str, str], verdicts: Sequence[Verdict]) -> str:
    """The verdict column while ratifying: a baseline's finding (`regression`, …) is what is
    being accepted; a win stays one, and an A/B finding, against a reference no update
    ratifies, stands."""
    worst = [v for v in verdicts if v.key == key and v.verdict == kind]
    if (
        kind in NOTEWORTHY
        and kind not in ("win", "ungated")
        and all(v.reference is None for v in worst)
    ):
        return ACCEPTED
    return kind


def _reasoning_cells(summary: PromptSummary, verdicts: Mapping[str, Verdict]) -> list[str]:
    judged = next((verdicts.get(m.name) for m in GATED_METRICS if m.reasoning), None)
    return [
        fixed(summary.figure("first_answer_ms", "p50")),
        change(judged.change_ratio if judged else None),
        fixed(summary.figure("reasoning_tokens", "p50"), 0),
    ]


# A cold case on an engine that cannot unload its model (an `openai` endpoint) runs warm: its
# figure is shown, but never as if it were a cold start.
RAN_WARM = "process_warm"
# `process_warm` is the ledger's word (it stays); a reader of a report gets a sentence.
RAN_WARM_WORDS = "no true cold start: the engine could not unload its model, so the call ran warm"


def cold_kind_words(kind: str | None) -> str:
    """A cold kind as a report shows it: `restart` and `unload` as they are, `process_warm`
    in words."""
    return RAN_WARM_WORDS if kind == RAN_WARM else plain(kind)


def _cold_figure(summary: PromptSummary, value: float | None) -> str:
    shown = fixed(value)
    return f"{shown} (ran warm)" if summary.cold_kind == RAN_WARM and value is not None else shown


TTFT_NAME = METRIC_NAMES[0]


def detectable(verdict: Verdict | None) -> str:
    """The smallest change the run could have caught: `≥ +18.0%`, `none` where it could catch
    no change (too few runs, an unsteady machine), `-` where nothing was judged."""
    if verdict is None or verdict.verdict in ("new", "incomparable"):
        return NONE
    if verdict.detectable_ratio is None:
        return "none" if verdict.noise is not None else NONE
    lower = verdict.detectable_ratio < 1.0
    return f"{'≤' if lower else '≥'} {change(verdict.detectable_ratio)}"


def _verdicts_by_key(verdicts: Iterable[Verdict]) -> dict[tuple[str, str], dict[str, Verdict]]:
    grouped: dict[tuple[str, str], dict[str, Verdict]] = {}
    for verdict in verdicts:
        grouped.setdefault(verdict.key, {})[verdict.metric] = verdict
    return grouped


def _changes(metrics: Mapping[str, Verdict]) -> str:
    ratios = [metrics.get(name) for name in METRIC_NAMES if name != SUCCESS_RATE]
    if all(verdict is None or verdict.change_ratio is None for verdict in ratios):
        return NONE
    return " / ".join(change(verdict.change_ratio if verdict else None) for verdict in ratios)


def verdict_notes(verdicts: Iterable[Verdict], *, accepted: bool = False) -> list[str]:
    """The messages of regressions, inconclusive changes and wins, worst first. With
    --baseline-update a change is not a finding but what is being ratified: `ACCEPTED`."""
    order = {kind: index for index, kind in enumerate(NOTEWORTHY)}
    chosen = [verdict for verdict in verdicts if verdict.verdict in order]
    metrics = {name: index for index, name in enumerate(ALL_METRIC_NAMES)}
    chosen.sort(key=lambda v: (order[v.verdict], v.key, metrics.get(v.metric, len(metrics))))
    return [
        f"ACCEPTED ({verdict.verdict}): {verdict.message}"
        if accepted and verdict.verdict not in ("win", "ungated")
        else f"{verdict.verdict.upper()}: {verdict.message}"
        for verdict in chosen
    ]


def render_summary(
    summaries: Iterable[PromptSummary],
    verdicts: Iterable[Verdict],
    *,
    accepted: bool = False,
    telemetry: Iterable[TelemetrySummary] = (),
    checks: Iterable[EngineChecks] = (),
) -> str:
    """The terminal summary: the table, the resource telemetry table (when anything was
    sampled), the checks against the engine (when it told anything), then one line per verdict
    that needs attention and per check that failed."""
    verdicts = list(verdicts)
    summaries = list(summaries)
    rows = summary_rows(summaries, verdicts, accepted=accepted)
    if not rows:
        return "no calls measured"
    notes = verdict_notes(verdicts, accepted=accepted)
    if any(summary.cold_kind == RAN_WARM and summary.n_cold for summary in summaries):
        notes.append(f"(ran warm): {RAN_WARM_WORDS}")
    resources = telemetry_rows(telemetry)
    tables = [table(rows, summary_headers(summaries))]
    if resources:
        tables.append(table(resources, TELEMETRY_HEADERS))
    checks = list(checks)
    engine_table = render_engine_checks(checks)
    if engine_table:
        tables.append(engine_table)
    notes.extend(engine_check_warnings(checks))
    head_to_head = render_ab(verdicts)
    if head_to_head:
        tables.append(head_to_head)
    return "\n".join([*tables, *notes])


# -- head-to-head A/B ---------------------------------------------------------------------------

AB_HEADERS = (
    "candidate",
    "reference",
    "prompt",
    "metric",
    "ratio of medians",
    "95% interval",
    "p",
    "pairs",
    "calls",
    "engine s",
    "verdict",
)


def ab_rows(verdicts: Iterable[Verdict]) -> list[list[str]]:
    """One row per A/B verdict (a candidate's metric against its reference, pair by pair):
    the change, its interval, the Wilcoxon p, the pairs judged of the most (fewer: sequential
    sampling stopped once decided), the calls and engine-seconds the verdict cost, the word."""
    return [
        [
            verdict.cell_id,
            str(verdict.reference),
            verdict.prompt_id,
            METRIC_LABELS.get(verdict.metric, verdict.metric),
            change(verdict.change_ratio),
            NONE
            if verdict.interval_low is None or verdict.interval_high is None
            else f"{change(verdict.interval_low)} … {change(verdict.interval_high)}",
            NONE if verdict.p_value is None else f"{verdict.p_value:.3g}",
            NONE if verdict.pairs is None else f"{verdict.pairs}/{verdict.max_pairs}",
            NONE if verdict.calls is None else str(verdict.calls),
            fixed(verdict.busy_s),
            verdict.verdict,
        ]
        for verdict in verdicts
        if verdict.reference is not None
    ]


def render_ab(verdicts: Iterable[Verdict], *, markdown: bool = False) -> str:
    """The A/B table, or "" when no cell has a reference."""
    rows = ab_rows(verdicts)
    return table(rows, AB_HEADERS, markdown=markdown) if rows else ""


# -- the end of a pytest session ------------------------------------------------------------

PROBE_HEADERS = ("cell", "engine version", "model digest", "status")


@dataclass(frozen=True)
class TerminalLine:
    text: str
    red: bool = False


def render_probe(rows: Iterable[ProbeRowLike]) -> str:
    return tabulate(
        [
            [row.cell_id, row.engine_version or NONE, row.model_digest or NONE, row.status]
            for row in rows
        ],
        headers=PROBE_HEADERS,
    )


def rental_lines(rentals: Iterable[Mapping[str, Any]]) -> list[TerminalLine]:
    """What each rented node cost, and loudly any session that could not be ended (each kind's
    line its own: targets/rentals.py)."""
    return [TerminalLine(*rental_text(rental)) for rental in rentals]


OUTCOME_HEADERS = ("cell", "status", "calls ok", "stage", "reason")


def outcome_lines(outcomes: Iterable[CellOutcome]) -> list[TerminalLine]:
    """Every planned cell: measured, failed (stage, reason), skipped, missing; unmeasured in red."""
    outcomes = list(outcomes)
    if not outcomes:
        return []
    rows = [
        [
            o.cell_id,
            o.status + (" (optional)" if o.optional and o.unmeasured else ""),
            f"{o.ok_calls}/{o.calls}",
            o.stage or NONE,
            shortened(o.reason or NONE),
        ]
        for o in outcomes
    ]
    text = table(rows, OUTCOME_HEADERS)
    lines = [TerminalLine(text, red=any(o.fails_run for o in outcomes))]
    # The table cuts a long reason; what to do is often at its end: each such reason whole.
    for outcome in outcomes:
        whole = " ".join((outcome.reason or "").split())
        if shortened(whole) != whole:
            named = whole if outcome.cell_id in whole else f"{outcome.cell_id}: {whole}"
            lines.append(TerminalLine(named, red=outcome.fails_run))
    return lines


def gate_lines(
    summaries: Iterable[PromptSummary],
    verdicts: Iterable[Verdict],
    *,
    baseline_notes: Iterable[str],
    gate_error: str | None,
    baseline_update: bool,
    baselines_dir: Path,
    telemetry: Iterable[TelemetrySummary] = (),
    checks: Iterable[EngineChecks] = (),
) -> list[TerminalLine]:
    """The gate's part of the terminal summary: the tables, baseline notes, errors, the status."""
    summaries, verdicts = list(summaries), list(verdicts)
    lines = (
        [
            TerminalLine(
                render_summary(
                    summaries,
                    verdicts,
                    accepted=baseline_update,
                    telemetry=telemetry,
                    checks=checks,
                )
            )
        ]
        if summaries
        else []
    )
    lines.extend(TerminalLine(note) for note in baseline_notes)
    if gate_error is not None:
        lines.append(TerminalLine(f"ERROR: {gate_error}", red=True))
    found = regressions(verdicts)
    against_baselines = [v for v in found if v.reference is None]
    if against_baselines and not baseline_update:
        lines.append(
            TerminalLine(
                f"gpubench: {len(against_baselines)} regression(s) against {baselines_dir}",
                red=True,
            )
        )
    head_to_head = [v for v in found if v.reference is not None]
    if head_to_head:
        lines.append(
            TerminalLine(
                f"gpubench: {len(head_to_head)} A/B regression(s) of a candidate against its "
                "reference",
                red=True,
            )
        )
    unsteady = [verdict for verdict in verdicts if verdict.verdict == "unsteady"]
    if unsteady and not baseline_update:
        keys = sorted({f"{v.cell_id} {v.prompt_id}" for v in unsteady})
        lines.append(
            TerminalLine(
                f"gpubench: the machine was unsteady while {', '.join(keys)} ran: not judged "
                "(neither a pass nor a regression); re-run on a steady machine",
                red=True,
            )
        )
    untold = [v for v in verdicts if holds_back(v) and v.verdict != "unsteady"]
    if untold and not baseline_update:
        keys = sorted({f"{v.cell_id} {v.prompt_id}" for v in untold})
        lines.append(
            TerminalLine(
                f"gpubench: the evidence could not tell for {', '.join(keys)}: neither a pass "
                "nor a regression; re-run with more runs (--gpubench-runs), runs of history "
                "(gpubench calibrate) or a reference: cell (A/B)",
                red=True,
            )
        )
    unlike = incomparables(verdicts)
    if unlike and not baseline_update:
        cells = sorted({verdict.cell_id for verdict in unlike})
        lines.append(
            TerminalLine(
                f"gpubench: the baselines of {', '.join(cells)} in {baselines_dir} were measured "
                "on another setup: not judged",
                red=True,
            )
        )
    return lines


def load_lines(
    loads: Sequence[LoadRecord],
    verdicts: Sequence[Verdict] = (),
    *,
    baseline_update: bool = False,
) -> list[TerminalLine]:
    """The terminal's load tables: one per cell, each point's figures and whether it is a
    result (an invalid point in red), then the gate's findings on the load points."""
    lines: list[TerminalLine] = []
    for cell_id in sorted({str(load.get("cell_id")) for load in loads}):
        own = [load for load in loads if load.get("cell_id") == cell_id]
        lines.append(TerminalLine(f"load: {cell_id}"))
        lines.append(TerminalLine(render_load_table(own)))
        check = render_server_check(own)
        if check:
            lines.append(TerminalLine(check))
        intervals = render_percentile_intervals(own)
        if intervals:
            lines.append(TerminalLine(intervals))
        split = render_adapter_split(own)
        if split:
            lines.append(TerminalLine(split))
        for load in own:
            if load.get("pattern") != "sweep" and not load.get("valid"):
                lines.append(
                    TerminalLine(
                        f"INVALID {load.get('case_id')} [{load.get('load_point')}]: "
                        f"{load.get('invalid_reason')}",
                        red=True,
                    )
                )
            for warning in load.get("delivery_warnings") or ():
                lines.append(
                    TerminalLine(
                        f"WARNING {load.get('case_id')} [{load.get('load_point')}]: {warning}",
                        red=True,
                    )
                )
    for note in verdict_notes(verdicts, accepted=baseline_update):
        lines.append(TerminalLine(note, red=note.startswith("REGRESSION")))
    found = regressions(verdicts)
    if found and not baseline_update:
        lines.append(TerminalLine(f"gpubench: {len(found)} load regression(s)", red=True))
    return lines
