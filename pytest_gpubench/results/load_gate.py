"""The gate on load points (pure): each point's output tokens/s, TTFT p99, TPOT p99 and goodput
against its baseline, decided by the one decision core (decision.py): past the ratio threshold
and significant (between runs when the point's history has enough runs, else on the samples),
with the smallest change the point could have shown. A sweep's steps are points too, named by
their place in the sweep; its saturation rate, one figure per run, is judged on the threshold
alone."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from pytest_gpubench.config.load_profile import LoadThresholds
from pytest_gpubench.config.metrics import LOAD_GATED, LOAD_SATURATION, LoadFigure
from pytest_gpubench.results.decision import (
    Decision,
    Evidence,
    VerdictKind,
    change_direction,
    decide,
)
from pytest_gpubench.results.stats import field_number
from pytest_gpubench.results.steadiness import Steadiness, signed_percent
from pytest_gpubench.results.verdict import Verdict, from_decision

# How many runs of each point a load baseline keeps (its between-run history).
LOAD_HISTORY_RUNS = 10


def point_key(record: Mapping[str, Any]) -> str:
    """How a load point is named in its baseline and verdicts: `<prompt>@load-<point>`; a sweep
    step by its place (`sweep-c1`, `sweep-c<max>`, `sweep-s<i>`: the i-th open-loop rate, whose
    value moves with the engine's speed from run to run)."""
    step = record.get("sweep_step")
    point = f"sweep-{step}" if step else record.get("load_point")
    return f"{record.get('prompt_id')}@load-{point}"


def gated(record: Mapping[str, Any]) -> bool:
    """The load records the gate judges: every point's (a trace replay's too), a sweep's steps
    among them, and the sweep's own (its saturation rate)."""
    return record.get("type") == "load" and record.get("pattern") in (
        "closed",
        "open",
        "sweep",
        "trace",
    )


def is_result(record: Mapping[str, Any]) -> bool:
    """A point that is a result, or a sweep that found its saturation rate."""
    if record.get("pattern") == "sweep":
        return field_number(record.get("saturation_rate")) is not None
    return bool(record.get("valid"))


def _judge_saturation(
    current: Mapping[str, Any], baseline: Mapping[str, Any] | None, threshold: float
) -> Verdict:
    """The sweep's saturation rate against the baseline's, on the throughput threshold alone
    (one figure per run: no samples to test; its steps' verdicts carry the significance)."""
    new = field_number(current.get("saturation_rate"))
    old = field_number(baseline.get("saturation_rate")) if baseline is not None else None
    found = partial(
        from_decision, str(current.get("cell_id")), point_key(current), LOAD_SATURATION.name
    )
    if old is None or old <= 0:
        text = "no load baseline yet" if baseline is None else "the baseline has no saturation rate"
        return found(Decision("new", text), current=new)
    if new is None:
        reason = current.get("error") or "no step was served"
        return found(Decision("inconclusive", f"saturation rate: not found ({reason})", old))
    ratio = new / old
    direction = change_direction(old, new, threshold, higher_is_better=True)
    change = f"saturation rate {signed_percent(ratio)} ({old:.4g} → {new:.4g} req/s)"
    if direction is None:
        text = f"{change} (within the {threshold:.0%} threshold)"
        return found(Decision("ok", text, old, ratio), current=new)
    kind: VerdictKind = "regression" if direction == "worse" else "win"
    text = f"{change}, past the {threshold:.0%} threshold"
    return found(Decision(kind, text, old, ratio), current=new)


def judge_point(
    current: Mapping[str, Any],
    baseline: Mapping[str, Any] | None,
    thresholds: LoadThresholds,
) -> list[Verdict]:
    """One verdict per metric the point has (goodput only under an SLO)."""
    found = partial(from_decision, str(current.get("cell_id")), point_key(current))
    # Goodput only where an SLO defines it.
    metrics = [m for m in LOAD_GATED if m.field != "goodput_rate" or current.get("slo")]
    changes = settings_changes(baseline, current)
    if changes:
        metric = LOAD_SATURATION if current.get("pattern") == "sweep" else metrics[0]
        text = (
            f"the load settings changed since the load baseline was measured ({changes}): "
            "ratify them with --baseline-update"
        )
        return [found(metric.name, Decision("incomparable", text))]
    if current.get("pattern") == "sweep":
        return [_judge_saturation(current, baseline, thresholds.throughput)]
    if baseline is None:
        new = Decision("new", "no load baseline yet")
        return [found(m.name, new, current=field_number(current.get(m.field))) for m in metrics]
    if baseline.get("prompt_sha256") not in (None, current.get("prompt_sha256")):
        text = (
            "the request changed since the load baseline was measured (prompt sha256): "
            "ratify it with --baseline-update"
        )
        return [found(metrics[0].name, Decision("incomparable", text))]
    if not current.get("valid"):
        reason = current.get("invalid_reason") or "not a result"
        unjudged = Decision("inconclusive", f"not judged: {reason}")
        return [found(m.name, unjudged) for m in metrics]
    return [
        judge_metric(m, current, baseline, float(getattr(thresholds, m.threshold_field)))
        for m in metrics
    ]


def settings_changes(baseline: Mapping[str, Any] | None, current: Mapping[str, Any]) -> str:
    """What changed in the settings that shape a point's figures (LoadProfile.shaping) since its
    baseline, as `arrival poisson → constant; warmup_s 0 → 5`; empty where nothing did, or where
    either side does not say (a baseline written before they were kept is judged as before)."""
    old = baseline.get("load_settings") if baseline is not None else None
    new = current.get("load_settings")
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return ""
    changed = [
        f"{name} {_setting(old.get(name))} → {_setting(new.get(name))}"
        for name in sorted(set(old) | set(new))
        if old.get(name) != new.get(name)
    ]
    return "; ".join(changed)


# Deeper than any setting (the sweep's and the SLO's are two levels): a baseline edited into
# thousands of levels shows `{…}` there rather than recursing past Python's limit.
_SETTING_DEPTH = 8


def _setting(value: Any, depth: int = 0) -> str:
    if value is None:
        return "unset"
    if isinstance(value, Mapping):
        if depth >= _SETTING_DEPTH:
            return "{…}"
        shown = (f"{k}: {_setting(v, depth + 1)}" for k, v in value.items() if v is not None)
        return "{" + ", ".join(shown) + "}"
    if isinstance(value, float):
        return f"{value:g}"
    try:
        return str(value)
    except RecursionError:  # a list nested as deep (str recurses through it)
        return "[…]"


def judge_metric(
    metric: LoadFigure,
    current: Mapping[str, Any],
    baseline: Mapping[str, Any],
    threshold: float,
) -> Verdict:
    """The decision core's verdict on one figure of a load point."""
    cell_id, key = str(current.get("cell_id")), point_key(current)
    decision = decide(
        Evidence(
            label=metric.label,
            higher_is_better=metric.higher_is_better,
            threshold=threshold,
            baseline=field_number(baseline.get(metric.field)),
            current=field_number(current.get(metric.field)),
            current_samples=_samples(current, metric),
            baseline_samples=_samples(baseline, metric),
            history=history_figures(baseline, metric.field),
            steadiness=point_steadiness(current, baseline),
            more_samples_hint="run the point longer (duration_s)",
        )
    )
    return from_decision(
        cell_id, key, metric.name, decision, current=field_number(current.get(metric.field))
    )


def point_steadiness(current: Mapping[str, Any], baseline: Mapping[str, Any]) -> Steadiness | None:
    """The CPU pressure over the point against the baseline's (the median over its history's
    runs, else its run's); None when this run did not read it. The point's own requests keep
    tasks waiting: only a change counts, not the level."""
    now = field_number(current.get("cpu_pressure"))
    if now is None:
        return None
    runs = baseline.get("history")
    entries = [run for run in runs if isinstance(run, Mapping)] if isinstance(runs, list) else []
    kept = [v for v in (field_number(run.get("cpu_pressure")) for run in entries) if v is not None]
    then = statistics.median(kept) if kept else field_number(baseline.get("cpu_pressure"))
    return Steadiness(
        None,
        None,
        pressure=now,
        baseline_pressure=then,
        contention_counts=False,
        pressure_window="the point's time",
    )


def history_figures(baseline: Mapping[str, Any], field: str) -> tuple[float, ...]:
    """A figure of the point in each run its baseline kept (oldest first); none in an older
    load baseline."""
    runs = baseline.get("history")
    if not isinstance(runs, list):
        return ()
    values = (field_number(run.get(field)) for run in runs if isinstance(run, Mapping))
    return tuple(value for value in values if value is not None and value > 0)


def history_entry(record: Mapping[str, Any]) -> dict[str, Any]:
    """What a load baseline's history keeps of one run of a point: its gated figures."""
    entry: dict[str, Any] = {"benchmark_run_id": record.get("benchmark_run_id")}
    entry.update({metric.field: field_number(record.get(metric.field)) for metric in LOAD_GATED})
    entry["cpu_pressure"] = field_number(record.get("cpu_pressure"))
    return entry


def judge_loads(
    loads: Sequence[Mapping[str, Any]],
    baselines: Mapping[str, Mapping[str, Mapping[str, Any]]],
    thresholds: Mapping[str, LoadThresholds],
) -> list[Verdict]:
    """Verdicts of every gated load record; `baselines`: {cell id: {point key: baseline}}."""
    verdicts: list[Verdict] = []
    for record in loads:
        if not gated(record):
            continue
        cell_id = str(record.get("cell_id"))
        baseline = baselines.get(cell_id, {}).get(point_key(record))
        verdicts.extend(judge_point(record, baseline, thresholds.get(cell_id, LoadThresholds())))
        verdicts.extend(skipped_steps(record, baselines.get(cell_id, {})))
    return verdicts


def skipped_step_keys(record: Mapping[str, Any]) -> dict[str, str]:
    """The steps a sweep did not run after it stopped at saturation, each with its point key."""
    stop = record.get("saturation_stop") if record.get("pattern") == "sweep" else None
    if not isinstance(stop, Mapping) or not isinstance(stop.get("skipped"), list):
        return {}
    return {str(step): point_key({**record, "sweep_step": step}) for step in stop["skipped"]}


def skipped_why(record: Mapping[str, Any]) -> str:
    stop = record.get("saturation_stop")
    assert isinstance(stop, Mapping)
    return f"the sweep stopped at saturation at {stop.get('sweep_step')} ({stop.get('rate')} req/s)"


def skipped_steps(
    record: Mapping[str, Any], baseline: Mapping[str, Mapping[str, Any]]
) -> list[Verdict]:
    """A sweep that stopped at saturation left its higher steps unmeasured: each that the
    baseline measured is `inconclusive` (the run is held back, exit 10), never passed unseen.
    The engine saturated at a lower rate than when the baseline was measured; the sweep's
    saturation rate says by how much, and ratifying takes the lower capacity (the steps leave the
    baseline: results/load_baseline.write_load_baselines)."""
    cell_id = str(record.get("cell_id"))
    found = []
    for step, key in skipped_step_keys(record).items():
        if key not in baseline:
            continue
        rate = field_number(baseline[key].get("rate"))
        text = (
            f"not measured: {skipped_why(record)}; the baseline measured {step}"
            + (f" ({rate:g} req/s)" if rate is not None else "")
            + "; re-run, or ratify the lower capacity with --baseline-update"
        )
        measured = field_number(baseline[key].get(LOAD_GATED[0].field))
        decision = Decision("inconclusive", text, measured)
        found.append(from_decision(cell_id, key, LOAD_GATED[0].name, decision))
    return found


def baseline_point(
    record: Mapping[str, Any], previous: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What a baseline keeps of a valid load record: its figures, per-request samples, and the
    history of the point's last runs (`previous`'s, this run appended; a run counts once)."""
    keep = (
        "prompt_id", "prompt_sha256", "load_point", "pattern", "concurrency", "rate", "arrival",
        "requests", "ok", "achieved_rate", "output_tokens_per_sec", "ttft_ms_p50", "ttft_ms_p99",
        "tpot_ms_p50", "tpot_ms_p99", "e2e_ms_p99", "goodput_rate", "send_lag_ms_p99",
        "benchmark_run_id", "started_at_utc", "samples", "sweep_step", "saturation_rate",
        "cpu_pressure", "load_settings",
    )  # fmt: skip
    point = {name: record.get(name) for name in keep}
    # Runs under another request or other settings are another point's: its history restarts.
    other = previous is not None and (
        previous.get("prompt_sha256") not in (None, record.get("prompt_sha256"))
        or bool(settings_changes(previous, record))
    )
    runs = previous.get("history") if previous is not None and not other else None
    kept = [
        run
        for run in (runs if isinstance(runs, list) else [])
        if isinstance(run, Mapping)
        and run.get("benchmark_run_id") != record.get("benchmark_run_id")
    ]
    point["history"] = [*kept, history_entry(record)][-LOAD_HISTORY_RUNS:]
    return point


def _samples(record: Mapping[str, Any], metric: LoadFigure) -> list[float]:
    samples = record.get("samples")
    values = samples.get(metric.samples) if isinstance(samples, Mapping) else None
    # A hand-edited file's figure of the wrong type is unknown, as in records.
    return (
        [n for v in values if (n := field_number(v)) is not None]
        if isinstance(values, list)
        else []
    )
