"""The baseline file's one format, as pydantic models built from the figures of
config/metrics.py: which keys a file must hold and of which type, read strictly, and a file that
is not one as one line naming the file and the key. results/baseline.py turns them into
summaries and back."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    create_model,
)
from pydantic_core import PydanticCustomError

from pytest_gpubench.config.metrics import MEASURES
from pytest_gpubench.core.errors import GpubenchError, key_path

# The first release reads and writes one format: per prompt its cold call, each measure's warm
# percentiles and the sampled measures' raw values (config/metrics.py), and its history (its last
# ratified runs' figures, run_history.py). Formats 1 to 4 were written by pre-releases between
# 2026-11-22 and 11-25: such a file is refused with one line, and --baseline-update writes it
# again. A measure added to config/metrics.py later (in_every_baseline False) reads as unknown
# where a file lacks it. A reasoning model's figures (`first_answer_ms`, `reasoning_tokens`) are
# written only where the model reasoned; absent, they are None (the gate judges no first answer).
FORMAT_VERSION = 5
REPAIR = "restore it with `git checkout -- <file>` or write it again with --baseline-update"


class CorruptBaseline(GpubenchError):
    """A baseline file that cannot be read as one (not JSON, a key missing or of the wrong type,
    a pre-release's format): --baseline-update replaces it. A newer format or an unreadable file
    is not corrupt."""


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
    """A measure's warm percentiles where a file may lack them (a measure added later)."""

    model_config = _Record

    p50: Number = None
    p90: Number = None
    p95: Number = None
    p99: Number = None


class Percentiles(OptionalPercentiles):
    """A measure's warm percentiles: every one present (null where the run had no value)."""

    p50: Number
    p90: Number
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


class WarmHead(BaseModel):
    """A prompt's warm calls: their counts; each measure's percentiles beside them (Warm)."""

    model_config = _Record

    n: Count
    n_ok: Count
    coalesced: Count
    # Derived from n and n_ok, written for a reader's eye and never read back (a number, though).
    success_rate: Number = None


def _percentiles_field(every: bool) -> Any:
    return (Percentiles, ...) if every else (OptionalPercentiles, OptionalPercentiles())


def _samples_field(every: bool) -> Any:
    return (Numbers, ...) if every else (Numbers, [])


# One key per measure of config/metrics.py: a measure in every baseline is required, a reasoning
# model's or a later one's may be absent. Built once, from the table, not written out here.
Warm: type[WarmHead] = create_model(
    "Warm",
    __base__=WarmHead,
    **{m.name: _percentiles_field(m.always_in_baseline) for m in MEASURES},
)
Samples: type[BaseModel] = create_model(
    "Samples",
    __config__=_Record,
    **{m.name: _samples_field(m.always_in_baseline) for m in MEASURES if m.samples},
)


class RunEntry(BaseModel):
    """One run of a prompt's history, as the file holds it."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    benchmark_run_id: str | None = None
    date: str | None = None
    n: int = Field(default=0, ge=0)
    figures: dict[str, float | None] = Field(default_factory=dict)
    control_ms: float | None = None
    cpu_pressure: float | None = Field(default=None, ge=0.0, le=1.0)
    engine_wait_per_cpu: float | None = Field(default=None, ge=0.0)
    neighbour_cpu_share: float | None = Field(default=None, ge=0.0, le=1.0)
    # Written only for a run of a calibration (`gpubench calibrate`).
    calibration: str | None = None


class Prompt(BaseModel):
    """A prompt's figures, samples and between-run history."""

    model_config = _Record

    prompt_sha256: Text
    cold: Cold
    if TYPE_CHECKING:
        warm: WarmHead
        samples: BaseModel
    else:
        warm: Warm
        samples: Samples
    history: Annotated[list[RunEntry], Strict()]


class Provenance(BaseModel):
    """The setup the numbers were measured on (null where unknown)."""

    model_config = _Record

    benchmark_run_id: Text
    git_sha: Text
    engine_version: Text
    model_digest: Text
    gpus: Annotated[list[Any], Strict()]
    date: Text
    model_identity: Text
    model_root: Text
    max_model_len: Count | None
    system_fingerprint: Text


class FileHead(BaseModel):
    """What is read first: the format, which says whether the rest can be read."""

    model_config = _Record

    format: Count


CellId = Annotated[Text, AfterValidator(_non_empty)]


class BaselineFile(FileHead):
    """The format: what dumps_baseline writes."""

    cell_id: CellId
    provenance: Provenance
    prompts: Annotated[dict[str, Prompt], Strict()]


def warm_percentiles(warm: BaseModel, measure: str) -> OptionalPercentiles:
    """A measure's percentiles as a file's `warm` holds them (all None where it lacks them)."""
    return cast(OptionalPercentiles, getattr(warm, measure, None) or OptionalPercentiles())


def sample_values(samples: BaseModel, measure: str) -> list[float]:
    return list(getattr(samples, measure, None) or [])


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
    """A parsed file validated by the format's model; `source` (the file) is named in the one
    line of any error. A newer format is not corrupt: it asks for an upgrade; a pre-release's is
    refused, and --baseline-update writes it again."""
    try:
        version = FileHead.model_validate(data).format
        if version > FORMAT_VERSION:
            raise GpubenchError(
                f"{source}: baseline format {version} is newer than this pytest-gpubench "
                f"understands ({FORMAT_VERSION}); upgrade pytest-gpubench"
            )
        if version < FORMAT_VERSION:
            raise CorruptBaseline(
                f"{source}: baseline format {version} was written by a pre-release of "
                f"pytest-gpubench and is no longer read (the release reads format "
                f"{FORMAT_VERSION}): write it again with `pytest --baseline-update`"
            )
        return BaselineFile.model_validate(data)
    except ValidationError as exc:
        raise corrupt(source, exc) from None
