"""History across runs: per cell, prompt and gated metric, the value of each ledger in a
directory, in run order, with the baseline updates and the gate's regressions marked; load points
too (`<prompt>@load-<point>`: throughput, p99s, goodput, a sweep's saturation rate); rendered as a
terminal table of sparklines and as an HTML page of charts."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pytest_gpubench.config.metrics import LOAD_GATED, LOAD_SATURATION
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.ledger.schema import LoadRecord
from pytest_gpubench.reports.charts import inline_svg, pyplot
from pytest_gpubench.reports.formatting import METRIC_LABELS, NONE, fixed, table
from pytest_gpubench.reports.frame import LedgerData, read_ledger_frame
from pytest_gpubench.reports.html import STYLE
from pytest_gpubench.results.gate import Verdict
from pytest_gpubench.results.judging_settings import wrote_baselines
from pytest_gpubench.results.load_gate import gated, point_key
from pytest_gpubench.results.metric import GATED_METRICS, RATIO_METRICS, SUCCESS_RATE
from pytest_gpubench.results.stats import PromptSummary

SPARKS = "▁▂▃▄▅▆▇█"
# In the marks line under a sparkline: a regression, a baseline update, both.
REGRESSION_MARK, UPDATE_MARK, BOTH_MARK, NO_MARK = "R", "B", "*", "·"


@dataclass(frozen=True)
class RunPoint:
    """One ledger of the history: when it started and what it did to the baselines."""

    run_id: str
    started_at_utc: str
    path: Path
    baseline_update: bool
    # (cell, prompt, metric) the gate found a regression in.
    regressions: frozenset[tuple[str, str, str]]


@dataclass
class Trend:
    cell_id: str
    prompt_id: str
    metric: str
    # One value per run of the history (None: not measured in that run).
    values: list[float | None] = field(default_factory=list)


@dataclass(frozen=True)
class History:
    runs: list[RunPoint]
    trends: list[Trend]


def metric_value(summary: PromptSummary, metric: str) -> float | None:
    if metric == SUCCESS_RATE:
        return summary.warm_success_rate
    return next(m.value(summary) for m in GATED_METRICS if m.name == metric)


HISTORY_METRICS = (*(m.name for m in RATIO_METRICS), SUCCESS_RATE)
# A load record's gated figures: {metric name: (record field, label)}.
LOAD_HISTORY = {m.name: (m.field, m.label) for m in (*LOAD_GATED, LOAD_SATURATION)}
LABELS = {**METRIC_LABELS, **{name: label for name, (_, label) in LOAD_HISTORY.items()}}


def ledgers_in(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise GpubenchError(f"{directory}: not a directory of ledgers")
    found = sorted(directory.rglob("*.jsonl"))
    if not found:
        raise GpubenchError(f"{directory}: holds no ledger (*.jsonl)")
    return found


def read_history(directory: Path) -> History:
    """Every ledger under the directory, ordered by the start time of its run."""
    runs: list[tuple[RunPoint, list[PromptSummary], list[LoadRecord]]] = []
    for path in ledgers_in(directory):
        data = read_ledger_frame(path)
        loads = [record for record in data.of_type("load") if gated(record)]
        runs.append((run_point(data, path), data.summaries(with_samples=False), loads))
    runs.sort(key=lambda run: (run[0].started_at_utc, str(run[0].path)))
    return History(
        [run for run, _, _ in runs],
        trends([summaries for _, summaries, _ in runs], [loads for _, _, loads in runs]),
    )


def run_point(data: LedgerData, path: Path) -> RunPoint:
    meta, end = data.meta, data.end
    regressions = frozenset(
        (v.cell_id, v.prompt_id, v.metric)
        for v in Verdict.all_from_records(end.get("verdicts"))
        if v.verdict == "regression"
    )
    return RunPoint(
        run_id=str(meta.get("benchmark_run_id") or path.stem),
        started_at_utc=str(meta.get("started_at_utc") or ""),
        path=path,
        baseline_update=wrote_baselines(meta),
        regressions=regressions,
    )


def trends(
    runs: Sequence[Iterable[PromptSummary]],
    loads: Sequence[Iterable[Mapping[str, object]]] = (),
) -> list[Trend]:
    """The warm metrics' trends per (cell, prompt), and the load figures' per (cell, point);
    `loads`: each run's gated load records, in the runs' order."""
    found: dict[tuple[str, str, str], Trend] = {}
    for index, summaries in enumerate(runs):
        for summary in summaries:
            for metric in HISTORY_METRICS:
                key = (summary.cell_id, summary.prompt_id, metric)
                trend = found.setdefault(key, Trend(*key, values=[None] * len(runs)))
                trend.values[index] = metric_value(summary, metric)
    for index, records in enumerate(loads):
        for record in records:
            for metric, (source, _) in LOAD_HISTORY.items():
                value = record.get(source)
                if isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                key = (str(record.get("cell_id")), point_key(record), metric)
                trend = found.setdefault(key, Trend(*key, values=[None] * len(runs)))
                trend.values[index] = float(value)
    order = {metric: index for index, metric in enumerate([*HISTORY_METRICS, *LOAD_HISTORY])}
    return sorted(found.values(), key=lambda t: (t.cell_id, t.prompt_id, order[t.metric]))


# -- the terminal -----------------------------------------------------------------------------


def sparkline(values: Sequence[float | None]) -> str:
    """One character per run, its height the value between the trend's min and max."""
    present = [value for value in values if value is not None]
    if not present:
        return " " * len(values)
    low, high = min(present), max(present)
    span = high - low
    return "".join(
        " "
        if value is None
        else SPARKS[0 if span == 0 else round((value - low) / span * (len(SPARKS) - 1))]
        for value in values
    )


