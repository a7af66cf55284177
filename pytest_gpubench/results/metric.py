"""The gated figures as the gate reads them (pure): a `Metric` (config/metrics.GATED's figure, its
value, samples and the engine's own counterpart in a summary), the lists of them the gate and the
reports use, which of them a (cell, prompt) is judged on (a decode figure of replies too short
to time is not: too_short_to_time), and their thresholds."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_gpubench.config.cell import Thresholds
from pytest_gpubench.config.metrics import (
    DEFAULT_RATIO_THRESHOLD,
    DEFAULT_SUCCESS_RATE,
    GATED,
    MEASURE_BY_NAME,
    VALIDITY,
    GatedFigure,
    Measure,
)
from pytest_gpubench.results.stats import PromptSummary


@dataclass(frozen=True)
class Metric:
    """A gated figure (config/metrics.GATED) as the gate reads it from a summary: its value, its
    raw samples, and the engine's own counterpart (its prompt time for TTFT, its decode rate for
    decode tokens/s), which says whether a change happened inside the engine."""

    figure: GatedFigure

    @property
    def name(self) -> str:
        return self.figure.name

    @property
    def label(self) -> str:
        return self.figure.label

    @property
    def threshold_field(self) -> str:
        return self.figure.threshold_key

    @property
    def engine_label(self) -> str:
        return self.figure.engine_label

    @property
    def measure(self) -> Measure:
        return MEASURE_BY_NAME[self.figure.measure]

    @property
    def higher_is_better(self) -> bool:
        return self.measure.higher_is_better

    @property
    def reasoning(self) -> bool:
        """Judged only where the engine reasoned (a reasoning model's figure)."""
        return self.measure.reasoning

    def value(self, summary: PromptSummary) -> float | None:
        return summary.figure(self.figure.measure, self.figure.percentile)

    def samples(self, summary: PromptSummary) -> tuple[float, ...]:
        return summary.samples.get(self.figure.measure, ())

    def engine_value(self, summary: PromptSummary) -> float | None:
        engine = self.figure.engine_measure
        return None if engine is None else summary.figure(engine, self.figure.percentile)

    @property
    def better(self) -> str:
        return "higher" if self.higher_is_better else "faster"


# Every gated figure, in the order the reports list them; the engine's decode rate, which says
# whether an engine slowed as a whole (attribute()).
GATED_METRICS = tuple(Metric(figure) for figure in GATED)
DECODE_TOKENS_PER_SEC = next(m for m in GATED_METRICS if m.measure.decode and m.higher_is_better)
# The figures judged on every (cell, prompt) whose run measured them: not a reasoning model's
# (only where it reasoned), not an opt-in one (only where its threshold is given).
RATIO_METRICS = tuple(m for m in GATED_METRICS if not m.reasoning and not m.figure.opt_in)
SUCCESS_RATE = "warm_success_rate"
METRIC_NAMES = (*tuple(metric.name for metric in RATIO_METRICS), SUCCESS_RATE)
# Every metric a verdict may name, in the order the reports list them.
ALL_METRIC_NAMES = (
    *METRIC_NAMES,
    *(m.name for m in GATED_METRICS if m.reasoning or m.figure.opt_in),
    *(rate.name for rate in VALIDITY),
)


def reasoned(summary: PromptSummary | None) -> bool:
    """Did the engine reason on this (cell, prompt)? Its first-answer figure exists only then."""
    return summary is not None and any(
        summary.figure(m.figure.measure) is not None for m in GATED_METRICS if m.reasoning
    )


def gated_metrics(
    current: PromptSummary, baseline: PromptSummary | None, thresholds: Thresholds | None = None
) -> tuple[Metric, ...]:
    """The ratio metrics judged for a (cell, prompt): a reasoning model's where either run
    reasoned (a baseline that reasoned and a run that did not is inconclusive, never passed
    unmeasured), an opt-in figure where the thresholds give it (all, without thresholds)."""
    either = reasoned(current) or reasoned(baseline)
    return tuple(
        metric
        for metric in GATED_METRICS
        if (either or not metric.reasoning)
        # A figure that does not apply to the prompt's request kind (an embedding's TTFT).
        and current.kind in metric.measure.kinds
        and (
            not metric.figure.opt_in
            or thresholds is None
            or thresholds.ratio(metric.figure.threshold_key) is not None
        )
    )


def ratio_threshold(thresholds: Thresholds, field: str) -> float:
    """A gated figure's threshold: its cell's, else the default (an opt-in figure is judged only
    where one is given: gated_metrics)."""
    value = thresholds.ratio(field)
    return DEFAULT_RATIO_THRESHOLD if value is None else value


def success_threshold(thresholds: Thresholds) -> float:
    value = thresholds.success_rate
    return DEFAULT_SUCCESS_RATE if value is None else float(value)


# The fewest gaps between tokens (completion tokens - 1, median over the calls) a reply needs
# for its decode figures to be gated. Fewer are decided by when the engine's, its delivery
# path's and the client's threads were scheduled more than by the engine: in issue 37's table
# (4-token replies, 3 gaps of about 1.5 ms, most with a gap of 0 where chunks came together) an
# unchanged engine's decode rate moved -45 % to +131 % per session. Such a figure is `ungated`
# for the prompt (issue 43): said, never holding a run back, never a re-run.
MIN_DECODE_GAPS = 16


def too_short_to_time(gaps: int | None) -> str | None:
    """Why a decode figure of replies with this many gaps between tokens is not gated for the
    prompt, and what would make it gateable; None where they are long enough or nothing says."""
    if gaps is None or gaps >= MIN_DECODE_GAPS:
        return None
    return (
        f"not gated for this prompt: its replies carry {gaps} gaps between tokens, fewer than "
        f"the {MIN_DECODE_GAPS} a decode figure needs (so few are decided by when the threads "
        f"were scheduled); raise the prompt's max_tokens to {MIN_DECODE_GAPS + 1} or "
        "more to gate it"
    )
