"""The regression gate: each (cell, prompt) summary against its baseline, metric by metric."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from pytest_gpubench.config.cell import Thresholds, engine_of
from pytest_gpubench.config.engine_kinds import engine_kind
from pytest_gpubench.config.metrics import (
    DEFAULT_RATIO_THRESHOLD,
    DEFAULT_SUCCESS_RATE,
    MEASURES,
    RESOURCE_LIMITS,
    VALIDITY,
    ValidityRate,
)
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.results.decision import (
    ALPHA,
    EXACT_TEST_MAX_N,
    VERDICT_ORDER,
    Decision,
    Evidence,
    VerdictKind,
    change_direction,
    decide,
    describe_change,
    min_achievable_p,
    mwu_method,
    one_sided_p,
    scipy_stats,
)
from pytest_gpubench.results.machine_steadiness import machine_steadiness
from pytest_gpubench.results.metric import (
    DECODE_TOKENS_PER_SEC,
    SUCCESS_RATE,
    Metric,
    gated_metrics,
    ratio_threshold,
    success_threshold,
    too_short_to_time,
)
from pytest_gpubench.results.run_history import (
    History,
    RunFigures,
    current_segment,
    figures,
)
from pytest_gpubench.results.stats import PromptSummary, is_success, summaries_by_key
from pytest_gpubench.results.steadiness import Steadiness, signed_percent
from pytest_gpubench.results.verdict import Attribution, Verdict, from_decision
from pytest_gpubench.telemetry.aggregate import limit_breaches, telemetry_summaries

__all__ = [
    "ALPHA",
    "DEFAULT_RATIO_THRESHOLD",
    "DEFAULT_SUCCESS_RATE",
    "EXACT_TEST_MAX_N",
    "VERDICT_ORDER",
    "Verdict",
    "VerdictKind",
    "change_direction",
    "min_achievable_p",
    "mwu_method",
    "one_sided_p",
]
# The metric of an `incomparable` verdict: the baseline's provenance, not a number.
PROVENANCE = "provenance"
ACCEPT_OPTION = "--gpubench-accept-incomparable"

RERUN_RUNS = 20
RERUN_HINT = f"re-run with --gpubench-runs {RERUN_RUNS}"
# A change is engine-side when the engine's own figure moved the same way by at least this share
# of the client's change (on a log scale: 0.5 means half as far); otherwise the engine held and
# the change lies between the engine and the client (transport, proxy, client machine).
ENGINE_SHARE = 0.5


def judge(
    current: PromptSummary,
    baseline: PromptSummary | None,
    thresholds: Thresholds | None = None,
    history: History = (),
    *,
    decode_gaps: int | None = None,
    alpha: float = ALPHA,
) -> list[Verdict]:
    """One verdict per metric; none when nothing warm was measured (a cold-only run).
    `history`: the baseline's last ratified runs of this (cell, prompt), oldest first;
    `decode_gaps`: the gaps between tokens of this run's replies (reply_gaps): a decode figure of
    replies too short to time is `ungated` (metric.too_short_to_time); `alpha`: the level of
    each test (a figure sampled on until decided tests at its look's share, sample_on.py)."""
    thresholds = thresholds or Thresholds()
    if current.n_warm == 0:
        return []
    metrics = gated_metrics(current, baseline, thresholds)
    if baseline is None:
        measured = [
            *((metric.name, metric.value(current)) for metric in metrics),
            (SUCCESS_RATE, current.warm_success_rate),
            *((rate.name, value) for rate, value in validity_rates(current)),
        ]
        new = Decision("new", "no baseline yet")
        return [from_decision(*current.key, name, new, current=value) for name, value in measured]
    check_prompt_unchanged(current, baseline)
    steady = machine_steadiness(current, baseline, history)
    verdicts = [
        ungated_verdict(metric, current, baseline, decode_gaps)
        or judge_ratio(
            metric,
            current,
            baseline,
            ratio_threshold(thresholds, metric.threshold_field),
            # The figure since its last ratified step: the reference is what that update
            # ratified.
            history=figures(current_segment(history, metric.name), metric.name),
            steady=steady,
            alpha=alpha,
        )
        for metric in metrics
    ]
    verdicts.append(judge_success_rate(current, baseline, success_threshold(thresholds)))
    verdicts += [
        judge_validity(rate, current, baseline, getattr(thresholds, rate.threshold_key))
        for rate, _ in validity_rates(current)
    ]
    return verdicts


def ungated_verdict(
    metric: Metric, current: PromptSummary, baseline: PromptSummary, decode_gaps: int | None
) -> Verdict | None:
    """A decode figure of replies too short to time: `ungated`, its figures shown, never
    judged; None for any other figure."""
    if not metric.measure.decode:
        return None
    why = too_short_to_time(decode_gaps)
    if why is None:
        return None
    old, new = metric.value(baseline), metric.value(current)
    ratio = new / old if new is not None and old else None
    seen = f"{metric.label} {signed_percent(ratio)}" if ratio is not None else metric.label
    decision = Decision("ungated", f"{seen}: {why}", old, ratio)
    return from_decision(*current.key, metric.name, decision, current=new)


def reply_gaps(calls: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], int]:
    """Per (cell, prompt): the gaps between tokens of its successful warm calls' replies (their
    completion tokens less one, the median), where the calls say how many tokens they had."""
    counts: dict[tuple[str, str], list[int]] = {}
    for call in calls:
        tokens = call.get("completion_tokens")
        if call.get("phase") != "warm" or not is_success(call):
            continue
        if isinstance(tokens, bool) or not isinstance(tokens, int | float) or tokens < 1:
            continue
        key = (str(call.get("cell_id")), str(call.get("prompt_id")))
        counts.setdefault(key, []).append(int(tokens) - 1)
    return {key: int(statistics.median_low(found)) for key, found in counts.items()}


