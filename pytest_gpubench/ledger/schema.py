"""The ledger's record types, field by field (README "The ledger"): what the builders in
records.py return and what the readers may index, so that mypy checks a field's name.

A ledger is JSON written by older versions too: a reader of a file still uses `.get()` for a
field that a version may lack. The types say what this version writes; the JSON is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal, NotRequired, TypedDict, cast, overload

from pytest_gpubench.config.shards import ShardFacts
from pytest_gpubench.core.errors import key_path, non_finite_at
from pytest_gpubench.core.provenance import GitState
from pytest_gpubench.engines.protocol import EngineFacts
from pytest_gpubench.ledger.load_figures import LoadFigures
from pytest_gpubench.ledger.outcomes import CellOutcomeRecord
from pytest_gpubench.measure.call_measurement import KindFields, MeasurementFields
from pytest_gpubench.measure.steadiness import SteadinessFields
from pytest_gpubench.targets.protocol import NodeFacts, Rental
from pytest_gpubench.targets.stages import StageFacts
from pytest_gpubench.telemetry.aggregate import TelemetryFields


class MetaRecord(GitState):
    """The first line: where, when, from which code and how the run was started."""

    type: Literal["meta"]
    benchmark_run_id: str
    harness_version: int
    started_at_utc: str
    host: str
    platform: str
    load_avg_start: float
    env: dict[str, str]
    cells_planned: list[str]
    cases_planned: int
    python_version: str
    pytest_version: str
    plugin_version: str
    command_line: list[str]
    rootdir: str
    cells_file: str
    prompts_file: str
    shard: ShardFacts | None
    slurm_job: dict[str, str] | None
    # The settings the run is judged with (results/judging.py); older ledgers lack them.
    judging: NotRequired[dict[str, Any]]
    # A merged ledger's cells whose shard left no ledger or no end record, and why.
    cells_lost: NotRequired[dict[str, str]]


class RequestFacts(TypedDict):
    """How a cell is asked: TLS, the request keys, the extra headers as `$VARIABLE` names."""

    tls_verify: bool | None
    ca_file: str | None
    request: dict[str, object]
    request_by_prompt: dict[str, dict[str, object]]
    request_headers: dict[str, str]
    tls_warning: NotRequired[str]


class CellFacts(TypedDict):
    """What a cell's start found (run/live_cell.py), for its cell record: the engine's own facts,
    the node's GPUs and facts, and where the engine was reached."""

    engine_facts: EngineFacts
    gpus: list[dict[str, str]]
    gpu_summary: str
    node_info: NodeFacts
    engine_url: str
    # An engine started outside the harness on this machine: the process found serving it
    # ({"pid", "comm"}), or why none was ({"missing"}).
    engine_process: NotRequired[dict[str, object]]


class CellRecord(RequestFacts, EngineFacts):
    """A healthy cell: its engine, model and node, and what the engine said of itself (the
    engine's describe(), EngineFacts)."""

    type: Literal["cell"]
    cell_id: str
    node: str
    node_kind: str
    engine: str
    model: str
    managed: bool
    endpoint: str | None
    gpus: list[dict[str, str]]
    gpu_summary: str
    node_info: NodeFacts
    at_utc: str
    benchmark_run_id: str
    node_port: int | None
    launch: list[str] | None
    engine_url: str | None
    # An engine started outside the harness, on this machine: the process found serving its
    # endpoint, whose own CPU wait its calls read ({"pid", "comm"}), or why none was
    # ({"missing"}). Absent for a managed engine, one on another node, and in older ledgers.
    engine_process: NotRequired[dict[str, object]]


class CaseHead(TypedDict):
    """The first fields of a case's measurement (`call`, `load`)."""

    benchmark_run_id: str
    cell_id: str
    node: str
    engine: str
    model: str
    prompt_id: str
    prompt_sha256: str
    phase: str


class EngineCheckFields(TypedDict, total=False):
    """A warm call's checks against the engine (issue 35; ledger/records.engine_check_fields),
    after its other fields; each absent from a ledger of an older version, and from a call where
    the engine tells nothing of it."""

    # config/engine_series.ENGINE_COUNTERS over the call (counters' changes, gauges' peaks), where
    # the engine exposes /metrics.
    engine_counters: dict[str, float]
    # The prompt was served (in part) from the engine's prefix cache: its own count of cached
    # prompt tokens (cache_n, cached_tokens) or its prefix_cache_hits counter.
    prefix_cache_hit: bool
    # The request asked for no prefix cache (cache_prompt: false, a unique cache_salt).
    prefix_cache_off: bool


class AdapterFields(TypedDict, total=False):
    """The LoRA adapter a call's request chose, on a cell that chooses them per request (absent
    elsewhere)."""

    lora_adapter: str


class SampledOnFields(TypedDict, total=False):
    """A warm call measured past the planned runs: because a figure was still undecided
    (run/sample_on.py), or in a later run of a first --baseline-update (run/history_runs.py);
    absent from every other call."""

    sampled_on: bool
    # A call of a later run of a first --baseline-update (run/history_runs.py): its run's number.
    history_run: int


