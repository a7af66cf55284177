"""The comparison of two runs (`gpubench compare`, `gpubench gate`, the Markdown document's
gate section): each (cell, prompt, metric) old against new, with its verdict. Pure."""

from __future__ import annotations

from collections.abc import Iterable

from pytest_gpubench.reports.formatting import METRIC_LABELS, NONE, change, fixed, table
from pytest_gpubench.reports.terminal import detectable, verdict_notes
from pytest_gpubench.results.gate import Verdict

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
