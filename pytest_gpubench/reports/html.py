"""The HTML report of one ledger: one self-contained file (inline SVG charts drawn by matplotlib,
inline CSS, no script, nothing fetched when it is opened). Pure: a ledger read as columns and the
baseline's summaries in, HTML text out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytest_gpubench.ledger.schema import CellRecord, EndRecord, MetaRecord, SampleRecord
from pytest_gpubench.reports.charts import inline_svg, pyplot
from pytest_gpubench.reports.engine_checks_table import (
    ENGINE_CHECK_HEADERS,
    engine_check_rows,
    engine_check_warnings,
)
from pytest_gpubench.reports.formatting import METRIC_LABELS, NONE, change, command_text, fixed
from pytest_gpubench.reports.formatting import escaped as _e
from pytest_gpubench.reports.formatting import html_table as _table
from pytest_gpubench.reports.frame import LedgerData
from pytest_gpubench.reports.load_html import LoadBaselines, render_load_section
from pytest_gpubench.reports.terminal import KIND_HEADERS, cold_kind_words, detectable, kind_rows
from pytest_gpubench.results.engine_checks import EngineChecks
from pytest_gpubench.results.gate import Verdict
from pytest_gpubench.results.judging_settings import unchecked_cells
from pytest_gpubench.results.metric import GATED_METRICS, RATIO_METRICS
from pytest_gpubench.results.stats import PromptSummary, summaries_by_key

# (sampled measure, chart title, unit): the distributions drawn per (cell, prompt), one per gated
# figure's measure (config/metrics.GATED); a reasoning model's (issue 23) only where some (cell,
# prompt) reasoned.
DISTRIBUTIONS = tuple(
    (m.figure.measure, m.figure.chart, m.measure.unit) for m in RATIO_METRICS if m.figure.chart
)
REASONING_DISTRIBUTIONS = tuple(
    (m.figure.measure, m.figure.chart, m.measure.unit) for m in GATED_METRICS if m.reasoning
)
CURRENT_COLOR = "#1f6fb4"
BASELINE_COLOR = "#9a9a9a"
VERDICT_COLORS = {
    "regression": "#c0392b",
    "unsteady": "#8e44ad",
    "inconclusive": "#d68910",
    "blind": "#7f8c8d",
    "win": "#1e8449",
    "ok": "#444444",
}
# Telemetry series drawn per cell from `sample` records: (kind, column, title).
TELEMETRY_SERIES = (
    ("gpu", "utilization_pct", "GPU utilization %"),
    ("gpu", "memory_used_mib", "GPU memory used MiB"),
    ("gpu", "power_w", "GPU power W"),
    ("gpu", "temperature_c", "GPU temperature °C"),
    ("cpu", "engine_rss_mib", "engine resident memory MiB"),
    ("cpu", "load1", "node load (1 min)"),
)
STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;
max-width:1200px}
h1{font-size:1.5em}
h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:2em}
h3{font-size:1.05em;margin-top:1.4em}
table{border-collapse:collapse;font-size:.9em;margin:8px 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.regression{color:#c0392b;font-weight:bold}.inconclusive{color:#d68910}.win{color:#1e8449}
.unsteady{color:#8e44ad;font-weight:bold}.blind{color:#7f8c8d;font-style:italic}
.failed,.missing{color:#c0392b;font-weight:bold}.chart svg{max-width:100%;height:auto}
.note{color:#666;font-size:.9em}code{background:#f4f4f4;padding:0 3px}
"""


def render_html(
    data: LedgerData,
    baseline: Sequence[PromptSummary] = (),
    *,
    baseline_source: str | None = None,
    read_baselines: LoadBaselines | None = None,
) -> str:
    """The report; the same ledger and baseline always give the same bytes. `read_baselines`:
    the load baseline points per cell, drawn beside this run's load points."""
    pyplot()  # without the [html] extra: one line before any work, whatever the ledger holds
    summaries = data.summaries()
    meta, end = data.meta, data.end
    run_id = meta.get("benchmark_run_id") or (data.path.stem if data.path else "run")
    sections = [
        f"<h1>Benchmark run {_e(run_id)}</h1>",
        _provenance(meta, end, data.of_type("cell")),
        _distributions(summaries, baseline, baseline_source),
        _verdicts(end),
        _outcomes(end),
        render_load_section(data.of_type("load"), read_baselines),
        _cold(summaries),
        _kinds(summaries),
        _engine_checks(data.engine_checks(unchecked_cells(meta))),
        _telemetry(data.of_type("sample")),
    ]
    body = "\n".join(section for section in sections if section)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>gpubench {_e(run_id)}</title><style>{STYLE}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )


