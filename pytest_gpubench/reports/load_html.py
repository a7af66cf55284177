"""The HTML report's load section (pure): per cell and prompt, its load points drawn against
concurrency (closed loops) or request rate (open loops and sweeps) — output tokens/s and goodput,
TTFT and TPOT p50/p99, the latency-throughput curve with the saturation rate and the SLO marked,
send lag and errors — beside the load baseline's points where there are any; then the points'
table, the client against the engine's own means, and the delivery warnings."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pytest_gpubench.reports.charts import inline_svg, pyplot
from pytest_gpubench.reports.formatting import escaped as _e
from pytest_gpubench.reports.formatting import html_table
from pytest_gpubench.reports.load_tables import (
    ADAPTER_HEADERS,
    SERVER_CHECK_HEADERS,
    adapter_split_rows,
    load_headers,
    load_rows,
    server_check_rows,
)
from pytest_gpubench.results.load_gate import point_key
from pytest_gpubench.results.stats import field_number

if TYPE_CHECKING:
    from pytest_gpubench.ledger.schema import LoadRecord

CURRENT_COLOR = "#1f6fb4"
P99_COLOR = "#c0392b"
BASELINE_COLOR = "#9a9a9a"
SLO_COLOR = "#d68910"
SATURATION_COLOR = "#1e8449"

# {cell id: {point key: baseline point}} as results/load_baseline.read_load_baselines gives.
LoadBaselines = Mapping[str, Mapping[str, Mapping[str, Any]]]


def _middle(row: Any) -> float | None:
    """A time slice's middle (s into its window), or None where it does not say its place."""
    if not isinstance(row, Mapping):
        return None
    start, span = field_number(row.get("start_s")), field_number(row.get("span_s"))
    return None if start is None or span is None else start + span / 2


def axis_of(point: Mapping[str, Any]) -> tuple[str, float | None]:
    """Which axis a point is drawn on and where: a closed loop by its concurrency, unless it is
    a sweep's step (all of a sweep's steps by request rate: offered, or achieved where a closed
    step offered none)."""
    if point.get("pattern") == "closed" and not point.get("sweep_step"):
        return "concurrency", field_number(point.get("concurrency"))
    offered = field_number(point.get("rate"))
    return "request rate (req/s)", offered if offered is not None else field_number(
        point.get("achieved_rate")
    )


def render_load_section(loads: Sequence[LoadRecord], baselines: LoadBaselines | None = None) -> str:
    """The section; empty for a ledger without load records."""
    if not loads:
        return ""
    baselines = baselines or {}
    parts = [
        "<h2>Load</h2>",
        "<p class=note>Each load point of this run in colour (p50 solid, p99 dashed), the load "
        "baseline's points in grey where there are any. The latency-throughput panel marks the "
        "saturation rate (green) and the SLO's TTFT limit (orange).</p>",
    ]
    for cell_id in sorted({str(load.get("cell_id")) for load in loads}):
        own = [load for load in loads if str(load.get("cell_id")) == cell_id]
        parts.append(f"<h3>{_e(cell_id)}</h3>")
        old = baselines.get(cell_id, {})
        for prompt_id in sorted({str(load.get("prompt_id")) for load in own}):
            points = [
                load
                for load in own
                if str(load.get("prompt_id")) == prompt_id and load.get("pattern") != "sweep"
            ]
            sweeps = [
                load
                for load in own
                if str(load.get("prompt_id")) == prompt_id and load.get("pattern") == "sweep"
            ]
            by_axis: dict[str, list[Mapping[str, Any]]] = {}
            for point in points:
                by_axis.setdefault(axis_of(point)[0], []).append(point)
            for axis, drawn in sorted(by_axis.items()):
                previous = [old[point_key(point)] for point in drawn if point_key(point) in old]
                saturation = next(
                    (
                        field_number(s.get("saturation_rate"))
                        for s in sweeps
                        if axis != "concurrency"
                    ),
                    None,
                )
                parts.append(
                    _load_chart(f"{cell_id} · {prompt_id}", axis, drawn, previous, saturation)
                )
            sliced = [point for point in points if point.get("slices")]
            if sliced:
                parts.append(_slices_chart(f"{cell_id} · {prompt_id} · over time", sliced))
        parts.append(_points_table(own))
    return "\n".join(parts)


