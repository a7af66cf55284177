"""The Markdown baseline document of a ledger (`gpubench report`): the run, a top summary, and
per cell its cold and warm tables and its gate. Pure: records in, text out; deterministic."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from pytest_gpubench.ledger.schema import end_of, meta_of, records_of
from pytest_gpubench.reports.comparison import render_comparison
from pytest_gpubench.reports.engine_checks_table import (
    engine_check_warnings,
    render_engine_checks,
)
from pytest_gpubench.reports.formatting import (
    code_span,
    command_text,
    fixed,
    markdown_cell,
    plain,
    table,
)
from pytest_gpubench.reports.load_tables import (
    render_adapter_split,
    render_load_table,
    render_percentile_intervals,
    render_server_check,
)
from pytest_gpubench.reports.telemetry_table import telemetry_section
from pytest_gpubench.reports.terminal import (
    KIND_HEADERS,
    cold_kind_words,
    kind_rows,
    reasoning_shown,
    render_ab,
)
from pytest_gpubench.results.engine_checks import EngineChecks, engine_checks
from pytest_gpubench.results.gate import (
    Verdict,
)
from pytest_gpubench.results.judging_settings import unchecked_cells
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


# -- the Markdown baseline document -----------------------------------------------------------


def render_markdown(records: Iterable[Mapping[str, Any]]) -> str:
    """The baseline document of one ledger: the same ledger always gives the same bytes."""
    records = list(records)
    others = [record for record in records if record.get("type") != "call"]
    calls = [record for record in records if record.get("type") == "call"]
    checks = engine_checks(calls, unchecked_cells(meta_of(others) or {}))
    return render_document(others, summarize(records), telemetry_summaries(records), checks)


def render_document(
    others: Sequence[Mapping[str, Any]],
    summaries: Sequence[PromptSummary],
    telemetry: Sequence[TelemetrySummary] = (),
    checks: Sequence[EngineChecks] = (),
) -> str:
    """render_markdown from a ledger read as columns (ledger_frame): the records other than
    calls, the summaries of the calls (with their samples, for the request kinds' valid
    answers), their resource figures and their checks against the engine."""
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
        telemetry_section(telemetry),
        _kinds_section(summaries),
        _engine_checks_section(checks),
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
    git = code_span(meta.get("git_sha"))
    if meta.get("git_dirty"):
        git += f" (dirty: {', '.join(code_span(name) for name in dirty) or 'yes'})"
    command = meta.get("command_line")
    python = f"{plain(meta.get('python_version'))} / {plain(meta.get('pytest_version'))}"
    load = f"{plain(meta.get('load_avg_start'))} / {plain(end.get('load_avg_end'))}"
    items = [
        ("started (UTC)", plain(meta.get("started_at_utc"))),
        ("finished (UTC)", plain(end.get("finished_at_utc"))),
        ("git", git),
        ("harness", plain(meta.get("harness_version"))),
        ("plugin", plain(meta.get("plugin_version"))),
        ("Python / pytest", python),
        ("host", f"{plain(meta.get('host'))} ({plain(meta.get('platform'))})"),
        ("load average start / end", load),
        ("command", code_span(command_text(command))),
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
    parts = [f"## {markdown_cell(cell_id)}"]
    if cell:
        parts.append(_cell_description(cell))
    cold = [s for s in mine if s.n_cold]
    warm = [s for s in mine if s.n_warm]
    if cold:
        parts.append("### Cold\n\n" + table(_cold_rows(cold), COLD_HEADERS, markdown=True))
    if warm:
        reasoning = reasoning_shown(warm)
        headers = (*WARM_HEADERS, *WARM_REASONING_HEADERS) if reasoning else WARM_HEADERS
        rows = _warm_rows(warm, reasoning=reasoning)
        parts.append("### Warm\n\n" + table(rows, headers, markdown=True))
    own_loads = [record for record in loads if record.get("cell_id") == cell_id]
    if own_loads:
        parts.append("### Load\n\n" + render_load_table(own_loads, markdown=True))
        check = render_server_check(own_loads, markdown=True)
        if check:
            parts.append("Client against engine, per point:\n\n" + check)
        intervals = render_percentile_intervals(own_loads, markdown=True)
        if intervals:
            parts.append("Percentiles with their intervals, per point:\n\n" + intervals)
        split = render_adapter_split(own_loads, markdown=True)
        if split:
            parts.append("Per LoRA adapter, per point:\n\n" + split)
        warnings = [
            f"- **{markdown_cell(str(load.get('load_point')))}**: {markdown_cell(warning)}"
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
        ("engine", f"{plain(cell.get('engine'))} {code_span(cell.get('engine_version'))}"),
        ("model", f"{plain(cell.get('model'))} ({_model_identity(cell)})"),
        ("GPUs", _gpus(cell.get("gpus"))),
    ]
    if cell.get("endpoint"):
        items.append(("endpoint", code_span(cell.get("endpoint"))))
    return "\n".join(f"- {name}: {value}" for name, value in items)


def _model_identity(cell: CellRecord) -> str:
    """`digest sha256:…`, or what identifies the model where no digest is known."""
    parts = [f"digest {code_span(cell.get('model_digest'))}"]
    identity = cell.get("model_identity")
    if identity and identity != "digest":
        parts.append(f"identity: {identity}")
    if cell.get("model_root"):
        parts.append(f"root {code_span(cell.get('model_root'))}")
    if cell.get("max_model_len"):
        parts.append(f"max model length {cell.get('max_model_len')}")
    return ", ".join(parts)


def _gpus(gpus: Any) -> str:
    if not isinstance(gpus, list):
        return "none reported"
    return gpu_summary(gpus)


COLD_HEADERS = ("prompt", "cold kind", "calls", "ok", "TTFT ms", "total ms")
# The warm table's figures: (header, measure, percentile, decimals), after prompt, calls and ok.
_WARM_FIGURES = (
    ("TTFT p50", "first_delta_ms", "p50", 2),
    ("TTFT p95", "first_delta_ms", "p95", 2),
    ("TTFT p99", "first_delta_ms", "p99", 2),
    ("total p50", "total_duration_ms", "p50", 2),
    ("total p95", "total_duration_ms", "p95", 2),
    ("total p99", "total_duration_ms", "p99", 2),
    ("decode tok/s p50", "decode_tokens_per_sec", "p50", 1),
    ("TPOT p90 ms", "tpot_ms", "p90", 3),
    ("engine tok/s p50", "engine_tokens_per_sec", "p50", 1),
)
# Where some prompt of the cell reasoned (issue 23): its first answer token and reasoning tokens.
_REASONING_FIGURES = (
    ("first answer p50", "first_answer_ms", "p50", 2),
    ("first answer p95", "first_answer_ms", "p95", 2),
    ("first answer p99", "first_answer_ms", "p99", 2),
    ("reasoning tok p50", "reasoning_tokens", "p50", 0),
)
WARM_HEADERS = ("prompt", "calls", "ok", *(f[0] for f in _WARM_FIGURES), "coalesced")
WARM_REASONING_HEADERS = tuple(f[0] for f in _REASONING_FIGURES)


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
    extra = _REASONING_FIGURES if reasoning else ()
    return [
        [
            s.prompt_id,
            str(s.n_warm),
            str(s.n_warm_ok),
            *(fixed(s.figure(measure, p), digits) for _, measure, p, digits in _WARM_FIGURES),
            str(s.warm_coalesced),
            *(fixed(s.figure(measure, p), digits) for _, measure, p, digits in extra),
        ]
        for s in summaries
    ]


def _kinds_section(summaries: Sequence[PromptSummary]) -> str:
    """The request kinds' figures (the terminal's kind columns) of each (cell, prompt) that is
    not chat; none where all are."""
    rows = kind_rows(summaries)
    if not rows:
        return ""
    headers = ("cell", "prompt", *KIND_HEADERS)
    return "## Request kinds\n\n" + table(rows, headers, markdown=True)


def _engine_checks_section(checks: Sequence[EngineChecks]) -> str:
    """The terminal's table of the checks against the engine, then its warnings."""
    rendered = render_engine_checks(checks, markdown=True)
    if not rendered:
        return ""
    warnings = [f"- {markdown_cell(line)}" for line in engine_check_warnings(checks)]
    parts = ["## Checks against the engine", rendered]
    if warnings:
        parts.append("\n".join(warnings))
    return "\n\n".join(parts)


def _gate_section(end: EndRecord) -> str:
    known = Verdict.all_from_records(end.get("verdicts"))
    if not known:
        return ""
    gate = "## Regression gate\n\n" + render_comparison(known, markdown=True)
    head_to_head = render_ab(known, markdown=True)
    if head_to_head:
        gate += "\n\n## Head-to-head A/B\n\n" + head_to_head
    return gate
