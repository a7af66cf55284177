"""All rendering: the terminal summary, the probe table, rented nodes, run comparisons and the
Markdown baseline document. Pure: text in, text out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from tabulate import tabulate

from pytest_gpubench.ledger.outcomes import CellOutcome
from pytest_gpubench.results.gate import (
    ALL_METRIC_NAMES,
    GATED_METRICS,
    METRIC_NAMES,
    PROVENANCE,
    RATIO_METRICS,
    SUCCESS_RATE,
    Verdict,
    incomparables,
    overall_by_key,
    regressions,
)
from pytest_gpubench.results.judging import undecided_improvement
from pytest_gpubench.results.stats import PromptSummary, summarize
from pytest_gpubench.targets.gpu import gpu_summary
from pytest_gpubench.telemetry.aggregate import TelemetrySummary, telemetry_summaries

if TYPE_CHECKING:
    # The record types import the measurement's (h11, pydantic): not at the end of a session
    # that measured nothing (the terminal summary).
    from pytest_gpubench.ledger.schema import (
        CellRecord,
        EndRecord,
        LoadRecord,
        MetaRecord,
        SkippedRecord,
    )

NONE = "-"
METRIC_LABELS = {
    **{metric.name: metric.figure.column for metric in GATED_METRICS},
    # Gated before issue 11; still named when an older ledger's end record is rendered.
    "warm_tokens_per_sec_mean": "tok/s mean",
    SUCCESS_RATE: "success rate",
    PROVENANCE: "baseline setup",
}
# Shown under a table: the verdicts a reader has to act on.
NOTEWORTHY = ("regression", "incomparable", "unsteady", "inconclusive", "blind", "win")


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


# -- formatting -------------------------------------------------------------------------------


def fixed(value: float | None, digits: int = 2) -> str:
    return NONE if value is None else f"{value:.{digits}f}"


def change(ratio: float | None) -> str:
    """1.352 -> "+35.2%"."""
    return NONE if ratio is None else f"{ratio - 1.0:+.1%}"


def success(summary: PromptSummary) -> str:
    return f"{summary.n_warm_ok}/{summary.n_warm}" if summary.n_warm else NONE


def table(rows: Sequence[Sequence[str]], headers: Sequence[str], *, markdown: bool = False) -> str:
    """Cells pre-formatted as text; columns of numbers right-aligned, names left-aligned."""
    cell = _md if markdown else str
    texts = [[cell(value) for value in row] for row in rows]
    align = [
        "right" if all(_numeric(row[index]) for row in texts) and texts else "left"
        for index in range(len(headers))
    ]
    return tabulate(
        texts,
        headers=[cell(header) for header in headers],
        tablefmt="pipe" if markdown else "simple",
        disable_numparse=True,
        colalign=align,
    )


def _numeric(text: str) -> bool:
    """A number as this module formats it: 12.30, +5.1%, 4/5, 1.2e-05, or the "-" of none."""
    return text == NONE or text[:1].isdigit() or (text[:1] in "+-" and text[1:2].isdigit())


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
    return any(summary.figure("first_answer_ms", "p50") is not None for summary in summaries)


def summary_headers(summaries: Iterable[PromptSummary]) -> tuple[str, ...]:
    """SUMMARY_HEADERS, with the reasoning columns where some (cell, prompt) reasoned."""
    if not reasoning_shown(summaries):
        return SUMMARY_HEADERS
    at = 2 + len(RATIO_METRICS)
    return (*SUMMARY_HEADERS[:at], *REASONING_HEADERS, *SUMMARY_HEADERS[at:])


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
    if kind in NOTEWORTHY and kind != "win" and all(v.reference is None for v in worst):
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
    return RAN_WARM_WORDS if kind == RAN_WARM else _text(kind)


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
        if accepted and verdict.verdict != "win"
        else f"{verdict.verdict.upper()}: {verdict.message}"
        for verdict in chosen
    ]


def render_summary(
    summaries: Iterable[PromptSummary],
    verdicts: Iterable[Verdict],
    *,
    accepted: bool = False,
    telemetry: Iterable[TelemetrySummary] = (),
) -> str:
    """The terminal summary: the table, the resource telemetry table (when anything was
    sampled), then one line per verdict that needs attention."""
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
    """What each rented node cost, and loudly any session that could not be ended."""
    lines = []
    for rental in rentals:
        if rental.get("kind") == "slurm":
            lines.append(_slurm_job_line(rental))
            continue
        if rental.get("kind") == "ssh_server":
            stopped = bool(rental.get("session_done"))
            how = rental.get("state") if stopped else "NOT stopped: stop it by hand"
            text = (
                f"ssh node {rental.get('node')}: left by a killed run: {rental.get('program')} "
                f"(pid {rental.get('pid')}): {how}"
            )
            lines.append(TerminalLine(text, red=not stopped))
            continue
        done = rental.get("session_done")
        state = "marked done" if done else "NOT marked done: end it by hand"
        leaked = "left rented by a killed run, given back now: " if rental.get("leaked") else ""
        text = (
            f"rented node {rental.get('node')}: {leaked}{rental.get('gpu_name')} at "
            f"{rental.get('price_per_hour')}/h for {rental.get('elapsed_s')} s, cost "
            f"{rental.get('cost')}; session {rental.get('session_id')} {state}"
        )
        lines.append(TerminalLine(text, red=not done))
    return lines


def _slurm_job_line(job: Mapping[str, Any]) -> TerminalLine:
    """A Slurm job of a cell's engine: how it ended; red when it may still be running."""
    state = job.get("state")
    ended = isinstance(state, str) and state not in ("RUNNING", "PENDING")
    leaked = "left by a killed run, cancelled now: " if job.get("leaked") else ""
    text = (
        f"slurm node {job.get('node')}: {leaked}job {job.get('slurm_job_id')} "
        f"({job.get('job_name')}) on {job.get('compute_node')}: {state} after "
        f"{job.get('elapsed_s')} s"
    )
    if not ended:
        text += f"; cancel it by hand: scancel {job.get('slurm_job_id')}"
    return TerminalLine(text, red=not ended)


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
            _shorten(o.reason or NONE),
        ]
        for o in outcomes
    ]
    text = table(rows, OUTCOME_HEADERS)
    return [TerminalLine(text, red=any(o.fails_run for o in outcomes))]