class SyntheticFields(TypedDict, total=False):
    """A call of a synthetic prompt (run/workloads.exact_facts): the tokens asked for, what
    the chat template adds (usage's prompt_tokens should read their sum) and who counted them;
    a load point's shared prefix, its tokens and its group; a trace's request, when it was due
    in the trace and how many hash_id blocks it shares."""

    input_tokens_requested: int
    template_tokens: int | None
    tokens_counted_by: str
    prefix_tokens: int
    prefix_group: int
    trace_at_s: float
    trace_hash_ids: int


class AbPair(TypedDict):
    """A warm call's place in an A/B group: the group's reference, its pair (run_idx) and its
    place in the pair's order (0: called first)."""

    reference: str
    index: int
    order: int


class AbPairFields(TypedDict, total=False):
    ab_pair: AbPair


class CallRecord(
    CaseHead,
    MeasurementFields,
    EngineCheckFields,
    KindFields,
    AdapterFields,
    SampledOnFields,
    SteadinessFields,
    SyntheticFields,
    AbPairFields,
    TelemetryFields,
):
    """One measured call of a case (successful or not); a load case's calls add the load
    fields, a case with telemetry its resource figures (telemetry/aggregate.TelemetryFields), a
    warm call its checks against the engine (EngineCheckFields), a call of a request kind other
    than chat its kind's fields (KindFields)."""

    type: Literal["call"]
    run_idx: int
    case_id: str
    test_id: str | None
    cold_kind: str | None
    started_at_utc: str
    worker: str | None


class LoadCallRecord(CallRecord):
    """A call of a load case: its load point, the window it was sent in, and when it was due
    and went out (ms from the point's start)."""

    load_point: str
    load_window: str
    request_idx: int
    scheduled_send_ms: float
    send_ms: float
    send_lag_ms: float
    process: int | None


class LoadRecord(CaseHead, LoadFigures):
    """One load point's summary; the pattern's keys and the summary's figures (LoadFigures) sit
    between the case's head and these."""

    type: Literal["load"]
    case_id: str
    load_point: str
    started_at_utc: str
    error: str | None
    worker: str | None
    # Requests sent before the point to warm the engine up (one, and one per LoRA adapter not
    # named since the engine was made cold; none where it answered within 60 s): no call record
    # holds them. Absent from ledgers written before issue 44.
    unrecorded_warmups: NotRequired[int]


class SampleRecord(TypedDict):
    """The resource samples of one case, as columns; a load case's engine gauges per point."""

    type: Literal["sample"]
    benchmark_run_id: str
    cell_id: str
    node: str
    case_id: str
    prompt_id: str
    phase: str
    run_idx: int
    interval_ms: int
    gpu_source: str | None
    cpu_source: str | None
    gpu: dict[str, list[Any]] | None
    cpu: dict[str, list[Any]] | None
    notes: list[str] | None
    worker: str | None
    engine: NotRequired[dict[str, list[Any]]]
    load_point: NotRequired[str | None]


class SkippedRecord(TypedDict):
    """A cell or case that could not run, with the reason and the stage it failed in."""

    type: Literal["skipped"]
    benchmark_run_id: str
    cell_id: str
    case_id: str | None
    prompt_id: str | None
    phase: str | None
    run_idx: int | None
    reason: str
    at_utc: str
    node: str
    stage: str | None
    # A case of a request kind the cell's engine cannot send (issue 35): the cell is not failed.
    kind_unsupported: NotRequired[bool]


class CheckpointRecord(TypedDict):
    """A timed run's figures so far (README "Timed runs")."""

    type: Literal["checkpoint"]
    benchmark_run_id: str
    cell_id: str
    node: str
    prompt_id: str
    case_id: str
    checkpoint_idx: int
    elapsed_s: float
    final: bool
    calls: int
    errors: int
    stalls: int
    calls_so_far: int
    ttft_p50_ms: float | None
    total_p50_ms: float | None
    tokens_per_sec_p50: float | None
    completion_tokens: int
    at_utc: str
    worker: str | None


class StageRecord(StageFacts):
    """How one stage of a remote node (or of a cell on it) ended."""

    type: Literal["stage"]
    benchmark_run_id: str
    at_utc: str
    worker: str | None


# One of the gate's verdicts as the end record holds it: results/verdict.Verdict, its one
# declaration, written by Verdict.to_record and read back by Verdict.from_record (the ledger is
# below results: it holds the record and does not look into it).
VerdictRecord = dict[str, object]


class JudgedEnd(TypedDict):
    """An end record's fields that the judgement gives (results/judging.judged_end): the
    session's end and `gpubench merge` write them alike."""

    verdicts: list[VerdictRecord]
    regressions: int
    gate_error: str | None
    cells: list[CellOutcomeRecord]
    exit_status: int


class EndRecord(TypedDict):
    """The last line: when it ended, the gate's verdicts, every planned cell's outcome and the
    session's exit status."""

    type: Literal["end"]
    benchmark_run_id: str
    finished_at_utc: str | None
    load_avg_end: Any
    pytest_exitstatus: int
    calls: int
    skipped: int
    verdicts: list[VerdictRecord]
    regressions: int
    gate_error: str | None
    nodes: list[Rental]
    cells: list[CellOutcomeRecord]
    exit_status: int


