"""The builders of the ledger's records: meta, cell, call, load, sample, skipped and end (one
place each), each returning its type from schema.py."""

from __future__ import annotations

import os
import platform
import socket
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from pytest_gpubench import HARNESS_VERSION, __version__
from pytest_gpubench.config.cases import Case
from pytest_gpubench.config.cell import Cell
from pytest_gpubench.config.prompts import Prompt, RequestShape
from pytest_gpubench.config.shards import ShardFacts
from pytest_gpubench.core.provenance import GitState, chosen_environment, load_average, utc_now
from pytest_gpubench.engines.protocol import EngineFacts
from pytest_gpubench.ledger.gaps import packed_record
from pytest_gpubench.ledger.outcomes import CellOutcomeRecord
from pytest_gpubench.ledger.schema import (
    AbPairFields,
    AdapterFields,
    CallRecord,
    CaseHead,
    CellRecord,
    CheckpointRecord,
    EndRecord,
    EngineCheckFields,
    LoadCallRecord,
    LoadRecord,
    MetaRecord,
    RequestFacts,
    SampledOnFields,
    SampleRecord,
    SkippedRecord,
    StageRecord,
    SyntheticFields,
    VerdictRecord,
)
from pytest_gpubench.measure.call_measurement import CallMeasurement, MeasurementFields
from pytest_gpubench.measure.gauges import Page, counter_changes
from pytest_gpubench.measure.steadiness import SteadinessFields
from pytest_gpubench.measure.stream import STALLED
from pytest_gpubench.targets.protocol import NodeFacts, Rental
from pytest_gpubench.targets.stages import Stage, StageFacts
from pytest_gpubench.telemetry.aggregate import TelemetryFields


