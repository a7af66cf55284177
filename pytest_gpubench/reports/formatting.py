"""How every report writes a figure: numbers, changes, the metrics' labels, and tables (plain,
Markdown or HTML). Pure: values in, text out."""

from __future__ import annotations

import html
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

from tabulate import tabulate

from pytest_gpubench.results.gate import PROVENANCE
from pytest_gpubench.results.metric import GATED_METRICS, SUCCESS_RATE
from pytest_gpubench.results.stats import PromptSummary
from pytest_gpubench.results.steadiness import signed_percent

NONE = "-"
METRIC_LABELS = {
    **{metric.name: metric.figure.column for metric in GATED_METRICS},
    # Gated before issue 11; still named when an older ledger's end record is rendered.
    "warm_tokens_per_sec_mean": "tok/s mean",
    SUCCESS_RATE: "success rate",
    PROVENANCE: "baseline setup",
}
# Shown under a table: the verdicts a reader has to act on, and a figure not gated for its prompt.
NOTEWORTHY = ("regression", "incomparable", "unsteady", "inconclusive", "blind", "win", "ungated")


# -- formatting -------------------------------------------------------------------------------


def fixed(value: float | None, digits: int = 2) -> str:
    """A figure with `digits` decimals; `-` for none, or for a value that is no number (an
    edited ledger's: a record's figure of the wrong type is unknown)."""
    return f"{value:.{digits}f}" if isinstance(value, numbers.Real) else NONE


def change(ratio: float | None) -> str:
    """1.352 -> "+35.2%"."""
    return NONE if ratio is None else signed_percent(ratio)


def success(summary: PromptSummary) -> str:
    return f"{summary.n_warm_ok}/{summary.n_warm}" if summary.n_warm else NONE


def table(rows: Sequence[Sequence[str]], headers: Sequence[str], *, markdown: bool = False) -> str:
    """Cells pre-formatted as text; columns of numbers right-aligned, names left-aligned."""
    cell = markdown_cell if markdown else str
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


def plain(value: Any) -> str:
    return NONE if value is None or value == "" else str(value)


def command_text(command: object) -> object:
    """A meta record's command line as one text: its words joined (each as text: an edited
    ledger's may hold null), or the value as it is where it is no list."""
    return " ".join(str(word) for word in command) if isinstance(command, list) else command


def code_span(value: Any) -> str:
    return NONE if value is None or value == "" else f"`{value}`"


def markdown_cell(text: str) -> str:
    """Escape the one character that breaks a Markdown table cell."""
    return text.replace("|", "\\|")


def shortened(text: str, limit: int = 100) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def escaped(value: Any) -> str:
    """A value as HTML text (`-` for nothing)."""
    return html.escape(NONE if value is None or value == "" else str(value))


def html_table(
    headers: Sequence[str], rows: Iterable[Sequence[str]], numeric: Sequence[int] = ()
) -> str:
    """An HTML table of cells already escaped (some carry markup); the columns in `numeric`
    right-aligned."""
    head = "".join(f"<th>{escaped(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{cell}</td>' if index in numeric else f"<td>{cell}</td>"
            for index, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
