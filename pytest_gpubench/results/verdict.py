"""A verdict: the gate's finding for one figure of one (cell, prompt), declared once here (its
ledger record is what to_record writes and from_record reads back: ledger/schema.VerdictRecord
names it and does not declare it again), and the one builder every gate goes through
(from_decision)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, cast

from pytest_gpubench.results.decision import VERDICT_ORDER, Decision, VerdictKind

if TYPE_CHECKING:
    from pytest_gpubench.ledger.schema import VerdictRecord

AttributionKind = Literal["engine", "client_or_transport", "unknown"]


@dataclass(frozen=True)
class Attribution:
    """Whether the engine's own figure moved with a change the client measured."""

    kind: AttributionKind
    engine_change_ratio: float | None
    message: str


# The fields of a head-to-head A/B verdict (results/paired.py), None on every other.
AB_FIELDS = ("reference", "interval_low", "interval_high", "pairs", "max_pairs", "calls", "busy_s")


@dataclass(frozen=True)
class Verdict:
    """The gate's finding for one metric of one (cell, prompt)."""

    cell_id: str
    prompt_id: str
    metric: str
    baseline: float | None
    current: float | None
    # current / baseline: 1.35 is 35 % more than the baseline.
    change_ratio: float | None
    p_value: float | None
    verdict: VerdictKind
    message: str
    # For a change past the threshold: "engine", "client_or_transport" or "unknown" (the engine
    # reports no timings of its own); None when there is no change to attribute.
    attribution: AttributionKind | None = None
    # The engine's own figure, current / baseline (its counterpart of change_ratio).
    engine_change_ratio: float | None = None
    # The smallest change this run could have caught (current / baseline in the worse
    # direction: 1.18 is "could detect ≥ +18 %"); None where none could be, or not judged.
    detectable_ratio: float | None = None
    # Why the gate could not see a change of the threshold's size here, or None.
    blind_reason: str | None = None
    # The noise model the verdict was decided on ("between runs (5 runs of history)", ...).
    noise: str | None = None
    # A suspected regression measured again at the session's end: "confirmed" or
    # "not confirmed" (decided on both passes together); None when not re-measured.
    remeasure: str | None = None
    # A head-to-head A/B verdict (results/paired.py): the reference cell it was judged against
    # (baseline is then the reference's median, change_ratio the ratio of medians), the
    # bootstrap interval of that ratio, the pairs judged (of the most that could be), and what
    # the verdict cost: calls of both sides and the seconds they held the engines.
    reference: str | None = None
    interval_low: float | None = None
    interval_high: float | None = None
    pairs: int | None = None
    max_pairs: int | None = None
    calls: int | None = None
    busy_s: float | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.cell_id, self.prompt_id)

    def to_record(self) -> VerdictRecord:
        """Built-in types only: goes into the ledger's end record (the A/B fields only on an
        A/B verdict)."""
        record = asdict(self)
        if self.reference is None:
            for name in AB_FIELDS:
                del record[name]
        return cast("VerdictRecord", record)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Verdict | None:
        """A verdict read back from a ledger's end record; None when it is not one."""
        if record.get("verdict") not in VERDICT_ORDER:
            return None
        # Fields with a default were added later: older end records lack them.
        try:
            return cls(
                **{
                    field.name: record[field.name]
                    for field in fields(cls)
                    if field.name in record or field.default is MISSING
                }
            )
        except (KeyError, TypeError):
            return None

    @classmethod
    def all_from_records(cls, records: object) -> list[Verdict]:
        """The verdicts of an end record's `verdicts` (whatever a ledger holds there), those
        that are not one left out."""
        if not isinstance(records, list):
            return []
        verdicts = (cls.from_record(r) for r in records if isinstance(r, Mapping))
        return [verdict for verdict in verdicts if verdict is not None]


def from_decision(
    cell_id: str,
    prompt_id: str,
    metric: str,
    decision: Decision,
    cause: Attribution | None = None,
    current: float | None = None,
) -> Verdict:
    """The one builder of a Verdict, from a finding (the decision core's, or a gate's own:
    `Decision(kind, text, baseline, ratio)`); its message names the cell and the prompt."""
    text = decision.text if cause is None else f"{decision.text}; {cause.message}"
    value = current
    if value is None and decision.ratio is not None and decision.baseline is not None:
        value = decision.ratio * decision.baseline
    return Verdict(
        cell_id=cell_id,
        prompt_id=prompt_id,
        metric=metric,
        baseline=decision.baseline,
        current=value,
        change_ratio=decision.ratio,
        p_value=decision.p_value,
        verdict=decision.kind,
        message=f"{cell_id} {prompt_id}: {text}",
        attribution=cause.kind if cause is not None else None,
        engine_change_ratio=cause.engine_change_ratio if cause is not None else None,
        detectable_ratio=decision.detectable_ratio,
        blind_reason=decision.blind_reason,
        noise=decision.noise,
    )