def validity_rates(summary: PromptSummary) -> list[tuple[ValidityRate, float]]:
    """The validity rates a (cell, prompt) measured (config/metrics.VALIDITY), with their value."""
    found = [(rate, summary.validity_rate(rate.measure)) for rate in VALIDITY]
    return [(rate, value) for rate, value in found if value is not None]


def judge_validity(
    rate: ValidityRate, current: PromptSummary, baseline: PromptSummary, minimum: float | None
) -> Verdict:
    """Absolute, like the success rate: below the cell's floor (its `thresholds:` key) is a
    regression; without a floor, a fall below the baseline's rate is."""
    value = current.validity_rate(rate.measure)
    old = baseline.validity_rate(rate.measure)
    values = current.samples[rate.measure]
    counts = f"{int(sum(values))}/{len(values)}"
    ratio = value / old if value is not None and old else None
    found = partial(from_decision, *current.key, rate.name, current=value)
    if value is None:
        return found(Decision("new", "no valid answer checked", old))
    if minimum is not None and value < minimum:
        below = f"{rate.label} {value:.2f} ({counts}) is below {minimum:.2f}"
        return found(Decision("regression", below, old, ratio))
    if minimum is None and old is not None and value < old:
        # A fall is a regression where it is significant (Fisher's exact test, one-sided, on the
        # valid and invalid answers of the two runs): 19 of 20 after 20 of 20 is a sampled
        # model's noise as often as not, and undecided it holds the run back.
        then = baseline.samples[rate.measure]
        table = [
            [int(sum(then)), len(then) - int(sum(then))],
            [int(sum(values)), len(values) - int(sum(values))],
        ]
        p_value = float(scipy_stats().fisher_exact(table, alternative="greater").pvalue)
        fell = f"{rate.label} {value:.2f} ({counts}) fell from {old:.2f}"
        if p_value < ALPHA:
            return found(Decision("regression", f"{fell}, p = {p_value:.3g}", old, ratio, p_value))
        unsure = (
            f"{fell}, but not significant (p = {p_value:.3g} ≥ {ALPHA:g}); re-run with more "
            "runs, or set a floor (thresholds: {" + rate.threshold_key + ": …})"
        )
        return found(Decision("inconclusive", unsure, old, ratio, p_value))
    return found(Decision("ok", f"{rate.label} {value:.2f} ({counts})", old, ratio))