def _escaped(rows: Iterable[Sequence[Any]]) -> list[list[str]]:
    return [[_e(cell) for cell in row] for row in rows]


def _points_table(loads: Sequence[LoadRecord]) -> str:
    text = html_table(load_headers(loads), _escaped(load_rows(loads)))
    if any("coalesced_calls" in load or load.get("server_check") for load in loads):
        text += (
            "\n<p class=note>The client's means against the engine's own over the same point "
            "(its /metrics read before and after), the replies that came whole in one read, "
            "and the requests behind the percentiles.</p>"
            + html_table(SERVER_CHECK_HEADERS, _escaped(server_check_rows(loads)))
        )
    split = adapter_split_rows(loads)
    if split:
        text += (
            "\n<p class=note>Per LoRA adapter chosen per request: its measured requests, "
            "errors and latency.</p>" + html_table(ADAPTER_HEADERS, _escaped(split))
        )
    warnings = [
        f"<li class=regression>{_e(load.get('load_point'))}: {_e(warning)}</li>"
        for load in loads
        for warning in load.get("delivery_warnings") or ()
    ]
    if warnings:
        text += "\n<ul>" + "".join(warnings) + "</ul>"
    return text


def _series(points: Sequence[Mapping[str, Any]], field: str) -> tuple[list[float], list[float]]:
    pairs = sorted(
        (x, y)
        for point in points
        if (x := axis_of(point)[1]) is not None
        and (y := field_number(point.get(field))) is not None
    )
    return [x for x, _ in pairs], [y for _, y in pairs]


def _load_chart(
    title: str,
    axis: str,
    points: Sequence[Mapping[str, Any]],
    baseline: Sequence[Mapping[str, Any]],
    saturation: float | None,
) -> str:
    """Four panels against one axis: throughput and goodput, TTFT and TPOT p50/p99, latency
    against throughput, send lag and errors."""
    plt = pyplot()
    figure, (rate, latency, curve, client) = plt.subplots(1, 4, figsize=(13, 3.0))

    def draw(axes: Any, field: str, label: str, color: str, dashed: bool = False) -> None:
        style = "--" if dashed else "-"
        xs, ys = _series(points, field)
        if xs:
            axes.plot(xs, ys, style, marker="o", markersize=3.5, color=color, label=label)
        old_x, old_y = _series(baseline, field)
        if old_x:
            axes.plot(old_x, old_y, style, marker="o", markersize=3, color=BASELINE_COLOR,
                      linewidth=0.9, label=f"{label} (baseline)")  # fmt: skip

    draw(rate, "output_tokens_per_sec", "output tokens/s", CURRENT_COLOR)
    rate.set_title("output tokens/s", loc="left")
    if any(field_number(p.get("goodput_rate")) is not None for p in points):
        goodput = rate.twinx()
        draw(goodput, "goodput_rate", "goodput req/s", SLO_COLOR, dashed=True)
        goodput.set_ylabel("goodput req/s (dashed)")
    draw(latency, "ttft_ms_p50", "TTFT p50", CURRENT_COLOR)
    draw(latency, "ttft_ms_p99", "TTFT p99", CURRENT_COLOR, dashed=True)
    draw(latency, "tpot_ms_p50", "TPOT p50", P99_COLOR)
    draw(latency, "tpot_ms_p99", "TPOT p99", P99_COLOR, dashed=True)
    latency.set_title("TTFT (blue) and TPOT (red) ms", loc="left")
    if any(field_number(p.get("ttft_ms_p50")) for p in points):
        latency.set_yscale("log")
    latency.legend(fontsize=6, loc="upper left")
    _latency_curve(curve, points, baseline, saturation)
    draw(client, "send_lag_ms_p99", "send lag p99 ms", CURRENT_COLOR)
    client.set_title("send lag p99 ms; errors (bars)", loc="left")
    errors = client.twinx()
    xs, ys = _series(points, "errors")
    if xs:
        width = (max(xs) - min(xs)) / 30 if len(xs) > 1 and max(xs) > min(xs) else 0.3
        errors.bar(xs, ys, width=width, color=P99_COLOR, alpha=0.5)
    errors.set_ylim(bottom=0, top=max([*ys, 1.0]) * 1.2)
    for axes in (rate, latency, client):
        axes.set_xlabel(axis)
        axes.grid(color="#eeeeee")
    figure.suptitle(title, x=0.01, ha="left", fontsize=10)
    figure.tight_layout()
    return inline_svg(figure)