# -- tables -----------------------------------------------------------------------------------


def _provenance(meta: MetaRecord, end: EndRecord, cells: Sequence[CellRecord]) -> str:
    git = _e(meta.get("git_sha"))
    if meta.get("git_dirty"):
        git += " (dirty)"
    command = meta.get("command_line")
    items = [
        ("started (UTC)", _e(meta.get("started_at_utc"))),
        ("finished (UTC)", _e(end.get("finished_at_utc"))),
        ("git sha", f"<code>{git}</code>"),
        ("host", f"{_e(meta.get('host'))} ({_e(meta.get('platform'))})"),
        (
            "plugin / harness",
            f"{_e(meta.get('plugin_version'))} / {_e(meta.get('harness_version'))}",
        ),
        (
            "command",
            f"<code>{_e(command_text(command))}</code>",
        ),
        ("exit status", _e(end.get("exit_status"))),
    ]
    run = "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in items)
    run += "</table>"
    seen: dict[str, CellRecord] = {}
    for cell in cells:
        seen.setdefault(str(cell.get("cell_id")), cell)
    rows = [
        (
            _e(cell_id),
            _e(cell.get("engine")),
            f"<code>{_e(cell.get('engine_version'))}</code>",
            _e(cell.get("model")),
            f"<code>{_e(cell.get('model_digest'))}</code>",
            _e(cell.get("gpu_summary")),
        )
        for cell_id, cell in sorted(seen.items())
    ]
    headers = ("cell", "engine", "engine version", "model", "model digest", "GPU")
    cells_table = _table(headers, rows) if rows else "<p class=note>no cell records</p>"
    return f"<h2>Provenance</h2>\n{run}\n{cells_table}"


def _verdicts(end: EndRecord) -> str:
    order = {kind: index for index, kind in enumerate(VERDICT_COLORS)}
    known = sorted(
        Verdict.all_from_records(end.get("verdicts")),
        key=lambda v: (order.get(v.verdict, len(order)), v.key),
    )
    if not end:
        return "<h2>Regression gate</h2>\n<p class=note>no end record: the run did not finish</p>"
    if not known:
        reason = end.get("gate_error") or "no baseline to compare with"
        return f"<h2>Regression gate</h2>\n<p class=note>no verdicts: {_e(reason)}</p>"
    rows = [
        (
            _e(v.cell_id),
            _e(v.prompt_id),
            _e(METRIC_LABELS.get(v.metric, v.metric)),
            fixed(v.baseline),
            fixed(v.current),
            change(v.change_ratio),
            NONE if v.p_value is None else f"{v.p_value:.3g}",
            f'<span class="{_e(v.verdict)}">{_e(v.verdict)}</span>',
            _e(detectable(v)),
            _e(v.remeasure),
            _e(v.attribution),
            _e(v.message),
        )
        for v in known
    ]
    headers = (
        "cell",
        "prompt",
        "metric",
        "baseline",
        "current",
        "change",
        "p",
        "verdict",
        "could detect",
        "re-measure",
        "attribution",
        "message",
    )
    found = sum(v.verdict == "regression" for v in known)
    lead = f'<p class="{"regression" if found else "note"}">{found} regression(s)</p>'
    return f"<h2>Regression gate</h2>\n{lead}\n{_table(headers, rows, (3, 4, 5, 6))}"


