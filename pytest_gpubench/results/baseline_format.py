"""The baseline file's format, version by version, as pydantic models: which keys a file of
each format must hold and of which type, read strictly, and a file that is not one as one line
naming the file and the key. results/baseline.py turns them into summaries and back."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from pytest_gpubench.core.errors import GpubenchError, key_path

# What each format added to the one before. 2: p90s, the decode, TPOT, end-to-end and
# engine-side metrics and samples, the coalesced count;
# the mean of per-call tokens/s of format 1 is no longer written (and ignored when read).
# 3: the model's identity beside its digest (model_identity, model_root, max_model_len) and the
# stream's system_fingerprint in the provenance; older files read them as unknown. A file may hold
# prompts and phases measured by different runs of the same setup (--baseline-update merges).
# 4: per prompt, `history`: the figures of its last ratified runs (run_history.py), and the
# control call's figures and samples (`control_ms`); an older file reads with no history and no
# control (the gate then says the noise floor is unknown).
# 5: the CPU pressure's figures and samples (`cpu_pressure`) beside the control call's, and its p50
# in each history entry; an older file reads without them (the gate then compares the control).
# In any format: a reasoning model's figures (`first_answer_ms`, `reasoning_tokens`), written only
# where the model reasoned; absent, they are None (and the gate judges no first answer).
FORMAT_VERSION = 5
REPAIR = "restore it with `git checkout -- <file>` or write it again with --baseline-update"


class CorruptBaseline(GpubenchError):
    """A baseline file that cannot be read as one (not JSON, a key missing or of the wrong type):
    --baseline-update replaces it. A newer format or an unreadable file is not corrupt."""


# Each model says which keys a file of its format must have and of which type; a key a reader
# does not know is ignored (a newer minor field, a reader's note). The types are strict: "12" is
# not a number, true is not a count. Every number is finite: Python's json reads NaN and
# Infinity (JSON has neither), and one in a figure, a sample or a history entry would reach the
# gate's arithmetic (an infinite history figure crashed the between-run spread).


def _non_empty(value: str | None) -> str | None:
    if not value:
        raise PydanticCustomError("empty_cell_id", "must be a non-empty string")
    return value


def _numbers(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """One message for the whole list, as a user reads it: which sample is bad matters less,
    but for a number that is not finite, named where it sits (`first_delta_ms[2]`)."""
    try:
        return handler(value)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "finite_number":
            raise
        raise PydanticCustomError("numbers", "expected a list of numbers") from None


Number = Annotated[float, Strict()] | None
Count = Annotated[int, Strict(), Field(ge=0)]
Text = Annotated[str, Strict()] | None
Numbers = Annotated[list[Annotated[float, Strict()]], WrapValidator(_numbers)]
_Record = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class OptionalPercentiles(BaseModel):
    """A metric's warm percentiles in a format older than the metric: each may be absent."""

    model_config = _Record

    p50: Number = None
    p90: Number = None
    p95: Number = None
    p99: Number = None


class Percentiles(OptionalPercentiles):
    """A metric's warm percentiles: every one present (null where the run had no value)."""

    p50: Number
    p90: Number
    p95: Number
    p99: Number


class Format1Percentiles(OptionalPercentiles):
    """Format 1 had no p90."""

    p50: Number
    p95: Number
    p99: Number


class Cold(BaseModel):
    """The first cold call of a prompt."""

    model_config = _Record

    n: Count
    n_ok: Count
    kind: Text
    first_delta_ms: Number
    total_duration_ms: Number


class WarmV1(BaseModel):
    """Format 1's warm figures: TTFT and total duration; the later metrics read as new."""

    model_config = _Record

    n: Count
    n_ok: Count
    first_delta_ms: Format1Percentiles
    total_duration_ms: Format1Percentiles
    decode_tokens_per_sec: OptionalPercentiles = OptionalPercentiles()
    tpot_ms: OptionalPercentiles = OptionalPercentiles()
    e2e_tokens_per_sec: OptionalPercentiles = OptionalPercentiles()
    engine_tokens_per_sec: OptionalPercentiles = OptionalPercentiles()
    engine_prompt_ms: OptionalPercentiles = OptionalPercentiles()
    engine_total_ms: OptionalPercentiles = OptionalPercentiles()
    control_ms: OptionalPercentiles = OptionalPercentiles()
    cpu_pressure: OptionalPercentiles = OptionalPercentiles()
    first_answer_ms: OptionalPercentiles = OptionalPercentiles()
    reasoning_tokens: OptionalPercentiles = OptionalPercentiles()

    @property
    def coalesced(self) -> int:
        return 0  # format 1 did not count them


