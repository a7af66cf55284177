"""Pure arithmetic on samples: per case (peak VRAM, mean GPU utilisation and power, energy from
the counter or integrated power, joules per token, engine CPU-seconds, peak RSS) and per (cell,
prompt) across a run's call records. No I/O, no threads."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any, TypedDict, cast

from pytest_gpubench.config.metrics import CLOCK_EVENTS, RESOURCE_LIMITS, RESOURCES
from pytest_gpubench.telemetry.samplers import CaseSamples, GpuSample, ProcSample


class TelemetryFields(TypedDict, total=False):
    """The call record's telemetry fields, in this order (after the measurement's fields):
    present on a call whose case was sampled. gpu_aggregates and cpu_aggregates give their
    share of them."""

    telemetry_interval_ms: float
    telemetry_gpu_source: str | None
    telemetry_cpu_source: str | None
    telemetry_samples: int
    telemetry_notes: list[str] | None
    gpu_peak_memory_used_mib: float | None
    gpu_memory_total_mib: float | None
    gpu_utilization_mean_pct: float | None
    gpu_power_mean_w: float | None
    gpu_temperature_max_c: float | None
    gpu_energy_j: float | None
    gpu_energy_source: str | None
    gpu_energy_j_per_token: float | None
    gpu_tokens_per_j: float | None
    engine_cpu_s: float | None
    engine_cpu_s_per_token: float | None
    engine_peak_rss_mib: float | None
    system_mem_used_peak_mib: float | None
    system_load1_max: float | None
    engine_gpu_memory_peak_mib: float | None
    gpu_other_processes: list[int] | None
    gpu_other_process_count: int | None
    gpu_clock_events: list[str] | None
    gpu_clock_event_bits: int | None


CALL_FIELDS = tuple(TelemetryFields.__annotations__)

Points = list[tuple[float, float]]
# NVML's energy counter on an H100 moves about every 100 ms, in steps of the power over that
# period (13 J at 130 W): read over a 15 ms call it gave 0 J in 19 of 21 calls, and over 240 ms
# calls it gave 25 or 39 J. Below this many moves in a case, power integrated over the case's own
# span measures it better.
MIN_COUNTER_STEPS = 4


def _at(points: Points, x: float) -> float:
    """A piecewise-linear series at x (held flat beyond its ends); points sorted by time."""
    if x <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in pairwise(points):
        if x <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (x - t0) / (t1 - t0)
    return points[-1][1]


def counter_delta(points: Points, start: float, end: float) -> float | None:
    """How much a cumulative counter grew over [start, end], read between its samples."""
    if len(points) < 2:
        return None
    return _at(points, end) - _at(points, start)


def counter_steps(points: Points, start: float, end: float) -> int:
    """How many times a cumulative counter moved between consecutive samples that overlap
    [start, end]: a counter that the driver updates in coarse steps moves only a few times over a
    short case, and reading it then measures the step, not the case."""
    return sum(1 for (t0, v0), (t1, v1) in pairwise(points) if t1 > start and t0 < end and v1 > v0)


def integral(points: Points, start: float, end: float) -> float | None:
    """The integral over [start, end] of a series sampled at points (trapezoids)."""
    if len(points) < 2 or end <= start:
        return None
    inner = [(t, v) for t, v in points if start < t < end]
    edges = [(start, _at(points, start)), *inner, (end, _at(points, end))]
    return sum((t1 - t0) * (v0 + v1) / 2 for (t0, v0), (t1, v1) in pairwise(edges))


def _series(samples: Iterable[Any], attr: str) -> Points:
    return sorted((s.t, float(v)) for s in samples if (v := getattr(s, attr)) is not None)


def _inside(samples: Sequence[Any], start: float, end: float) -> list[Any]:
    """The samples taken during the case; the bracketing ones where none was (a short case)."""
    inside = [s for s in samples if start <= s.t <= end]
    return inside or list(samples)


def _by_gpu(samples: Sequence[GpuSample]) -> dict[int, list[GpuSample]]:
    gpus: dict[int, list[GpuSample]] = {}
    for sample in samples:
        gpus.setdefault(sample.gpu, []).append(sample)
    return gpus


def _peaks_per_gpu(gpus: Mapping[int, Sequence[GpuSample]], attr: str) -> list[float | None]:
    """Each GPU's highest reading of `attr` (None for a GPU that never gave one)."""
    return [
        max((v for s in samples if (v := getattr(s, attr)) is not None), default=None)
        for samples in gpus.values()
    ]


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _sum_or_none(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known and len(known) == len(values) else None


def gpu_aggregates(samples: Sequence[GpuSample], start: float, end: float) -> TelemetryFields:
    """Across the node's GPUs: peak memory (the sum of each GPU's peak), mean utilisation (of
    all GPUs), mean power and energy (summed over GPUs). Energy comes from the counter where
    every GPU has one that moved at least MIN_COUNTER_STEPS times over the case, else from
    integrated power, and says which."""
    gpus = _by_gpu(samples)
    inside = [_inside(gpu_samples, start, end) for gpu_samples in gpus.values()]
    peaks = _peaks_per_gpu(gpus, "memory_used_mib")
    totals = _peaks_per_gpu(gpus, "memory_total_mib")
    utilization = [s.utilization_pct for g in inside for s in g if s.utilization_pct is not None]
    power_means = [_mean([s.power_w for s in g if s.power_w is not None]) for g in inside]
    temperatures = [
        s.temperature_c for g in gpus.values() for s in g if s.temperature_c is not None
    ]
    counters = [
        counter_delta(series, start, end)
        if counter_steps(series := _series(g, "energy_mj"), start, end) >= MIN_COUNTER_STEPS
        else None
        for g in gpus.values()
    ]
    energy_mj = _sum_or_none(counters) if gpus else None
    source = "counter" if energy_mj is not None else None
    if energy_mj is None and gpus:
        integrated = [integral(_series(g, "power_w"), start, end) for g in gpus.values()]
        joules = _sum_or_none(integrated)
        if joules is not None:
            energy_mj, source = joules * 1000.0, "integrated_power"
    engine_peaks = _peaks_per_gpu(gpus, "engine_memory_mib")
    during = [s for g in inside for s in g]
    listed = [s.other_pids for s in during if s.other_pids is not None]
    events = [s.clock_events for s in during if s.clock_events is not None]
    mask = 0
    for event in events:
        mask |= event
    mask &= sum(CLOCK_EVENTS)
    others = sorted({pid for pids in listed for pid in pids}) if listed else None
    return {
        "gpu_peak_memory_used_mib": _sum_or_none(peaks) if gpus else None,
        "engine_gpu_memory_peak_mib": _sum_or_none(engine_peaks) if gpus else None,
        "gpu_memory_total_mib": _sum_or_none(totals) if gpus else None,
        "gpu_utilization_mean_pct": _mean(utilization),
        "gpu_power_mean_w": _sum_or_none(power_means) if gpus else None,
        "gpu_temperature_max_c": max(temperatures, default=None),
        "gpu_energy_j": energy_mj / 1000.0 if energy_mj is not None else None,
        "gpu_energy_source": source,
        # Other processes on the GPUs during the case, and what held their clocks down: None
        # where not read (nvidia-smi, no engine process), [] where none.
        "gpu_other_processes": others,
        "gpu_other_process_count": len(others) if others is not None else None,
        "gpu_clock_events": (
            [name for bit, name in CLOCK_EVENTS.items() if mask & bit] if events else None
        ),
        "gpu_clock_event_bits": mask if events else None,
    }


def cpu_aggregates(samples: Sequence[ProcSample], start: float, end: float) -> TelemetryFields:
    """The engine's CPU-seconds over the case (its counter read between samples; only samples of
    the process that served the case), its peak RSS, and the node's memory and load."""
    pids = [s.engine_pid for s in samples if s.engine_pid is not None]
    engine = [s for s in samples if pids and s.engine_pid == pids[-1]]
    rss = [s.engine_rss_mib for s in engine if s.engine_rss_mib is not None]
    used = [s.mem_used_mib for s in samples if s.mem_used_mib is not None]
    load = [s.load1 for s in samples if s.load1 is not None]
    cpu = counter_delta(_series(engine, "engine_cpu_s"), start, end)
    return {
        "engine_cpu_s": max(cpu, 0.0) if cpu is not None else None,
        "engine_peak_rss_mib": max(rss, default=None),
        "system_mem_used_peak_mib": max(used, default=None),
        "system_load1_max": max(load, default=None),
    }


def case_aggregates(case: CaseSamples, completion_tokens: int | None) -> TelemetryFields:
    """The call record's telemetry fields (CALL_FIELDS) for one case."""
    gpu = gpu_aggregates(case.gpu, case.start, case.end)
    cpu = cpu_aggregates(case.cpu, case.start, case.end)
    tokens = completion_tokens or None
    energy = gpu["gpu_energy_j"]
    fields: dict[str, Any] = {
        "telemetry_interval_ms": case.interval_ms,
        "telemetry_gpu_source": case.gpu_source,
        "telemetry_cpu_source": case.cpu_source,
        "telemetry_samples": len(case.gpu) + len(case.cpu),
        "telemetry_notes": list(case.notes) or None,
        **gpu,
        "gpu_energy_j_per_token": energy / tokens if energy is not None and tokens else None,
        "gpu_tokens_per_j": tokens / energy if energy and tokens else None,
        **cpu,
        "engine_cpu_s_per_token": (
            cpu["engine_cpu_s"] / tokens if cpu["engine_cpu_s"] is not None and tokens else None
        ),
    }
    return cast(TelemetryFields, {name: fields[name] for name in CALL_FIELDS})


def sample_columns(case: CaseSamples) -> dict[str, dict[str, list[Any]]]:
    """The case's samples as columns (times in ms from the case's start), for the sample record."""
    columns: dict[str, dict[str, list[Any]]] = {}
    for kind, samples in (("gpu", case.gpu), ("cpu", case.cpu)):
        if not samples:
            continue
        rows = [asdict(sample) for sample in samples]
        table: dict[str, list[Any]] = {
            "t_ms": [round((s.t - case.start) * 1000, 1) for s in samples]
        }
        for name in rows[0]:
            if name != "t":
                table[name] = [_compact(row[name]) for row in rows]
        columns[kind] = table
    return columns


def _compact(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


@dataclass(frozen=True)
class TelemetrySummary:
    """Per (cell, prompt), over the warm calls that succeeded: a field per figure of
    config/metrics.RESOURCES, the median of the per-call figures or the peak of the peaks."""

    cell_id: str
    prompt_id: str
    calls: int
    gpu_peak_memory_used_mib: float | None
    engine_gpu_memory_peak_mib: float | None
    gpu_utilization_mean_pct: float | None
    gpu_power_mean_w: float | None
    gpu_energy_j_per_token: float | None
    gpu_tokens_per_j: float | None
    gpu_energy_source: str | None
    engine_cpu_s: float | None
    engine_cpu_s_per_token: float | None
    engine_peak_rss_mib: float | None


def _median(calls: Sequence[Mapping[str, Any]], name: str) -> float | None:
    values = [float(call[name]) for call in calls if call.get(name) is not None]
    return statistics.median(values) if values else None


def _peak(calls: Sequence[Mapping[str, Any]], name: str) -> float | None:
    return max((float(call[name]) for call in calls if call.get(name) is not None), default=None)


def telemetry_summaries(records: Iterable[Mapping[str, Any]]) -> list[TelemetrySummary]:
    """Per (cell, prompt), sorted, from a run's records (call records of older ledgers without
    telemetry fields give None figures)."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for record in records:
        if record.get("type") != "call" or record.get("phase") != "warm" or record.get("error"):
            continue
        cell_id, prompt_id = record.get("cell_id"), record.get("prompt_id")
        if not isinstance(cell_id, str) or not isinstance(prompt_id, str):
            continue  # an odd or edited ledger: stats leaves such a record out too
        groups.setdefault((cell_id, prompt_id), []).append(record)
    summaries = []
    for (cell_id, prompt_id), calls in sorted(groups.items()):
        sources = sorted({str(c["gpu_energy_source"]) for c in calls if c.get("gpu_energy_source")})
        summaries.append(
            TelemetrySummary(
                cell_id=cell_id,
                prompt_id=prompt_id,
                calls=len(calls),
                gpu_energy_source="+".join(sources) or None,
                **{
                    figure.name: (_peak if figure.peak else _median)(calls, figure.name)
                    for figure in RESOURCES
                },
            )
        )
    return summaries


@dataclass(frozen=True)
class LimitBreach:
    """A (cell, prompt) whose telemetry figure went over its limit."""

    cell_id: str
    prompt_id: str
    limit_name: str
    figure: str
    value: float
    limit: float


def limit_breaches(
    summaries: Iterable[TelemetrySummary], limits: Mapping[str, Mapping[str, float | None]]
) -> list[LimitBreach]:
    """Every figure over its limit ({cell_id: {`max_` key (config/metrics.RESOURCE_LIMITS):
    limit}}); a figure that was not measured (no GPU, no engine process) breaches nothing."""
    breaches = []
    for summary in summaries:
        for limit_name, limit in sorted(limits.get(summary.cell_id, {}).items()):
            figure = RESOURCE_LIMITS[limit_name]
            value = getattr(summary, figure)
            if limit is not None and value is not None and value > limit:
                breaches.append(
                    LimitBreach(
                        summary.cell_id, summary.prompt_id, limit_name, figure, value, limit
                    )
                )
    return breaches
