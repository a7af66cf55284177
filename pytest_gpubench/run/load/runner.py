"""Running one load case on a live cell: its requests (load/driver.py, by its pattern or the
sweep), then its records: a `call` record per request and a `load` record per load point."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pytest_gpubench.config.cases import Case
from pytest_gpubench.config.load_profile import LoadProfile
from pytest_gpubench.config.matrix import Cell, Matrix, Prompt, RequestShape
from pytest_gpubench.config.synthetic import synthetic_prompt
from pytest_gpubench.core.provenance import utc_now
from pytest_gpubench.ledger.records import call_record, load_call_record, load_record, sample_record
from pytest_gpubench.ledger.schema import as_json
from pytest_gpubench.measure.gauges import GaugeScraper
from pytest_gpubench.results.load_summary import percentile, summarize_point
from pytest_gpubench.run.load import LoadPattern, make_pattern, pattern_facts
from pytest_gpubench.run.load.driver import LoadRun, Sent, Target, build_target
from pytest_gpubench.run.load.processes import run_in_processes

if TYPE_CHECKING:
    from pytest_gpubench.run.live_cell import LiveCell


@dataclass
class LoadOutcome:
    """What a load case produced: its main `load` record (the sweep's, or its one point's) and
    every other record (call records, a sweep's per-step load records)."""

    record: dict[str, Any]
    others: list[dict[str, Any]] = field(default_factory=list)


def load_prompt(matrix: Matrix, cell: Cell, prompt_id: str) -> tuple[Prompt, RequestShape]:
    """The prompt a load case sends and its request keys: a synthetic one (fixed output length)
    or a frozen one with the cell's request keys, the output length fixed (ignore_eos) unless
    the cell or prompt says otherwise."""
    assert cell.load is not None
    if cell.load.synthetic is not None and prompt_id == cell.load.synthetic.prompt_id:
        prompt = synthetic_prompt(cell.load.synthetic)
    else:
        prompt = matrix.prompts[prompt_id]
    request = cell.request_for(prompt)
    if request.ignore_eos is None:
        request = request.merged(RequestShape(ignore_eos=True))
    return prompt, request


def run_load_case(live: LiveCell, matrix: Matrix, case: Case, run_id: str) -> LoadOutcome:
    """Warm the engine up with the case's request, then run its load point, with Python's
    cyclic garbage collector held off: a full collection in a pytest process takes milliseconds,
    and a send due then would go out that late (the client's allocations are freed by reference
    counting all the same)."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        return _run_load_case(live, matrix, case, run_id)
    finally:
        gc.enable()
        gc.unfreeze()


def _run_load_case(live: LiveCell, matrix: Matrix, case: Case, run_id: str) -> LoadOutcome:
    cell = live.cell
    profile = cell.load
    assert profile is not None and case.load_point is not None and live.engine is not None
    prompt, request = load_prompt(matrix, cell, case.prompt_id)
    live.warm_up(prompt.prompt, prompt.max_tokens, request)
    engine: Any = live.engine
    payload = engine.payload(prompt.prompt, prompt.max_tokens, request)
    target = build_target(
        engine.kind,
        engine.base_url,
        json.dumps(payload).encode(),
        engine.request_headers(),
        cell.timeout_s,
        getattr(engine, "tls", None),
    )
    recorder = _Recorder(run_id, cell, case, prompt.sha256(request), profile)
    if case.load_point == "sweep":
        from pytest_gpubench.run.load.sweep import run_sweep

        started = utc_now()
        sweep = asyncio.run(
            run_sweep(profile, lambda point, pattern: recorder.step(target, point, pattern))
        )
        steps = [record for record in recorder.loads]
        valid = [step for step in steps if step["valid"]]
        record = load_record(
            run_id=run_id,
            cell=cell,
            case=case,
            prompt_sha256=recorder.sha256,
            load_point="sweep",
            pattern={"pattern": "sweep", **sweep},
            started_at_utc=started,
            summary={"output_tokens": sum(step["output_tokens"] for step in steps)},
            error=None if valid else "no step of the sweep was a valid result",
        )
        live.last_call_end = time.monotonic()
        return LoadOutcome(as_json(record), recorder.records)
    pattern = make_pattern(profile, case.load_point)
    asyncio.run(recorder.step(target, case.load_point, pattern))
    live.last_call_end = time.monotonic()
    main = recorder.records.pop()
    return LoadOutcome(main, recorder.records)


class _Recorder:
    """Runs steps and turns what each sent into records."""

    def __init__(
        self, run_id: str, cell: Cell, case: Case, sha256: str, profile: LoadProfile
    ) -> None:
        self.run_id, self.cell, self.case, self.sha256 = run_id, cell, case, sha256
        self.profile = profile
        self.records: list[dict[str, Any]] = []
        self.loads: list[dict[str, Any]] = []

    async def step(self, target: Target, point: str, pattern: LoadPattern) -> Mapping[str, Any]:
        run = LoadRun(target, self.profile)
        started = utc_now()
        wall_ns = time.time_ns() - time.perf_counter_ns()
        scraper = GaugeScraper(
            target.endpoint, target.headers, self.cell.telemetry.interval_ms, target.tls
        )
        before = await scraper.scrape()
        stop = asyncio.Event()
        scraping: asyncio.Task[None] | None = None
        if before is not None:
            scraper.samples.counters_before = before[1]
        try:
            if self.profile.processes > 1:
                started_ns = time.perf_counter_ns()
                scraping = asyncio.create_task(scraper.run(started_ns, stop)) if before else None
                started_ns, sent = await asyncio.to_thread(
                    run_in_processes, target, self.profile, pattern
                )
            else:
                await run.open(pattern.connections)
                started_ns = run.started_ns
                if before is not None:
                    scraping = asyncio.create_task(scraper.run(started_ns, stop))
                await pattern.drive(run)
                sent = run.sent
        finally:
            stop.set()
            if scraping is not None:
                await scraping
            await run.close()
        after = await scraper.settled_counters() if before is not None else None
        if after is not None:
            scraper.samples.counters_after = after
        calls = [self._call(point, started_ns, wall_ns, item) for item in sent]
        summary = summarize_point(
            calls,
            offered_rate=pattern.offered_rate,
            slo=self.profile.slo,
            max_send_lag_ms=(
                self.profile.max_send_lag_ms if pattern.offered_rate is not None else None
            ),
        )
        record = load_record(
            run_id=self.run_id,
            cell=self.cell,
            case=self.case,
            prompt_sha256=self.sha256,
            load_point=point,
            pattern=pattern_facts(pattern),
            started_at_utc=started,
            summary={
                **summary,
                "processes": self.profile.processes,
                "send_lag_by_process": _lag_by_process(calls)
                if self.profile.processes > 1
                else None,
                # Every request of the point (warm-up and cool-down too) against the engine's
                # own counters over the same span (None where it exposes none).
                "client_completion_tokens": sum(
                    int(call.get("completion_tokens") or 0) for call in calls
                ),
                "engine_counters": scraper.samples.counter_changes() or None,
                "engine_metrics_notes": scraper.samples.notes or None,
            },
            error=summary["invalid_reason"],
        )
        self.records.extend(calls)
        if scraper.samples.columns:
            self.records.append(
                as_json(
                    sample_record(
                        run_id=self.run_id,
                        cell=self.cell,
                        case=self.case,
                        interval_ms=scraper.samples.interval_ms,
                        gpu_source=None,
                        cpu_source=None,
                        columns={},
                        notes=scraper.samples.notes,
                        engine=scraper.samples.columns,
                        load_point=point,
                    )
                )
            )
        self.records.append(as_json(record))
        self.loads.append(as_json(record))
        return summary

    def _call(self, point: str, started_ns: int, wall_ns: int, sent: Sent) -> dict[str, Any]:
        at = datetime.fromtimestamp((wall_ns + sent.sent_ns) / 1e9, UTC)
        call = call_record(
            run_id=self.run_id,
            cell=self.cell,
            case=self.case,
            prompt_sha256=self.sha256,
            cold_kind=None,
            started_at_utc=at.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            measurement=sent.measurement,
        )
        return as_json(
            load_call_record(
                call,
                load_point=point,
                window=sent.window,
                request_idx=sent.index,
                scheduled_send_ms=round((sent.scheduled_ns - started_ns) / 1e6, 4),
                send_ms=round((sent.sent_ns - started_ns) / 1e6, 4),
                send_lag_ms=sent.send_lag_ms,
                process=sent.process if self.profile.processes > 1 else None,
            )
        )


def _lag_by_process(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each client process's own send lag (p50, p99, max ms) over the measured window."""
    rows = []
    for process in sorted({call["process"] for call in calls}):
        lags = [
            float(call["send_lag_ms"])
            for call in calls
            if call["process"] == process and call["load_window"] == "measured"
        ]
        rows.append(
            {
                "process": process,
                "requests": len(lags),
                "send_lag_ms_p50": percentile(lags, 50),
                "send_lag_ms_p99": percentile(lags, 99),
                "send_lag_ms_max": max(lags) if lags else None,
            }
        )
    return rows