def _outcomes(end: EndRecord) -> str:
    cells = [cell for cell in end.get("cells") or [] if isinstance(cell, dict)]
    if not cells:
        return ""
    rows = [
        (
            _e(cell.get("cell_id")),
            f'<span class="{_e(cell.get("status"))}">{_e(cell.get("status"))}</span>'
            + (" (optional)" if cell.get("optional") else ""),
            f"{_e(cell.get('ok_calls'))}/{_e(cell.get('calls'))}",
            _e(cell.get("stage")),
            _e(cell.get("reason")),
        )
        for cell in cells
    ]
    return "<h2>Cells</h2>\n" + _table(
        ("cell", "status", "calls ok", "stage", "reason"), rows, (2,)
    )


def _cold(summaries: Sequence[PromptSummary]) -> str:
    cold = [s for s in summaries if s.n_cold]
    if not cold:
        return ""
    rows = [
        (
            _e(s.cell_id),
            _e(s.prompt_id),
            _e(cold_kind_words(s.cold_kind)),
            f"{s.n_cold_ok}/{s.n_cold}",
            fixed(s.cold_first_delta_ms),
            fixed(s.cold_total_duration_ms),
        )
        for s in cold
    ]
    headers = ("cell", "prompt", "cold kind", "ok", "cold TTFT ms", "cold total ms")
    return "<h2>Cold calls</h2>\n" + _table(headers, rows, (3, 4, 5))


def _kinds(summaries: Sequence[PromptSummary]) -> str:
    """The request kinds' figures of each (cell, prompt) that is not chat (the terminal's)."""
    rows = [[_e(cell) for cell in row] for row in kind_rows(summaries)]
    if not rows:
        return ""
    headers = ("cell", "prompt", *KIND_HEADERS)
    return '<h2 id="request-kinds">Request kinds</h2>\n' + _table(headers, rows, (3,))


def _engine_checks(checks: Sequence[EngineChecks]) -> str:
    """The terminal's table of the warm calls' checks against the engine, then its warnings."""
    rows = [[_e(cell) for cell in row] for row in engine_check_rows(checks)]
    if not rows:
        return ""
    warnings = "".join(
        f'<li class="regression">{_e(line)}</li>' for line in engine_check_warnings(checks)
    )
    return (
        '<h2 id="engine-checks">Checks against the engine</h2>\n'
        + _table(ENGINE_CHECK_HEADERS, rows)
        + (f"\n<ul>{warnings}</ul>" if warnings else "")
    )


# -- charts -----------------------------------------------------------------------------------


def _distributions(
    summaries: Sequence[PromptSummary],
    baseline: Sequence[PromptSummary],
    baseline_source: str | None,
) -> str:
    warm = [s for s in summaries if s.samples["first_delta_ms"] or s.samples["total_duration_ms"]]
    if not warm:
        return "<h2>Warm distributions</h2>\n<p class=note>no successful warm calls</p>"
    old = summaries_by_key(baseline)
    against = (
        f"against the baseline in <code>{_e(baseline_source)}</code> (grey)"
        if old and baseline_source
        else "no baseline found: the current run only"
    )
    note = (
        "<p class=note>Box: p25-p75, black line: median, whiskers: p5-p95; this run in blue, "
        f"{against}.</p>"
    )
    return "<h2>Warm distributions</h2>\n" + note + "\n" + _distribution_chart(warm, old)