class WarmV2(BaseModel):
    """Formats 2 and 3: every metric's percentiles, the coalesced count; no control call."""

    model_config = _Record

    n: Count
    n_ok: Count
    coalesced: Count
    # Derived from n and n_ok, written for a reader's eye and never read back (a number, though).
    success_rate: Number = None
    first_delta_ms: Percentiles
    total_duration_ms: Percentiles
    decode_tokens_per_sec: Percentiles
    tpot_ms: Percentiles
    e2e_tokens_per_sec: Percentiles
    engine_tokens_per_sec: Percentiles
    engine_prompt_ms: Percentiles
    engine_total_ms: Percentiles
    control_ms: OptionalPercentiles = OptionalPercentiles()
    cpu_pressure: OptionalPercentiles = OptionalPercentiles()
    # A reasoning model's, in any format from 2 on: only where the model reasoned.
    first_answer_ms: OptionalPercentiles = OptionalPercentiles()
    reasoning_tokens: OptionalPercentiles = OptionalPercentiles()


class WarmV4(WarmV2):
    """Format 4 adds the control call's figures."""

    control_ms: Percentiles


class WarmV5(WarmV4):
    """Format 5 adds the CPU pressure's."""

    cpu_pressure: Percentiles


class SamplesV1(BaseModel):
    """Format 1's raw warm values; its `tokens_per_sec` (another definition) is ignored."""

    model_config = _Record

    first_delta_ms: Numbers
    total_duration_ms: Numbers
    # A reasoning model's, in any format: only where the model reasoned.
    first_answer_ms: Numbers = []


class SamplesV2(SamplesV1):
    """Formats 2 and 3: the decode rate and the engine's own figures beside the client's."""

    decode_tokens_per_sec: Numbers
    engine_prompt_ms: Numbers
    engine_tokens_per_sec: Numbers
    engine_total_ms: Numbers


class SamplesV4(SamplesV2):
    """Format 4 adds the control call's."""

    control_ms: Numbers


class SamplesV5(SamplesV4):
    """Format 5 adds the CPU pressure's."""

    cpu_pressure: Numbers


class RunEntry(BaseModel):
    """One run of a prompt's history, as the file holds it."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    benchmark_run_id: str | None = None
    date: str | None = None
    n: int = Field(default=0, ge=0)
    figures: dict[str, float | None] = Field(default_factory=dict)
    control_ms: float | None = None
    cpu_pressure: float | None = Field(default=None, ge=0.0, le=1.0)


class PromptV1(BaseModel):
    model_config = _Record

    prompt_sha256: Text
    cold: Cold
    warm: WarmV1
    samples: SamplesV1


class PromptV2(BaseModel):
    model_config = _Record

    prompt_sha256: Text
    cold: Cold
    warm: WarmV2
    samples: SamplesV2


class PromptV4(BaseModel):
    """A prompt of format 4: its figures, samples and between-run history."""

    model_config = _Record

    prompt_sha256: Text
    cold: Cold
    warm: WarmV4
    samples: SamplesV4
    history: Annotated[list[RunEntry], Strict()]


class PromptV5(PromptV4):
    """A prompt of the current format: with the CPU pressure's figures and samples."""

    warm: WarmV5
    samples: SamplesV5


class ProvenanceV1(BaseModel):
    """Formats 1 and 2: the model's identity facts may be absent (read as unknown)."""

    model_config = _Record

    benchmark_run_id: Text
    git_sha: Text
    engine_version: Text
    model_digest: Text
    gpus: Annotated[list[Any], Strict()]
    date: Text
    model_identity: Text = None
    model_root: Text = None
    max_model_len: Count | None = None
    system_fingerprint: Text = None


class ProvenanceV3(ProvenanceV1):
    """Format 3 on: every identity fact present (null where unknown)."""

    model_identity: Text
    model_root: Text
    max_model_len: Count | None
    system_fingerprint: Text