def counted_measure(kind: str) -> str:
    """The measure whose warm samples count a run's calls of this request kind: the first one
    it has (TTFT for a kind that generates, the end-to-end time for an embedding or a rerank,
    which have no TTFT)."""
    return next(m.name for m in MEASURES if m.samples and kind in m.kinds)


def run_figures(
    summary: PromptSummary, *, run_id: str | None, date: str | None, calibration: str | None = None
) -> RunFigures:
    """What a baseline's history keeps of one run of a (cell, prompt); `calibration`: the
    calibration it was one run of."""
    control = summary.samples["control_ms"]
    pressure = summary.samples["cpu_pressure"]
    engine_wait = summary.samples["engine_wait_per_cpu"]
    neighbours = summary.samples["neighbour_cpu_share"]
    return RunFigures(
        benchmark_run_id=run_id,
        date=date,
        n=len(summary.samples[counted_measure(summary.kind)]),
        figures={metric.name: metric.value(summary) for metric in gated_metrics(summary, None)},
        control_ms=sorted(control)[len(control) // 2] if control else None,
        cpu_pressure=statistics.median(pressure) if pressure else None,
        engine_wait_per_cpu=statistics.median(engine_wait) if engine_wait else None,
        neighbour_cpu_share=statistics.median(neighbours) if neighbours else None,
        calibration=calibration,
    )


def check_prompt_unchanged(current: PromptSummary, baseline: PromptSummary) -> None:
    """A frozen prompt never changes: comparing numbers of two different prompts means nothing."""
    if current.prompt_sha256 is None or baseline.prompt_sha256 is None:
        return
    if current.prompt_sha256 != baseline.prompt_sha256:
        raise GpubenchError(
            f"prompt '{current.prompt_id}' changed: cell {current.cell_id} has a baseline measured "
            f"with sha256 {baseline.prompt_sha256[:12]}…, this run used "
            f"{current.prompt_sha256[:12]}…. Prompts are frozen once shipped: restore the text of "
            f"'{current.prompt_id}' and add the new prompt under a new id instead."
        )


def judge_ratio(
    metric: Metric,
    current: PromptSummary,
    baseline: PromptSummary,
    threshold: float,
    *,
    history: tuple[float, ...] = (),
    steady: Steadiness | None = None,
    alpha: float = ALPHA,
) -> Verdict:
    """The decision core's verdict on one metric (decision.decide), with its attribution."""
    decision = decide(
        Evidence(
            label=metric.label,
            higher_is_better=metric.higher_is_better,
            threshold=threshold,
            baseline=metric.value(baseline),
            current=metric.value(current),
            current_samples=metric.samples(current),
            baseline_samples=metric.samples(baseline),
            history=history,
            steadiness=steady,
            more_samples_hint=RERUN_HINT,
            missing=_why_missing(metric, current),
            alpha=alpha,
        )
    )
    if decision.kind == "inconclusive":
        decision = _with_engines_word(
            metric, current, baseline, decision, threshold=threshold, steady=steady, alpha=alpha
        )
    cause: Attribution | None = None
    if decision.direction is not None and decision.ratio is not None:
        cause = attribute(metric, current, baseline, decision.ratio)
    return from_decision(current.cell_id, current.prompt_id, metric.name, decision, cause)


def _with_engines_word(
    metric: Metric,
    current: PromptSummary,
    baseline: PromptSummary,
    found: Decision,
    *,
    threshold: float,
    steady: Steadiness | None,
    alpha: float,
) -> Decision:
    """An `inconclusive` change judged within the run, decided by the engine's own counterpart
    (issue 43, item 6): where the engine's own figure over the same calls moved the same way past
    the threshold, and significantly at the same level, the change is the engine's and the
    client's together, and the engine's figure, free of the transport's and the client's jitter,
    decides it (a regression or a win) at the look where the client's spread alone could not:
    what sampling on would have decided, with fewer calls. Nothing else changes: a change the
    engine's figure did not share (the transport's, the client's), an engine figure that is not
    significant, a machine the engine's figure cannot be judged on (steadiness, as the client's),
    and a figure judged between runs (the history keeps no engine figures) stay as found."""
    measure = metric.figure.engine_measure
    now = metric.value(current)
    if (
        measure is None
        or metric.reasoning
        or found.direction is None
        or found.baseline is None
        or now is None
        or not (found.noise or "").startswith("within")
    ):
        return found
    engine = engine_name(current.cell_id)
    own = decide(
        Evidence(
            label=f"{engine}'s own {metric.engine_label}",
            higher_is_better=metric.higher_is_better,
            threshold=threshold,
            baseline=metric.engine_value(baseline),
            current=metric.engine_value(current),
            current_samples=current.samples.get(measure, ()),
            baseline_samples=baseline.samples.get(measure, ()),
            steadiness=steady,
            alpha=alpha,
        )
    )
    if own.kind not in ("regression", "win") or own.direction != found.direction:
        return found
    change = describe_change(
        metric.label, found.baseline, now, found.direction, metric.higher_is_better
    )
    alone = "" if found.p_value is None else f" (p = {found.p_value:.3g})"
    text = (
        f"{change}, not significant on its own{alone}, but decided with {engine}'s own "
        f"{metric.engine_label}, which moved with it over the same calls: {own.text}"
    )
    return replace(found, kind=own.kind, text=text, p_value=own.p_value)


def _why_missing(metric: Metric, current: PromptSummary) -> str:
    if metric.reasoning and current.n_warm_ok:
        return "the baseline's model reasoned, this run's produced no reasoning tokens"
    if metric.measure.decode and current.warm_coalesced:
        return (
            f"no decode rate in this run: {current.warm_coalesced} of {current.n_warm_ok} "
            "successful warm calls were coalesced (their content arrived in one read)"
        )
    return "no successful warm call to compare"


def engine_name(cell_id: str) -> str:
    """The server of the cell's engine kind (`<node>:<engine>:<model>`), for the messages."""
    return engine_kind(engine_of(cell_id) or "").server_name


def attribute(
    metric: Metric, current: PromptSummary, baseline: PromptSummary, ratio: float
) -> Attribution:
    """Did the engine's own figure move with the client's (current / baseline = `ratio`)?"""
    if metric.reasoning:
        return _reasoning_cause(current, baseline)
    old, new = metric.engine_value(baseline), metric.engine_value(current)
    engine = engine_name(current.cell_id)
    if old is None and new is None:
        return Attribution(
            "unknown", None, f"not attributed: {engine} reports no timings of its own"
        )
    if old is None or new is None or old <= 0 or new <= 0:
        side = "this run" if old is not None else "the baseline"
        return Attribution(
            "unknown", None, f"not attributed: {side} has no {engine} {metric.engine_label}"
        )
    engine_ratio = new / old
    own = f"{engine}'s own {metric.engine_label} {signed_percent(engine_ratio)}"
    if _share(engine_ratio, ratio) >= ENGINE_SHARE:
        return Attribution("engine", engine_ratio, f"engine-side: {own}")
    # The engine's prompt time leaves out the wait before it starts on a request (its queue, a
    # busy host); an engine slowed as a whole shows it in its decode rate over the same calls.
    # A lower rate is a longer time: inverted, it moves the way a slower TTFT or total does.
    rate_old = DECODE_TOKENS_PER_SEC.engine_value(baseline)
    rate_new = DECODE_TOKENS_PER_SEC.engine_value(current)
    if (
        metric is not DECODE_TOKENS_PER_SEC
        and rate_old
        and rate_new
        and _share(rate_old / rate_new, ratio) >= ENGINE_SHARE
    ):
        slower = f"{engine}'s own decode rate {signed_percent(rate_new / rate_old)}"
        return Attribution(
            "engine", engine_ratio, f"engine-side: {slower} over the same calls ({own})"
        )
    # The engine's timings start when it begins on the prompt: say what they cannot see.
    unseen = (
        ""
        if metric is DECODE_TOKENS_PER_SEC
        else f"; they leave out the wait before {engine} starts on a request"
    )
    return Attribution(
        "client_or_transport",
        engine_ratio,
        f"client or transport side: the engine's own timings held ({own}{unseen})",
    )


def _reasoning_cause(current: PromptSummary, baseline: PromptSummary) -> Attribution:
    """A later first answer comes from more reasoning or from slower tokens: the reasoning token
    count (p50) of both runs says which; the engine's own timings do not split the two."""
    old, new = baseline.figure("reasoning_tokens", "p50"), current.figure("reasoning_tokens", "p50")
    if old is None or new is None:
        return Attribution("unknown", None, "not attributed: no reasoning token count to compare")
    moved = f"reasoning tokens p50 {old:g} → {new:g}"
    return Attribution("unknown", None, f"not attributed: {moved}")


def _share(engine_ratio: float, client_ratio: float) -> float:
    """How far the engine's figure moved relative to the client's, on a log scale (1 = as far)."""
    if engine_ratio <= 0 or client_ratio <= 0 or client_ratio == 1.0:
        return 0.0
    return math.log(engine_ratio) / math.log(client_ratio)


def judge_success_rate(current: PromptSummary, baseline: PromptSummary, minimum: float) -> Verdict:
    """Absolute: below the minimum is a regression whatever the baseline was."""
    rate, old = current.warm_success_rate, baseline.warm_success_rate
    found = partial(from_decision, *current.key, SUCCESS_RATE, current=rate)
    if rate is None:
        return found(Decision("new", "no warm call measured", old))
    ratio = rate / old if old else None
    counts = f"{current.n_warm_ok}/{current.n_warm}"
    if rate < minimum:
        below = f"warm success rate {rate:.2f} ({counts}) is below {minimum:.2f}"
        return found(Decision("regression", below, old, ratio))
    return found(Decision("ok", f"warm success rate {rate:.2f} ({counts})", old, ratio))


def too_few_samples(n_baseline: int, n_later: int) -> str | None:
    """Why a baseline of `n_baseline` warm samples can never give a significant verdict against
    runs of `n_later` samples (--baseline-update refuses to write it), or None."""
    floor = min_achievable_p(n_later, n_baseline)
    if floor < ALPHA:
        return None
    return f"{n_baseline} against {n_later} (smallest possible p = {floor:.3g} ≥ {ALPHA})"


def incomparable(current: PromptSummary, changes: str) -> Verdict:
    """A baseline measured on another setup: its numbers are not judged."""
    text = (
        f"baseline measured on another setup ({changes}): its numbers are not judged; accept "
        f"them with {ACCEPT_OPTION} or ratify this setup with --baseline-update"
    )
    return from_decision(*current.key, PROVENANCE, Decision("incomparable", text))


def compare(
    old_summaries: Iterable[PromptSummary],
    new_summaries: Iterable[PromptSummary],
    thresholds: Thresholds | Mapping[str, Thresholds] | None = None,
    *,
    changed_setups: Mapping[str, str] | None = None,
    accept_incomparable: bool = False,
    histories: Mapping[tuple[str, str], History] | None = None,
    decode_gaps: Mapping[tuple[str, str], int] | None = None,
    alphas: Mapping[tuple[str, str], float] | None = None,
) -> list[Verdict]:
    """Verdicts for every new (cell, prompt), sorted; thresholds may be given per cell id.

    `changed_setups`: per cell id, what differs between its baseline's setup and this run's
    (`engine version b4100 → b4200`). Those cells' prompts with a baseline are `incomparable`,
    or, accepted, judged with a note on every verdict that the baseline came from another setup.
    `histories`: per (cell, prompt), the baseline's last ratified runs (run_history.py).
    `decode_gaps`: per (cell, prompt), the gaps between tokens of this run's replies (reply_gaps).
    `alphas`: per (cell, prompt) sampled on until decided, the level of its tests (sample_on.py).
    """
    old = summaries_by_key(old_summaries)
    gaps = decode_gaps or {}
    levels = alphas or {}
    changed = changed_setups or {}
    runs = histories or {}
    verdicts: list[Verdict] = []
    for summary in sorted(new_summaries, key=lambda item: item.key):
        baseline = old.get(summary.key)
        changes = changed.get(summary.cell_id)
        if changes and baseline is not None and summary.n_warm:
            if not accept_incomparable:
                verdicts.append(incomparable(summary, changes))
                continue
            note = f" [baseline from another setup ({changes}), accepted with {ACCEPT_OPTION}]"
            verdicts.extend(
                replace(verdict, message=verdict.message + note)
                for verdict in judge(
                    summary,
                    baseline,
                    _for_cell(thresholds, summary),
                    decode_gaps=gaps.get(summary.key),
                    alpha=levels.get(summary.key, ALPHA),
                )
            )
            continue
        history = runs.get(summary.key, ())
        verdicts.extend(
            judge(
                summary,
                baseline,
                _for_cell(thresholds, summary),
                history,
                decode_gaps=gaps.get(summary.key),
                alpha=levels.get(summary.key, ALPHA),
            )
        )
    return verdicts


def _for_cell(
    thresholds: Thresholds | Mapping[str, Thresholds] | None, summary: PromptSummary
) -> Thresholds:
    if thresholds is None:
        return Thresholds()
    if isinstance(thresholds, Thresholds):
        return thresholds
    return thresholds.get(summary.cell_id, Thresholds())


def telemetry_verdicts(
    records: Iterable[Mapping[str, Any]], thresholds: Mapping[str, Thresholds]
) -> list[Verdict]:
    """A regression for each (cell, prompt) whose warm calls' resource figure went over its
    cell's `max_` limit (peak VRAM, energy or engine CPU-seconds per token); none unmeasured."""
    limits = {
        cell_id: {name: cell.limit(name) for name in RESOURCE_LIMITS}
        for cell_id, cell in thresholds.items()
    }
    return [
        from_decision(
            breach.cell_id,
            breach.prompt_id,
            breach.figure,
            Decision(
                "regression",
                f"{breach.figure} {_number(breach.value)} over its limit "
                f"({breach.limit_name}: {_number(breach.limit)})",
            ),
            current=breach.value,
        )
        for breach in limit_breaches(telemetry_summaries(records), limits)
    ]


def overall(verdicts: Iterable[Verdict]) -> VerdictKind | None:
    """The worst verdict among a (cell, prompt)'s metrics; None when there are none."""
    kinds = {verdict.verdict for verdict in verdicts}
    return next((kind for kind in VERDICT_ORDER if kind in kinds), None)


def overall_by_key(verdicts: Iterable[Verdict]) -> dict[tuple[str, str], VerdictKind]:
    grouped: dict[tuple[str, str], list[Verdict]] = {}
    for verdict in verdicts:
        grouped.setdefault(verdict.key, []).append(verdict)
    result: dict[tuple[str, str], VerdictKind] = {}
    for key, group in grouped.items():
        kind = overall(group)
        if kind is not None:
            result[key] = kind
    return result


def regressions(verdicts: Iterable[Verdict]) -> list[Verdict]:
    return [verdict for verdict in verdicts if verdict.verdict == "regression"]


def incomparables(verdicts: Iterable[Verdict]) -> list[Verdict]:
    return [verdict for verdict in verdicts if verdict.verdict == "incomparable"]


def _number(value: float) -> str:
    return f"{value:.4g}"