def _shorten(text: str, limit: int = 100) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def gate_lines(
    summaries: Iterable[PromptSummary],
    verdicts: Iterable[Verdict],
    *,
    baseline_notes: Iterable[str],
    gate_error: str | None,
    baseline_update: bool,
    baselines_dir: Path,
    telemetry: Iterable[TelemetrySummary] = (),
) -> list[TerminalLine]:
    """The gate's part of the terminal summary: the tables, baseline notes, errors, the status."""
    summaries, verdicts = list(summaries), list(verdicts)
    lines = (
        [
            TerminalLine(
                render_summary(summaries, verdicts, accepted=baseline_update, telemetry=telemetry)
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
    untold = [
        verdict
        for verdict in verdicts
        if verdict.verdict in ("inconclusive", "blind") and not undecided_improvement(verdict)
    ]
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


# -- resource telemetry --------------------------------------------------------------------------

TELEMETRY_HEADERS = (
    "cell",
    "prompt",
    "peak VRAM MiB",
    "engine VRAM MiB",
    "GPU util %",
    "power W",
    "J/token",
    "tokens/J",
    "engine CPU s",
    "CPU s/token",
    "peak RSS MiB",
)


def telemetry_rows(summaries: Iterable[TelemetrySummary]) -> list[list[str]]:
    """One row per (cell, prompt) whose warm calls were sampled (medians; peaks of peaks). Energy
    integrated from power, for GPUs without an energy counter, is marked `~`."""
    rows = []
    for summary in summaries:
        figures = (
            summary.gpu_peak_memory_used_mib,
            summary.engine_gpu_memory_peak_mib,
            summary.gpu_utilization_mean_pct,
            summary.gpu_power_mean_w,
            summary.gpu_energy_j_per_token,
            summary.gpu_tokens_per_j,
            summary.engine_cpu_s,
            summary.engine_cpu_s_per_token,
            summary.engine_peak_rss_mib,
        )
        if all(figure is None for figure in figures):
            continue
        integrated = "~" if summary.gpu_energy_source == "integrated_power" else ""
        peak, engine_peak, util, power, joules, per_joule, cpu, cpu_per_token, rss = figures
        rows.append(
            [
                summary.cell_id,
                summary.prompt_id,
                fixed(peak, 0),
                fixed(engine_peak, 0),
                fixed(util, 1),
                fixed(power, 1),
                integrated + fixed(joules, 4) if joules is not None else NONE,
                integrated + fixed(per_joule, 2) if per_joule is not None else NONE,
                fixed(cpu, 3),
                fixed(cpu_per_token, 5),
                fixed(rss, 1),
            ]
        )
    return rows


def _telemetry_section(telemetry: Sequence[TelemetrySummary]) -> str:
    rows = telemetry_rows(telemetry)
    if not rows:
        return ""
    return "\n\n".join(
        [
            "## Resource telemetry (warm calls)",
            "Medians per call; peak VRAM and RSS are the highest seen. Peak VRAM is the whole "
            "GPU's, engine VRAM the engine's own processes' (NVML). `~`: energy integrated "
            "from power draw (no energy counter on the GPU, or one too coarse for the call).",
            table(rows, TELEMETRY_HEADERS, markdown=True),
        ]
    )


# -- comparison of two runs -------------------------------------------------------------------

COMPARISON_HEADERS = (
    "cell",
    "prompt",
    "metric",
    "old",
    "new",
    "change",
    "p",
    "could detect",
    "verdict",
)


def comparison_rows(verdicts: Iterable[Verdict]) -> list[list[str]]:
    return [
        [
            verdict.cell_id,
            verdict.prompt_id,
            METRIC_LABELS.get(verdict.metric, verdict.metric),
            fixed(verdict.baseline),
            fixed(verdict.current),
            change(verdict.change_ratio),
            NONE if verdict.p_value is None else f"{verdict.p_value:.3g}",
            detectable(verdict),
            verdict.verdict,
        ]
        for verdict in verdicts
    ]


def render_comparison(verdicts: Iterable[Verdict], *, markdown: bool = False) -> str:
    verdicts = list(verdicts)
    if not verdicts:
        return "nothing to compare: no (cell, prompt) with warm calls in the new run"
    lines = [table(comparison_rows(verdicts), COMPARISON_HEADERS, markdown=markdown)]
    notes = verdict_notes(verdicts)
    if notes:
        lines.append("")
        lines.extend(f"- {note}" if markdown else note for note in notes)
    return "\n".join(lines)


# -- the Markdown baseline document -----------------------------------------------------------


def render_markdown(records: Iterable[Mapping[str, Any]]) -> str:
    """The baseline document of one ledger: the same ledger always gives the same bytes."""
    records = list(records)
    others = [record for record in records if record.get("type") != "call"]
    return render_document(others, summarize(records), telemetry_summaries(records))


def render_document(
    others: Sequence[Mapping[str, Any]],
    summaries: Sequence[PromptSummary],
    telemetry: Sequence[TelemetrySummary] = (),
) -> str:
    """render_markdown from a ledger read as columns (ledger_frame): the records other than
    calls, the summaries of the calls and their resource figures."""
    from pytest_gpubench.ledger.schema import end_of, meta_of, records_of

    meta = meta_of(others) or cast("MetaRecord", {})  # none: every fact unknown
    end = end_of(others) or cast("EndRecord", {})
    cells = _first_by_cell(records_of(others, "cell"))
    skipped = records_of(others, "skipped")
    loads = records_of(others, "load")
    cell_ids = sorted(
        {s.cell_id for s in summaries}
        | set(cells)
        | {str(r.get("cell_id")) for r in [*skipped, *loads]}
    )
    sections = [
        _title(meta),
        _run_section(meta, end),
        _top_summary(summaries),
        *(
            _cell_section(cell_id, cells.get(cell_id), summaries, skipped, loads)
            for cell_id in cell_ids
        ),
        _telemetry_section(telemetry),
        _gate_section(end),
    ]
    return "\n\n".join(section for section in sections if section) + "\n"


def _first_by_cell(records: Iterable[CellRecord]) -> dict[str, CellRecord]:
    first: dict[str, CellRecord] = {}
    for record in records:
        first.setdefault(str(record.get("cell_id")), record)
    return first


def _title(meta: MetaRecord) -> str:
    run_id = meta.get("benchmark_run_id")
    return f"# Benchmark run {run_id}" if run_id else "# Benchmark run"


def _run_section(meta: MetaRecord, end: EndRecord) -> str:
    dirty = meta.get("git_dirty_files") or []
    git = _code(meta.get("git_sha"))
    if meta.get("git_dirty"):
        git += f" (dirty: {', '.join(_code(name) for name in dirty) or 'yes'})"
    command = meta.get("command_line")
    python = f"{_text(meta.get('python_version'))} / {_text(meta.get('pytest_version'))}"
    load = f"{_text(meta.get('load_avg_start'))} / {_text(end.get('load_avg_end'))}"
    items = [
        ("started (UTC)", _text(meta.get("started_at_utc"))),
        ("finished (UTC)", _text(end.get("finished_at_utc"))),
        ("git", git),
        ("harness", _text(meta.get("harness_version"))),
        ("plugin", _text(meta.get("plugin_version"))),
        ("Python / pytest", python),
        ("host", f"{_text(meta.get('host'))} ({_text(meta.get('platform'))})"),
        ("load average start / end", load),
        ("command", _code(" ".join(command) if isinstance(command, list) else command)),
    ]
    env = meta.get("env")
    if isinstance(env, dict) and env:
        items.append(("environment", ", ".join(f"`{k}={env[k]}`" for k in sorted(env))))
    return "\n".join(f"- {name}: {value}" for name, value in items)


def _top_summary(summaries: Sequence[PromptSummary]) -> str:
    """Warm TTFT p50 per cell (rows) and prompt (columns)."""
    if not summaries:
        return "No calls were measured."
    prompt_ids = sorted({s.prompt_id for s in summaries})
    values = {s.key: s.figure("first_delta_ms", "p50") for s in summaries}
    rows = [
        [cell_id, *(fixed(values.get((cell_id, p))) for p in prompt_ids)]
        for cell_id in sorted({s.cell_id for s in summaries})
    ]
    aligned = table(rows, ["cell", *prompt_ids], markdown=True)
    return f"## Warm TTFT p50 (ms)\n\n{aligned}"


def _cell_section(
    cell_id: str,
    cell: CellRecord | None,
    summaries: Sequence[PromptSummary],
    skipped: Sequence[SkippedRecord],
    loads: Sequence[LoadRecord] = (),
) -> str:
    mine = [s for s in summaries if s.cell_id == cell_id]
    parts = [f"## {_md(cell_id)}"]
    if cell:
        parts.append(_cell_description(cell))
    cold = [s for s in mine if s.n_cold]
    warm = [s for s in mine if s.n_warm]
    if cold:
        parts.append("### Cold\n\n" + table(_cold_rows(cold), COLD_HEADERS, markdown=True))
    if warm:
        headers = (
            (*WARM_HEADERS, *WARM_REASONING_HEADERS) if reasoning_shown(warm) else WARM_HEADERS
        )
        rows = _warm_rows(warm, reasoning=reasoning_shown(warm))
        parts.append("### Warm\n\n" + table(rows, headers, markdown=True))
    own_loads = [record for record in loads if record.get("cell_id") == cell_id]
    if own_loads:
        parts.append("### Load\n\n" + render_load_table(own_loads, markdown=True))
        check = render_server_check(own_loads, markdown=True)
        if check:
            parts.append("Client against engine, per point:\n\n" + check)
        warnings = [
            f"- **{_md(str(load.get('load_point')))}**: {_md(warning)}"
            for load in own_loads
            for warning in load.get("delivery_warnings") or ()
        ]
        if warnings:
            parts.append("\n".join(warnings))
    reasons = Counter(
        str(r.get("reason") or "no reason given") for r in skipped if r.get("cell_id") == cell_id
    )
    if reasons:
        lines = [f"- {reason} ({count}×)" for reason, count in sorted(reasons.items())]
        parts.append("### Skipped\n\n" + "\n".join(lines))
    return "\n\n".join(parts)


def _cell_description(cell: CellRecord) -> str:
    items = [
        ("engine", f"{_text(cell.get('engine'))} {_code(cell.get('engine_version'))}"),
        ("model", f"{_text(cell.get('model'))} ({_model_identity(cell)})"),
        ("GPUs", _gpus(cell.get("gpus"))),
    ]
    if cell.get("endpoint"):
        items.append(("endpoint", _code(cell.get("endpoint"))))
    return "\n".join(f"- {name}: {value}" for name, value in items)


def _model_identity(cell: CellRecord) -> str:
    """`digest sha256:…`, or what identifies the model where no digest is known."""
    parts = [f"digest {_code(cell.get('model_digest'))}"]
    identity = cell.get("model_identity")
    if identity and identity != "digest":
        parts.append(f"identity: {identity}")
    if cell.get("model_root"):
        parts.append(f"root {_code(cell.get('model_root'))}")
    if cell.get("max_model_len"):
        parts.append(f"max model length {cell.get('max_model_len')}")
    return ", ".join(parts)


def _gpus(gpus: Any) -> str:
    if not isinstance(gpus, list):
        return "none reported"
    return gpu_summary(gpus)


COLD_HEADERS = ("prompt", "cold kind", "calls", "ok", "TTFT ms", "total ms")
WARM_HEADERS = (
    "prompt",
    "calls",
    "ok",
    "TTFT p50",
    "TTFT p95",
    "TTFT p99",
    "total p50",
    "total p95",
    "total p99",
    "decode tok/s p50",
    "TPOT p90 ms",
    "engine tok/s p50",
    "coalesced",
)
# Where some prompt of the cell reasoned (issue 23): its first answer token and reasoning tokens.
WARM_REASONING_HEADERS = (
    "first answer p50",
    "first answer p95",
    "first answer p99",
    "reasoning tok p50",
)


def _cold_rows(summaries: Iterable[PromptSummary]) -> list[list[str]]:
    return [
        [
            s.prompt_id,
            cold_kind_words(s.cold_kind),
            str(s.n_cold),
            str(s.n_cold_ok),
            fixed(s.cold_first_delta_ms),
            fixed(s.cold_total_duration_ms),
        ]
        for s in summaries
    ]


def _warm_rows(summaries: Iterable[PromptSummary], *, reasoning: bool = False) -> list[list[str]]:
    return [
        [
            s.prompt_id,
            str(s.n_warm),
            str(s.n_warm_ok),
            fixed(s.figure("first_delta_ms", "p50")),
            fixed(s.figure("first_delta_ms", "p95")),
            fixed(s.figure("first_delta_ms", "p99")),
            fixed(s.figure("total_duration_ms", "p50")),
            fixed(s.figure("total_duration_ms", "p95")),
            fixed(s.figure("total_duration_ms", "p99")),
            fixed(s.figure("decode_tokens_per_sec", "p50"), 1),
            fixed(s.figure("tpot_ms", "p90"), 3),
            fixed(s.figure("engine_tokens_per_sec", "p50"), 1),
            str(s.warm_coalesced),
            *(
                (
                    fixed(s.figure("first_answer_ms", "p50")),
                    fixed(s.figure("first_answer_ms", "p95")),
                    fixed(s.figure("first_answer_ms", "p99")),
                    fixed(s.figure("reasoning_tokens", "p50"), 0),
                )
                if reasoning
                else ()
            ),
        ]
        for s in summaries
    ]


def _gate_section(end: EndRecord) -> str:
    raw = end.get("verdicts")
    verdicts = [Verdict.from_record(r) for r in raw if isinstance(r, dict)] if raw else []
    known = [verdict for verdict in verdicts if verdict is not None]
    if not known:
        return ""
    gate = "## Regression gate\n\n" + render_comparison(known, markdown=True)
    head_to_head = render_ab(known, markdown=True)
    if head_to_head:
        gate += "\n\n## Head-to-head A/B\n\n" + head_to_head
    return gate


def _text(value: Any) -> str:
    return NONE if value is None or value == "" else str(value)


def _code(value: Any) -> str:
    return NONE if value is None or value == "" else f"`{value}`"


def _md(text: str) -> str:
    """Escape the one character that breaks a Markdown table cell."""
    return text.replace("|", "\\|")


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


def _load_extras(loads: Sequence[Mapping[str, Any]]) -> tuple[bool, bool]:
    """(some point has a prefix-cache hit rate, some point reasoned)."""
    return (
        any(load.get("prefix_cache_hit_rate") is not None for load in loads),
        any(load.get("reasoning_tokens_p50") is not None for load in loads),
    )


def load_headers(loads: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """LOAD_HEADERS, with the prefix-cache and reasoning columns after the TTFT where some
    point has them."""
    prefix, reasoning = _load_extras(list(loads))
    at = LOAD_HEADERS.index("TTFT p50 / p99 ms") + 1
    extra = (
        *(LOAD_PREFIX_HEADERS if prefix else ()),
        *(LOAD_REASONING_HEADERS if reasoning else ()),
    )
    return (*LOAD_HEADERS[:at], *extra, *LOAD_HEADERS[at:])


def _load_extra_cells(load: Mapping[str, Any], prefix: bool, reasoning: bool) -> list[str]:
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
    return cells


def load_rows(loads: Iterable[LoadRecord]) -> list[list[str]]:
    """One row per load point (a sweep: per step, then the sweep's saturation point), in the
    columns of load_headers."""
    loads = list(loads)
    prefix, reasoning = _load_extras(loads)
    extras = int(prefix) + 2 * int(reasoning)
    rows = []
    for load in loads:
        if load.get("pattern") == "sweep":
            saturation = load.get("saturation_rate")
            rows.append(
                [
                    _text(load.get("prompt_id")),
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
            else f"INVALID: {_shorten(str(load.get('invalid_reason')), 60)}"
        )
        rows.append(
            [
                _text(load.get("prompt_id")),
                _text(load.get("load_point")),
                fixed(load.get("offered_rate")),
                fixed(load.get("achieved_rate")),
                fixed(load.get("output_tokens_per_sec"), 1),
                f"{fixed(load.get('ttft_ms_p50'))} / {fixed(load.get('ttft_ms_p99'))}",
                *_load_extra_cells(load, prefix, reasoning),
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
                _text(load.get("load_point")),
                _text(check.get("engine")),
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