def _latency_curve(
    axes: Any,
    points: Sequence[Mapping[str, Any]],
    baseline: Sequence[Mapping[str, Any]],
    saturation: float | None,
) -> None:
    """TTFT p99 against achieved requests/s (each point labelled), the saturation rate and the
    SLO's TTFT limit."""
    for group, color, label in ((baseline, BASELINE_COLOR, "baseline"), (points, P99_COLOR, "")):
        pairs = sorted(
            (x, y, str(point.get("load_point")))
            for point in group
            if (x := field_number(point.get("achieved_rate"))) is not None
            and (y := field_number(point.get("ttft_ms_p99"))) is not None
        )
        if not pairs:
            continue
        axes.plot([x for x, _, _ in pairs], [y for _, y, _ in pairs], "-", marker="o",
                  markersize=3.5, color=color, label=label or "this run")  # fmt: skip
        if group is points:
            for x, y, name in pairs:
                axes.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if saturation is not None:
        axes.axvline(saturation, color=SATURATION_COLOR, linestyle=":", label="saturation")
    slo = next((p.get("slo") for p in points if isinstance(p.get("slo"), Mapping)), None)
    limit = field_number(slo.get("ttft_ms")) if slo is not None else None
    if limit is not None:
        axes.axhline(limit, color=SLO_COLOR, linestyle="--", label="SLO TTFT")
    axes.set_title("TTFT p99 ms against req/s", loc="left")
    axes.set_xlabel("achieved req/s")
    axes.grid(color="#eeeeee")
    axes.legend(fontsize=6, loc="upper left")


def _slices_chart(title: str, points: Sequence[Mapping[str, Any]]) -> str:
    """Each point's time slices (`slice_s`) against the time into its measured window: output
    tokens/s and TTFT p50/p99 per slice, one colour per point, so that a point that degraded
    partway shows where; a ramp's slices before 0 (dotted, shaded), left out of its figures."""
    plt = pyplot()
    figure, (rate, latency) = plt.subplots(1, 2, figsize=(13, 3.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, point in enumerate(points):
        color = colors[index % len(colors)]
        name = str(point.get("load_point"))
        # A slice without its place (a hand-edited or merged ledger) is left out, not a crash.
        rows = [row for row in point.get("slices") or () if _middle(row) is not None]
        ramp = [row for row in point.get("ramp_slices") or () if _middle(row) is not None]
        ramp_span = sum(field_number(row.get("span_s")) or 0.0 for row in ramp)
        for axes, field in ((rate, "output_tokens_per_sec"), (latency, "ttft_ms_p50")):
            pairs = [
                ((_middle(row) or 0.0) - ramp_span, y)
                for row in ramp
                if (y := field_number(row.get(field))) is not None
            ]
            if pairs:
                axes.plot([x for x, _ in pairs], [y for _, y in pairs], ":", marker=".",
                          color=color, label=f"{name} ramp")  # fmt: skip
                axes.axvspan(-ramp_span, 0.0, color="#eeeeee", zorder=0)
        for axes, field, label, style in (
            (rate, "output_tokens_per_sec", f"{name} output tokens/s", "-"),
            (latency, "ttft_ms_p50", f"{name} TTFT p50", "-"),
            (latency, "ttft_ms_p99", f"{name} TTFT p99", "--"),
        ):
            pairs = [
                (_middle(row) or 0.0, y)
                for row in rows
                if (y := field_number(row.get(field))) is not None
            ]
            if pairs:
                axes.plot([x for x, _ in pairs], [y for _, y in pairs], style, marker="o",
                          markersize=3.5, color=color, label=label)  # fmt: skip
    rate.set_title("output tokens/s per slice", loc="left")
    latency.set_title("TTFT p50 (solid) and p99 (dashed) ms per slice", loc="left")
    for axes in (rate, latency):
        axes.set_xlabel("s into the measured window (a ramp before 0)")
        axes.grid(color="#eeeeee")
        axes.legend(fontsize=6, loc="upper left")
    figure.suptitle(title, x=0.01, ha="left", fontsize=10)
    figure.tight_layout()
    return inline_svg(figure)