def meta_record(
    *,
    run_id: str,
    root: Path,
    git: GitState,
    env_names: Sequence[str],
    cells_planned: list[str],
    cases_planned: int,
    argv: list[str],
    cells_path: Path,
    prompts_path: Path,
    shard: ShardFacts | None = None,
    judging: dict[str, Any] | None = None,
) -> MetaRecord:
    """The first line of a ledger: where, when, from which code and how the run was started;
    a shard of a job array says which (`shard`: index, count, the whole matrix's cells); and
    the settings its judgement needs (`judging`, results/judging.py), so that the ledger is
    judged from itself alone."""
    record: dict[str, Any] = {
        "type": "meta",
        "benchmark_run_id": run_id,
        **git,
        "harness_version": HARNESS_VERSION,
        "started_at_utc": utc_now(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "load_avg_start": load_average(),
        "env": chosen_environment(env_names),
        "cells_planned": cells_planned,
        "cases_planned": cases_planned,
        "python_version": platform.python_version(),
        "pytest_version": pytest.__version__,
        "plugin_version": __version__,
        "command_line": [sys.argv[0], *argv],
        "rootdir": str(root),
        "cells_file": str(cells_path),
        "prompts_file": str(prompts_path),
        "shard": shard.copy() if shard is not None else None,
        # The Slurm job (an array task) the run ran in, when it ran in one.
        "slurm_job": _slurm_job(),
    }
    if judging is not None:
        record["judging"] = judging
    return cast(MetaRecord, record)


def _slurm_job() -> dict[str, str] | None:
    names = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NODELIST")
    found = {name.lower(): os.environ[name] for name in names if name in os.environ}
    return found or None


def cell_record(
    *,
    run_id: str,
    cell: Cell,
    engine_facts: EngineFacts,
    gpus: list[dict[str, str]],
    gpu_summary: str,
    node_info: NodeFacts,
    prompts: Mapping[str, Prompt] | None = None,
    engine_url: str | None = None,
    engine_process: Mapping[str, object] | None = None,
) -> CellRecord:
    """A healthy cell: the engine's version, the model's digest and the node's GPUs, and how it
    is asked (TLS, request keys, header names; never a header's value)."""
    spec = cell.spec
    # A cast: the engine's own facts (describe()) are open, and sit amid the typed fields.
    return cast(
        CellRecord,
        {
            "type": "cell",
            "cell_id": cell.cell_id,
            "node": spec.node,
            "node_kind": cell.node.kind,
            "engine": spec.engine,
            "model": spec.model,
            "managed": cell.managed,
            "endpoint": cell.endpoint_as_written,
            **request_facts(cell, prompts or {}),
            **engine_facts,
            "gpus": gpus,
            "gpu_summary": gpu_summary,
            "node_info": node_info.copy(),
            "at_utc": utc_now(),
            "benchmark_run_id": run_id,
            # An engine on the node addressed by its port there; how a managed one was launched;
            # the address it was reached at from here (through the node's SSH forward).
            "node_port": spec.port,
            "launch": list(spec.launch) if spec.launch is not None else None,
            "engine_url": engine_url,
            # The process found serving an engine started outside the harness on this machine
            # (its pid and name), or why none was (measure/listener.py); absent otherwise.
            **({"engine_process": dict(engine_process)} if engine_process is not None else {}),
        },
    )


def tls_warning(cell: Cell) -> str | None:
    """The line said (and recorded) when a cell does not check its endpoint's certificate."""
    if cell.spec.tls_verify:
        return None
    return (
        f"cell {cell.cell_id}: TLS certificate checks are OFF (tls_verify: false): "
        f"anyone between here and {cell.endpoint_as_written} could answer for the engine"
    )


def request_facts(cell: Cell, prompts: Mapping[str, Prompt]) -> RequestFacts:
    """TLS, the request keys (the cell's, and per prompt where a prompt changes them) and the
    extra headers as `$VARIABLE` names, for the cell record."""
    spec = cell.spec
    https = spec.endpoint is not None and spec.endpoint.scheme == "https"
    cell_request = spec.request or RequestShape()
    by_prompt = {}
    for prompt_id in cell.prompt_ids:
        prompt = prompts.get(prompt_id)
        if prompt is not None and prompt.request is not None:
            by_prompt[prompt_id] = _request_keys(cell.request_for(prompt))
    facts: RequestFacts = {
        "tls_verify": spec.tls_verify if https else None,
        "ca_file": spec.ca_file,
        "request": _request_keys(cell_request),
        "request_by_prompt": by_prompt,
        "request_headers": {name: f"${value.env}" for name, value in spec.headers.items()},
    }
    warning = tls_warning(cell)
    if warning is not None:
        facts["tls_warning"] = warning
    return facts


def _request_keys(request: RequestShape) -> dict[str, Any]:
    keys = request.model_dump(exclude_none=True)
    return {"temperature": request.temperature_or_default, **keys}


def _case_head(run_id: str, cell: Cell, case: Case, prompt_sha256: str) -> CaseHead:
    """The first fields of a case's measurement (`call`, `load`, after their type): what ran,
    where, on which prompt, in which phase."""
    spec = cell.spec
    return {
        "benchmark_run_id": run_id,
        "cell_id": cell.cell_id,
        "node": spec.node,
        "engine": spec.engine,
        "model": spec.model,
        "prompt_id": case.prompt_id,
        "prompt_sha256": prompt_sha256,
        "phase": case.phase,
    }


def call_record(
    *,
    run_id: str,
    cell: Cell,
    case: Case,
    prompt_sha256: str,
    cold_kind: str | None,
    started_at_utc: str,
    measurement: CallMeasurement,
    telemetry: TelemetryFields | None = None,
    adapter: str | None = None,
) -> CallRecord:
    """One measured call (successful or not) of a case; `telemetry` adds the case's resource
    figures (telemetry/aggregate.TelemetryFields) after the others. Its inter-chunk gaps are
    packed into `inter_chunk_packed` (read them with ledger.gaps.gaps_ms). `adapter`: the LoRA
    adapter a load request chose (a warm or cold call's is its case's)."""
    record: CallRecord = {
        "type": "call",
        **_case_head(run_id, cell, case, prompt_sha256),
        "run_idx": case.run_idx,
        "case_id": case.case_id,
        # The test that measured its own request (its prompt_id is then the test's name).
        "test_id": case.test_id,
        "cold_kind": cold_kind,
        "started_at_utc": started_at_utc,
        # The gaps packed (ledger/gaps.py): most of a long reply's record otherwise.
        **cast(MeasurementFields, packed_record(measurement.to_record())),
        **measurement.kind_fields(),
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
        # A warm call's checks against the engine come later (engine_check_fields).
        **EngineCheckFields(),
        **AdapterFields(),
        # A call measured past the planned runs says so later (run/sample_on.py).
        **SampledOnFields(),
        # The machine's readings beside a warm call come later (run/harness.py).
        **SteadinessFields(),
        # A synthetic or trace prompt's facts come later (run/harness.py, load/runner.py).
        **SyntheticFields(),
        # The case's A/B place and its telemetry fields come last (below).
        **AbPairFields(),
        **TelemetryFields(),
    }
    chosen = adapter if adapter is not None else case.adapter
    if chosen is not None:
        record["lora_adapter"] = chosen
    # Last, as before: an A/B pair's place, then the telemetry fields (one per sampler column).
    cast(dict[str, Any], record).update({**_ab_pair(case), **(telemetry or {})})
    return record


def engine_check_fields(
    measurement: CallMeasurement,
    request: RequestShape,
    before: Page | None,
    after: Page | None,
    extra_body: Mapping[str, Any] | None = None,
) -> EngineCheckFields:
    """A warm call's checks against the engine: its counters' changes over the call (pages read
    before and after it), whether its prompt came from the prefix cache, and whether the
    request asked for no prefix cache (the cell's or prompt's request keys, a test's own
    `extra_body`)."""
    fields: EngineCheckFields = {}
    changes = counter_changes(before, after) if before is not None and after is not None else {}
    if changes:
        fields["engine_counters"] = changes
    cached = measurement.cached_prompt_tokens
    hits = changes.get("prefix_cache_hits")
    if (cached is not None or hits is not None) and measurement.error is None:
        fields["prefix_cache_hit"] = bool(cached) or bool(hits)
    if cache_off_asked(request, extra_body):
        fields["prefix_cache_off"] = True
    return fields


def cache_off_asked(request: RequestShape, extra_body: Mapping[str, Any] | None = None) -> bool:
    """Whether a request asks for no prefix cache: `cache_prompt: false` in its body (llama.cpp),
    or a cache salt of its own on every call (`cache_salt: per_call`, vLLM)."""
    bodies = [request.extra_body or {}, extra_body or {}]
    off = any(body.get("cache_prompt") is False for body in bodies)
    return off or request.cache_salt == "per_call"


def _ab_pair(case: Case) -> AbPairFields:
    """A warm call of an A/B group: the group's reference, its pair (run_idx) and its place in
    the pair's order (0: called first)."""
    if case.pair_reference is None or case.pair_order is None:
        return {}
    return {
        "ab_pair": {
            "reference": case.pair_reference,
            "index": case.run_idx,
            "order": case.pair_order,
        }
    }


def load_call_record(
    call: CallRecord,
    *,
    load_point: str,
    window: str,
    request_idx: int,
    scheduled_send_ms: float,
    send_ms: float,
    send_lag_ms: float,
    process: int | None = None,
) -> LoadCallRecord:
    """A call record of a load case (`call`'s fields first), with its load point, the window it
    was sent in (warmup, measured, cooldown), and when it was due and went out, in ms from the
    point's start: the send lag is what coordinated omission would hide."""
    return {
        **call,
        "load_point": load_point,
        "load_window": window,
        "request_idx": request_idx,
        "scheduled_send_ms": scheduled_send_ms,
        "send_ms": send_ms,
        "send_lag_ms": send_lag_ms,
        # The client process that sent it (`processes: N`), or None with one.
        "process": process,
    }


def load_record(
    *,
    run_id: str,
    cell: Cell,
    case: Case,
    prompt_sha256: str,
    load_point: str,
    pattern: Mapping[str, Any],
    started_at_utc: str,
    summary: Mapping[str, Any],
    error: str | None,
) -> LoadRecord:
    """One load point's summary (load/summary.py): rates, throughput, latency percentiles,
    goodput, errors, send lag, whether it is a result (`valid`, `invalid_reason`) and the
    per-request samples the gate compares. `error` says why the case failed, or None."""
    # A cast: the pattern's keys and the summary's figures are open, amid the typed fields.
    return cast(
        LoadRecord,
        {
            "type": "load",
            **_case_head(run_id, cell, case, prompt_sha256),
            "case_id": case.case_id,
            "load_point": load_point,
            **pattern,
            "started_at_utc": started_at_utc,
            **summary,
            "error": error,
            "worker": os.environ.get("PYTEST_XDIST_WORKER"),
        },
    )


def sample_record(
    *,
    run_id: str,
    cell: Cell,
    case: Case,
    interval_ms: int,
    gpu_source: str | None,
    cpu_source: str | None,
    columns: Mapping[str, Mapping[str, list[Any]]],
    notes: Sequence[str],
    engine: Mapping[str, list[Any]] | None = None,
    load_point: str | None = None,
) -> SampleRecord:
    """The resource samples of one case, as columns (`gpu`, `cpu`: name -> values, `t_ms` from
    the case's start; the first and last samples may lie just outside it) and the notes of
    samplers that ended or were missing. A load case adds the engine's own gauges (`engine`,
    from its /metrics) per load point."""
    record: SampleRecord = {
        "type": "sample",
        "benchmark_run_id": run_id,
        "cell_id": cell.cell_id,
        "node": cell.spec.node,
        "case_id": case.case_id,
        "prompt_id": case.prompt_id,
        "phase": case.phase,
        "run_idx": case.run_idx,
        "interval_ms": interval_ms,
        "gpu_source": gpu_source,
        "cpu_source": cpu_source,
        "gpu": {name: list(values) for name, values in columns.get("gpu", {}).items()} or None,
        "cpu": {name: list(values) for name, values in columns.get("cpu", {}).items()} or None,
        "notes": list(notes) or None,
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
    }
    if engine is not None:
        record["engine"] = {name: list(values) for name, values in engine.items()}
        record["load_point"] = load_point
    return record


def skipped_record(
    *,
    run_id: str,
    cell: Cell,
    case: Case | None,
    reason: str,
    stage: Stage | None,
    kind_unsupported: bool = False,
) -> SkippedRecord:
    """A cell or case that could not run, with the reason and the stage it failed in;
    `kind_unsupported`: a case of a request kind the cell's engine cannot send (skipped, the
    cell not failed for it)."""
    record: SkippedRecord = {
        "type": "skipped",
        "benchmark_run_id": run_id,
        "cell_id": cell.cell_id,
        "case_id": case.case_id if case else None,
        "prompt_id": case.prompt_id if case else None,
        "phase": case.phase if case else None,
        "run_idx": case.run_idx if case else None,
        "reason": reason,
        "at_utc": utc_now(),
        "node": cell.spec.node,
        "stage": stage,
    }
    if kind_unsupported:
        record["kind_unsupported"] = True
    return record


def checkpoint_record(
    *,
    run_id: str,
    cell: Cell,
    case: Case,
    index: int,
    elapsed_s: float,
    window: Sequence[Mapping[str, Any]],
    calls_so_far: int,
    final: bool,
) -> CheckpointRecord:
    """A timed run's figures so far (docs/cells.md): written every checkpoint_s, so that
    a run that dies keeps them. `window`: the call records since the previous checkpoint."""
    ok = [call for call in window if call.get("error") is None]
    return {
        "type": "checkpoint",
        "benchmark_run_id": run_id,
        "cell_id": cell.cell_id,
        "node": cell.spec.node,
        "prompt_id": case.prompt_id,
        "case_id": case.case_id,
        "checkpoint_idx": index,
        "elapsed_s": round(elapsed_s, 3),
        "final": final,
        "calls": len(window),
        "errors": len(window) - len(ok),
        "stalls": sum(str(call.get("error") or "").startswith(STALLED) for call in window),
        "calls_so_far": calls_so_far,
        "ttft_p50_ms": _median([call.get("first_delta_ms") for call in ok]),
        "total_p50_ms": _median([call.get("total_duration_ms") for call in ok]),
        "tokens_per_sec_p50": _median([call.get("tokens_per_sec") for call in ok]),
        "completion_tokens": sum(call.get("completion_tokens") or 0 for call in ok),
        "at_utc": utc_now(),
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
    }


def _median(values: Sequence[Any]) -> float | None:
    numbers = [float(value) for value in values if isinstance(value, int | float)]
    return round(statistics.median(numbers), 4) if numbers else None


def stage_record(*, run_id: str, facts: StageFacts) -> StageRecord:
    """How one stage of a remote node (or of a cell on it) ended: node, cell_id (None for a
    node's own stage), stage, outcome (ok, failed, timeout, skipped), elapsed_s, timeout_s,
    error."""
    return {
        "type": "stage",
        "benchmark_run_id": run_id,
        **facts,
        "at_utc": utc_now(),
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
    }


def end_record(
    *,
    run_id: str,
    pytest_exitstatus: int,
    calls: int,
    skipped: int,
    verdicts: list[VerdictRecord],
    regressions: int,
    gate_error: str | None,
    nodes: list[Rental],
    cells: list[CellOutcomeRecord],
    exit_status: int,
    ended: tuple[str | None, Any] | None = None,
) -> EndRecord:
    """The last line of a ledger: when it ended, the machine's load, the gate's verdict, every
    planned cell's outcome and the session's exit status. `ended` gives when and under what
    load, for a ledger not ended here and now (a merged one); else they are read now."""
    finished_at_utc, load_avg_end = ended if ended is not None else (utc_now(), load_average())
    return {
        "type": "end",
        "benchmark_run_id": run_id,
        "finished_at_utc": finished_at_utc,
        "load_avg_end": load_avg_end,
        "pytest_exitstatus": pytest_exitstatus,
        "calls": calls,
        "skipped": skipped,
        "verdicts": verdicts,
        "regressions": regressions,
        "gate_error": gate_error,
        "nodes": nodes,
        # What became of every planned cell: measured, failed (stage, reason), skipped, missing.
        "cells": cells,
        "exit_status": exit_status,
    }