def marks(trend: Trend, runs: Sequence[RunPoint]) -> str:
    key = (trend.cell_id, trend.prompt_id, trend.metric)
    line = []
    for run in runs:
        regressed = key in run.regressions
        if regressed and run.baseline_update:
            line.append(BOTH_MARK)
        elif regressed:
            line.append(REGRESSION_MARK)
        elif run.baseline_update:
            line.append(UPDATE_MARK)
        else:
            line.append(NO_MARK)
    return "".join(line) if line.count(NO_MARK) < len(line) else ""


HISTORY_HEADERS = ("cell", "prompt", "metric", "trend", "marks", "first", "last", "min", "max")


def render_history(history: History) -> str:
    """The terminal table: a sparkline per (cell, prompt, metric), the runs' marks under it in a
    column of their own (R regression, B baseline update), and the first, last, min, max."""
    runs = history.runs
    rows = []
    for trend in history.trends:
        present = [value for value in trend.values if value is not None]
        digits = 3 if trend.metric == SUCCESS_RATE else 2
        rows.append(
            [
                trend.cell_id,
                trend.prompt_id,
                LABELS.get(trend.metric, trend.metric),
                sparkline(trend.values),
                marks(trend, runs) or NONE,
                fixed(_first(trend.values), digits),
                fixed(_first(list(reversed(trend.values))), digits),
                fixed(min(present) if present else None, digits),
                fixed(max(present) if present else None, digits),
            ]
        )
    first, last = runs[0], runs[-1]
    lead = (
        f"{len(runs)} runs from {first.started_at_utc or first.run_id} to "
        f"{last.started_at_utc or last.run_id}; one character per run, oldest first; "
        f"marks: {REGRESSION_MARK} regression, {UPDATE_MARK} baseline update"
    )
    regressed = [
        f"REGRESSION in run {run.run_id} ({run.started_at_utc}): "
        + ", ".join(f"{c} {p} {LABELS.get(m, m)}" for c, p, m in sorted(run.regressions))
        for run in runs
        if run.regressions
    ]
    updates = [f"baseline update: run {run.run_id}" for run in runs if run.baseline_update]
    return "\n".join([lead, table(rows, HISTORY_HEADERS), *regressed, *updates])


def _first(values: Sequence[float | None]) -> float | None:
    return next((value for value in values if value is not None), None)


# -- HTML -------------------------------------------------------------------------------------


def render_history_html(history: History) -> str:
    """One self-contained page: a chart per (cell, prompt), one panel per metric, regressions as
    red crosses and baseline updates as dashed lines."""
    plt = pyplot()
    runs = history.runs
    by_key: dict[tuple[str, str], list[Trend]] = {}
    for trend in history.trends:
        by_key.setdefault((trend.cell_id, trend.prompt_id), []).append(trend)
    charts = []
    for (cell_id, prompt_id), group in by_key.items():
        figure, axes_row = plt.subplots(1, len(group), figsize=(12, 2.6), squeeze=False)
        for axes, trend in zip(axes_row[0], group, strict=True):
            xs = [i for i, v in enumerate(trend.values) if v is not None]
            ys = [v for v in trend.values if v is not None]
            axes.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.2, color="#1f6fb4")
            for index, run in enumerate(runs):
                if run.baseline_update:
                    axes.axvline(index, color="#888888", linestyle="--", linewidth=0.8)
                value = trend.values[index]
                if (cell_id, prompt_id, trend.metric) in run.regressions and value is not None:
                    axes.plot([index], [value], marker="X", markersize=9, color="#c0392b")
            axes.set_title(LABELS.get(trend.metric, trend.metric), fontsize=9)
            axes.set_xlabel("run")
            axes.grid(color="#eeeeee")
        figure.suptitle(f"{cell_id} · {prompt_id}")
        figure.tight_layout()
        charts.append(inline_svg(figure))
    rows = "".join(
        f"<tr><td>{index}</td><td>{html.escape(run.run_id)}</td>"
        f"<td>{html.escape(run.started_at_utc)}</td>"
        f"<td>{'baseline update' if run.baseline_update else ''}</td>"
        f"<td class=regression>{len(run.regressions) or ''}</td></tr>"
        for index, run in enumerate(runs)
    )
    runs_table = (
        "<table><thead><tr><th>run</th><th>id</th><th>started (UTC)</th><th>baselines</th>"
        f"<th>regressions</th></tr></thead><tbody>{rows}</tbody></table>"
    )
    note = (
        "<p class=note>One point per run, oldest first; red cross: the gate found a regression; "
        "dashed line: the baselines were updated in that run.</p>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>gpubench history</title><style>{STYLE}</style></head>\n<body>\n"
        f"<h1>Benchmark history: {len(runs)} runs</h1>\n{note}\n"
        + "\n".join(charts)
        + f"\n<h2>Runs</h2>\n{runs_table}\n</body></html>\n"
    )