Record = (
    MetaRecord
    | CellRecord
    | CallRecord
    | LoadCallRecord
    | LoadRecord
    | SampleRecord
    | SkippedRecord
    | CheckpointRecord
    | StageRecord
    | EndRecord
)


def _fields(*types: Any) -> frozenset[str]:
    return frozenset(name for kind in types for name in kind.__annotations__)


# The fields each record type declares, by its `type` (a call of a load case adds the load
# fields): where a reader takes a number. A key no type declares is a newer version's or a
# test's own, and is read as it is.
DECLARED_FIELDS: dict[str, frozenset[str]] = {
    "meta": _fields(MetaRecord),
    "cell": _fields(CellRecord),
    "call": _fields(LoadCallRecord),
    "load": _fields(LoadRecord),
    "sample": _fields(SampleRecord),
    "skipped": _fields(SkippedRecord),
    "checkpoint": _fields(CheckpointRecord),
    "stage": _fields(StageRecord),
    "end": _fields(EndRecord),
}


def non_finite_field(record: Mapping[str, Any]) -> tuple[str, float] | None:
    """Where a record holds NaN or an infinity in a field its type declares, and that number
    (`first_delta_ms`, `verdicts[0].change_ratio`); None where it holds none. Python's json
    writes and reads them, JSON has neither, and a reader would count one as a figure."""
    kind = record.get("type")
    fields = DECLARED_FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        return None
    for name, value in record.items():
        if name not in fields:
            continue
        if isinstance(value, float):  # most fields: no walk
            if not math.isfinite(value):
                return name, value
        elif isinstance(value, dict | list):
            found = non_finite_at(value, (name,))
            if found is not None:
                return key_path(found[0]), found[1]
    return None


def finite_fields(record: dict[str, Any]) -> dict[str, Any]:
    """The record with NaN and infinities in the fields its type declares written as unknown
    (None), as a reader takes them: the ledger's writer never writes a line its readers refuse
    (non_finite_field); the record itself where it holds none."""
    if non_finite_field(record) is None:
        return record
    fields = DECLARED_FIELDS[str(record.get("type"))]

    def finite(value: Any) -> Any:
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if isinstance(value, dict):
            return {key: finite(inner) for key, inner in value.items()}
        if isinstance(value, list):
            return [finite(inner) for inner in value]
        return value

    return {name: finite(value) if name in fields else value for name, value in record.items()}


def as_json(record: Record) -> dict[str, Any]:
    """A record as the JSON object it is written as: what the ledger writer, the secret
    scrubber and xdist's reports carry (any record, and the older ones read back)."""
    return cast(dict[str, Any], record)


# -- reading a ledger back ----------------------------------------------------------------------
# A ledger read from a file is JSON (ledger/writer.read_ledger): these give its records by type,
# typed, so that a reader's field names are checked. A file of an older version may lack a field
# that this one writes: a reader still uses `.get()` for such a field.


@overload
def records_of(records: Iterable[Mapping[str, Any]], kind: Literal["meta"]) -> list[MetaRecord]: ...
@overload
def records_of(records: Iterable[Mapping[str, Any]], kind: Literal["cell"]) -> list[CellRecord]: ...
@overload
def records_of(records: Iterable[Mapping[str, Any]], kind: Literal["call"]) -> list[CallRecord]: ...
@overload
def records_of(records: Iterable[Mapping[str, Any]], kind: Literal["load"]) -> list[LoadRecord]: ...
@overload
def records_of(
    records: Iterable[Mapping[str, Any]], kind: Literal["sample"]
) -> list[SampleRecord]: ...
@overload
def records_of(
    records: Iterable[Mapping[str, Any]], kind: Literal["skipped"]
) -> list[SkippedRecord]: ...
@overload
def records_of(
    records: Iterable[Mapping[str, Any]], kind: Literal["checkpoint"]
) -> list[CheckpointRecord]: ...
@overload
def records_of(
    records: Iterable[Mapping[str, Any]], kind: Literal["stage"]
) -> list[StageRecord]: ...
@overload
def records_of(records: Iterable[Mapping[str, Any]], kind: Literal["end"]) -> list[EndRecord]: ...
@overload
def records_of(records: Iterable[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]: ...
def records_of(records: Iterable[Mapping[str, Any]], kind: str) -> list[Any]:
    """The records of one type, in ledger order, as that type."""
    return [record for record in records if record.get("type") == kind]


def meta_of(records: Iterable[Mapping[str, Any]]) -> MetaRecord | None:
    """The ledger's meta record (its first line), or None."""
    return next(iter(records_of(records, "meta")), None)


def end_of(records: Iterable[Mapping[str, Any]]) -> EndRecord | None:
    """The ledger's last end record (a run ends once; a merged ledger once too), or None."""
    ends = records_of(records, "end")
    return ends[-1] if ends else None
