"""Confirmation before failing (pure): a regression found on the session's first pass stands
only when the re-measure (pass 2, run/remeasure.py) finds it too; otherwise it is `not
confirmed` and does not fail the run. Both passes' figures are named in the verdict."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from pytest_gpubench.results.gate import Verdict, VerdictKind
from pytest_gpubench.results.metric import GATED_METRICS
from pytest_gpubench.results.steadiness import signed_percent

CONFIRMED = "confirmed"
NOT_CONFIRMED = "not confirmed"
RATIO_NAMES = {metric.name for metric in GATED_METRICS}


def suspects(verdicts: Iterable[Verdict]) -> list[tuple[str, str]]:
    """The (cell, prompt)s with a regression on a measured figure (not a telemetry limit or a
    success rate: those are absolute), sorted."""
    return sorted(
        {v.key for v in verdicts if v.verdict == "regression" and v.metric in RATIO_NAMES}
    )


def confirm(
    first: Iterable[Verdict],
    second: Iterable[Verdict],
    not_remeasured: Mapping[tuple[str, str], str] | None = None,
) -> list[Verdict]:
    """The first pass's verdicts, each suspected regression decided on both passes: confirmed
    when the second pass regresses too, else `inconclusive` (or `unsteady` when the second pass
    found the machine unsteady) and `not confirmed`. A suspect that could not be measured again
    keeps its regression and says why."""
    again = {(v.key, v.metric): v for v in second}
    skipped = not_remeasured or {}
    result = []
    for verdict in first:
        if verdict.verdict != "regression" or verdict.metric not in RATIO_NAMES:
            result.append(verdict)
            continue
        if verdict.key in skipped:
            note = f"; not re-measured: {skipped[verdict.key]}"
            result.append(replace(verdict, message=_noted(verdict.message, note)))
            continue
        later = again.get((verdict.key, verdict.metric))
        if later is not None and later.verdict == "regression":
            note = f"; confirmed on re-measure ({_figure(later)})"
            result.append(
                replace(verdict, remeasure=CONFIRMED, message=_noted(verdict.message, note))
            )
            continue
        seen = _figure(later) if later is not None else "no successful call"
        kind: VerdictKind = (
            "unsteady" if later is not None and later.verdict == "unsteady" else "inconclusive"
        )
        note = f"; not confirmed on re-measure ({seen}: {later.verdict if later else 'unmeasured'})"
        result.append(
            replace(
                verdict,
                verdict=kind,
                remeasure=NOT_CONFIRMED,
                message=_noted(verdict.message, note),
            )
        )
    return result


def _noted(message: str, note: str) -> str:
    """The message with the note added before a closing bracketed remark (the baseline accepted
    from another setup), which stays last."""
    cut = message.rfind(" [") if message.endswith("]") else -1
    if cut < 0:
        return message + note
    return message[:cut] + note + message[cut:]


def _figure(verdict: Verdict) -> str:
    if verdict.change_ratio is None:
        return "pass 2: not measured"
    p_value = f", p = {verdict.p_value:.3g}" if verdict.p_value is not None else ""
    return f"pass 2: {signed_percent(verdict.change_ratio)}{p_value}"
