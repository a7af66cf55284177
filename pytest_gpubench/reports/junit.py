"""What CI sees in pytest's JUnit XML (--junitxml): each case's figures as properties, and each
regression, incomparable baseline and unmeasured cell as a failed test case of its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gpubench.config.metrics import MEASURES

if TYPE_CHECKING:
    from pytest_gpubench.results.judging import Judgement
    from pytest_gpubench.results.verdict import Verdict

# The JUnit "file" of the gate's own test cases; their class name is gpubench.gate.
GATE_PATH = "gpubench/gate"
_LEADING = (
    "first_delta_ms",
    "total_duration_ms",
    "prompt_tokens",
    "completion_tokens",
    "client_chunks",
    "tokens_per_sec",
    "tpot_ms",
    "e2e_tokens_per_sec",
    "coalesced",
    "engine_tokens_per_sec",
    "engine_prompt_ms",
    "engine_total_ms",
    "finish_reason",
    "cold_kind",
    "error",
)
# Then each measure's call record field those leave out (config/metrics.py): a measure added
# there is a property too. A reasoning model's are a call's that reasoned only.
CALL_PROPERTIES = (
    *_LEADING,
    *(m.field for m in MEASURES if not m.reasoning and m.field not in _LEADING),
)
REASONING_PROPERTIES = (*(m.field for m in MEASURES if m.reasoning), "answer_tokens")


# A load case's figures (its `load` record).
LOAD_PROPERTIES = (
    "load_point",
    "achieved_rate",
    "output_tokens_per_sec",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p99",
    "goodput_rate",
    "errors",
    "send_lag_ms_p99",
    "valid",
    "saturation_rate",
    "error",
)


def call_properties(record: Mapping[str, Any]) -> list[tuple[str, object]]:
    """A call record's figures as JUnit properties; the engine's own timings as `engine.<name>`.
    A load case's record gives its load figures."""
    if record.get("type") == "load":
        return [(name, record[name]) for name in LOAD_PROPERTIES if record.get(name) is not None]
    properties: list[tuple[str, object]] = [
        (name, record[name]) for name in CALL_PROPERTIES if record.get(name) is not None
    ]
    # A call that reasoned (issue 23): when its answer began and how its tokens split; other
    # calls' first answer is their TTFT, not repeated.
    if record.get("reasoning_tokens"):
        properties.extend(
            (name, record[name]) for name in REASONING_PROPERTIES if record.get(name) is not None
        )
    timings = record.get("engine_timings")
    if isinstance(timings, Mapping):
        properties.extend(
            (f"engine.{name}", value)
            for name, value in sorted(timings.items())
            if isinstance(value, int | float | str)
        )
    return properties


def gate_failures(judgement: Judgement) -> list[tuple[str, str]]:
    """(test name, message) of everything the gate failed the run for."""
    failures = [
        (
            f"{outcome.cell_id} unmeasured",
            f"{outcome.cell_id}: {outcome.status} "
            f"({outcome.stage or 'no stage'}): {outcome.reason}",
        )
        for outcome in judgement.unmeasured
    ]
    found = [*judgement.failing_regressions(), *judgement.failing_incomparables()]
    failures.extend(
        (f"{v.cell_id} {v.prompt_id} {v.metric}", f"{v.verdict.upper()}: {v.message}")
        for v in found
    )
    return failures


def ab_passes(judgement: Judgement) -> list[tuple[str, list[tuple[str, object]]]]:
    """(test name, properties) of each A/B verdict that is no regression (those are failures)
    and not undecided (those are skipped): CI sees every candidate's verdict word, its ratio of
    medians, interval and p."""
    from pytest_gpubench.results.judging import holds_back

    return [
        (
            _case_name(v),
            [
                ("gpubench.verdict", v.verdict),
                ("gpubench.change_ratio", v.change_ratio),
                ("gpubench.interval", f"{v.interval_low} {v.interval_high}"),
                ("gpubench.p_value", v.p_value),
                ("gpubench.pairs", f"{v.pairs}/{v.max_pairs}"),
                ("gpubench.calls", v.calls),
                ("gpubench.message", v.message),
            ],
        )
        for v in judgement.verdicts
        if v.reference is not None and v.verdict != "regression" and not holds_back(v)
    ]


def gate_skips(judgement: Judgement) -> list[tuple[str, str]]:
    """(test name, message) of what the gate could not tell (the run exits 10): an `unsteady`
    verdict (the machine drifted), an `inconclusive` one (past the threshold, not decided) and a
    `blind` one (nothing seen, but nothing could have been)."""
    if judgement.settings.baseline_update:
        return []
    return [(_case_name(v), f"{v.verdict.upper()}: {v.message}") for v in judgement.undecided()]


def _case_name(verdict: Verdict) -> str:
    """A gate case's name: an A/B candidate's names its reference."""
    against = f" vs {verdict.reference}" if verdict.reference is not None else ""
    return f"{verdict.cell_id}{against} {verdict.prompt_id} {verdict.metric}"


def add_gate_failures(config: pytest.Config, judgement: Judgement) -> None:
    """Write the gate's failures into the JUnit XML, when pytest writes one: each a failed
    `gpubench.gate` case; an unsteady or blind verdict a skipped one; each A/B verdict that
    passed a passed one (with its figures as properties)."""
    from _pytest.junitxml import xml_key

    xml = config.stash.get(xml_key, None)
    if xml is None:
        return
    for name, properties in ab_passes(judgement):
        nodeid = f"{GATE_PATH}::{name}"
        for when in ("call", "teardown"):
            xml.pytest_runtest_logreport(
                pytest.TestReport(
                    nodeid,
                    (GATE_PATH, None, name),
                    {},
                    "passed",
                    None,
                    "call" if when == "call" else "teardown",
                    user_properties=properties if when == "teardown" else (),
                )
            )
    for name, message in gate_skips(judgement):
        nodeid = f"{GATE_PATH}::{name}"
        for when, outcome in (("call", "skipped"), ("teardown", "passed")):
            xml.pytest_runtest_logreport(
                pytest.TestReport(
                    nodeid,
                    (GATE_PATH, None, name),
                    {},
                    outcome,  # type: ignore[arg-type]
                    (GATE_PATH, 0, message) if outcome == "skipped" else None,
                    when,  # type: ignore[arg-type]
                )
            )
    for name, message in gate_failures(judgement):
        nodeid = f"{GATE_PATH}::{name}"
        for when, outcome in (("call", "failed"), ("teardown", "passed")):
            xml.pytest_runtest_logreport(
                pytest.TestReport(
                    nodeid,
                    (GATE_PATH, None, name),
                    {},
                    outcome,  # type: ignore[arg-type]
                    message if outcome == "failed" else None,
                    when,  # type: ignore[arg-type]
                )
            )