class FileHead(BaseModel):
    """What is read first: the format, which picks the model of the rest."""

    model_config = _Record

    format: Count


CellId = Annotated[Text, AfterValidator(_non_empty)]


class BaselineFileV1(FileHead):
    cell_id: CellId
    provenance: ProvenanceV1
    prompts: Annotated[dict[str, PromptV1], Strict()]


class BaselineFileV2(FileHead):
    cell_id: CellId
    provenance: ProvenanceV1
    prompts: Annotated[dict[str, PromptV2], Strict()]


class BaselineFileV3(FileHead):
    cell_id: CellId
    provenance: ProvenanceV3
    prompts: Annotated[dict[str, PromptV2], Strict()]


class BaselineFileV4(FileHead):
    cell_id: CellId
    provenance: ProvenanceV3
    prompts: Annotated[dict[str, PromptV4], Strict()]


class BaselineFileV5(FileHead):
    """The current format: what dumps_baseline writes."""

    cell_id: CellId
    provenance: ProvenanceV3
    prompts: Annotated[dict[str, PromptV5], Strict()]


FILE_MODELS: dict[
    int,
    type[BaselineFileV1 | BaselineFileV2 | BaselineFileV3 | BaselineFileV4 | BaselineFileV5],
] = {
    1: BaselineFileV1,
    2: BaselineFileV2,
    3: BaselineFileV3,
    4: BaselineFileV4,
    5: BaselineFileV5,
}

# A problem by pydantic's error type, in the words of a file's reader.
_PROBLEMS = {
    "missing": "required key is missing",
    "float_type": "expected a number",
    "finite_number": "expected a finite number",
    "int_type": "expected a count",
    "greater_than_equal": "expected a count (greater than or equal to 0)",
    "string_type": "expected a string",
    "model_type": "expected an object",
    "model_attributes_type": "expected an object",
    "dict_type": "expected an object",
    "list_type": "expected a list",
}


def corrupt(source: str, exc: ValidationError) -> CorruptBaseline:
    """The first problem pydantic found, as one line naming the file and the key."""
    error = exc.errors()[0]
    where = key_path(tuple(error["loc"])) or "top level"
    problem = _PROBLEMS.get(error["type"])
    if problem is None:
        problem = str(error["msg"]).lower()
    elif error["type"] != "missing":
        problem = f"{problem}, got {_kind(error.get('input'))}"
    return corrupt_line(source, where, problem)


def corrupt_line(source: str, where: str, problem: str) -> CorruptBaseline:
    return CorruptBaseline(f"{source}: corrupt baseline: {where}: {problem}; {REPAIR}")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    try:
        shown = json.dumps(value)[:40]
    except (RecursionError, ValueError):  # json's writer recurses less deep than its reader
        shown = "(nested too deeply to show)"
    return f"{type(value).__name__} {shown}"


BaselineFile = BaselineFileV1 | BaselineFileV2 | BaselineFileV3 | BaselineFileV4 | BaselineFileV5


def read_json(text: str, source: str) -> Any:
    """The file's JSON; text that is not is one line naming the file and where it breaks."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CorruptBaseline(
            f"{source}: corrupt baseline: not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}); {REPAIR}"
        ) from None
    except (ValueError, RecursionError) as exc:
        # An integer longer than Python reads (4,300 digits), or nesting deeper than it recurses.
        what = "nested too deeply" if isinstance(exc, RecursionError) else "a number too long"
        raise CorruptBaseline(f"{source}: corrupt baseline: {what} to read; {REPAIR}") from None


def validated(data: Any, source: str) -> BaselineFile:
    """A parsed file validated by the model of its format; `source` (the file) is named in the
    one line of any error. A newer format is not corrupt: it asks for an upgrade."""
    try:
        version = FileHead.model_validate(data).format
        if version > FORMAT_VERSION:
            raise GpubenchError(
                f"{source}: baseline format {version} is newer than this pytest-gpubench "
                f"understands ({FORMAT_VERSION}); upgrade pytest-gpubench"
            )
        return FILE_MODELS[max(version, 1)].model_validate(data)
    except ValidationError as exc:
        raise corrupt(source, exc) from None