def _distribution_chart(
    warm: Sequence[PromptSummary], old: Mapping[tuple[str, str], PromptSummary]
) -> str:
    """One row per (cell, prompt), one panel per metric: the run's box above the baseline's."""
    plt = pyplot()
    rows = list(reversed(warm))
    panels: tuple[tuple[str, str, str], ...] = DISTRIBUTIONS
    if any(
        summary.samples[measure] for summary in warm for measure, _, _ in REASONING_DISTRIBUTIONS
    ):
        panels = (*DISTRIBUTIONS, *REASONING_DISTRIBUTIONS)
    figure, axes_row = plt.subplots(
        1, len(panels), figsize=(4 * len(panels), 1.0 + 0.6 * len(rows)), sharey=True, squeeze=False
    )
    for axes, (field, title, unit) in zip(axes_row[0], panels, strict=True):
        for index, summary in enumerate(rows):
            current = summary.samples.get(field, ())
            previous = old[summary.key].samples.get(field, ()) if summary.key in old else ()
            if current:
                _box(axes, current, index + 0.17, CURRENT_COLOR)
            if previous:
                _box(axes, previous, index - 0.17, BASELINE_COLOR)
        axes.set_title(f"{title} ({unit})")
        if len(rows) > 8:  # a tall chart: the scale at the top too
            axes.tick_params(labeltop=True, top=True)
        axes.grid(axis="x", color="#e5e5e5")
        axes.set_axisbelow(True)
    first = axes_row[0][0]
    first.set_yticks(range(len(rows)), [f"{s.cell_id}\n{s.prompt_id}" for s in rows])
    first.set_ylim(-0.6, len(rows) - 0.4)
    figure.tight_layout()
    return inline_svg(figure)


def _box(axes: Any, values: Sequence[float], position: float, color: str) -> None:
    axes.boxplot(
        [values],
        positions=[position],
        orientation="horizontal",
        whis=(5, 95),
        showfliers=False,
        widths=0.28,
        patch_artist=True,
        boxprops={"facecolor": color, "edgecolor": color, "alpha": 0.55},
        medianprops={"color": "black", "linewidth": 1.6},
        whiskerprops={"color": color},
        capprops={"color": color},
        manage_ticks=False,
    )


def _telemetry(samples: Sequence[SampleRecord]) -> str:
    """One chart per cell from its `sample` records (telemetry); none without them."""
    if not samples:
        return ""
    by_cell: dict[str, list[SampleRecord]] = {}
    for record in samples:
        by_cell.setdefault(str(record.get("cell_id")), []).append(record)
    charts = [_telemetry_chart(cell_id, records) for cell_id, records in sorted(by_cell.items())]
    shown = [chart for chart in charts if chart]
    if not shown:
        return ""
    note = "<p class=note>Cases one after another; time in seconds of sampling.</p>"
    return "<h2>Telemetry</h2>\n" + note + "\n" + "\n".join(shown)


def _telemetry_chart(cell_id: str, records: Sequence[SampleRecord]) -> str:
    series = _timelines(records)
    if not series:
        return ""
    plt = pyplot()
    figure, axes_list = plt.subplots(
        len(series), 1, figsize=(9, 1.6 * len(series) + 0.6), sharex=True, squeeze=False
    )
    for axes, (title, lines) in zip(axes_list[:, 0], series.items(), strict=True):
        for label, (times, values) in sorted(lines.items()):
            axes.plot(times, values, linewidth=1.0, label=label)
        axes.set_title(title, fontsize=9, loc="left")
        axes.grid(color="#eeeeee")
        if len(lines) > 1:
            axes.legend(fontsize=7, loc="upper right")
    axes_list[-1, 0].set_xlabel("s")
    figure.suptitle(cell_id)
    return inline_svg(figure)


def _timelines(
    records: Sequence[Mapping[str, Any]],
) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """{title: {GPU or series label: (times s, values)}}; cases laid end to end."""
    series: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    offset = 0.0
    for record in records:
        longest = 0.0
        for kind, column, title in TELEMETRY_SERIES:
            table = record.get(kind)
            if not isinstance(table, dict):
                continue
            times, values = table.get("t_ms"), table.get(column)
            if not isinstance(times, list) or not isinstance(values, list):
                continue
            devices = table.get("gpu") if kind == "gpu" else None
            for index, (t, value) in enumerate(zip(times, values, strict=False)):
                if not isinstance(t, int | float) or not isinstance(value, int | float):
                    continue
                label = f"GPU {devices[index]}" if isinstance(devices, list) else kind
                lines = series.setdefault(title, {}).setdefault(label, ([], []))
                lines[0].append(offset + t / 1000)
                lines[1].append(float(value))
                longest = max(longest, t / 1000)
        offset += longest + (record.get("interval_ms") or 0) / 1000
    order = [title for _kind, _column, title in TELEMETRY_SERIES]
    return {title: series[title] for title in order if title in series}
